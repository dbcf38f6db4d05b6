import pytest
import torch

import flashot
from flashot.numerics.optim import AdamNewton, NewtonCG, TrustRegion

F64 = torch.float64


def registration(n=12):
    gen = torch.Generator().manual_seed(0)
    X = torch.randn(n, 2, generator=gen, dtype=F64)
    A_true = torch.tensor([[1.3, 0.4], [-0.2, 0.8]], dtype=F64)
    t_true = torch.tensor([0.5, -0.3], dtype=F64)
    Y = X @ A_true + t_true
    A = torch.eye(2, dtype=F64, requires_grad=True)
    t = torch.zeros(2, dtype=F64, requires_grad=True)

    def closure():
        return flashot.sinkhorn_divergence(X @ A + t, Y, eps=0.5, tol=1e-11, max_iter=20000)

    return (A, t), closure, (A_true, t_true)


def test_second_order_registers_an_affine_map_in_far_fewer_steps_than_adam():
    finals = []
    for cls in (NewtonCG, TrustRegion):
        params, closure, (A_true, t_true) = registration()
        opt = cls(params)
        for _ in range(8):
            opt.step(closure)
        with torch.no_grad():
            finals.append(float(closure()))
        assert finals[-1] < 1e-12
        assert torch.allclose(params[0], A_true, atol=1e-5)
        assert torch.allclose(params[1], t_true, atol=1e-5)
        log = opt.log
        assert len(log) == 8 and all(e["loss"] > -1e-12 for e in log)
        assert any(e["cg_iters"] > 0 for e in log) and log[0]["grad_norm"] > log[-1]["grad_norm"]
    final = max(finals)
    # Adam, tuned (lr 0.05: the lowest loss at 40 steps of 0.01, 0.02, 0.05, 0.1, 0.2), 5x the steps
    params, closure, _ = registration()
    adam = torch.optim.Adam(params, lr=0.05)
    for _ in range(40):
        adam.zero_grad()
        closure().backward()
        adam.step()
    with torch.no_grad():
        assert float(closure()) > 1e4 * max(final, 1e-16)


def saddle():
    # two points ±θ against targets ±e1: θ = 0 is a saddle (concave along e1, convex along
    # e2); started on the e2 axis, symmetry keeps gradient descent on it
    Y = torch.tensor([[1.0, 0.0], [-1.0, 0.0]], dtype=F64)
    theta = torch.tensor([0.0, 0.6], dtype=F64, requires_grad=True)

    def closure():
        return flashot.sinkhorn_divergence(torch.stack([theta, -theta]), Y, eps=0.05, tol=1e-12,
                                           max_iter=20000)  # fmt: skip

    return theta, closure


def test_adam_newton_escapes_a_saddle_where_gradient_descent_stalls():
    theta, closure = saddle()
    sgd = torch.optim.SGD([theta], lr=0.1)
    for _ in range(60):
        sgd.zero_grad()
        closure().backward()
        sgd.step()
    with torch.no_grad():
        assert float(closure()) > 0.9 and abs(float(theta[0])) < 1e-8  # stuck at the saddle
    theta, closure = saddle()
    opt = AdamNewton([theta], lr=0.05, switch_grad_norm=0.1)
    for _ in range(40):
        opt.step(closure)
    escapes = [e for e in opt.log if e["step"] == "negative_curvature"]
    assert escapes and escapes[0]["lambda_min"] < -1.0
    with torch.no_grad():
        assert float(closure()) < 1e-8
    assert torch.allclose(theta.detach().abs(), torch.tensor([1.0, 0.0], dtype=F64), atol=1e-5)


def test_adam_newton_escapes_an_exact_saddle_with_zero_gradient():
    """At θ = 0 the gradient vanishes (to rounding) and both points coincide: a first-order
    test would call it converged. The curvature check escapes it; the coinciding points'
    cotangents are rounding noise, which the dual solve must take (not a gauge error)."""
    theta, closure = saddle()
    with torch.no_grad():
        theta.zero_()
    opt = AdamNewton([theta], lr=0.05, switch_grad_norm=0.1)
    for _ in range(40):
        opt.step(closure)
    assert opt.log[0]["step"] == "negative_curvature" and opt.log[0]["grad_norm"] < 1e-12
    assert opt.log[0]["lambda_min"] < -1.0
    with torch.no_grad():
        assert float(closure()) < 1e-8
    assert opt.log[-1]["step"] == "converged" and opt.log[-1]["lambda_min"] > -1e-6


