r"""Second-order optimizers for losses built from flashot operations (torch.optim style).

Each takes a ``closure`` that re-evaluates the loss (like :class:`torch.optim.LBFGS`,
but it must *not* call ``backward``: the optimizer differentiates it, twice). Hessian-
vector products are double backward passes through the loss, exact for flashot's OT
values (:mod:`flashot.autodiff.second_order`), so each costs a dual CG solve and a few
streaming passes, and no n × m or (nd)² array.

- :class:`NewtonCG`: inexact Newton steps (CG to a forcing tolerance, stopped at
  negative curvature) with an Armijo backtracking line search.
- :class:`TrustRegion`: Steihaug–Toint truncated CG in a ball whose radius follows the
  ratio of actual to predicted decrease; negative curvature leads to the boundary.
- :class:`AdamNewton`: Adam steps while the gradient is large; near a stationary point
  it estimates λ_min of the Hessian by Lanczos, takes a negative-curvature step when
  λ_min < −τ (saddle escape) and a Newton step when the Hessian is positive definite.

Forcing (both Newton methods): the inner CG stops at the relative residual η_k of
Eisenstat and Walker (1996, choice 2), ``η_k = γ (‖g_k‖ / ‖g_{k−1}‖)^α`` with γ = 0.9,
α = 2, safeguarded by ``γ η_{k−1}^α`` and capped at ``η_max = ½``: loose while far from
the minimum (cheap early steps), tightening as the gradient falls (superlinear
convergence). The HVPs follow it: each step's dual solves run to the accuracy
``η_k / 10`` (:func:`flashot.sinkhorn`'s ``hvp_tol``, at most 5 %), since an HVP more
accurate than the CG that uses it buys nothing.

Evaluations: the point a Newton or trust-region step accepts was evaluated with autograd
on (and with the next step's HVP accuracy), so the next step differentiates that
evaluation instead of calling the closure again: one closure call per accepted step,
plus the line search's rejected trials (as :class:`torch.optim.LBFGS` reuses its line
search's last evaluation).

Every optimizer appends one dict per step to :attr:`log`: ``loss``, ``grad_norm``,
``step`` (the step type), ``cg_iters``, ``lambda_min`` (when computed, with
``lambda_residual`` and ``lambda_converged`` of its Lanczos estimate), ``t`` (the step
length accepted), ``radius`` (trust region).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable

import torch

from flashot.autodiff.implicit import RESIDUAL_PER_ERROR
from flashot.autodiff.second_order import dual_solve_options
from flashot.numerics.linalg import cg, lanczos

__all__ = ["AdamNewton", "NewtonCG", "TrustRegion"]


class _SecondOrder(torch.optim.Optimizer):
    """Shared machinery: one flat parameter vector, gradients and HVPs of the closure."""

    def __init__(self, params, defaults):
        super().__init__(params, defaults)
        if len(self.param_groups) != 1:
            raise ValueError(f"{type(self).__name__} supports a single parameter group")
        self.log: list[dict] = []
        # (parameters, hvp_tol, loss with its graph) of the last point evaluated with
        # autograd, which the next step's derivatives take instead of a new evaluation
        self._kept: tuple | None = None
        self._trial: tuple | None = None

    @property
    def _params(self) -> list[torch.Tensor]:
        return self.param_groups[0]["params"]

    def _flat(self) -> torch.Tensor:
        return torch.cat([p.detach().reshape(-1) for p in self._params])

    def _assign(self, flat: torch.Tensor) -> None:
        start = 0
        with torch.no_grad():
            for p in self._params:
                p.copy_(flat[start : start + p.numel()].view_as(p))
                start += p.numel()

    def _loss_at(self, closure, flat: torch.Tensor, keep: tuple | None = None) -> float:
        """The loss at ``flat`` (the parameters then hold it).

        ``keep=(hvp_tol,)``: evaluated with autograd and that accuracy, so that
        :meth:`_accept` can hand it to the next step's derivatives.
        """
        self._assign(flat)
        if keep is None:
            with torch.no_grad():
                return float(closure())
        with torch.enable_grad(), _accuracy(keep[0]):
            loss = closure()
        self._trial = (flat.clone(), keep[0], loss)
        return float(loss.detach())

    def _accept(self, accepted: bool) -> None:
        """The last trial becomes the next step's evaluation if the step took it."""
        self._kept, self._trial = (self._trial if accepted else None), None

    def _reusable(self, hvp_tol: float | None):
        """The kept loss if it was evaluated at these parameters with this accuracy."""
        kept, self._kept = self._kept, None
        if kept is None or kept[1] != hvp_tol or not torch.equal(kept[0], self._flat()):
            return None
        return kept[2]

    def _derivatives(self, closure, hvp_tol: float | None = None
                     ) -> tuple[float, torch.Tensor, Callable]:  # fmt: skip
        """(loss, flat gradient, v ↦ H v) at the current parameters.

        ``hvp_tol``: the HVPs' relative accuracy for this step (the dual solves of the
        flashot values the closure builds); None: the closure's own.
        """
        loss = self._reusable(hvp_tol)
        with torch.enable_grad(), _accuracy(hvp_tol):
            loss = closure() if loss is None else loss
            if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
                raise TypeError("the closure must return the loss as a 0-dim tensor")
            grads = torch.autograd.grad(loss, self._params, create_graph=True,
                                        allow_unused=True)  # fmt: skip
        unused = [i for i, g in enumerate(grads) if g is None]
        if unused:
            shapes = ", ".join(f"{i} (shape {tuple(self._params[i].shape)})" for i in unused)
            raise ValueError(f"the closure's loss does not depend on parameter {shapes} of "
                             f"{type(self).__name__}: leave it out of the optimizer's params, "
                             "or use it in the loss")  # fmt: skip
        flat_grad = torch.cat([g.reshape(-1) for g in grads]).detach()

        def hvp(v: torch.Tensor) -> torch.Tensor:
            pieces, start = [], 0
            for p in self._params:
                pieces.append(v[start : start + p.numel()].view_as(p).to(p.dtype))
                start += p.numel()
            with torch.enable_grad():
                hv = torch.autograd.grad(grads, self._params, grad_outputs=pieces,
                                         retain_graph=True, allow_unused=True)  # fmt: skip
            return torch.cat([(torch.zeros_like(p) if h is None else h).reshape(-1)
                              for h, p in zip(hv, self._params, strict=True)]).detach()  # fmt: skip

        return float(loss.detach()), flat_grad, hvp

    def _line_search(self, closure, x, loss, grad, direction, t, c1=1e-4, shrink=0.5, tries=30,
                     keep=None):  # fmt: skip
        """Armijo backtracking from step ``t``; returns (t, new loss) or (0, loss).

        ``keep``: as :meth:`_loss_at`'s, for the point accepted.
        """
        slope = float(grad @ direction)
        for _ in range(tries):
            new = self._loss_at(closure, x + t * direction, keep)
            if math.isfinite(new) and new <= loss + c1 * t * slope:
                self._accept(keep is not None)
                return t, new
            t *= shrink
        self._accept(False)
        self._assign(x)
        return 0.0, loss

    def _newton_direction(self, grad, hvp, cg_max_iter, tol):
        """Inexact Newton direction (CG to the relative residual ``tol``), or −g.

        −g where the curvature along CG's first direction is not positive, or where the
        CG's direction does not descend.
        """
        res = cg(hvp, -grad, tol=tol, max_iter=cg_max_iter, on_negative_curvature="return",
                 warn=False)  # fmt: skip
        direction = res.x
        if res.negative_curvature is not None and res.n_iter == 0:
            return -grad, 0, "gradient"
        if float(grad @ direction) >= 0:
            return -grad, res.n_iter, "gradient"
        return direction, res.n_iter, "newton"

    def _forced_derivatives(self, closure, forcing: Forcing, adaptive: bool):
        """(loss, grad, hvp, η): derivatives whose HVPs are as accurate as η asks.

        The HVPs' accuracy is fixed when the closure builds its values, before ‖g‖ is
        known: it is set from the η the previous step's ‖g‖ gives (η/10, at most 5 %);
        the first step keeps the closure's own.
        """
        loss, grad, hvp = self._derivatives(closure, _next_hvp_tol(forcing, adaptive))
        return loss, grad, hvp, forcing.next(float(grad.norm()))


