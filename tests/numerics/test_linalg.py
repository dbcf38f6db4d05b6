import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flashot.numerics.linalg import CGWarning, LanczosWarning, NegativeCurvature, cg, lanczos

F64 = torch.float64


def spd(n, seed, cond=100.0):
    gen = torch.Generator().manual_seed(seed)
    Q, _ = torch.linalg.qr(torch.randn(n, n, generator=gen, dtype=F64))
    w = torch.logspace(0, torch.log10(torch.tensor(cond)).item(), n, dtype=F64)
    return Q @ torch.diag(w) @ Q.T


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 40), st.integers(0, 10**6), st.floats(1.0, 1e4))
def test_cg_solves_spd_systems(n, seed, cond):
    A = spd(n, seed, cond)
    b = torch.randn(n, generator=torch.Generator().manual_seed(seed + 1), dtype=F64)
    res = cg(lambda v: A @ v, b, tol=1e-10, max_iter=10 * n + 50)
    assert res.converged and res.residual <= 1e-10
    assert torch.allclose(res.x, torch.linalg.solve(A, b), rtol=0, atol=1e-8 * cond * b.norm())


def test_cg_on_matrix_shaped_unknowns_with_a_preconditioner():
    A = spd(12, 3, 1e3)
    d = torch.diag(A)
    B = torch.randn(4, 3, dtype=F64)  # the unknown is (4, 3): A acts on its flattening
    op = lambda v: (A @ v.reshape(-1)).reshape(4, 3)  # noqa: E731
    res = cg(op, B, tol=1e-12, preconditioner=lambda r: (r.reshape(-1) / d).reshape(4, 3))
    assert res.converged
    assert torch.allclose(res.x.reshape(-1), torch.linalg.solve(A, B.reshape(-1)), atol=1e-9)


def test_cg_warns_when_it_stops_short_and_reports_the_true_residual():
    A = spd(30, 0, 1e6)
    b = torch.ones(30, dtype=F64)
    with pytest.warns(CGWarning, match="did not reach"):
        res = cg(lambda v: A @ v, b, tol=1e-12, max_iter=3)
    assert not res.converged and res.n_iter == 3
    assert res.residual == pytest.approx(float((b - A @ res.x).norm() / b.norm()), rel=1e-12)


def test_cg_negative_curvature_raises_or_returns_the_direction():
    A = torch.diag(torch.tensor([2.0, 1.0, -1.0], dtype=F64))
    b = torch.ones(3, dtype=F64)
    with pytest.raises(NegativeCurvature):
        cg(lambda v: A @ v, b)
    res = cg(lambda v: A @ v, b, on_negative_curvature="return")
    p = res.negative_curvature
    assert p is not None and float(p @ A @ p) <= 0


def test_cg_zero_rhs_and_bad_options():
    res = cg(lambda v: 2 * v, torch.zeros(5, dtype=F64))
    assert res.converged and res.n_iter == 0 and torch.equal(res.x, torch.zeros(5, dtype=F64))
    with pytest.raises(ValueError, match="tol"):
        cg(lambda v: v, torch.ones(2), tol=0)
    with pytest.raises(ValueError, match="on_negative_curvature"):
        cg(lambda v: v, torch.ones(2), on_negative_curvature="ignore")


@settings(max_examples=20, deadline=None)
@given(st.integers(2, 30), st.integers(0, 10**6), st.integers(2, 9))
def test_cg_checked_every_few_iterations_is_the_same_solve(n, seed, every):
    # the steps of a block run past convergence are masked out: same iterate, same count
    A = spd(n, seed, 1e3)
    b = torch.randn(n, generator=torch.Generator().manual_seed(seed + 1), dtype=F64)
    one = cg(lambda v: A @ v, b, tol=1e-8, max_iter=10 * n + 50)
    some = cg(lambda v: A @ v, b, tol=1e-8, max_iter=10 * n + 50, check_every=every)
    assert some.n_iter == one.n_iter and some.converged
    assert torch.equal(some.x, one.x)


def test_cg_blocks_stop_at_negative_curvature_and_at_nan():
    A = torch.diag(torch.tensor([2.0, 1.0, -1.0], dtype=F64))
    b = torch.ones(3, dtype=F64)
    res = cg(lambda v: A @ v, b, on_negative_curvature="return", check_every=8)
    ref = cg(lambda v: A @ v, b, on_negative_curvature="return")
    assert res.n_iter == ref.n_iter and torch.equal(res.negative_curvature, ref.negative_curvature)
    with pytest.warns(CGWarning):  # a nan curvature is no direction: stop, warn
        res = cg(lambda v: v * float("nan"), b, check_every=4)
    assert res.negative_curvature is None and res.n_iter == 0 and not res.converged
    with pytest.raises(ValueError, match="check_every"):
        cg(lambda v: v, b, check_every=0)


@settings(max_examples=20, deadline=None)
@given(st.integers(5, 60), st.integers(0, 10**6), st.integers(1, 3),
       st.sampled_from(["smallest", "largest"]))  # fmt: skip
