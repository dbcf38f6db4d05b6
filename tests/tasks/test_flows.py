"""Dataset flows (flashot.tasks.flows): Euler steps of the OTDD gradient flow."""

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flashot.tasks.flows import dataset_flow
from flashot.tasks.otdd import dataset_distance

F64 = torch.float64


def data(seed=0, n=30, m=24, d=4):
    g = torch.Generator().manual_seed(seed)
    ya, yb = torch.arange(n) % 3, torch.arange(m) % 3
    xa = torch.rand(n, d, generator=g, dtype=F64) * 0.5
    xb = torch.rand(m, d, generator=g, dtype=F64) * 0.5 + 0.4 + 0.1 * yb[:, None]
    return xa, ya, xb, yb


KW = dict(eps=0.1, tol=1e-11, max_iter=20000)


@pytest.mark.parametrize("rho", [None, 0.5, (0.3, 2.0)])
def test_one_step_is_the_euler_step_of_the_distance(rho):
    # the flow differentiates OT(A, A) on one side when it is symmetric (rho None or
    # equal on both sides), on both otherwise; the distance's autograd on both always
    xa, ya, xb, yb = data()
    kw = dict(KW, rho=rho)
    out = dataset_flow(xa, ya, xb, yb, steps=1, step_size=0.05, progress=False, **kw)
    x = xa.clone().requires_grad_()
    first = dataset_distance(x, ya, xb, yb, **kw)
    (grad,) = torch.autograd.grad(first.distance, x)
    assert torch.allclose(out.x, xa - 0.05 * len(xa) * grad, rtol=1e-10, atol=1e-12)
    assert out.distances[0] == pytest.approx(float(first.distance.detach()), rel=1e-10)
    assert torch.equal(xa, data()[0])  # the input is not modified


@pytest.mark.parametrize("recompute", [False, True])
def test_the_flow_brings_the_datasets_together(recompute, capsys):
    xa, ya, xb, yb = data(1)
    out = dataset_flow(xa, ya, xb, yb, steps=6, step_size=0.2, recompute_stats=recompute, **KW)
    d = out.distances
    assert len(d) == 7 and all(b < a for a, b in itertools.pairwise(d))
    # held statistics keep the label term between A's and B's classes: a floor above 0
    assert d[-1] < (0.2 if recompute else 0.6) * d[0]
    final = float(dataset_distance(out.x, ya, xb, yb, **KW).distance)  # fresh statistics
    if recompute:  # the flow saw the moving classes' statistics: the true OTDD fell too
        assert final == pytest.approx(d[-1], rel=1e-8)
    assert capsys.readouterr().err.count("flow step") == 6


@pytest.mark.parametrize("recompute", [False, True])
def test_warm_starts_change_the_iterations_not_the_flow(recompute, monkeypatch):
    """Each step's problems start from the previous step's potentials: the same states
    and distances as solves from scratch (to the solver's tolerance, float64), in fewer
    Sinkhorn iterations over the flow (with ε-scaling, which a warm start skips)."""
    import flashot

    solve, iterations = flashot.sinkhorn, []

    def counted(*args, **kwargs):
        res = solve(*args, **kwargs)
        iterations.append(int(res.n_iter))
        return res

    monkeypatch.setattr(flashot, "sinkhorn", counted)
    xa, ya, xb, yb = data(3)
    kw = dict(KW, eps_schedule="geomloss", steps=4, step_size=0.2, recompute_stats=recompute,
              progress=False)  # fmt: skip
    outs, totals = [], []
    for warm in (True, False):
        iterations.clear()
        outs.append(dataset_flow(xa, ya, xb, yb, warm_start=warm, **kw))
        totals.append(sum(iterations))
    warm, cold = outs
    assert torch.allclose(warm.x, cold.x, rtol=1e-8, atol=1e-10)
    assert warm.distances == pytest.approx(cold.distances, rel=1e-9)
    assert totals[0] < totals[1], totals


def test_snapshots_are_png_grids(tmp_path):
    pytest.importorskip("matplotlib")
    xa, ya, xb, yb = data(2, d=16)
    out = dataset_flow(xa, ya, xb, yb, steps=3, step_size=0.1, snapshot_every=2,
                       snapshot_dir=tmp_path, progress=False, **KW)  # fmt: skip
    assert [p.name for p in out.snapshots] == ["step_0000.png", "step_0002.png", "step_0003.png"]
    assert all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in out.snapshots)