def _accuracy(hvp_tol: float | None) -> contextlib.AbstractContextManager:
    """Values built within take ``hvp_tol`` for their dual solves (None: their own)."""
    if hvp_tol is None:
        return contextlib.nullcontext()
    return dual_solve_options(hvp_tol * RESIDUAL_PER_ERROR)


def _next_hvp_tol(forcing: Forcing, adaptive: bool) -> float | None:
    """The HVP accuracy of a step after ``forcing``'s last one: η/10, at most 5 %."""
    if not adaptive or forcing.last is None:
        return None
    return min(0.1 * forcing.peek(forcing.last[0]), 0.05)


class Forcing:
    """Eisenstat–Walker forcing terms (choice 2; see the module) of an inexact Newton.

    Args:
        spec: ``"eisenstat-walker"``, ``"sqrt"`` (``min(½, √‖g‖)``) or a float (a fixed η).
        eta_max: the largest η.  floor: the smallest.
    """

    GAMMA, ALPHA = 0.9, 2.0

    def __init__(self, spec="eisenstat-walker", eta_max: float = 0.5, floor: float = 1e-12):
        fixed = isinstance(spec, float) and 0 < spec < 1
        if not (fixed or spec in ("eisenstat-walker", "sqrt")):
            raise ValueError("forcing must be 'eisenstat-walker', 'sqrt' or a float in (0, 1), "
                             f"got {spec!r}")  # fmt: skip
        self.spec, self.eta_max, self.floor = spec, eta_max, floor
        self.last: tuple[float, float] | None = None  # (‖g‖, η) of the previous step

    def peek(self, gnorm: float) -> float:
        """η for a step at gradient norm ``gnorm`` (the state unchanged)."""
        if isinstance(self.spec, float):
            eta = self.spec
        elif self.spec == "sqrt":
            eta = min(0.5, math.sqrt(gnorm))
        elif self.last is None:
            eta = self.eta_max
        else:
            g_old, eta_old = self.last
            eta = self.GAMMA * (gnorm / max(g_old, 1e-300)) ** self.ALPHA
            safe = self.GAMMA * eta_old**self.ALPHA
            if safe > 0.1:  # (no sudden tightening after one lucky step)
                eta = max(eta, safe)
            eta = min(eta, self.eta_max)
        return max(eta, self.floor)

    def next(self, gnorm: float) -> float:
        """η for the step at ``gnorm``, remembered for the next one."""
        eta = self.peek(gnorm)
        self.last = (gnorm, eta)
        return eta