def test_lanczos_matches_eigvalsh(n, seed, k, which):
    gen = torch.Generator().manual_seed(seed)
    M = torch.randn(n, n, generator=gen, dtype=F64)
    A = (M + M.T) / 2
    k = min(k, n)
    vals, vecs = lanczos(lambda v: A @ v, n, k=k, which=which, tol=1e-12, max_iter=n,
                         generator=torch.Generator().manual_seed(1))  # fmt: skip
    ref = torch.linalg.eigvalsh(A)
    ref = ref[:k] if which == "smallest" else ref.flip(0)[:k]
    assert torch.allclose(vals, ref, atol=1e-8 * float(ref.abs().max()))
    for lam, v in zip(vals, vecs, strict=True):
        assert float((A @ v - lam * v).norm()) <= 1e-6 * float(ref.abs().max())


def test_lanczos_is_deterministic_given_a_generator_and_keeps_shapes():
    A = spd(24, 5)
    op = lambda v: (A @ v.reshape(-1)).reshape(8, 3)  # noqa: E731
    shape = torch.zeros(8, 3, dtype=F64)
    one = lanczos(op, shape, generator=torch.Generator().manual_seed(7))
    two = lanczos(op, shape, generator=torch.Generator().manual_seed(7))
    assert torch.equal(one[0], two[0]) and one[1].shape == (1, 8, 3)
    with pytest.raises(ValueError, match="which"):
        lanczos(op, shape, which="middle")
    with pytest.raises(ValueError, match="k must"):
        lanczos(op, shape, k=0)


def test_cg_kept_capture_is_replayed_by_later_calls_reading_refreshed_buffers():
    # capture=(cache, key): blocks captured in one call are replayed by the next, whose
    # operator reads the same buffer with new contents (Replayer stands in for a graph
    # and replays the first call's closure, as a CUDA graph would)
    from flashot.solver.graphs import GraphCache
    from tests.solver.test_graphs import Replayer

    Replayer.log = []
    cache = GraphCache(capture=Replayer)
    gen = torch.Generator().manual_seed(3)
    buffer = torch.empty(30, 30, dtype=torch.float64)
    for _ in range(2):
        a = torch.randn(30, 30, generator=gen, dtype=torch.float64)
        a = a @ a.T + 5 * torch.eye(30, dtype=torch.float64)
        b = torch.randn(30, generator=gen, dtype=torch.float64)
        buffer.copy_(a)
        kept = cg(lambda u, m=buffer: m @ u, b, tol=1e-12, check_every=4, capture=(cache, "a"))
        ref = cg(lambda u, m=a: m @ u, b, tol=1e-12, check_every=4)
        assert kept.n_iter == ref.n_iter and torch.allclose(kept.x, ref.x, rtol=0, atol=1e-12)
        assert kept.residual <= 1e-12
    assert Replayer.log.count("capture") == 1 and Replayer.log.count("replay") > 8


@settings(max_examples=15, deadline=None)
@given(n=st.integers(2, 30), k=st.integers(1, 5), seed=st.integers(0, 10_000))
def test_cg_columns_is_one_cg_per_column(n, k, seed):
    """columns=True: each column follows its own CG (own steps, own stop) while sharing
    the matvecs; a zero column stays zero."""
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(n, n, generator=gen, dtype=torch.float64)
    a = a @ a.T + 0.5 * torch.eye(n, dtype=torch.float64)
    b = torch.randn(n, k, generator=gen, dtype=torch.float64) * torch.logspace(-3, 3, k)
    b[:, 0] = 0.0 if k > 1 else b[:, 0]
    d = torch.rand(n, generator=gen, dtype=torch.float64) + 0.5
    calls = []

    def matvec(v):
        calls.append(v.shape)
        return a @ v

    res = cg(matvec, b, tol=1e-10, columns=True, preconditioner=lambda v: v / d[:, None])
    assert all(shape == (n, k) for shape in calls) and res.converged and res.residual <= 1e-10
    for j in range(k):
        one = cg(lambda v: a @ v, b[:, j], tol=1e-10, preconditioner=lambda v: v / d)
        scale = float(b[:, j].abs().max())
        assert torch.allclose(res.x[:, j], one.x, rtol=1e-9, atol=1e-12 * scale)
    with pytest.raises(ValueError, match="columns"):
        cg(matvec, b[:, 0], columns=True)


def test_lanczos_continues_past_an_invariant_subspace():
    # the zero operator maps the start block to exactly 0: fresh directions keep the basis
    # growing, and the k eigenvalues (all 0) come out exactly
    res = lanczos(lambda v: 0 * v, 5, k=2, generator=torch.Generator().manual_seed(0))
    assert torch.equal(res.values, torch.zeros(2, dtype=F64)) and res.converged


