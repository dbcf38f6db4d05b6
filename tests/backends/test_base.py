"""The primitive contract, checked for every backend against dense float64 formulas."""

import math

import pytest
import torch

from flashot.backends import available_backends, resolve_backend
from flashot.backends.dual import Potentials
from flashot.backends.torch_backend import TorchBackend
from flashot.geometry.costs import attention_form, get_cost
from tests.conftest import rel

BACKENDS = ["torch", "triton"]


def make_backend(name, device, precision="auto"):
    if name not in available_backends(device):
        pytest.skip(f"backend {name} unavailable on {device}")
    return resolve_backend(name, torch.device(device), precision)


def exact(name):
    """(dtype, rel. tolerance) in which a backend should match the dense formulas."""
    return (torch.float64, 1e-12) if name == "torch" else (torch.float32, 2e-5)


def devices():
    return ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def backends_on_devices(name):
    """``(device, backend)`` for every device the backend runs on (skip if none): Triton
    runs on CPU only in the interpreter, on CUDA only natively."""
    found = [(dev, resolve_backend(name, torch.device(dev), "auto"))
             for dev in devices() if name in available_backends(dev)]  # fmt: skip
    if not found:
        pytest.skip(f"backend {name} unavailable here")
    return found


def dense_attend(form, h, eps, v):
    s = (form.q.double() @ form.k.double().T + h.double()[None, :]) / eps
    lse = eps * torch.logsumexp(s, 1)
    w = torch.softmax(s, 1)
    return lse, (None if v is None else w @ v.double())


def problem(gen, n, m, d, dtype, device, spread=1.0):
    x = torch.randn(n, d, generator=gen, dtype=torch.float64) * spread
    y = torch.randn(m, d, generator=gen, dtype=torch.float64) * spread + 0.3
    form = attention_form(get_cost("sqeuclidean"), x.to(device, dtype), y.to(device, dtype))
    h = (torch.randn(m, generator=gen, dtype=torch.float64) - form.beta.double().cpu()).to(
        device, dtype
    )
    return form, h


SHAPES = [(1, 1, 1), (1, 37, 3), (37, 1, 2), (50, 37, 3), (64, 64, 16), (33, 70, 5)]


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_row_attend_matches_dense(gen, name, shape, dtype):
    for device, backend in backends_on_devices(name):
        if dtype == torch.float64 and name == "triton":
            continue  # the triton backend computes in float32
        n, m, d = shape
        form, h = problem(gen, n, m, d, dtype, device)
        v = torch.randn(m, 4, generator=gen, dtype=torch.float64).to(device, dtype)
        lse, out = backend.row_attend(form, h, 0.3, v)
        ref_lse, ref_out = dense_attend(form, h, 0.3, v)
        tol = 1e-12 if dtype == torch.float64 else 2e-5
        assert rel(lse.cpu(), ref_lse.cpu()) < tol
        assert rel(out.cpu(), ref_out.cpu()) < tol
        lse_only, none = backend.row_attend(form, h, 0.3)
        assert none is None and rel(lse_only.cpu(), ref_lse.cpu()) < tol


@pytest.mark.parametrize("name", BACKENDS)
def test_masked_columns_contribute_nothing(gen, name):
    backend = make_backend(name, "cpu")
    dtype, tol = exact(name)
    form, h = problem(gen, 20, 30, 3, dtype, "cpu")
    h[::3] = -math.inf
    v = torch.randn(30, 2, generator=gen, dtype=torch.float64).to(dtype)
    lse, out = backend.row_attend(form, h, 0.1, v)
    keep = torch.isfinite(h)
    sub = type(form)(form.q, form.k[keep], form.alpha, form.beta[keep])
    ref_lse, ref_out = dense_attend(sub, h[keep], 0.1, v[keep])
    assert rel(lse, ref_lse) < tol and rel(out, ref_out) < tol


@pytest.mark.parametrize("name", BACKENDS)
def test_symmetric_lse_is_rows_and_columns(gen, name):
    backend = make_backend(name, "cpu")
    dtype, tol = exact(name)
    form, h_col = problem(gen, 21, 34, 3, dtype, "cpu")
    h_row = torch.randn(21, generator=gen, dtype=torch.float64).to(dtype)
    rows, cols = backend.symmetric_lse(form, h_col, h_row, 0.5)
    assert rel(rows, dense_attend(form, h_col, 0.5, None)[0]) < tol
    assert rel(cols, dense_attend(form.T, h_row, 0.5, None)[0]) < tol