class NewtonCG(_SecondOrder):
    """Newton-CG with an Armijo line search and Eisenstat–Walker forcing (see module).

    Args:
        params: parameters (one group).
        lr: initial step length of the line search (1: the full Newton step).
        cg_max_iter: CG iterations per step at most.
        cg_tol: a fixed relative residual of the CG (instead of ``forcing``).
        forcing: ``"eisenstat-walker"`` (default), ``"sqrt"`` (``min(½, √‖g‖)``) or a
            float η.
        adaptive_hvp: the HVPs' accuracy follows η (each step's dual solves to η/10, at
            most 5 %); False: the closure's own ``hvp_tol``.
        grad_tol: a step is skipped when ``‖g‖ ≤ grad_tol``.
    """

    def __init__(self, params, lr: float = 1.0, cg_max_iter: int = 50,
                 cg_tol: float | None = None, forcing="eisenstat-walker",
                 adaptive_hvp: bool = True, grad_tol: float = 1e-10):  # fmt: skip
        super().__init__(params, dict(lr=lr, cg_max_iter=cg_max_iter, cg_tol=cg_tol,
                                      grad_tol=grad_tol))  # fmt: skip
        self._forcing = Forcing(float(cg_tol) if cg_tol is not None else forcing)
        self._adaptive = bool(adaptive_hvp)

    def step(self, closure):
        """One Newton-CG step; returns the loss before it."""
        group = self.param_groups[0]
        loss, grad, hvp, eta = self._forced_derivatives(closure, self._forcing, self._adaptive)
        entry = dict(loss=loss, grad_norm=float(grad.norm()), cg_iters=0, t=0.0, eta=eta)
        if entry["grad_norm"] <= group["grad_tol"]:
            self.log.append(dict(entry, step="converged"))
            return loss
        direction, iters, kind = self._newton_direction(grad, hvp, group["cg_max_iter"], eta)
        keep = (_next_hvp_tol(self._forcing, self._adaptive),)
        t, _ = self._line_search(closure, self._flat(), loss, grad, direction, group["lr"],
                                 keep=keep)  # fmt: skip
        self.log.append(dict(entry, step=kind, cg_iters=iters, t=t))
        return loss


