r"""Second derivatives of a fixed-iteration solve: the derivative of the gradient it returns.

A solve without a stopping tolerance (``tol=None``; every :class:`flashot.SamplesLoss`,
which runs GeomLoss' ε-schedule) stops before its potentials are converged. Its gradient
is the envelope one of its final extrapolation, the last potentials ``z_K = (f_K, g_K)``
held fixed:

.. math::

    G(\theta) = \partial_\theta V(\theta, z_K) \big|_{z_K = z_K(\theta)},

which is not the Hessian's gradient of the converged problem (nor the derivative of the
value). The second derivatives consistent with it are those of ``G`` itself,

.. math::

    \frac{dG}{d\theta} v = \partial_\theta G\, v + \partial_z G\, \frac{d z_K}{d\theta} v,

where ``z_K(θ)`` is the schedule's K iterations: this module writes both as
differentiable expressions. The iterations are replayed by
:func:`~flashot.autodiff.replay.unrolled_potentials` (one autograd node whose backward is
the schedule's adjoint sweep: one streamed plan_vjp per pass), and ``∂_θ V`` is
written out explicitly (:func:`envelope_gradient`) with :class:`~flashot.autodiff.implicit.
PlanProduct`. A finite difference of the returned gradient matches it to the dtype's
accuracy, whatever the schedule; it is symmetric only as far as the schedule converged.
Memory: the K iterates, O(K (n + m)), while a second derivative is formed.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from flashot.autodiff.implicit import DualSpec, other_masses
from flashot.backends import entry_point
from flashot.backends.near import warm_bounds
from flashot.backends.temperature import device_value
from flashot.geometry.costs import AttentionForm

__all__ = [
    "KEEP_ITERATES_BYTES",
    "Trajectory",
    "Transform",
    "envelope_gradient",
    "fill_transform_grads",
    "keeps_iterates",
    "spec_at",
    "transform_form",
    "transform_pass",
    "transform_vjp",
]


@dataclass(frozen=True)
class Trajectory:
    """How a fixed-iteration solve ran, to replay it with autograd.

    Attributes:
        temps: the ε schedule (one iteration per entry, the last kept to the end).
        iterations: K, the iterations run (the initialization not counted).
        update: ``"symmetric"`` or ``"alternating"``.
        init: the warm start ``(f, g)`` (constants), or None for the solver's own
            ``(λ T(0), λ Tᵀ(0))`` at the first temperature.
        momentum: ω of the alternating updates at the final ε, or None.
        check_every: the solve's check period (which alternating step keeps plain
            columns under momentum).
        refusal: why this solve cannot be replayed (its second derivatives then raise
            this), or None.
        iterates: the solve's own iterates ``(F (K+1, n), G (K+1, m))`` of symmetric
            steps (:func:`keeps_iterates`), which the replay then reads instead of
            running the schedule again; None otherwise.
    """

    temps: tuple[float, ...]
    iterations: int
    update: str = "symmetric"
    init: tuple[torch.Tensor, torch.Tensor] | None = None
    momentum: float | None = None
    check_every: int = 10
    refusal: str | None = None
    iterates: tuple[torch.Tensor, torch.Tensor] | None = None


#: a differentiable fixed-iteration solve keeps its iterates for a double backward when
#: they take at most this many bytes, or at most the clouds' own (memory stays O((n + m) d))
KEEP_ITERATES_BYTES = 2**26


def keeps_iterates(form: AttentionForm, iterations: int, *weights) -> bool:
    """Whether a fixed-iteration solve of ``form`` keeps its K + 1 iterates.

    Only for a differentiable solve (grad mode on, the form or ``weights`` (tensors or
    None) requiring it: a double backward may come), when the stacks take at most
    :data:`KEEP_ITERATES_BYTES` or the bytes of q and k. They live as long as the value's
    graph: first-order training holds them until its backward, and a double backward
    saves a replay of the whole schedule (at 50 000 points a solve's time).
    """
    q, k = form.q, form.k
    parts = (q, k, form.alpha, form.beta, *weights)
    if not (torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in parts)):
        return False
    size = (iterations + 1) * (q.shape[0] + k.shape[0]) * form.alpha.element_size()
    return size <= max(KEEP_ITERATES_BYTES, q.nbytes + k.nbytes)


def transform_form(q, alpha, k, beta, spec: DualSpec) -> AttentionForm:
    """The form of a pass, inside an autograd Function (grad mode off: no detach needed).

    q and k are the replay's own tensors, not detached copies: every pass then hands
    the backend the same objects, whose conversions its operand cache serves
    (``spec.operands``) instead of converting them for each pass.
    """
    return AttentionForm(q, k, alpha.detach(), beta.detach(), cost_bound=spec.cost_bound,
                         segments=spec.segments)  # fmt: skip


def spec_at(spec: DualSpec, eps: float, warm: bool = False) -> DualSpec:
    """``spec`` at ``eps``, a warm-up temperature's when ``warm``.

    A warm-up temperature takes the near-uniform LSE from :data:`WARM_NEAR_FROM` × the
    bound, as the solve did: the same function, and the usual path is cheaper.
    """
    if not warm:  # (a Temperature equal to spec.eps still replaces it: its row is read)
        return spec if eps is spec.eps else dataclasses.replace(spec, eps=eps)
    bound, seg = warm_bounds(spec.cost_bound, spec.segments)
    return dataclasses.replace(spec, eps=eps, cost_bound=bound, segments=seg)


class Transform(torch.autograd.Function):
    r"""The soft c-transform and its negated LSE, differentiable once.

    ``t_i = α_i − ε LSE_j[(⟨q_i, k_j⟩ + h_j − β_j)/ε + log w_j]`` and ``r = t − α``, in q,
    α, k, β, log w and the column potential h (:func:`transform_vjp`). ``r`` (the negated
    LSE, as the pass computed it) is what the transform's plan reads: ``t − α``
    recomputed would carry an ulp of α, ``|α|/ε`` ulps in the plan's exponents.
    """

    @staticmethod
    def forward(ctx, q, alpha, k, beta, log_w, h, spec):
        """One row pass: ``(t, r)``."""
        t, r = transform_pass(q, alpha, k, beta, log_w, h, spec)
        ctx.save_for_backward(q, k, beta, log_w, h, r)
        ctx.spec = spec
        ctx.set_materialize_grads(False)
        return t, r

    @staticmethod
    @torch.autograd.function.once_differentiable
    @entry_point
    def backward(ctx, u_t, u_r):
        """One plan_vjp (:func:`transform_vjp`)."""
        if u_t is None and u_r is None:
            return (None,) * 7
        q, k, beta, log_w, h, r = ctx.saved_tensors
        u = u_t if u_r is None else (u_r if u_t is None else u_t + u_r)
        with ctx.spec.backend.operand_scope(ctx.spec.operands):  # (the replay's conversions)
            grads = transform_vjp((q, None, k, beta, log_w, h), r, u, u_t, ctx.spec,
                                  ctx.needs_input_grad[:6])  # fmt: skip
        return (*grads, None)


def transform_pass(q, alpha, k, beta, log_w, h, spec: DualSpec):
    """:class:`Transform`'s values without autograd: ``(t (n,), r (n,))``, one row pass."""
    form = transform_form(q, alpha, k, beta, spec)
    with spec.backend.operand_scope(spec.operands):
        lse, _ = spec.backend.row_attend(form, h.detach() - form.beta, spec.eps,
                                         log_w=log_w.detach())  # fmt: skip
    return form.alpha - lse, -lse


def transform_vjp(parts, r, u, u_alpha, spec: DualSpec, needs, mirror: bool = False) -> list:
    r"""The gradients of ``⟨u, −LSE⟩ + ⟨u_α, α⟩`` for :class:`Transform`'s pass.

    None where ``needs`` is False; with ``u_α = u`` they are those of ``⟨u, t⟩``.

    With ``Π_ij = w_j e^{(r_i + h_j − β_j + ⟨q_i, k_j⟩)/ε}`` (the row softmax):
    ``∂q = −u ⊙ Π k``, ``∂α = u_α``, ``∂k = −Πᵀ(u ⊙ q)``, ``∂β = Πᵀ u = −∂h``,
    ``∂log w = −ε Πᵀ u``: one plan_vjp; under autograd (the envelope gradient's row terms,
    which are differentiated once more) ``Π k`` by :class:`RowAverage`.

    Args:
        parts: (q, α, k, β, log w, h) as the transform took them (α unread).
        r: (n,) its negated LSE.  u, u_alpha: (n,) cotangents (u_alpha may be None).
        needs: six flags for ``parts``.
        mirror: a self problem's transform (one cloud on both sides, ``s_ij = s_ji``):
            its rows' and columns' terms from one pass of
            :meth:`~flashot.backends.base.Backend.mirror_vjp` where the backend offers
            it, instead of plan_vjp's two launches.
    """
    q, _, k, beta, log_w, h = parts
    zero = torch.zeros_like(r)
    weights = (torch.ones_like(r), torch.exp(log_w))
    out: list = [None] * 6
    out[1] = u_alpha if needs[1] else None
    if not (
        torch.is_grad_enabled()
        and any(p is not None and p.requires_grad for p in (q, k, beta, log_w, h, r, u))
    ):
        # a plain reverse pass: one plan_vjp, S_ij = Π_ij u_i (no value copies)
        want = {"row_k"} if needs[0] else set()
        want |= {"col_q"} if needs[2] else set()
        want |= {"col"} if any(needs[3:]) else set()
        if want:
            form, got = transform_form(q, zero, k, beta, spec), None
            if mirror and needs[0] and len(want) > 1:
                with spec.backend.operand_scope(spec.operands):
                    got = spec.backend.mirror_vjp(form, h, r, log_w, u, spec.eps)
            if got is None:
                vjp = spec.backend.plan_vjp(form, r, h, *weights, spec.eps,
                                            u.new_ones(k.shape[0], 1), u[:, None],
                                            frozenset(want))  # fmt: skip
                got = (vjp.row_k, vjp.col_q, vjp.col)
            fill_transform_grads(out, needs, spec.eps, *got)
        return out
    # (the envelope gradient's row terms, differentiable once more)
    assert not any(needs[2:]), "internal: a differentiable transform VJP of rows only"
    if needs[0]:
        out[0] = -u[:, None] * RowAverage.apply(q, k, beta, log_w, h, k, spec)
    return out


class RowAverage(torch.autograd.Function):
    r"""``Π V`` (n, p), differentiable once in q, k, β, log w, h and V.

    ``Π_ij ∝ w_j e^{(⟨q_i, k_j⟩ + h_j − β_j)/ε}`` is the row softmax.

    Its backward streams ``S_ij = Π_ij (⟨D_i, V_j⟩ − ⟨D_i, (ΠV)_i⟩)``, centered per
    element (one plan_vjp with the row-sum cotangent ``−⟨D, ΠV⟩``): the derivative in q
    is a covariance of the keys under Π, which a difference of moments would lose to
    rounding when Π is peaked (small ε).
    """

    @staticmethod
    def forward(ctx, q, k, beta, log_w, h, v, spec):
        """One row pass with values."""
        zero = q.new_zeros(q.shape[0])
        form = transform_form(q, zero, k, beta, spec)
        with spec.backend.operand_scope(spec.operands):
            lse, out = spec.backend.row_attend(form, h.detach() - form.beta, spec.eps,
                                               v.detach(), log_w.detach())  # fmt: skip
        ctx.save_for_backward(q, k, beta, log_w, h, v, lse, out)
        ctx.spec = spec
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    @entry_point
    def backward(ctx, d):
        """One centered plan_vjp."""
        q, k, beta, log_w, h, v, lse, out = ctx.saved_tensors
        spec, eps = ctx.spec, ctx.spec.eps
        zero = torch.zeros_like(lse)
        needs = ctx.needs_input_grad
        want = {"row_k"} if needs[0] else set()
        want |= {"col_q"} if needs[1] else set()
        want |= {"col"} if any(needs[2:5]) else set()
        want |= {"pt_d"} if needs[5] else set()
        with spec.backend.operand_scope(spec.operands):
            vjp = spec.backend.plan_vjp(transform_form(q, zero, k, beta, spec), -lse, h,
                                        torch.ones_like(lse), torch.exp(log_w), eps, v, d,
                                        frozenset(want), d0=-(d * out).sum(1))  # fmt: skip
        col = vjp.col
        return (None if vjp.row_k is None else vjp.row_k.div_(eps),
                None if vjp.col_q is None else vjp.col_q.div_(eps),
                None if not needs[2] else -col / eps, col if needs[3] else None,
                None if not needs[4] else col / eps, vjp.pt_d, None)  # fmt: skip


def fill_transform_grads(out: list, needs, eps: float, row_k, col_q, pt_u) -> None:
    """:func:`transform_vjp`'s gradients from ``u ⊙ Π k``, ``Πᵀ(u ⊙ q)`` and ``Πᵀ u``."""
    if needs[0]:
        out[0] = -row_k
    if needs[2]:
        out[2] = -col_q
    if needs[3]:
        out[3] = pt_u
    if needs[4]:
        out[4] = -device_value(eps) * pt_u
    if needs[5]:
        out[5] = -pt_u


def damping(rho: float | None, eps: float) -> float:
    """``λ = ρ / (ρ + ε)`` (1 on a balanced side)."""
    return 1.0 if rho is None else rho / (rho + eps)


def dual_partials(pot, w, eps: float, rho: float | None, kind: str):
    r"""``(∂Φ/∂f, ∂Φ/∂w)`` of one side's share ``Φ(f, w)`` of the value, as expressions.

    ``kind``: ``"plain"``, a balanced problem's ``Φ = ⟨w, f⟩``; ``"geomloss"``,
    :func:`~flashot.autodiff.functions.dual_term` (relaxed: ``∂f = (ρ + ε)/ρ · w e^{−f/ρ}``,
    ``∂w = −(ρ + ε) expm1(−f/ρ) − ε/2``); ``"dual"``, an unbalanced problem's
    :func:`~flashot.autodiff.functions.relaxed_side` (``∂w`` has ``−ε`` instead of ``−ε/2``,
    and ``f − ε`` on a balanced side; the ``ε m(a) m(b)`` term is the caller's).
    """
    if rho is None:
        return w, (pot - eps if kind == "dual" else pot)
    return (rho + eps) / rho * w * torch.exp(-pot / rho), -(rho + eps) * torch.expm1(-pot / rho) - (
        0.5 * eps if kind == "geomloss" else eps
    )


def envelope_gradient(theta, z, trajectory: Trajectory, spec: DualSpec, kind: str,
                      mirror: bool = False):  # fmt: skip
    r"""``∂_θ V(θ, z)``, the gradient a fixed-iteration solve returns, as an expression in θ, z.

    ``V = Φ_x(f*, a) + Φ_y(g*, b)`` (:func:`dual_partials`, plus ``ε m(a) m(b)`` on the
    dual value of a relaxed :func:`flashot.sinkhorn`) with the final extrapolation
    ``f* = λ_x T(g_K)`` and ``g* = λ_y Tᵀ(f_K)`` (``Tᵀ(f*)`` after alternating updates);
    as in the first-order graph each transform is differentiated on its own side only
    (its queries and offsets; the other side, the potential and the weights inside it are
    constants of the step). Differentiating the result once more gives ``dG/dθ``.

    Args:
        theta: (q, α, k, β, a, b).
        z: (f_K, g_K) from :func:`~flashot.autodiff.replay.unrolled_potentials`.
        trajectory: how the solve ran.  spec: the problem's :class:`DualSpec`.
        kind: how the value is written (:func:`dual_partials`).
        mirror: a mirror problem (:mod:`~flashot.autodiff.replay`: θ's columns the same
            functions of the sources as its rows, f_K = g_K): the columns' terms equal the
            rows', so the rows' are formed once and counted twice, in the rows' slots.

    Returns:
        Six gradients shaped like θ (None for those that need none, and for the columns'
        slots of a mirror).
    """
    q, alpha, k, beta, a, b = theta
    f_k, g_k = z
    eps, (rho_x, rho_y) = spec.eps, spec.rho
    log_a, log_b = torch.log(a), torch.log(b)
    lam_x, lam_y = damping(rho_x, eps), damping(rho_y, eps)
    seg = spec.segments
    t_x, r_x = Transform.apply(q, alpha, k, beta, log_b, g_k, spec)
    f_star = lam_x * t_x
    c_x, grad_a = dual_partials(f_star, a, eps, rho_x, kind)
    if kind == "dual":  # (+ ε m(a) m(b), per problem)
        grad_a = grad_a + eps * other_masses(b, seg, a)
    u_x = lam_x * c_x
    wanted = (q.requires_grad, alpha.requires_grad, False, False, False, False)
    row = transform_vjp((q, alpha, k, beta, log_b, g_k), r_x, u_x, u_x, spec, wanted)
    grad_a = grad_a if a.requires_grad else None
    if mirror:  # (the columns' terms are the rows')
        twice = [None if t is None else 2.0 * t for t in (row[0], row[1], grad_a)]
        return twice[0], twice[1], None, None, twice[2], None
    h_y = f_star if trajectory.update == "alternating" else f_k
    t_y, r_y = Transform.apply(k, beta, q, alpha, log_a, h_y, spec.T)
    g_star = lam_y * t_y
    c_y, grad_b = dual_partials(g_star, b, eps, rho_y, kind)
    if kind == "dual":
        grad_b = grad_b + eps * other_masses(a, None if seg is None else seg.T, b)
    u_y = lam_y * c_y
    wanted = (k.requires_grad, beta.requires_grad, False, False, False, False)
    col = transform_vjp((k, beta, q, alpha, log_a, h_y), r_y, u_y, u_y, spec.T, wanted)
    return row[0], row[1], col[0], col[1], grad_a, grad_b if b.requires_grad else None
