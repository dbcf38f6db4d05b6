"""flashot.bench: the providers compute the same value, the harness and CLI write what
they say (CPU-sized; the H200 suite is BENCHMARKS.md's)."""

import pytest
import torch

import flashot
from flashot.bench.providers import POT, DenseTorch, Flashot, GeomLoss, make_problem
from tests.references import entropic_ot

CPU = torch.device("cpu")


@pytest.mark.parametrize("d", [2, 16])
@pytest.mark.parametrize("workload", ["forward", "gradient"])
def test_fixed_iteration_providers_agree_with_float64(d, workload):
    """flashot, the dense loop and GeomLoss' own loop run the same symmetric updates: after
    10 iterations their values agree with flashot's float64 value to float32 accuracy."""
    pytest.importorskip("geomloss")  # (a test extra: the GPU image lacks it)
    pb = make_problem(150, 120, d, CPU, eps=0.5 * d, seed=3)
    x, y, a, b = (t.double() for t in (pb.x, pb.y, pb.a, pb.b))
    want = float(flashot.sinkhorn(x, y, a, b, eps=pb.eps, tol=None, max_iter=pb.iters,
                                  update="symmetric", backend="torch").cost)  # fmt: skip
    for prov in (Flashot("torch"), DenseTorch(), GeomLoss("tensorized")):
        assert prov.unavailable(CPU) is None
        got = float(prov.prepare(workload, pb)())
        assert got == pytest.approx(want, rel=2e-6), prov.name


def test_plan_and_hvp_workloads_match_float64():
    """plan: the streamed product and the dense plan's agree with the float64 one; hvp:
    flashot's <v, Hv> in float32 against its float64 value (dense-checked elsewhere)."""
    from flashot.bench.harness import _reference

    pb = make_problem(120, 100, 3, CPU, eps=0.5, seed=5)
    want = _reference(pb, "plan")
    for prov in (Flashot("torch"), DenseTorch()):
        assert float(prov.prepare("plan", pb)()) == pytest.approx(want, rel=1e-5), prov.name
    got = float(Flashot("torch").prepare("hvp", pb)())
    assert got == pytest.approx(_reference(pb, "hvp"), rel=1e-3)


@pytest.mark.gpu
def test_flash_sinkhorn_hvp_route_matches_float64():
    """The peer's hvp row runs its own streaming HVP (CG on the dual system) at its
    pre-extrapolation potentials: its <v, Hv> matches flashot's float64 value (2026-12-02,
    in the interpreter with the package's CUDA checks removed: 9.3e-4 relative; on the GPU
    its scores are TF32, hence 1e-2)."""
    pytest.importorskip("flash_sinkhorn")
    if not torch.cuda.is_available():
        pytest.skip("flash-sinkhorn needs a CUDA GPU")
    from flashot.bench.harness import _reference
    from flashot.bench.providers import FlashSinkhorn

    pb = make_problem(1200, 1000, 3, torch.device("cuda"), eps=0.5, seed=5)
    got = float(FlashSinkhorn().prepare("hvp", pb)())
    assert got == pytest.approx(_reference(pb, "hvp"), rel=1e-2)


def test_ott_provider_runs_alternating_fixed_iterations_and_converges():
    """OTT-JAX (skipped without it; runs on jax 0.10 with the provider’s compatibility shim):
    ``converge`` reaches the dense solution; after 10 alternating updates from zero its
    value is within 1e-3 of flashot's (OTT values unconverged potentials its own way and
    takes no final extrapolation: the same algorithm, not the same number)."""
    pytest.importorskip("ott")
    from flashot.bench.providers import OTT

    pb = make_problem(90, 70, 3, CPU, eps=0.5, tol=1e-6, seed=6)
    x, y, a, b = (t.double() for t in (pb.x, pb.y, pb.a, pb.b))
    for mode in ("dense", "online"):
        prov = OTT(mode, batch_size=32)
        assert prov.unavailable(CPU) is None
        ref = flashot.sinkhorn(x, y, a, b, eps=pb.eps, tol=None, max_iter=pb.iters,
                               update="alternating", init=(torch.zeros_like(a),
                               torch.zeros_like(b)), backend="torch")  # fmt: skip
        assert float(prov.prepare("forward", pb)()) == pytest.approx(float(ref.cost), rel=1e-3)
        want = float(entropic_ot(x, y, a, b, pb.eps))
        assert float(prov.prepare("converge", pb)()) == pytest.approx(want, rel=1e-4)


def test_converge_providers_reach_the_dense_solution():
    pytest.importorskip("ot")
    pb = make_problem(100, 100, 3, CPU, eps=0.5, tol=1e-7, seed=4, dtype=torch.float64)
    want = float(entropic_ot(*(t.double() for t in (pb.x, pb.y, pb.a, pb.b)), pb.eps))
    for prov in (Flashot("torch"), POT()):
        assert float(prov.prepare("converge", pb)()) == pytest.approx(want, rel=1e-6), prov.name