def steihaug(hvp, grad, radius: float, tol: float, max_iter: int):
    """Steihaug–Toint CG for ``min gᵀp + ½ pᵀHp`` in ``‖p‖ ≤ radius``: (p, iters, hit_boundary)."""
    p = torch.zeros_like(grad)
    r, d = grad.clone(), -grad
    if float(r.norm()) == 0.0:
        return p, 0, False

    def to_boundary(p, d):  # τ ≥ 0 with ‖p + τ d‖ = radius
        a, b, c = float(d @ d), 2 * float(p @ d), float(p @ p) - radius**2
        return p + ((-b + math.sqrt(b * b - 4 * a * c)) / (2 * a)) * d

    r0 = float(r.norm())
    for it in range(max_iter):
        hd = hvp(d)
        dhd = float(d @ hd)
        if dhd <= 0:
            return to_boundary(p, d), it + 1, True
        alpha = float(r @ r) / dhd
        p_next = p + alpha * d
        if float(p_next.norm()) >= radius:
            return to_boundary(p, d), it + 1, True
        r_next = r + alpha * hd
        if float(r_next.norm()) <= tol * r0:
            return p_next, it + 1, False
        d = -r_next + (float(r_next @ r_next) / float(r @ r)) * d
        p, r = p_next, r_next
    return p, max_iter, False


class TrustRegion(_SecondOrder):
    """Trust-region Newton with Steihaug–Toint CG (handles negative curvature).

    Args:
        params: parameters (one group).
        radius: initial trust radius.  max_radius: its cap.
        eta: accept a step when actual/predicted decrease > eta.
        cg_max_iter: CG iterations per step at most.
        forcing, adaptive_hvp: the Steihaug CG's relative residual and the HVPs'
            accuracy, as in :class:`NewtonCG`.
        grad_tol: a step is skipped when ``‖g‖ ≤ grad_tol``.
    """

    def __init__(self, params, radius: float = 1.0, max_radius: float = 1e3, eta: float = 0.1,
                 cg_max_iter: int = 50, forcing="eisenstat-walker", adaptive_hvp: bool = True,
                 grad_tol: float = 1e-10):  # fmt: skip
        if not (radius > 0 and max_radius >= radius and 0 <= eta < 0.25):
            raise ValueError("need radius > 0, max_radius ≥ radius and 0 ≤ eta < 1/4")
        super().__init__(params, dict(radius=radius, max_radius=max_radius, eta=eta,
                                      cg_max_iter=cg_max_iter, grad_tol=grad_tol))  # fmt: skip
        self._forcing, self._adaptive = Forcing(forcing), bool(adaptive_hvp)

    def step(self, closure):
        """One trust-region step; returns the loss before it."""
        group = self.param_groups[0]
        loss, grad, hvp, tol = self._forced_derivatives(closure, self._forcing, self._adaptive)
        gnorm = float(grad.norm())
        entry = dict(loss=loss, grad_norm=gnorm, radius=group["radius"], cg_iters=0, t=0.0,
                     eta=tol)  # fmt: skip
        if gnorm <= group["grad_tol"]:
            self.log.append(dict(entry, step="converged"))
            return loss
        x = self._flat()
        p, iters, boundary = steihaug(hvp, grad, group["radius"], tol, group["cg_max_iter"])
        predicted = -(float(grad @ p) + 0.5 * float(p @ hvp(p)))
        new = self._loss_at(closure, x + p, (_next_hvp_tol(self._forcing, self._adaptive),))
        ratio = (loss - new) / predicted if predicted > 0 else -1.0
        if ratio < 0.25:
            group["radius"] *= 0.25
        elif ratio > 0.75 and boundary:
            group["radius"] = min(2 * group["radius"], group["max_radius"])
        accepted = math.isfinite(new) and ratio > group["eta"]
        self._accept(accepted)
        if not accepted:
            self._assign(x)
        self.log.append(dict(entry, step="trust" if accepted else "rejected", cg_iters=iters,
                             t=1.0 if accepted else 0.0))  # fmt: skip
        return loss


