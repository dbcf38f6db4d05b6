r"""Autograd for entropic OT, in one place.

Gradients follow the envelope theorem: the Sinkhorn loop runs without autograd,
and only a final extrapolation step is differentiated, with the other potential
held fixed (as GeomLoss does). That step is the soft c-transform

.. math::

    f_i(q_i, \alpha_i) = \lambda\Big(\alpha_i - \varepsilon \log \sum_j
        \exp\frac{\langle q_i, k_j\rangle + h_j}{\varepsilon}\Big),
    \qquad
    \frac{\partial f_i}{\partial q_i} = -\lambda \sum_j w_{ij} k_j,\quad
    \frac{\partial f_i}{\partial \alpha_i} = \lambda,

with ``w`` the row softmax of the scores; ``k`` and ``h`` are constants of the
step. ``Σ_j w_ij k_j`` streams in the same pass as the forward value, so the
backward costs O(n d) and no extra pass. Loss formulas on top of the potentials
(balanced, unbalanced, debiased) are plain differentiable PyTorch code.
"""

from __future__ import annotations

import torch

from flashot.backends import entry_point
from flashot.backends.base import Backend
from flashot.backends.dual import Potentials
from flashot.geometry.costs import AttentionForm

__all__ = [
    "SECOND_ORDER",
    "SoftCTransform",
    "dual_term",
    "extrapolate",
    "extrapolation_parts",
    "final_step_for",
    "grads_needed",
    "needs_grad",
    "relaxed_side",
    "soft_c_transform",
    "transform_parts",
]


SECOND_ORDER = (
    "these extrapolated potentials (e.g. SamplesLoss(potentials=True)) are differentiable "
    "once only (create_graph=True is not supported through them); OT values are "
    "differentiable twice"
)


class SoftCTransform(torch.autograd.Function):
    """``f = λ (α − ε LSE_j[(q k^T + h)/ε])``, differentiable in q and α."""

    @staticmethod
    def forward(ctx, q, alpha, k, h, log_w, eps, lam, backend, bound, segments=None, parts=None):
        """Forward: one streaming pass; also ``Σ_j w_ij k_j`` when q needs a gradient.

        ``parts``: that pass's ``(lse, W k)`` when it ran already (in a replayed solve,
        :func:`transform_parts`); the other arguments after ``alpha`` are then unused.
        """
        need_q = ctx.needs_input_grad[0]
        if parts is None:  # (q and k are the caller's tensors: see transform_parts)
            form = AttentionForm(q, k, alpha, h, cost_bound=bound, segments=segments)  # (β unread)
            parts = transform_parts(form, h, log_w, eps, backend, need_q)
        lse, wk = parts
        if need_q and wk is None:
            raise RuntimeError("internal: a soft c-transform needs W k for q's gradient")
        ctx.save_for_backward(wk if need_q else None)
        ctx.lam = lam
        # a double backward reaches here with no gradient (the value's exact second-order
        # path replaced this graph): undefined, not zeros, so it can tell
        ctx.set_materialize_grads(False)
        return lam * (alpha.detach() - lse)

    @staticmethod
    @entry_point
    def backward(ctx, grad_f):
        """Backward: ``∂q = −λ grad_f ⊙ (W k)``, ``∂α = λ grad_f``."""
        if grad_f is None:
            return (None,) * 11
        if torch.is_grad_enabled():  # create_graph=True: a second derivative was asked for
            raise RuntimeError(SECOND_ORDER)
        (wk,) = ctx.saved_tensors
        lam = ctx.lam
        grad_q = None if wk is None else (-lam) * grad_f[:, None] * wk
        grad_alpha = lam * grad_f if ctx.needs_input_grad[1] else None
        return grad_q, grad_alpha, *(None,) * 9


def soft_c_transform(
    form: AttentionForm,
    h: torch.Tensor,
    log_w: torch.Tensor,
    eps: float,
    lam: float,
    backend: Backend,
    parts: tuple[torch.Tensor, torch.Tensor | None] | None = None,
) -> torch.Tensor:
    """Differentiable soft c-transform of the rows of ``form`` (see module docstring).

    Args:
        form: attention form; gradients flow to ``form.q`` and ``form.alpha`` only.
        h: (m,) column bias ``g − β`` (treated as a constant).
        log_w: (m,) log column weights ``log b``.
        eps: ε > 0.
        lam: unbalanced damping λ ∈ (0, 1] (1 when balanced).
        backend: the streaming primitives.
        parts: the pass's ``(lse, W k)`` from :func:`transform_parts` when it ran already
            (inside a replayed solve); W k may be None when ``form.q`` needs no gradient.

    Returns:
        (n,) potential.
    """
    return SoftCTransform.apply(
        form.q,
        form.alpha,
        form.k,
        h,
        log_w,
        eps,
        lam,
        backend,
        form.cost_bound,
        form.segments,
        parts,
    )