def test_options_and_closures_are_checked():
    x = torch.zeros(2, dtype=F64, requires_grad=True)
    with pytest.raises(ValueError, match="single parameter group"):
        NewtonCG([{"params": [x]}, {"params": [torch.zeros(1, requires_grad=True)]}])
    with pytest.raises(ValueError, match="radius"):
        TrustRegion([x], radius=-1.0)
    with pytest.raises(TypeError, match="0-dim"):
        NewtonCG([x]).step(lambda: x * 1.0)


def test_newton_on_a_quadratic_is_one_step():
    # the machinery itself, on a loss with a known Hessian
    H = torch.tensor([[3.0, 1.0], [1.0, 2.0]], dtype=F64)
    x = torch.tensor([1.0, -2.0], dtype=F64, requires_grad=True)
    opt = NewtonCG([x], cg_tol=1e-12)
    opt.step(lambda: 0.5 * x @ H @ x - x.sum())
    assert torch.allclose(x.detach(), torch.linalg.solve(H, torch.ones(2, dtype=F64)), atol=1e-8)


def test_eisenstat_walker_forcing():
    from flashot.numerics.optim import Forcing

    ew = Forcing()
    assert ew.next(1.0) == 0.5  # first step: η_max
    assert ew.next(0.5) == pytest.approx(0.9 * 0.5**2)  # γ (‖g‖/‖g_old‖)^2
    assert ew.next(1e-6) == pytest.approx(0.9 * (1e-6 / 0.5) ** 2)  # safeguard 0.046 < 0.1
    held = Forcing()
    held.last = (1.0, 0.5)  # a sudden drop, held back by γ η_old² = 0.225 > 0.1
    assert held.next(1e-3) == pytest.approx(0.225)
    tight = Forcing()
    tight.last = (1.0, 0.01)
    assert tight.next(0.01) == pytest.approx(0.9 * 1e-4)  # quadratic in the gradient ratio
    assert Forcing("sqrt").next(0.04) == pytest.approx(0.2)
    assert Forcing(0.3).next(123.0) == 0.3
    with pytest.raises(ValueError, match="forcing"):
        Forcing("fast")


def test_newton_hvps_follow_the_forcing():
    """Each Newton step's dual solves run to η/10 of that step (η from the previous
    gradient), so early steps are cheap; the minimum is reached all the same."""
    params, closure, (A_true, _t_true) = registration()
    opt = NewtonCG(params)
    tols = []
    for _ in range(8):
        with flashot.record_dual_solves() as log:
            opt.step(closure)
        tols.append(max(s.tol for s in log) if len(log) else None)
    assert torch.allclose(params[0], A_true, atol=1e-5)
    etas = [e["eta"] for e in opt.log]
    assert etas[0] == 0.5 and min(etas) < 1e-3  # loose first, tight near the minimum
    # the second step's HVPs at min(η/10, 5 %) of the first step's η: 0.05 · 0.1 residual
    assert tols[1] == pytest.approx(0.05 * 0.1)
    fixed = NewtonCG(registration()[0], adaptive_hvp=False)
    assert fixed._adaptive is False


@pytest.mark.parametrize("cls", [NewtonCG, TrustRegion, AdamNewton])
def test_a_parameter_the_loss_does_not_use_is_named(cls):
    (A, t), closure, _ = registration()
    stray = torch.zeros(3, dtype=F64, requires_grad=True)
    with pytest.raises(ValueError, match=r"parameter 2 \(shape \(3,\)\)"):
        cls([A, t, stray]).step(closure)


@pytest.mark.parametrize("cls", [NewtonCG, TrustRegion, AdamNewton])
def test_an_accepted_point_is_evaluated_once(cls, monkeypatch):
    """The next step differentiates the evaluation that accepted its point (one closure
    call per accepted step and per rejected trial), with the same iterates as a fresh
    evaluation at every step."""
    logs, calls = [], []
    for reuse in (True, False):
        if not reuse:  # (the reference: every step evaluates the closure anew)
            monkeypatch.setattr(cls, "_reusable", lambda self, tol: setattr(self, "_kept", None))
        params, closure, _ = registration()
        count = [0]

        def counted(closure=closure, count=count):
            count[0] += 1
            return closure()

        # (AdamNewton: curvature steps from the start, not Adam's)
        opt = cls(params, switch_grad_norm=1e9) if cls is AdamNewton else cls(params)
        for _ in range(4):
            opt.step(counted)
        logs.append([(e["loss"], e["grad_norm"], e["step"]) for e in opt.log])
        rejected = sum(e["step"] == "rejected" for e in opt.log)
        calls.append((count[0], rejected, [e["t"] for e in opt.log]))
    assert logs[0] == logs[1]
    (reused, _, steps), (fresh, _, _) = calls
    # every step that accepted a point saved the next step its evaluation
    assert fresh >= 8 and reused == fresh - sum(t > 0 for t in steps[:-1])