class AdamNewton(_SecondOrder):
    """Adam, switching to curvature-aware steps near stationary points.

    While ``‖g‖ > switch_grad_norm`` it takes Adam steps; with ``plateau_steps`` set, also
    while the loss fell by more than ``plateau_rtol`` (relative) over the last
    ``plateau_steps`` Adam steps, so that a slow crawl past a saddle counts as near
    stationary too. Then it estimates the smallest Hessian eigenvalue by Lanczos on
    HVPs: if ``λ_min < −tau`` it steps along the eigenvector, the saddle escape, even
    where the gradient vanishes. It takes the lowest loss over both signs (at a
    symmetric saddle the gradient does not pick one) and the lengths
    ``escape_step·2^k``, k = 2 … −6, among those that decrease by a tenth of the
    quadratic model's decrease: 18 loss evaluations, no derivatives. Otherwise it
    takes a Newton-CG step with a line search, or stops (``"converged"``) once
    ``‖g‖ ≤ grad_tol`` or once that Newton step cannot lower the loss (the accuracy of
    the loss itself, e.g. a Sinkhorn tolerance, is reached first). After an escape,
    and after a Newton step that descends, it takes Newton steps (no new eigenvalue
    estimate) until one meets negative curvature or fails, then tests the curvature
    again.

    Args:
        params: parameters (one group).
        lr: Adam's step.  betas, adam_eps: Adam's averaging and denominator constants.
        switch_grad_norm: gradient norm under which curvature is examined.
        tau: the negative-curvature threshold.
        escape_step: first trial length of a negative-curvature step.
        lanczos_iter: Hessian-vector products per λ_min estimate (a budget: the log's
            ``lambda_residual`` and ``lambda_converged`` say how good the estimate was; a
            negative Ritz value is a direction of negative curvature either way).
        cg_max_iter: CG iterations per Newton step.  grad_tol: no step when ``‖g‖ ≤ grad_tol``.
        plateau_steps, plateau_rtol: the plateau test above (None: gradient norm only).
        generator: RNG of Lanczos' start vectors.
    """

    def __init__(self, params, lr: float = 1e-2, betas=(0.9, 0.999), adam_eps: float = 1e-8,
                 switch_grad_norm: float = 1e-3, tau: float = 1e-6, escape_step: float = 1.0,
                 lanczos_iter: int = 20, cg_max_iter: int = 50, grad_tol: float = 1e-10,
                 plateau_steps: int | None = None, plateau_rtol: float = 1e-3,
                 generator: torch.Generator | None = None):  # fmt: skip
        if plateau_steps is not None and plateau_steps < 1:
            raise ValueError(f"plateau_steps must be a positive int or None, got {plateau_steps}")
        super().__init__(params, dict(lr=lr, betas=betas, adam_eps=adam_eps,
                                      switch_grad_norm=switch_grad_norm, tau=tau,
                                      escape_step=escape_step, lanczos_iter=lanczos_iter,
                                      cg_max_iter=cg_max_iter, grad_tol=grad_tol,
                                      plateau_steps=plateau_steps,
                                      plateau_rtol=plateau_rtol))  # fmt: skip
        self._gen = generator or torch.Generator().manual_seed(0)
        self._forcing = Forcing("sqrt")  # (its Newton steps start near a minimum)
        self._m = self._v = None
        self._t = 0
        self._adam_losses: list[float] = []
        self._newton_mode = False

    def _on_plateau(self, loss: float) -> bool:
        group = self.param_groups[0]
        k = group["plateau_steps"]
        if k is None or len(self._adam_losses) < k:
            return False
        before = self._adam_losses[-k]
        return before - loss <= group["plateau_rtol"] * abs(before)

    def _adam(self, grad):
        group = self.param_groups[0]
        b1, b2 = group["betas"]
        if self._m is None:
            self._m, self._v = torch.zeros_like(grad), torch.zeros_like(grad)
        self._t += 1
        self._m = b1 * self._m + (1 - b1) * grad
        self._v = b2 * self._v + (1 - b2) * grad * grad
        m_hat = self._m / (1 - b1**self._t)
        v_hat = self._v / (1 - b2**self._t)
        self._assign(self._flat() - group["lr"] * m_hat / (v_hat.sqrt() + group["adam_eps"]))

    def step(self, closure):
        """One step (Adam, negative-curvature or Newton); returns the loss before it."""
        group = self.param_groups[0]
        loss, grad, hvp = self._derivatives(closure)
        gnorm = float(grad.norm())
        entry = dict(loss=loss, grad_norm=gnorm, cg_iters=0, t=0.0)
        explore = gnorm > group["switch_grad_norm"] and not self._on_plateau(loss)
        if explore and not self._newton_mode:
            self._adam_losses.append(loss)
            self._adam(grad)
            self.log.append(dict(entry, step="adam", t=group["lr"]))
            return loss
        x = self._flat()
        self._m = self._v = None  # a curvature step makes Adam's moments stale
        self._t = 0
        self._adam_losses = []
        newton_failed = False  # a Newton step on a positive-definite model found no decrease
        if self._newton_mode and gnorm > group["grad_tol"]:
            # in a convex basin: Newton steps while they descend, no eigenvalue estimate
            direction, iters, kind = self._newton_direction(
                grad, hvp, group["cg_max_iter"], self._forcing.next(gnorm)
            )
            if kind == "newton":
                t, _ = self._line_search(closure, x, loss, grad, direction, 1.0, tries=12,
                                         keep=(None,))  # fmt: skip
                if t > 0:
                    self.log.append(dict(entry, step=kind, cg_iters=iters, t=t))
                    return loss
                newton_failed = True
            self._newton_mode = False
        # a budgeted estimate: its Ritz value bounds λ_min from above (a negative one is a
        # direction of negative curvature whether converged or not); the log says how far
        est = lanczos(hvp, x, k=1, which="smallest", max_iter=group["lanczos_iter"],
                      generator=self._gen, warn=False)  # fmt: skip
        lam, vec = float(est.values[0]), est.vectors[0]
        entry.update(lambda_min=lam, lambda_residual=float(est.residuals[0]),
                     lambda_converged=est.converged)  # fmt: skip
        if lam >= -group["tau"] and (gnorm <= group["grad_tol"] or newton_failed):
            self.log.append(dict(entry, step="converged"))  # a minimum, not a saddle
            return loss
        if lam < -group["tau"]:
            # the best point on the negative-curvature line, both ways, over lengths
            # escape_step·2^k (k = 2 … −6) that decrease by a tenth of the quadratic model
            best = None
            for sign in (1.0, -1.0):
                direction = sign * vec
                slope = float(grad @ direction)
                for k in range(2, -7, -1):
                    t = group["escape_step"] * 2.0**k
                    new = self._loss_at(closure, x + t * direction)
                    enough = new < loss + 0.1 * (t * slope + 0.5 * t * t * lam)
                    if math.isfinite(new) and enough and (best is None or new < best[0]):
                        best = (new, t, direction)
            if best is None:
                self._assign(x)
                self.log.append(dict(entry, step="rejected"))
                return loss
            _, t, direction = best
            self._assign(x + t * direction)
            self._newton_mode = True  # try Newton in the basin it stepped into
            self.log.append(dict(entry, step="negative_curvature", t=t))
            return loss
        direction, iters, kind = self._newton_direction(
            grad, hvp, group["cg_max_iter"], self._forcing.next(gnorm)
        )
        t, _ = self._line_search(closure, x, loss, grad, direction, 1.0, tries=12, keep=(None,))
        self._newton_mode = kind == "newton" and t > 0
        # no negative curvature and no Newton step lowers the loss: the loss's own
        # accuracy (a Sinkhorn tolerance) is reached before grad_tol
        floor = kind == "newton" and t == 0
        self.log.append(dict(entry, step="converged" if floor else kind, cg_iters=iters, t=t))
        return loss