@pytest.mark.parametrize("name", BACKENDS)
def test_small_eps_large_scores_do_not_overflow(gen, name):
    backend = make_backend(name, "cpu")
    form, h = problem(gen, 40, 40, 3, torch.float32, "cpu", spread=30.0)
    lse, _ = backend.row_attend(form, h, 1e-3)
    ref, _ = dense_attend(form, h, 1e-3, None)
    assert torch.isfinite(lse).all() and rel(lse, ref) < 1e-5


def test_torch_tiles_combine_online(gen):
    """A tiny budget forces many tiles per row and column: same answer."""
    form, h = problem(gen, 45, 70, 3, torch.float64, "cpu")
    v = torch.randn(70, 3, generator=gen, dtype=torch.float64)
    whole = TorchBackend().row_attend(form, h, 0.2, v)
    import flashot.backends.torch_backend as tb

    tiny = TorchBackend(budget=16)
    orig = tb.tile_sizes
    tb.tile_sizes = lambda n, m, budget: (4, 8)
    try:
        tiled = tiny.row_attend(form, h, 0.2, v)
    finally:
        tb.tile_sizes = orig
    assert rel(tiled[0], whole[0]) < 1e-13 and rel(tiled[1], whole[1]) < 1e-13


def test_precision_validation():
    with pytest.raises(ValueError, match="precision"):
        TorchBackend("fp8")
    with pytest.raises(ValueError, match="backend"):
        resolve_backend("keops", torch.device("cpu"))


def off_fixed_point(gen, form, eps, steps, push, zero_b=False):
    """Weights (a zero in a, and in b with ``zero_b``), the dense cost and potentials:
    ``steps`` alternating Sinkhorn steps from 0, then rows pushed off by up to e^±push.

    Returns ``(a, b, C, f, g)`` in float64 on the CPU.
    """
    n, m = form.q.shape[0], form.k.shape[0]
    a = torch.rand(n, generator=gen, dtype=torch.float64) + 0.1
    b = torch.rand(m, generator=gen, dtype=torch.float64) + 0.1
    a[0] = 0.0 if n > 1 else a[0]  # (all-zero weights are refused upstream)
    if zero_b:
        b[-1] = 0.0
    C = (form.alpha.double()[:, None] + form.beta.double()[None]
         - form.q.double() @ form.k.double().T).cpu()  # fmt: skip
    f = torch.zeros(n, dtype=torch.float64)
    for _ in range(steps):
        g = -eps * torch.logsumexp((f[:, None] - C) / eps + torch.log(a)[:, None], 0)
        f = -eps * torch.logsumexp((g[None] - C) / eps + torch.log(b)[None], 1)
    f = f + eps * (torch.rand(n, generator=gen, dtype=torch.float64) * (2 * push) - push)
    return a, b, C, f, g


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize("shape,eps", [((50, 37, 3), 0.3), ((33, 70, 5), 0.05), ((1, 9, 2), 1.0)])
def test_plan_matvec_matches_dense(gen, name, shape, eps):
    """Backend.plan_matvec: (P w, Pᵀ u) at any potentials (far from a fixed point, with a
    zero weight), each product alone or both, against the dense float64 plan."""
    n, m, d = shape
    for device, backend in backends_on_devices(name):
        dtype, tol = exact(name)
        form, _ = problem(gen, n, m, d, dtype, device)
        # two Sinkhorn steps from 0, then rows pushed off by up to e^±3: far from the
        # fixed point, yet a plan whose sums are of the order of the weights
        a, b, C, f64, g64 = off_fixed_point(gen, form, eps, steps=2, push=3.0)
        log_a, log_b = (torch.log(t).to(device, dtype) for t in (a, b))
        f, g = f64.to(device, dtype), g64.to(device, dtype)
        P = a[:, None] * b[None] * torch.exp((f64[:, None] + g64[None] - C) / eps)
        w = torch.randn(m, generator=gen, dtype=torch.float64)
        u = torch.randn(n, generator=gen, dtype=torch.float64)
        r, c = P.sum(1).to(device, dtype), P.sum(0).to(device, dtype)
        pot = Potentials(form, f, g, log_a, log_b, eps)
        pw, ptu = backend.plan_matvec(pot, r, c, w.to(device, dtype), u.to(device, dtype))
        assert rel(pw.double().cpu(), P @ w) < tol and rel(ptu.double().cpu(), P.T @ u) < tol
        pots = (pot, r, c)
        alone, none = backend.plan_matvec(*pots, w=w.to(device, dtype))
        assert none is None and rel(alone.double().cpu(), P @ w) < tol
        none, alone = backend.plan_matvec(*pots, u=u.to(device, dtype))
        assert none is None and rel(alone.double().cpu(), P.T @ u) < tol
        ones = backend.plan_matvec(pot, r, c, torch.ones_like(g), torch.ones_like(f))
        assert rel(ones[0], r) < 4 * torch.finfo(dtype).eps  # P 1 = r to rounding
        assert rel(ones[1], c) < 4 * torch.finfo(dtype).eps