def transform_parts(
    form: AttentionForm,
    h: torch.Tensor,
    log_w: torch.Tensor,
    eps: float,
    backend: Backend,
    need_q: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The streaming pass of :func:`soft_c_transform`, without autograd.

    Returns:
        ``(lse (n,), W k (n, d'))``, the row LSE of the biased scores and the softmax
        average of the columns' features, or ``(lse, None)`` when ``need_q`` is False.
    """
    # q and k themselves where they need no detaching: the backend keys its operand
    # conversions by identity, so the passes share the solve's (and each other's)
    own = AttentionForm(_plain(form.q), _plain(form.k), form.alpha.detach(),
                        torch.zeros_like(h), cost_bound=form.cost_bound,
                        segments=form.segments)  # fmt: skip
    return backend.row_attend(own, h.detach(), eps, own.k if need_q else None, log_w)


def _plain(t: torch.Tensor) -> torch.Tensor:
    return t.detach() if t.requires_grad and torch.is_grad_enabled() else t


def extrapolation_parts(
    form: AttentionForm,
    f: torch.Tensor,
    g: torch.Tensor,
    log_a: torch.Tensor,
    log_b: torch.Tensor,
    eps: float,
    lam: tuple[float, float],
    backend: Backend,
    update: str,
    need: tuple[bool, bool],
) -> tuple[tuple, tuple]:
    """The two streaming passes of a differentiated :func:`extrapolate`, without autograd.

    Run where the loop runs (inside a replayed solve), they leave :func:`extrapolate`
    only its elementwise autograd nodes. ``need``: whether ``form.q`` and ``form.k``
    need gradients (then the pass also averages the other side's features).

    Returns:
        ``(row, col)``, each ``(lse, W k or None)`` of :func:`transform_parts`.
    """
    form = form.detach()  # (the solve's form itself: it has no history)
    row = transform_parts(form, g - form.beta, log_b, eps, backend, need[0])
    if update == "alternating":  # (the value SoftCTransform gives, bit for bit)
        f = lam[0] * (form.alpha - row[0])
    col = transform_parts(form.T, f - form.alpha, log_a, eps, backend, need[1])
    return row, col


def grads_needed(form: AttentionForm) -> tuple[bool, bool]:
    """Whether autograd will ask for ``W k`` on each side: ``(form.q, form.k)`` need gradients."""
    on = torch.is_grad_enabled()
    return on and form.q.requires_grad, on and form.k.requires_grad


def final_step_for(form: AttentionForm) -> bool | tuple[bool, bool]:
    """What a solve on ``form`` runs as its final step (``final_step`` of the solver).

    The whole step when autograd does not need it (True), else its passes, with ``W k``
    for the sides of :func:`grads_needed` (:func:`flashot.solver.loop.solve`).
    """
    return grads_needed(form) if needs_grad(form) else True


def needs_grad(form: AttentionForm) -> bool:
    """Whether autograd must see the final step (grad mode on, a part of form needs it)."""
    parts = (form.q, form.k, form.alpha, form.beta)
    return torch.is_grad_enabled() and any(t.requires_grad for t in parts)


def extrapolate(
    form: AttentionForm,
    f: torch.Tensor,
    g: torch.Tensor,
    log_a: torch.Tensor,
    log_b: torch.Tensor,
    eps: float,
    lam: tuple[float, float],
    backend: Backend,
    update: str = "symmetric",
    parts: tuple[tuple, tuple] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The final step, the only one autograd sees.

    ``(λ_x T(g), λ_y T(f))`` after symmetric updates (GeomLoss), and the alternating
    step ``f' = λ_x T(g), g' = λ_y T(f')`` after alternating ones: a Jacobi step from
    an alternating iterate can undo its exact column marginal, and measure above the
    loop's error. ``T(g)`` is differentiable in the row side of ``form`` and the
    column transform in its column side (the other potential held fixed). When
    autograd needs neither, the backend's own (possibly fused) passes run instead.

    Args:
        form: attention form (with its autograd history).
        f: (n,), g: (m,) detached potentials of the last iteration.
        log_a: (n,), log_b: (m,) log weights.  eps: ε.  lam: (λ_x, λ_y).
        backend: the streaming primitives.
        update: the loop's update, ``"symmetric"`` or ``"alternating"``.
        parts: the two passes from :func:`extrapolation_parts` (with ``need`` =
            :func:`grads_needed`) when they ran already, e.g. inside a replayed solve.
    """
    if not needs_grad(form):
        form = form.detach()
        if update != "alternating":
            return backend.extrapolate(Potentials(form, f, g, log_a, log_b, eps), lam)
        f_new = lam[0] * (form.alpha - backend.row_attend(form, g - form.beta, eps, log_w=log_b)[0])
        lse_c = backend.row_attend(form.T, f_new - form.alpha, eps, log_w=log_a)[0]
        return f_new, lam[1] * (form.beta - lse_c)
    if parts is not None:  # (the biases went into those passes)
        return (soft_c_transform(form, g, log_b, eps, lam[0], backend, parts[0]),
                soft_c_transform(form.T, f, log_a, eps, lam[1], backend, parts[1]))  # fmt: skip
    f_new = soft_c_transform(form, g - form.beta.detach(), log_b, eps, lam[0], backend)
    if update == "alternating":
        f = f_new.detach()
    g_new = soft_c_transform(form.T, f - form.alpha.detach(), log_a, eps, lam[1], backend)
    return f_new, g_new


def relaxed_side(
    pot: torch.Tensor, weights: torch.Tensor, eps: float, rho: float | None, total=torch.sum
) -> torch.Tensor:
    r"""One side of the entropic dual with envelope-exact partial derivatives.

    .. math::

        \Psi(f, a) = \sum_i a_i \psi(f_i), \qquad
        \psi(t) = \begin{cases} t - \varepsilon & \text{balanced} \\
                   \rho - (\rho + \varepsilon) e^{-t/\rho} & \text{KL-relaxed}\end{cases}

    With ``f = λ T(g)`` from :func:`soft_c_transform`, ``∂Ψ/∂f_i = r_i / λ`` where
    ``r_i`` is the plan's row mass, so ``∂Ψ/∂x_i = Σ_j P_ij ∇_x C_ij``, and
    ``∂Ψ/∂a_i = φ(f_i) − ε r_i / a_i`` (``φ(t) = ρ(1 − e^{−t/ρ})``): the partial
    derivatives of the dual objective.

    Args:
        pot: (n,) potential.
        weights: (n,) weights.
        eps: ε.
        rho: ρ, or None for a balanced side.
        total: the sum over i (per problem for a packed batch: ``Segments.sum``).
    """
    if rho is None:
        return total(weights * (pot - eps))
    # ρ − (ρ + ε) e^{−f/ρ} = −(ρ + ε) expm1(−f/ρ) − ε: no cancellation as ρ → ∞
    return -(rho + eps) * total(weights * torch.expm1(-pot / rho)) - eps * total(weights)


def dual_term(
    pot: torch.Tensor, weights: torch.Tensor, eps: float, rho: float | None, total=None
) -> torch.Tensor:
    """One measure's share of GeomLoss' (debiased) Sinkhorn cost, with exact gradients.

    Value: ``⟨w, f⟩`` when balanced, ``(ρ + ε/2) ⟨w, 1 − e^{−f/ρ}⟩`` when relaxed
    (GeomLoss' formula; the debiased difference of such terms is the unbalanced
    Sinkhorn divergence of Séjourné et al., 2019). Gradient: that of
    :func:`relaxed_side` plus ``ε/2`` per unit mass, which are the envelope
    derivatives of that value. (GeomLoss 0.3.1 scales its relaxed x-gradient by
    ``(ρ + ε/2)/(ρ + ε)`` instead, because its ``UnbalancedWeight.backward`` is
    never called.)

    Args:
        pot: (n,) potential from :func:`soft_c_transform`.
        weights: (n,) weights.
        eps: ε.
        rho: ρ or None.
        total: the sum to take (default: over all entries; a packed batch's
            per-problem sums, :meth:`flashot.geometry.segments.Segments.sum`, give (B,) values).
    """
    total = total or torch.sum
    if rho is None:
        return total(weights * pot)
    # value −(ρ + ε/2) ⟨w, expm1(−f/ρ)⟩; the last term adds ∂/∂w = −ε/2 and is exactly 0
    shrink = total(weights * torch.expm1(-pot / rho))
    mass = total(weights)
    return -(rho + eps) * shrink + 0.5 * eps * shrink.detach() - 0.5 * eps * (mass - mass.detach())