@pytest.mark.parametrize("workload", ["forward", "gradient", "converge"])
def test_pot_lazy_is_the_value_of_its_alternating_plan(workload, monkeypatch):
    """POT's online solver in blocks of a few rows: after 10 alternating updates (f, then
    g, from zero) the value of its plan is that of the same updates on the dense float64
    matrix; converged, the entropic OT value."""
    import flashot.bench.providers as providers

    pytest.importorskip("ot")
    monkeypatch.setattr(providers, "POT_LAZY_BLOCK", 7 * 30)  # 7 rows a block
    pb = make_problem(40, 30, 3, CPU, eps=0.5, tol=1e-9, seed=8, dtype=torch.float64)
    if workload == "converge":
        want = float(entropic_ot(pb.x, pb.y, pb.a, pb.b, pb.eps))
    else:
        c = torch.cdist(pb.x, pb.y) ** 2
        f, g = torch.zeros_like(pb.a), torch.zeros_like(pb.b)
        for _ in range(pb.iters):
            f = pb.a.log() - torch.logsumexp(g[None, :] - c / pb.eps, 1)
            g = pb.b.log() - torch.logsumexp(f[:, None] - c / pb.eps, 0)
        log_p = f[:, None] + g[None, :] - c / pb.eps
        p = log_p.exp()
        kl = (p * (log_p - pb.a.log()[:, None] - pb.b.log()[None, :])).sum() - p.sum() + 1
        want = float((p * c).sum() + pb.eps * kl)
    prov = providers.POTLazy()
    assert prov.unavailable(CPU) is None
    assert float(prov.prepare(workload, pb)()) == pytest.approx(want, rel=1e-9)
    if workload == "forward":  # the gradient in x: the plan's envelope gradient
        pb.x.requires_grad_()
        (grad,) = torch.autograd.grad(prov.prepare(workload, pb)(), pb.x)
        want_grad = 2 * (p.sum(1)[:, None] * pb.x - p @ pb.y)
        assert torch.allclose(grad, want_grad.detach(), rtol=1e-8, atol=1e-12)


def test_otdd_workload_streamed_and_dense_agree_with_float64():
    """flashot's dataset_distance and the dense formula (augmented n×m cost, the same
    debiased symmetric solves) against flashot's float64 value."""
    from flashot.bench.harness import _reference

    pb = make_problem(80, 70, 4, CPU, eps=2.0, seed=8)
    want = _reference(pb, "otdd")
    for prov in (Flashot("torch"), DenseTorch()):
        assert "otdd" in prov.workloads
        assert float(prov.prepare("otdd", pb)()) == pytest.approx(want, rel=1e-5), prov.name


@pytest.mark.parametrize("name, forms", [("flashot-triton-cache", True),
                                          ("flashot-triton-stream", False)])  # fmt: skip
def test_the_scores_providers_are_opt_in_and_compute_the_same_value(name, forms):
    """``flashot-triton-cache`` and ``-stream`` run only when named, and their forward
    (a solve reading one cached score matrix, or none; Triton's interpreter here) equals
    the float64 value."""
    from flashot.backends import available_backends
    from flashot.bench.providers import providers

    assert name not in [p.name for p in providers(torch.device("cuda"))]
    (prov,) = providers(CPU, [name])
    if "triton" not in available_backends(CPU):
        pytest.skip("needs triton's interpreter")
    pb = make_problem(40, 30, 5, CPU, eps=2.0, seed=4)
    x, y, a, b = (t.double() for t in (pb.x, pb.y, pb.a, pb.b))
    want = float(flashot.sinkhorn(x, y, a, b, eps=pb.eps, tol=None, max_iter=pb.iters,
                                  update="symmetric", backend="torch").cost)  # fmt: skip
    from unittest import mock

    from flashot.backends.triton import _operands

    with mock.patch.object(_operands, "score_matrix", wraps=_operands.score_matrix) as made:
        got = float(prov.prepare("forward", pb)())
    assert (made.call_count >= 1) == forms  # (the solve read a cached matrix, or streamed)
    assert got == pytest.approx(want, rel=2e-6)


def test_a_fresh_process_can_ask_a_flashot_provider_whether_it_runs():
    """`flashot.backends` loads lazily: a provider asked first in a fresh process read it
    as an attribute and raised AttributeError (v59, a device script's first rows)."""
    import subprocess
    import sys

    code = ("import torch\nfrom flashot.bench.providers import Flashot\n"
            "print(Flashot('torch').unavailable(torch.device('cpu')))")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == "None", out.stderr[-500:]