@pytest.mark.parametrize("kw, match", [
    (dict(steps=-1), "steps"), (dict(step_size=0.0), "step_size"),
    (dict(snapshot_every=1), "snapshot_dir"), (dict(steps=1.5), "steps"),
    (dict(init=None), "init"), (dict(warm_start=1), "warm_start"),
])  # fmt: skip
def test_bad_options_are_named(kw, match):
    xa, ya, xb, yb = data()
    with pytest.raises(ValueError, match=match):
        dataset_flow(xa, ya, xb, yb, eps=0.1, progress=False, **kw)


def test_a_flow_step_keeps_under_four_and_a_half_clouds(monkeypatch):
    """One flow step holds about 4.4 cloud-sized tensors beyond the inputs ((d + K)/d =
    1.07 wide operands): the flow state, one problem's q and k, the gradient, and one
    block of rows of a plan product (1/8 of a cloud; ``flows.GRADIENT_BLOCKS``). The
    gradient is the plans' envelope formula, accumulated a block at a time: no autograd
    graph, no barycenters of A's size. No labeled copy of either cloud, no centered or
    concatenated temporaries, no second problem's operands. It was 5.2 with autograd
    (the first gradient beside the second problem's barycenters), 8.3 before that.
    In-place passes work in blocks of ``_BLOCK`` elements: set small here so that,
    as at full size, a block is far below a cloud."""
    import flashot.geometry.costs
    from flashot.backends.torch_backend import TorchBackend
    from tests.live_memory import LiveTensors

    monkeypatch.setattr(flashot.geometry.costs, "_BLOCK", 1 << 12)
    n, d = 300, 120
    g = torch.Generator().manual_seed(0)
    xa, xb = torch.randn(n, d, generator=g), torch.randn(n, d, generator=g) + 0.3
    ya, yb = torch.randint(0, 4, (n,), generator=g), torch.randint(0, 4, (n,), generator=g)
    cloud = n * d * 4
    with LiveTensors(cloud // 4) as live:
        live.ignore(xa, xb)
        out = dataset_flow(xa, ya, xb, yb, steps=2, step_size=0.1, eps=5.0, progress=False,
                           max_iter=10, tol=None, diagonal=True,
                           backend=TorchBackend(budget=1 << 12))  # fmt: skip
    assert torch.isfinite(out.x).all() and live.peak / cloud <= 4.5


@settings(max_examples=12, deadline=None)
@given(n=st.integers(5, 14), m=st.integers(5, 14), d=st.integers(1, 4), k=st.integers(1, 3),
       eps=st.sampled_from([0.2, 0.5, 1.0]), rho=st.sampled_from([None, 0.7, (0.4, 1.5)]),
       seed=st.integers(0, 2**16))  # fmt: skip
def test_the_envelope_gradient_is_the_distance_gradient(n, m, d, k, eps, rho, seed):
    """Property: the flow's gradient (plans' envelope formula, row blocks) equals autograd
    of the float64 distance, for any sizes, classes, ε and ρ (balanced, symmetric,
    asymmetric)."""
    g = torch.Generator().manual_seed(seed)
    xa, xb = torch.rand(n, d, generator=g, dtype=F64), torch.rand(m, d, generator=g, dtype=F64)
    ya, yb = torch.arange(n) % k, torch.arange(m) % k
    kw = dict(KW, eps=eps, rho=rho)
    out = dataset_flow(xa, ya, xb, yb, steps=1, step_size=0.01, progress=False, **kw)
    x = xa.clone().requires_grad_()
    (grad,) = torch.autograd.grad(dataset_distance(x, ya, xb, yb, **kw).distance, x)
    assert torch.allclose(out.x, xa - 0.01 * n * grad, rtol=1e-9, atol=1e-11)


def test_the_envelope_gradient_on_the_kernels():
    """The same on the Triton backend (the interpreter), float32, against float64."""
    from flashot.backends import available_backends

    if "triton" not in available_backends("cpu"):
        pytest.skip("triton unavailable")
    xa, ya, xb, yb = data(3, n=12, m=10, d=2)
    kw = dict(eps=2.0, tol=1e-5, max_iter=5000)
    got = dataset_flow(xa.float(), ya, xb.float(), yb, steps=1, step_size=0.05, progress=False,
                       backend="triton", **kw)  # fmt: skip
    x = xa.clone().requires_grad_()
    ref = dataset_distance(x, ya, xb, yb, **dict(kw, tol=1e-11))
    (grad,) = torch.autograd.grad(ref.distance, x)
    want = xa - 0.05 * len(xa) * grad
    assert (got.x.double() - want).abs().max() < 1e-4 * (1 + want.abs().max())