def dense_plan_vjp(form, f, g, a, b, eps, v, d, d0=None):
    """The reductions of S = P ⊙ (d⁰ 1ᵀ + D Vᵀ) and Pᵀ D, from the dense float64 plan."""
    q, k, al, be = (t.double().cpu() for t in (form.q, form.k, form.alpha, form.beta))
    f, g, a, b, v, d = (t.double().cpu() for t in (f, g, a, b, v, d))
    E = torch.exp((f[:, None] + g[None] - al[:, None] - be[None] + q @ k.T) / eps)
    P = a[:, None] * b[None] * E
    U = d @ v.T if d0 is None else d @ v.T + d0.double().cpu()[:, None]
    T = E * U  # S / (a ⊗ b), defined where a weight is 0 too
    S = a[:, None] * b[None] * T
    return dict(
        row=S.sum(1),
        row_k=S @ k,
        col=S.sum(0),
        col_q=S.T @ q,
        pt_d=P.T @ d,
        per_a=T @ b,
        per_b=T.T @ a,
    )


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize(
    "shape,p,eps",
    [((50, 37, 3), 2, 0.3), ((33, 70, 5), 6, 0.05), ((1, 9, 2), 1, 1.0), ((40, 45, 20), 21, 0.5)],
)
@pytest.mark.parametrize("splits", [None, 3])
def test_plan_vjp_matches_dense(gen, name, shape, p, eps, splits):
    """Backend.plan_vjp near a fixed point (rows off by up to e^±2, a zero weight on
    each side) against the dense float64 plan, with and without a row-sum cotangent d0;
    Triton also with forced column splits."""
    n, m, d = shape
    if name == "torch" and splits is not None:
        pytest.skip("splits are a Triton launch option")
    for device, backend in backends_on_devices(name):
        if splits is not None:
            backend.splits = splits
        dtype, tol = exact(name)
        form, _ = problem(gen, n, m, d, dtype, device)
        a, b, _, f64, g64 = off_fixed_point(gen, form, eps, steps=3, push=2.0, zero_b=True)
        v = torch.randn(m, p, generator=gen, dtype=torch.float64)
        dd = torch.randn(n, p, generator=gen, dtype=torch.float64)
        args = [t.to(device, dtype) for t in (f64, g64, a, b, v, dd)]
        d0 = torch.randn(n, generator=gen, dtype=torch.float64).to(device, dtype)
        if dtype == torch.float32:  # exponents of size X/ε are rounded to X/ε ulps (GPU)
            size = (
                form.q.norm(dim=1).max() * form.k.norm(dim=1).max()
                + (args[0] - form.alpha).abs().max()
                + (args[1] - form.beta).abs().max()
            )
            tol = max(tol, 2.0**-21 * float(size) / eps)
        for row_sums in (None, d0):
            out = backend.plan_vjp(form, *args[:4], eps, *args[4:], d0=row_sums)
            want = dense_plan_vjp(form, *args[:4], eps, *args[4:], row_sums)  # same rounded inputs
            for key, ref in want.items():
                assert rel(getattr(out, key).double().cpu(), ref) < tol, (key, row_sums is None)
        fields = dict(row=("row", "per_a"), col=("col", "per_b"))
        for need in ({"row_k"}, {"col"}, {"pt_d"}, {"row", "col_q"}):  # only what is asked
            part = backend.plan_vjp(form, *args[:4], eps, *args[4:], need=frozenset(need), d0=d0)
            for key in (k for name in need for k in fields.get(name, (name,))):
                assert rel(getattr(part, key).double().cpu(), want[key]) < tol, (need, key)
