"""Score matrices held in memory (flashot.backends.triton._scores, ``scores="cache"``)."""

import contextlib
from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import flashot
from flashot.backends import available_backends
from flashot.backends.device import triton_interpreted
from tests.conftest import rel

pytestmark = pytest.mark.skipif("triton" not in available_backends(), reason="needs triton")
#: the kernels' device: CPU tensors in the interpreter (CI), the GPU otherwise
DEV = "cpu" if triton_interpreted() else "cuda"


def _backend(scores: str, **kw):
    from flashot.backends.triton import TritonBackend

    return TritonBackend(scores=scores, **kw)


@contextlib.contextmanager
def _counting():
    """The problem (n, m) of every score matrix formed within (a list, filled as they are;
    the matrix is formed for the transposed problem, k qᵀ), outside CUDA graph captures
    (a capture of a solve's block forms its own: on a GPU, by design)."""
    from flashot.backends.triton import _operands, _scores

    formed, real = [], _scores.score_matrix

    def counting(ops, k, q):
        if not (q.is_cuda and torch.cuda.is_current_stream_capturing()):
            formed.append((q.shape[0], k.shape[0]))
        return real(ops, k, q)

    with mock.patch.object(_operands, "score_matrix", counting):
        yield formed


@pytest.mark.parametrize("transposed", [False, True])
def test_the_views_address_the_matrix_and_its_transpose(transposed):
    """Element (i, j) at ``i·stride(0) + j·stride(1)`` of the first view's pointer is
    S[i, j] (or S[j, i]); the second view only counts the columns."""
    from flashot.backends.triton._scores import cached_views

    s = torch.arange(35.0).view(5, 7)
    q, k = cached_views(s, transposed)
    want = s.T if transposed else s
    assert q.shape == (want.shape[0], 1) and k.shape == (want.shape[1], 1)
    flat = s.view(-1)
    offset = q.data_ptr() - s.data_ptr()
    got = torch.tensor([[float(flat[offset // 4 + i * q.stride(0) + j * q.stride(1)])
                         for j in range(want.shape[1])] for i in range(want.shape[0])])  # fmt: skip
    assert torch.equal(got, want)


@settings(max_examples=10, deadline=None)
@given(n=st.integers(1, 40), m=st.integers(1, 40), d=st.integers(1, 70),
       seed=st.integers(0, 2**31 - 1))  # fmt: skip
def test_the_matrix_is_the_streamed_scores(n, m, d, seed):
    """``score_matrix`` equals q kᵀ in float64 to float32's accuracy (relative to |q||k|),
    whatever the sizes (tails of tiles, several feature chunks)."""
    from flashot.backends.triton._operands import Operands
    from flashot.backends.triton._scores import score_matrix

    gen = torch.Generator().manual_seed(seed)
    q, k = torch.randn(n, d, generator=gen), torch.randn(m, d, generator=gen) * 3.0
    s = score_matrix(Operands("fp32", None), q.to(DEV), k.to(DEV)).cpu().double()
    ref = q.double() @ k.double().T
    scale = q.double().norm(dim=1)[:, None] * k.double().norm(dim=1)[None, :]
    assert s.shape == (n, m) and float(((s - ref).abs() / scale).max()) < 1e-6


@settings(max_examples=4, deadline=None)  # (each example: four interpreted solves)
@given(n=st.integers(2, 24), m=st.integers(2, 24), d=st.sampled_from([2, 5, 33]),
       cost=st.sampled_from(["sqeuclidean", "cosine"]), rho=st.sampled_from([None, 1.0]),
       seed=st.integers(0, 2**31 - 1))  # fmt: skip
def test_cached_solves_equal_streamed_ones(n, m, d, cost, rho, seed):
    """Cost, potentials and the gradient of a cached solve equal the streamed solve's
    (balanced and unbalanced, both costs, random weights); one matrix a pair and scope,
    dropped after it."""
    with _counting() as formed:
        _compare_solves(n, m, d, cost, rho, seed, formed)


def _compare_solves(n, m, d, cost, rho, seed, formed):
    gen = torch.Generator().manual_seed(seed)
    x, y = torch.randn(n, d, generator=gen), torch.randn(m, d, generator=gen) + 0.4
    a, b = torch.rand(n, generator=gen) + 0.1, torch.rand(m, generator=gen) + 0.1
    a, b = a / a.sum(), b / b.sum()
    out = {}
    for scores in ("stream", "cache"):
        formed.clear()
        backend = _backend(scores)
        xs = x.clone().to(DEV).requires_grad_()
        res = flashot.sinkhorn(xs, y.to(DEV), a.to(DEV), b.to(DEV), eps=0.5, cost=cost,
                               rho=rho, backend=backend)  # fmt: skip
        (grad,) = torch.autograd.grad(res.cost, xs)
        out[scores] = (res.cost.detach(), res.f.detach(), res.g.detach(), grad)
        assert backend.operands.matrices == []  # (dropped when the solve ended)
        assert len(formed) == (0 if scores == "stream" else len(set(formed)))
    assert formed  # the cached solve formed its matrix
    (c0, f0, g0, x0), (c1, f1, g1, x1) = out["stream"], out["cache"]
    if rho is None:  # (balanced: (f + c, g − c) is the same solution; rounding moves c)
        shift = (f1 - f0).mean()
        f1, g1 = f1 - shift, g1 + shift
    for streamed, cached in ((c0, c1), (f0, f1), (g0, g1), (x0, x1)):
        assert rel(cached, streamed) < 1e-5


def test_a_debiased_loss_and_its_hvp_are_the_same_cached():
    """SamplesLoss' three problems (x against y, x and y against themselves) and the double
    backward's reverse products read cached matrices: the same value, gradient and HVP."""
    with _counting() as formed:
        _compare_debiased(formed)


def _compare_debiased(formed):
    gen = torch.Generator().manual_seed(3)
    x, y = torch.randn(18, 6, generator=gen), torch.randn(15, 6, generator=gen) + 0.3
    u = torch.randn(18, 6, generator=gen)
    out = {}
    for scores in ("stream", "cache"):
        loss = flashot.SamplesLoss(blur=0.5, scaling=0.7, backend=_backend(scores))
        xs = x.clone().to(DEV).requires_grad_()
        value = loss(xs, y.to(DEV))
        (grad,) = torch.autograd.grad(value, xs, create_graph=True)
        (hvp,) = torch.autograd.grad((grad * u.to(DEV)).sum(), xs)
        out[scores] = (value.detach(), grad.detach(), hvp)
    assert {(18, 15), (18, 18), (15, 15)} <= set(formed)
    for streamed, cached in zip(out["stream"], out["cache"], strict=True):
        assert rel(cached, streamed) < 1e-5


def test_passes_outside_a_solve_stream():
    """A one-off pass (no operand scope) forms no matrix: memory stays O((n + m) d)."""
    with _counting() as formed:
        _one_off_and_scoped(formed)


def _one_off_and_scoped(formed):
    from flashot.geometry.costs import attention_form, get_cost

    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(20, 4, generator=gen).to(DEV), torch.randn(15, 4, generator=gen).to(DEV)
    backend = _backend("cache")
    form = attention_form(get_cost("sqeuclidean"), x, y)
    backend.row_attend(form, torch.zeros(15, device=DEV), 0.5)
    assert formed == []
    with backend.operand_scope():
        backend.row_attend(form, torch.zeros(15, device=DEV), 0.5)
        backend.row_attend(form.T, torch.zeros(20, device=DEV), 0.5)  # (the transposed pair)
    assert formed == [(20, 15)] and backend.operands.matrices == []


def test_the_option_is_checked():
    with pytest.raises(ValueError, match=r"scores must be one of \('auto', 'stream', 'cache'\)"):
        _backend("dense")


def test_auto_caches_wide_features_and_the_result_says_so():
    """``scores="auto"`` (the default) streams below ``AUTO_FROM_D`` features and caches
    from there; the result's ``score_memory`` is the matrix's bytes (0 streamed), its repr
    says so, and the cached solve's cost and gradient (a program per value chunk, 300
    values) equal the streamed one's."""
    from flashot.backends.triton import TritonBackend, _configs
    from flashot.backends.triton._scores import AUTO_FROM_D

    wide = AUTO_FROM_D["fp32"]
    assert TritonBackend().operands.scores == "auto"
    out = {}
    with _counting() as formed:
        for d, scores in ((wide - 1, "auto"), (wide + 44, "auto"), (wide + 44, "stream")):
            formed.clear()
            gen = torch.Generator().manual_seed(d)  # (the same clouds for both options)
            x, y = torch.randn(9, d, generator=gen), torch.randn(7, d, generator=gen) / 2
            x = x.to(DEV).requires_grad_()
            res = flashot.sinkhorn(x, y.to(DEV), eps=float(d), tol=None, max_iter=4,
                                   backend=TritonBackend(scores=scores))  # fmt: skip
            (grad,) = torch.autograd.grad(res.cost, x)
            cached = scores == "auto" and d >= wide
            assert res.score_memory == (4 * 9 * 7 if cached else 0)
            assert formed == ([(9, 7)] if cached else [])
            assert ("scores cached" in repr(res)) == cached
            out[(d, scores)] = (res.cost.detach(), grad)
    assert _configs.value_loop(d, cached=True) == 1 < _configs.value_loop(d)
    for streamed, cached in zip(out[(wide + 44, "stream")], out[(wide + 44, "auto")],
                                strict=True):  # fmt: skip
        assert rel(cached, streamed) < 1e-5


def test_a_matrix_that_does_not_fit_streams():
    """Where the matrix would take more than the free share, the solve streams."""
    from flashot.backends.triton import _operands

    x, y = torch.randn(6, 3).to(DEV), torch.randn(5, 3).to(DEV)
    with _counting() as formed, mock.patch.object(_operands, "fits", return_value=False):
        res = flashot.sinkhorn(x, y, eps=1.0, tol=None, max_iter=3, backend=_backend("cache"))
    assert formed == [] and res.score_memory == 0


def test_a_capture_repeats_its_eager_choice():
    """While capturing a CUDA graph the choice is the eager call's of the same shapes (no
    driver query), and without one the capture streams; a replay counts the matrix its
    capture holds."""
    from flashot.backends.triton import _operands
    from flashot.backends.triton._operands import Operands

    ops = Operands("fp32", None, "cache")
    q, k, other = torch.randn(6, 3), torch.randn(5, 3), torch.randn(4, 3)
    _operands._CHOICES.clear()
    assert ops.caches(q, k, capturing=True) is False  # (no eager call yet)
    assert ops.caches(q, k) is True  # (the CPU always fits)
    assert ops.caches(q, k, capturing=True) is True
    assert ops.caches(other, k, capturing=True) is False
    ops.replayed(other, k)  # (a replay holds what its capture formed: nothing here)
    assert ops.take_held() == 0
    ops.replayed(q, k)
    assert ops.take_held() == 4 * 6 * 5 and ops.take_held() == 0
    other_instance = Operands("fp32", None, "cache")  # (graphs are shared: so are choices)
    assert other_instance.caches(q, k, capturing=True) is True
    other_instance.replayed(q, k)
    assert other_instance.take_held() == 4 * 6 * 5
    ops.scores = "auto"
    assert ops.caches(q, k, capturing=True) is False  # (another option: no choice yet)
    assert ops.caches(q, k) is False and ops.caches(q, k, capturing=True) is False
    ops.replayed(q, k)
    assert ops.take_held() == 0


def test_otdd_streams_where_sinkhorn_would_cache():
    """OTDD keeps its O((n + m) d) memory: its solves stream under a backend named by a
    string, where a plain solve of the same clouds caches."""
    from flashot.backends.triton._scores import AUTO_FROM_D
    from flashot.tasks.otdd import dataset_distance

    gen = torch.Generator().manual_seed(2)
    d = AUTO_FROM_D["fp32"]
    xa, xb = torch.randn(12, d, generator=gen).to(DEV), torch.randn(10, d, generator=gen).to(DEV)
    ya, yb = torch.arange(12).to(DEV) % 3, torch.arange(10).to(DEV) % 2
    with _counting() as formed:
        out = dataset_distance(xa, ya, xb, yb, eps=float(d), diagonal=True, tol=None,
                               max_iter=3, backend="triton")  # fmt: skip
        assert formed == [] and out.result.score_memory == 0
        res = flashot.sinkhorn(xa, xb, eps=float(d), tol=None, max_iter=3, backend="triton")
        assert formed == [(12, 10)] and res.score_memory == 4 * 12 * 10


def test_the_free_share_counts_the_matrices_held():
    """A matrix fits while all the solve holds stays within half the memory free before
    them (a debiased solve's three too), asked of the device's free memory."""
    from flashot.backends.triton._scores import fits

    cuda = torch.device("cuda")
    with mock.patch.object(torch.cuda, "mem_get_info", return_value=(1000, 10**6)):
        assert fits(10, 10, cuda)  # 400 of 1 000 free
        assert not fits(10, 13, cuda)  # 520
        assert not fits(10, 10, cuda, held=400)  # 800 of 1 400
        assert fits(10, 5, cuda, held=400)  # 600 of 1 400
    assert fits(10**6, 10**6, torch.device("cpu"))


@pytest.mark.parametrize("scores", ["stream", "cache"])
@pytest.mark.parametrize("d", [3, 7])
def test_inference_mode_gives_the_plain_numbers(scores, d):
    """Under torch.inference_mode (tensors without version counters) the Triton backend
    solves as in plain mode: operand conversions (triples up to 5 features) and cached
    score matrices alike; it crashed in both before."""
    gen = torch.Generator().manual_seed(d)
    x, y = torch.randn(14, d, generator=gen).to(DEV), torch.randn(11, d, generator=gen).to(DEV)
    out = {}
    for mode, ctx in (("plain", torch.no_grad), ("inference", torch.inference_mode)):
        with ctx():
            res = flashot.sinkhorn(x, y, eps=2.0, tol=None, max_iter=5, backend=_backend(scores))
            out[mode] = (res.cost.clone(), res.f.clone(), res.score_memory)
    assert torch.equal(out["plain"][0], out["inference"][0])
    assert torch.equal(out["plain"][1], out["inference"][1])
    assert out["plain"][2] == out["inference"][2] == (4 * 14 * 11 if scores == "cache" else 0)