def spectrum(values, seed=0):
    """A symmetric matrix with the given eigenvalues in a random basis."""
    values = torch.as_tensor(values, dtype=F64)
    gen = torch.Generator().manual_seed(seed)
    Q, _ = torch.linalg.qr(torch.randn(len(values), len(values), generator=gen, dtype=F64))
    return Q @ torch.diag(values) @ Q.T


@pytest.mark.parametrize("which", ["smallest", "largest"])
@pytest.mark.parametrize("k", [2, 3])
def test_lanczos_finds_a_repeated_eigenvalue_k_times(which, k):
    # single-vector Lanczos saw 0.25 once and gave the next eigenvalue as its copy
    sign = 1.0 if which == "largest" else -1.0
    A = spectrum(sign * torch.cat([torch.full((3,), 0.25), torch.linspace(-1.0, 0.24, 117)]))
    res = lanczos(lambda v: A @ v, 120, k=k, which=which,
                  generator=torch.Generator().manual_seed(1))  # fmt: skip
    want = torch.full((k,), 0.25 * sign, dtype=F64)
    assert res.converged and torch.allclose(res.values, want, atol=1e-8)
    for lam, v, r in zip(res.values, res.vectors, res.residuals, strict=True):
        assert float((A @ v - lam * v).norm()) == pytest.approx(float(r), abs=1e-12)
    assert torch.allclose(res.vectors @ res.vectors.T, torch.eye(k, dtype=F64), atol=1e-10)


def test_lanczos_on_a_dense_cluster():
    # 40 eigenvalues 1e-3 apart below 160 spread ones: 0.10001, 0.10150, 0.10415 before,
    # with residuals up to 7e-3 and no word of it
    values = torch.cat([0.1 + 1e-3 * torch.arange(40, dtype=F64), torch.linspace(0.5, 2.0, 160)])
    A = spectrum(values, seed=2)
    res = lanczos(lambda v: A @ v, 200, k=3, generator=torch.Generator().manual_seed(0))
    assert res.converged and torch.allclose(res.values, values[:3], atol=1e-9)
    assert float(res.residuals.max()) <= 1e-8 * 2.0


def test_lanczos_says_when_it_stops_short_and_what_it_can_vouch_for():
    values = torch.cat([0.1 + 1e-3 * torch.arange(40, dtype=F64), torch.linspace(0.5, 2.0, 160)])
    A = spectrum(values, seed=2)
    with pytest.warns(LanczosWarning, match="did not reach"):
        res = lanczos(lambda v: A @ v, 200, k=3, max_iter=30)
    assert not res.converged and res.n_matvec == 30
    for lam, r in zip(res.values, res.residuals, strict=True):  # some eigenvalue within ‖r‖
        assert float((values - lam).abs().min()) <= float(r)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        lanczos(lambda v: A @ v, 200, k=3, max_iter=30, warn=False)


@pytest.mark.parametrize("block_size", [None, 4])
def test_lanczos_on_blocks_with_a_batched_operator(block_size):
    A = spectrum(torch.linspace(-2.0, 3.0, 50), seed=4)
    shape = torch.zeros(10, 5, dtype=F64)
    sizes = []

    def op(V):  # (p, 10, 5) -> (p, 10, 5)
        sizes.append(V.shape[0])
        return (V.reshape(V.shape[0], -1) @ A).reshape(V.shape)

    res = lanczos(op, shape, k=2, which="largest", batched=True, block_size=block_size)
    want = torch.tensor([3.0, 3.0 - 5 / 49], dtype=F64)
    assert res.converged and torch.allclose(res.values, want, atol=1e-8)
    assert res.vectors.shape == (2, 10, 5) and max(sizes) == (block_size or 2)
    assert sum(sizes) == res.n_matvec


def test_lanczos_options_are_checked():
    with pytest.raises(ValueError, match="block_size"):
        lanczos(lambda v: v, 5, block_size=6)
    with pytest.raises(ValueError, match="tol"):
        lanczos(lambda v: v, 5, tol=0.0)
    with pytest.raises(ValueError, match="max_iter"):
        lanczos(lambda v: v, 5, k=3, max_iter=2)


# ---- on a CUDA GPU (pytest -m gpu; skipped without one) ----
@pytest.mark.gpu
def test_lanczos_keeps_its_basis_on_the_operator_device():
    from flashot.numerics import linalg

    gen = torch.Generator("cuda").manual_seed(0)
    Q, _ = torch.linalg.qr(torch.randn(300, 300, device="cuda", dtype=torch.float64,
                                       generator=gen))  # fmt: skip
    w = torch.linspace(0.5, 2.0, 300, device="cuda", dtype=torch.float64)
    w[-2:] = 3.0
    A = Q @ torch.diag(w) @ Q.T
    res = linalg.lanczos(lambda v: A @ v, torch.zeros(300, device="cuda", dtype=torch.float64),
                         k=2, which="largest")  # fmt: skip
    assert res.converged and res.values.is_cuda and res.vectors.is_cuda
    assert torch.allclose(res.values, torch.full((2,), 3.0, device="cuda", dtype=torch.float64))
