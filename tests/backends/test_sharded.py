"""The sharded backend's pieces that need no process group (flashot.backends.sharded);
the sharded solve itself: tests/test_distributed.py (two gloo ranks)."""

import torch
from hypothesis import given
from hypothesis import strategies as st

from flashot.backends.sharded import merge_lse


@given(seed=st.integers(0, 2**31 - 1), n=st.integers(1, 6), cut=st.integers(0, 9),
       eps=st.floats(0.01, 10.0), empty_rows=st.booleans())  # fmt: skip
def test_merging_two_column_blocks_is_the_whole_rows_lse_and_average(seed, n, cut, eps,
                                                                       empty_rows):  # fmt: skip
    """LSE and softmax average of the scores of all columns from those of two blocks, in
    either order; a block whose weights are all zero (LSE −∞) changes nothing."""
    gen = torch.Generator().manual_seed(seed)
    s = torch.randn(n, 9, generator=gen, dtype=torch.float64) * 3
    v = torch.randn(9, 2, generator=gen, dtype=torch.float64)
    if empty_rows:
        s[:, :cut] = -torch.inf

    def block(cols):
        lse = eps * torch.logsumexp(s[:, cols] / eps, 1)
        w = torch.softmax(s[:, cols] / eps, 1)
        return lse, torch.nan_to_num(w) @ v[cols]

    whole = block(slice(None))
    left, right = block(slice(0, cut)), block(slice(cut, 9))
    for first, second in ((left, right), (right, left)):
        lse, avg = merge_lse(*first[:1], first[1], *second, eps)
        assert torch.allclose(lse, whole[0], rtol=1e-12, atol=1e-12)
        assert torch.allclose(avg, whole[1], rtol=1e-10, atol=1e-12)
    assert merge_lse(None, None, *whole, eps)[0] is whole[0]
