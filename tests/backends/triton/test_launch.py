"""The Triton backend's launch layer (``_launch``): tiles that do not fit the GPU."""

import pytest
import torch

from flashot.backends import available_backends

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif("triton" not in available_backends(DEVICE), reason="no triton")


def refuse_big_tiles(monkeypatch, most):
    """Make ``start`` raise Triton's OutOfResources (as loading a kernel whose shared
    memory exceeds the GPU's does) for tiles of more than ``most`` elements·stages;
    returns the list of tiles it was asked for."""
    from triton.runtime.errors import OutOfResources

    from flashot.backends.triton import _launch

    asked, run = [], _launch.start

    def guarded(raw, cfg, plan, device):
        size = cfg.kwargs["BLOCK_M"] * cfg.kwargs["BLOCK_N"] * cfg.num_stages
        asked.append((cfg.kwargs["BLOCK_M"], cfg.kwargs["BLOCK_N"], cfg.num_stages))
        if size > most:
            raise OutOfResources(size * 8, most * 8, "shared memory")
        return run(raw, cfg, plan, device)

    monkeypatch.setattr(_launch, "start", guarded)
    monkeypatch.setattr(_launch, "_FITTED", {})
    return asked


def test_tiles_that_do_not_fit_step_down_and_are_remembered(monkeypatch):
    """A table entry of another key can need more shared memory than the GPU has (H200,
    Triton 3.6: d = 64's 128 × 128 tiles with 3 stages take 384 KiB at d = 100). The
    launch steps down to tiles that load, the same result, and later launches of the
    key start from those."""
    import triton

    from flashot.backends.triton import TritonBackend, _launch

    gen = torch.Generator().manual_seed(0)
    x, y = (torch.randn(n, 3, generator=gen).to(DEVICE) for n in (40, 50))
    ref = TritonBackend()
    want = ref.row_attend(*_form(x, y), 0.5)[0]
    asked = refuse_big_tiles(monkeypatch, most=16 * 16 * 2)
    backend = TritonBackend()
    key, big = ("attend", 3), triton.Config({"BLOCK_M": 16, "BLOCK_N": 16}, num_stages=4)
    monkeypatch.setattr(_launch, "tiles_for", lambda *args: big)
    got = backend.row_attend(*_form(x, y), 0.5)[0]
    assert torch.allclose(got, want, rtol=1e-6, atol=1e-6)
    # 4 stages asked for twice what the GPU has: 3 stages would still not fit by the
    # estimate, so the launch goes straight to 2 (each try compiles the kernel)
    assert [a[2] for a in asked] == [4, 2]
    asked.clear()
    backend.row_attend(*_form(x, y), 0.5)
    assert [a[2] for a in asked] == [2]  # remembered
    assert any(slot[0][:2] == key for slot in _launch._FITTED)


def test_a_launch_that_fails_otherwise_raises(monkeypatch):
    from flashot.backends.triton import TritonBackend, _launch

    def broken(raw, cfg, plan, device):
        raise RuntimeError("not a resource problem")

    monkeypatch.setattr(_launch, "start", broken)
    x = torch.randn(8, 3).to(DEVICE)
    with pytest.raises(RuntimeError, match="not a resource problem"):
        TritonBackend().row_attend(*_form(x, x), 0.5)


def test_packed_batches_step_down_with_their_block_tables(monkeypatch):
    """A packed batch's table of blocks is cut for the tiles that run: refused tiles
    (more stages) step down, the batch's costs unchanged."""
    from flashot import sinkhorn_varlen

    gen = torch.Generator().manual_seed(1)
    sizes = [(7, 9), (20, 13), (1, 5)]
    xs = [torch.randn(n, 2, generator=gen).to(DEVICE) for n, _ in sizes]
    ys = [torch.randn(m, 2, generator=gen).to(DEVICE) for _, m in sizes]
    xo = torch.tensor([0] + [n for n, _ in sizes]).cumsum(0)
    yo = torch.tensor([0] + [m for _, m in sizes]).cumsum(0)
    x, y = torch.cat(xs), torch.cat(ys)
    args = dict(eps=0.5, tol=None, max_iter=6, backend="triton")
    want = sinkhorn_varlen(x, y, xo, yo, **args).cost
    asked = refuse_big_tiles(monkeypatch, most=16 * 16 * 2 if DEVICE == "cpu" else 32 * 32 * 2)
    got = sinkhorn_varlen(x, y, xo, yo, **args).cost
    assert torch.allclose(got, want, rtol=1e-6, atol=1e-6)
    sizes = [a[0] * a[1] * a[2] for a in asked]
    assert asked and max(sizes) > min(sizes)  # some tiles were refused, smaller ones ran


def _form(x, y):
    from flashot.geometry.costs import attention_form, get_cost

    form = attention_form(get_cost("sqeuclidean"), x, y)
    return form, torch.zeros(len(y), device=x.device)


def test_deterministic_mode_refuses_the_triton_kernels_and_auto_takes_torch():
    """torch.use_deterministic_algorithms(True) was neither honoured nor refused: the
    Triton kernels (atomic sums) now refuse it as PyTorch's own ops do, warn in
    warn-only mode, and backend='auto' then takes the torch backend."""
    import warnings

    import flashot
    from flashot.backends import available_backends

    if "triton" not in available_backends("cpu"):
        pytest.skip("needs triton's interpreter")
    x, y = torch.randn(12, 2), torch.randn(10, 2)
    torch.use_deterministic_algorithms(True)
    try:
        with pytest.raises(RuntimeError, match="deterministic"):
            flashot.sinkhorn(x, y, eps=0.5, backend="triton")
        res = flashot.sinkhorn(x, y, eps=0.5)  # auto: torch on the CPU either way
        assert res.plan.backend.name == "torch"
        torch.use_deterministic_algorithms(True, warn_only=True)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            flashot.sinkhorn(x, y, eps=0.5, backend="triton")
        assert any("atomic" in str(w.message) for w in caught)
    finally:
        torch.use_deterministic_algorithms(False)
