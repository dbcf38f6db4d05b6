r"""Exact derivatives of converged potentials: the implicit function theorem, streamed.

The entropic dual is :math:`L(z, \theta)` with potentials ``z = (f, g)`` and problem
data ``θ = (q, α, k, β, a, b)`` (the cost in attention form and the weights):

.. math::

    L = \langle a, \varphi_x(f)\rangle + \langle b, \varphi_y(g)\rangle
        - \varepsilon \sum_{ij} (P_{ij} - a_i b_j), \qquad
    P_{ij} = a_i b_j e^{(f_i + g_j - \alpha_i - \beta_j + \langle q_i, k_j\rangle)/\varepsilon},

with ``φ(t) = t`` on a balanced side and ``ρ(1 − e^{−t/ρ})`` on a relaxed one. The
converged potentials solve ``∂_z L = 0``, so ``dz/dθ = M⁻¹ ∂_z∂_θ L`` with the
negative dual Hessian

.. math::

    M = -\partial_z^2 L = \frac1\varepsilon
        \begin{pmatrix} D_r & P \\ P^T & D_c \end{pmatrix}, \qquad
    D_r = \mathrm{diag}\big(r + \tfrac{\varepsilon}{\rho_x} a e^{-f/\rho_x}\big)

(``D_r = diag(r)`` when balanced; the same for columns). :class:`ImplicitPotentials`
returns z as a function of θ whose backward solves ``M w = z̄`` by conjugate
gradients on the Schur complement ``S = D_c − Pᵀ D_r⁻¹ P`` (two plan products per
iteration, preconditioned by ``D_c``, shifted by 100 ulps of ``D_c`` against
rounding). When both sides are balanced, ``S`` has the null vector 1 (the
potentials' constant shift); the solve adds ``c cᵀ / Σc``, which leaves ``S``'s
range alone and picks the solution with ``⟨c, w_g⟩ = 0``.
:class:`PlanProduct` is ``P V`` as a function of θ, z and V whose backward is the
streamed :meth:`~flashot.backends.base.Backend.plan_vjp`; with these, the exact
gradient of the OT value (:func:`value_gradient`) is an ordinary differentiable
expression, and its derivative is the exact Hessian.
"""

from __future__ import annotations

import contextlib
import warnings
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from flashot.autodiff import dense_dual
from flashot.autodiff.dual_log import DualSolveInfo, DualSolveLog, log_solve, record_dual_solves
from flashot.backends import entry_point
from flashot.backends.base import Backend
from flashot.backends.dual import Potentials, marginal_error, plan_times, relaxed_weight, row_mass
from flashot.backends.near import is_near_uniform
from flashot.backends.plan_vjp import outputs_for
from flashot.geometry.costs import AttentionForm
from flashot.geometry.segments import Segments, other_masses, problem_sums
from flashot.numerics.linalg import CGWarning, cg
from flashot.solver.graphs import GraphCache, capture_or_eager

__all__ = [
    "DeferredSolves",
    "DualSolveInfo",
    "DualSolveLog",
    "DualSpec",
    "ImplicitPotentials",
    "PlanProduct",
    "add_optional",
    "clear_dual_graphs",
    "deferred_dual_solves",
    "other_masses",
    "problem_sums",
    "record_dual_solves",
    "refine_potentials",
    "value_gradient",
]
#: the dual solve's relative residual per unit of relative HVP error asked for: measured
#: HVP errors were 0.1–1.6 times the residual (float64, n = 600, d ≤ 64, ε from 0.5 % to
#: 10 % of the mean cost; benchmarks/NOTES.md) and up to ~13 times at 0.14 % (the
#: peer's setting, float32, H200)
RESIDUAL_PER_ERROR = 0.1
#: the dual CG replays CUDA graphs up to this many plan entries (n·m); beyond, a step's
#: two passes outlast the host's ~1.5 ms of launches and eager launches keep the GPU busy
#: (benchmarks/HISTORY.md v14). Captured blocks are kept per (shapes, ε, ρ, backend) and
#: replayed by later solves: see :func:`clear_dual_graphs`.
CAPTURE_UP_TO = 1 << 28


@dataclass(frozen=True)
class DualSpec:
    """The non-tensor data of a dual problem.

    Attributes:
        eps: ε.  rho: (ρ_x, ρ_y), None for a balanced side.
        backend: the streaming primitives.  cost_bound: the form's bound on the cost.
        cg_tol: relative residual of the dual solves.  cg_max_iter: their iterations at most.
        segments: the packing of a batch of problems (:mod:`flashot.geometry.segments`), or None:
            every sum over the weights, and the dual system's null vectors, per problem.
    """

    eps: float
    rho: tuple[float | None, float | None]
    backend: Backend
    cost_bound: float | None
    cg_tol: float
    cg_max_iter: int = 10_000
    segments: Segments | None = None
    #: the operand conversions a replayed schedule's passes share (Backend.operand_scope)
    operands: list | None = field(default=None, compare=False)

    @property
    def T(self) -> DualSpec:
        """The spec of the transposed problem (rows and columns swapped)."""
        seg = None if self.segments is None else self.segments.T
        return DualSpec(self.eps, self.rho[::-1], self.backend, self.cost_bound, self.cg_tol,
                        self.cg_max_iter, seg, self.operands)  # fmt: skip


def _form(q, alpha, k, beta, spec: DualSpec) -> AttentionForm:
    return AttentionForm(q.detach(), k.detach(), alpha.detach(), beta.detach(),
                         cost_bound=spec.cost_bound, segments=spec.segments)  # fmt: skip


class PlanProduct(torch.autograd.Function):
    """``(P V, P 1)``, differentiable once in q, α, k, β, a, b, f, g and V.

    The row sums come with the product's pass at no cost, so a caller that needs both
    (the value's gradient: ``P k`` and ``P 1``) keeps no ``[1, V]`` copy for the backward.
    """

    @staticmethod
    def forward(ctx, q, alpha, k, beta, a, b, f, g, v, spec):
        """``(P V, P 1)`` in one streaming pass."""
        form = _form(q, alpha, k, beta, spec)
        ctx.save_for_backward(q, alpha, k, beta, a, b, f, g, v)
        ctx.spec = spec
        ctx.set_materialize_grads(False)
        with torch.no_grad():
            lse, out = spec.backend.row_attend(form, g - form.beta, spec.eps, v, torch.log(b))
            mass = row_mass(f, lse, form.alpha, torch.log(a), spec.eps)
            return mass[:, None] * out, mass

    @staticmethod
    @torch.autograd.function.once_differentiable
    @entry_point
    def backward(ctx, dout, dmass):
        """The cotangents of θ, f, g and V (two streaming passes)."""
        q, alpha, k, beta, a, b, f, g, v = ctx.saved_tensors
        spec, eps = ctx.spec, ctx.spec.eps
        if dout is None and dmass is None:
            return (None,) * 10
        dout = v.new_zeros(q.shape[0], v.shape[1]) if dout is None else dout
        vjp = spec.backend.plan_vjp(_form(q, alpha, k, beta, spec), f, g, a, b, eps, v, dout,
                                    outputs_for(ctx.needs_input_grad), d0=dmass)  # fmt: skip
        row, col = _over_(vjp.row, eps), _over_(vjp.col, eps)
        return (_over_(vjp.row_k, eps), _neg(row), _over_(vjp.col_q, eps), _neg(col), vjp.per_a,
                vjp.per_b, row, col, vjp.pt_d, None)  # fmt: skip


def _over_(t, eps):
    """``t / ε`` in place (t a backward's fresh output)."""
    return None if t is None else t.div_(eps)


def _neg(t):
    return None if t is None else -t


def plan_product(theta, z, v, spec: DualSpec, transpose: bool = False, with_mass: bool = False):
    """``P V`` (or ``Pᵀ V``) through :class:`PlanProduct`; θ = (q, α, k, β, a, b), z = (f, g).

    ``with_mass``: return ``(P V, P 1)`` (the row sums of the product's plan).
    """
    q, alpha, k, beta, a, b = theta
    f, g = z
    if transpose:
        out = PlanProduct.apply(k, beta, q, alpha, b, a, g, f, v, spec.T)
    else:
        out = PlanProduct.apply(q, alpha, k, beta, a, b, f, g, v, spec)
    return out if with_mass else out[0]


class _Buffers:
    """A dual system's data in tensors of its own, refreshed in place for each solve.

    CG blocks captured as CUDA graphs read these, so later solves replay them.
    """

    def __init__(self, tensors):
        self.tensors = [t.detach().clone() for t in tensors]

    def load(self, tensors) -> list:
        for own, t in zip(self.tensors, tensors, strict=True):
            own.copy_(t)
        return self.tensors


#: captured dual-CG blocks, and the buffers they read (least recently used dropped)
_GRAPHS = GraphCache(capacity=4, capture=capture_or_eager)
_BUFFERS: OrderedDict = OrderedDict()


def clear_dual_graphs() -> None:
    """Drop the captured dual-CG blocks, their buffers and the kept dense factor.

    The blocks and buffers hold GPU memory; the factor is the last small problem's dual
    system (:mod:`flashot.autodiff.dense_dual`).
    """
    _GRAPHS.clear()
    _BUFFERS.clear()
    dense_dual.clear_dense_factors()


def _captures(backend: Backend, form: AttentionForm) -> bool:
    """Whether the dual CG of this problem runs captured blocks (see :data:`CAPTURE_UP_TO`)."""
    if form.segments is not None:  # (a packed batch's blocks: not keyed here)
        return False
    size = form.q.shape[0] * form.k.shape[0]
    # half precisions read cached half copies of q and k, made outside a capture: a
    # replay would not see the buffers' new contents
    full = backend.precision in ("fp32", "tf32")
    return backend.capturable and full and form.q.is_cuda and size <= CAPTURE_UP_TO


def _capture_plan(spec: DualSpec, form: AttentionForm, data):
    """``(capture, data)`` for the dual CG: False (eager) or ``(cache, key)``.

    With a key, ``data`` comes back moved into the buffers that blocks captured with
    this key read (in this solve and later ones).
    """
    if not _captures(spec.backend, form):
        return False, data
    backend = spec.backend
    # everything a block's launches depend on besides the buffers' contents: the shapes,
    # ε, ρ, the backend's launch options and its host-side branch at this ε
    sig = (backend.launch_key(), form.q.shape, form.k.shape, form.q.dtype, form.q.device,
           spec.eps, spec.rho, is_near_uniform(form, spec.eps))  # fmt: skip
    buffers = _BUFFERS.get(sig)
    if buffers is None:
        buffers = _BUFFERS[sig] = _Buffers(data)
        if len(_BUFFERS) > _GRAPHS.capacity:
            # graphs read their key's buffers: with some buffers gone, drop all graphs
            # (keys are plain tuples, so that the cache's memory of keys holds no tensor)
            _BUFFERS.popitem(last=False)
            _GRAPHS.clear()
    _BUFFERS.move_to_end(sig)
    return (_GRAPHS, sig), buffers.load(data)


def solve_dual(form: AttentionForm, f, g, a, b, spec: DualSpec, f_bar, g_bar):
    """``w = M⁻¹ (f̄, ḡ)`` by CG on the Schur complement (see the module docstring).

    All arguments detached: form, f (n,), g (m,), a (n,), b (m,), f̄ (n,), ḡ (m,); or
    k right-hand sides f̄ (n, k), ḡ (m, k), solved by one CG per column that share each
    streaming pass (value passes take the k columns at once; no capture).
    """
    eps, (rho_x, rho_y), backend = spec.eps, spec.rho, spec.backend
    columns = f_bar.dim() == 2
    # S is PSD, but its smallest eigenvalues drown in rounding: a shift of 100 ulps of
    # D_c keeps CG's curvatures positive and costs ~100 ulps of relative accuracy there
    shift = 100 * torch.finfo(f.dtype).eps
    if dense_dual.fits(form):  # small: one factorization, kept for the next solves
        system = dense_dual.dense_dual(form, f, g, a, b, eps, spec.rho, shift)
        if system is not None:
            w_f, w_g, residual = system.solve(f_bar, g_bar, eps)
            log_solve(DualSolveInfo(0, residual, spec.cg_tol, residual <= spec.cg_tol,
                               f_bar.shape[1] if columns else 1, float(eps),
                               (form.q.shape[0], form.k.shape[0])))  # fmt: skip
            return w_f, w_g
    log_a, log_b = torch.log(a), torch.log(b)
    at_z = Potentials(form, f, g, log_a, log_b, eps)
    r, c = backend.marginals(at_z)
    d_r = r if rho_x is None else r + (eps / rho_x) * relaxed_weight(f, a, rho_x)
    d_c = c if rho_y is None else c + (eps / rho_y) * relaxed_weight(g, b, rho_y)
    d_r_inv = torch.where(d_r > 0, 1.0 / d_r, torch.zeros_like(d_r))
    d_c_inv = torch.where(d_c > 0, 1.0 / d_c, torch.zeros_like(d_c))
    deflate = rho_x is None and rho_y is None
    col_seg = None if spec.segments is None else spec.segments.T
    c_unit = c / problem_sums(c, col_seg)  # (one null vector per balanced problem)
    if columns:
        capture = False
        d_r_inv, d_c, d_c_inv, c_unit = (t[:, None] for t in (d_r_inv, d_c, d_c_inv, c_unit))

        def p_times(w):  # P W: (m, k) -> (n, k), one pass
            return plan_times(backend, at_z, w)

        def pt_times(u):  # Pᵀ U: (n, k) -> (m, k), one pass
            return plan_times(backend, at_z.T, u)

    else:
        data = (form.q, form.k, form.alpha, form.beta, f, g, log_a, log_b, r, c, d_r_inv, d_c,
                d_c_inv, c_unit)  # fmt: skip
        capture, data = _capture_plan(spec, form, data)
        q, k, alpha, beta, f, g, log_a, log_b, r, c, d_r_inv, d_c, d_c_inv, c_unit = data
        form = AttentionForm(q, k, alpha, beta, cost_bound=form.cost_bound, segments=form.segments)
        pot = Potentials(form, f, g, log_a, log_b, eps)  # (the captured blocks' buffers)

        def p_times(w):  # P w: (m,) -> (n,)
            return backend.plan_matvec(pot, r, c, w=w)[0]

        def pt_times(u):  # Pᵀ u: (n,) -> (m,)
            return backend.plan_matvec(pot, r, c, u=u)[1]

    def schur(w):
        out = (1 + shift) * d_c * w - pt_times(d_r_inv * p_times(w))
        if deflate:
            out = out + c_unit * problem_sums(c.reshape(c.shape + (1,) * (w.dim() - 1)) * w,
                                              col_seg)  # fmt: skip
        return out

    rhs = eps * (g_bar - pt_times(d_r_inv * f_bar))
    if deflate:  # the part along 1 is a gauge dependence: no solution, dropped
        rhs = rhs - c_unit * problem_sums(rhs, col_seg)
    res = cg(schur, rhs, tol=spec.cg_tol, max_iter=spec.cg_max_iter, capture=capture,
             columns=columns, preconditioner=lambda v: d_c_inv * v,
             on_negative_curvature="return", warn=False)  # fmt: skip
    _report(res, spec, form, columns, f_bar)
    w_g = res.x
    w_f = d_r_inv * (eps * f_bar - p_times(w_g))
    return w_f, w_g


def _report(res, spec: DualSpec, form: AttentionForm, columns: bool, f_bar) -> None:
    """Log the solve (:func:`record_dual_solves`); warn, naming the cause, if it missed."""
    info = DualSolveInfo(res.n_iter, res.residual, spec.cg_tol, res.converged,
                         f_bar.shape[1] if columns else 1, float(spec.eps),
                         (form.q.shape[0], form.k.shape[0]))  # fmt: skip
    log_solve(info)
    if res.converged:
        return
    dtype = form.q.dtype
    if res.negative_curvature is not None:  # rounding won: the iterate is as good as it gets
        cause = (f"rounding: in {dtype} the dual system cannot be resolved below this "
                 "residual at this eps (float64 inputs or a larger eps help)")  # fmt: skip
    else:
        # CG's residual falls like ((√κ − 1)/(√κ + 1))^k: the rate seen gives κ
        rate = res.residual ** (1.0 / max(res.n_iter, 1)) if res.residual > 0 else 0.0
        kappa = ((1 + rate) / max(1 - rate, 1e-12)) ** 2
        cause = (f"the iteration limit (cg_max_iter={spec.cg_max_iter}); the residual fell "
                 f"by {rate:.3f} per iteration, a condition number of at least ~{kappa:.0e}, "
                 "which grows as eps shrinks against the cost's spread (a larger eps, a "
                 "larger cg_max_iter or a looser hvp_tol help)")  # fmt: skip
    warnings.warn(
        f"the dual system's CG stopped at relative residual {res.residual:.1e} after "
        f"{res.n_iter} iterations, above its tolerance {spec.cg_tol:.1e}: {cause}; second "
        f"derivatives are accurate to about {res.residual / RESIDUAL_PER_ERROR:.0e} "
        "(relative)",
        CGWarning,
        stacklevel=2,
    )


def add_optional(x, y):
    """``x + y`` where None is a zero (gradients that autograd did not form)."""
    return y if x is None else (x if y is None else x + y)


def _theta_grads(form, f, g, a, b, spec: DualSpec, w_f, w_g, needs) -> tuple:
    """θ̄ = ∂_θ ⟨∂_z L, w⟩ for the dual solution w = (w_f, w_g); None where not needed.

    ``∂_θ [⟨a', w_f⟩ + ⟨b', w_g⟩ − Σ_ij P_ij (w_f,i + w_g,j)]``: one plan_vjp.
    ``needs``: the six flags of (q, α, k, β, a, b).
    """
    eps = spec.eps
    ones_n, ones_m = torch.ones_like(w_f), torch.ones_like(w_g)
    v = torch.stack([ones_m, w_g], 1)
    d = torch.stack([w_f, ones_n], 1)
    vjp = spec.backend.plan_vjp(form, f, g, a, b, eps, v, d, outputs_for(needs))
    row, col = _over_(vjp.row, eps), _over_(vjp.col, eps)
    grad_a = grad_b = None
    if needs[4]:
        grad_a = relaxed_weight(f, ones_n, spec.rho[0]) * w_f - vjp.per_a
    if needs[5]:
        grad_b = relaxed_weight(g, ones_m, spec.rho[1]) * w_g - vjp.per_b
    row_k = None if vjp.row_k is None else vjp.row_k.div_(-eps)
    col_q = None if vjp.col_q is None else vjp.col_q.div_(-eps)
    return (row_k, row, col_q, col, grad_a, grad_b)


class DeferredSolves:
    """Dual solves of several backward passes, gathered to share their streaming passes.

    Within :func:`deferred_dual_solves`, an :class:`ImplicitPotentials` backward records
    its cotangent (per node, under the current :attr:`direction`) and returns no
    gradient; :meth:`finish` then solves each node's cotangents as the columns of one
    CG and adds their gradients, ``∂x`` of ``⟨θ̄, θ(x)⟩``, per direction.
    """

    def __init__(self):
        self.direction = 0
        self.nodes: dict = {}  # id(ctx) -> (saved tensors, spec, needs, {direction: (f̄, ḡ)})

    def record(self, ctx, f_bar, g_bar) -> None:
        """Keep a node's cotangents (f̄, ḡ) under the current direction."""
        saved = ctx.saved_tensors
        entry = self.nodes.setdefault(id(ctx), (saved, ctx.spec, ctx.needs_input_grad[:6], {}))
        old = entry[3].get(self.direction)
        entry[3][self.direction] = (
            (f_bar, g_bar) if old is None else (old[0] + f_bar, old[1] + g_bar)
        )

    def finish(self, inputs, count: int) -> list:
        """Per direction, the gradients w.r.t. ``inputs`` that the deferred solves owe."""
        out = [[None] * len(inputs) for _ in range(count)]
        for saved, spec, needs, bars in self.nodes.values():
            q, alpha, k, beta, a, b, f, g = saved
            form = _form(q, alpha, k, beta, spec)
            order = sorted(bars)
            f_bars = torch.stack([bars[i][0] for i in order], 1)
            g_bars = torch.stack([bars[i][1] for i in order], 1)
            with torch.no_grad():
                w_f, w_g = solve_dual(form, f.detach(), g.detach(), a.detach(), b.detach(),
                                      spec, f_bars, g_bars)  # fmt: skip
            theta = [t for t, need in zip(saved[:6], needs, strict=True) if need]
            if not theta:
                continue
            for j, i in enumerate(order):
                with torch.no_grad():
                    grads = _theta_grads(form, f.detach(), g.detach(), a.detach(), b.detach(),
                                         spec, w_f[:, j], w_g[:, j], needs)  # fmt: skip
                cot = [t for t, need in zip(grads, needs, strict=True) if need]
                found = torch.autograd.grad(theta, inputs, grad_outputs=cot, retain_graph=True,
                                            allow_unused=True)  # fmt: skip
                out[i] = [add_optional(x, y) for x, y in zip(out[i], found, strict=True)]
        return out


_DEFERRED: list = []


@contextlib.contextmanager
def deferred_dual_solves():
    """Within the block, dual solves are recorded on the yielded :class:`DeferredSolves`."""
    deferred = DeferredSolves()
    _DEFERRED.append(deferred)
    try:
        yield deferred
    finally:
        _DEFERRED.pop()


class ImplicitPotentials(torch.autograd.Function):
    """The converged ``(f, g)`` as a function of θ = (q, α, k, β, a, b) (see module)."""

    @staticmethod
    def forward(ctx, q, alpha, k, beta, a, b, f, g, spec, check_gauge=True):
        """Copies of the converged (f, g), now functions of θ."""
        ctx.save_for_backward(q, alpha, k, beta, a, b, f, g)
        ctx.spec, ctx.check_gauge = spec, check_gauge
        return f.detach().clone(), g.detach().clone()

    @staticmethod
    @torch.autograd.function.once_differentiable
    @entry_point
    def backward(ctx, f_bar, g_bar):
        """θ̄ from a CG solve of the dual system (see the module)."""
        q, alpha, k, beta, a, b, f, g = ctx.saved_tensors
        spec = ctx.spec
        form = _form(q, alpha, k, beta, spec)
        f_bar = torch.zeros_like(f) if f_bar is None else f_bar
        g_bar = torch.zeros_like(g) if g_bar is None else g_bar
        if spec.rho == (None, None) and ctx.check_gauge:
            _check_gauge(f_bar, g_bar)
        if _DEFERRED:  # solved later, with other directions' (DeferredSolves)
            _DEFERRED[-1].record(ctx, f_bar, g_bar)
            return (None,) * 10
        w_f, w_g = solve_dual(form, f, g, a, b, spec, f_bar, g_bar)
        grads = _theta_grads(form, f, g, a, b, spec, w_f, w_g, ctx.needs_input_grad[:6])
        return (*grads, None, None, None, None)


GAUGE = (
    "this function of the potentials depends on their additive constant: a balanced "
    "problem's (f + c, g − c) are as optimal as (f, g), so it has no derivative. Make it "
    "invariant (e.g. use f - f.mean(), or f_i + g_j), or relax a marginal (rho)"
)


def _check_gauge(f_bar, g_bar) -> None:
    """Raise :data:`GAUGE` unless ``⟨(f̄, ḡ), (1, −1)⟩ = 0`` up to rounding."""
    drift = float((f_bar.sum() - g_bar.sum()).abs())
    size = float(f_bar.abs().sum() + g_bar.abs().sum())
    if drift > 1e3 * torch.finfo(f_bar.dtype).eps * max(size, 1e-300):
        raise RuntimeError(GAUGE)


#: a second derivative's potentials are polished to this marginal error per unit of the
#: HVP error asked for (measured: HVP errors 1–3.4 times the solve's L1 marginal error,
#: float64, n ≤ 9, balanced and relaxed, both costs)
MARGINAL_PER_ERROR = 0.1


@torch.no_grad()
def refine_potentials(theta, f, g, spec: DualSpec, target: float, max_iter: int = 2000):
    """``(f, g)`` polished for a second derivative by alternating Sinkhorn steps.

    The steps run until the L1 marginal error is ≤ ``target`` (or stalls, or after
    ``max_iter`` steps).

    A solve stops at its ``tol`` (1e-6 by default); the converged problem's Hessian at
    those potentials is off by about that much, while ``hvp_tol`` may ask for less. The
    first-order results keep the solve's potentials; the polish costs one pass per side
    and step, and none when the solve was accurate enough.

    Args:
        theta: (q, α, k, β, a, b) (detached here).  f: (n,), g: (m,) potentials.
        spec: the problem's :class:`DualSpec`.  target: the marginal error to reach.

    Returns:
        ``(f, g, error)``, error the last measured L1 marginal error.
    """
    q, alpha, k, beta, a, b = (t.detach() for t in theta)
    form = AttentionForm(q, k, alpha, beta, cost_bound=spec.cost_bound, segments=spec.segments)
    backend, eps, rho_x = spec.backend, spec.eps, spec.rho[0]
    lam = [1.0 if r is None else r / (r + eps) for r in spec.rho]
    log_a, log_b = torch.log(a), torch.log(b)
    f, g = f.detach(), g.detach()
    best, since, error = float("inf"), 0, float("inf")
    with backend.operand_scope():
        for it in range(max_iter + 1):
            lse_r, _ = backend.row_attend(form, g - beta, eps, log_w=log_b)
            if it % 5 == 0:  # (columns are exact after a g-step: the rows hold the error)
                r = row_mass(f, lse_r, alpha, log_a, eps)
                error = float(marginal_error(f, r, log_a, rho_x))
                if error <= target or it == max_iter:
                    break
                since = 0 if error < 0.9 * best else since + 5
                best = min(best, error)
                if since >= 50:  # stalled at the dtype's floor
                    break
            f = lam[0] * (alpha - lse_r)
            lse_c, _ = backend.row_attend(form.T, f - alpha, eps, log_w=log_a)
            g = lam[1] * (beta - lse_c)
    return f, g, error


def implicit_potentials(theta, f, g, spec: DualSpec, check_gauge: bool = True):
    """``(f, g)`` carrying the exact derivatives of the converged potentials in θ.

    ``check_gauge``: raise :data:`GAUGE` when a balanced problem's cotangent is not
    invariant to the potentials' constant shift. Callers whose functions are invariant by
    construction (the plan, the value's gradient) turn it off: their cotangents can be
    rounding noise alone (points that coincide), which the dual solve's deflation drops.
    """
    return ImplicitPotentials.apply(*theta, f.detach(), g.detach(), spec, check_gauge)


def _phi(pot, rho):
    return pot if rho is None else -rho * torch.expm1(-pot / rho)


def value_gradient(theta, z, spec: DualSpec):
    r"""The exact gradient of the OT value in θ, differentiable (through z = z(θ)) once more.

    .. math::

        \partial_q = -P k,\quad \partial_\alpha = P 1,\quad
        \partial_k = -P^T q,\quad \partial_\beta = P^T 1,\quad
        \partial_{a_i} = \varphi_x(f_i) - \varepsilon (r_i / a_i - m(b))

    (the columns alike), with ``r_i / a_i = e^{−f_i/ρ_x}`` (1 when balanced) at the
    solution: written so, it holds on the whole solution manifold.

    Args:
        theta: (q, α, k, β, a, b) with their autograd history.
        z: (f, g) from :func:`implicit_potentials`.
        spec: the dual's :class:`DualSpec`.

    Returns:
        The six gradients, shaped like θ; those of row (column) features and offsets
        are None when neither requires a gradient (their plan pass is skipped).
    """
    q, alpha, k, beta, a, b = theta
    f, g = z
    eps, (rho_x, rho_y) = spec.eps, spec.rho
    grads = [None] * 4
    if q.requires_grad or alpha.requires_grad:
        p_k, r = plan_product(theta, z, k, spec, with_mass=True)
        grads[:2] = -p_k, r
    if k.requires_grad or beta.requires_grad:
        pt_q, c = plan_product(theta, z, q, spec, transpose=True, with_mass=True)
        grads[2:] = -pt_q, c
    one_x = torch.ones_like(f) if rho_x is None else torch.exp(-f / rho_x)
    one_y = torch.ones_like(g) if rho_y is None else torch.exp(-g / rho_y)
    seg = spec.segments
    grad_a = _phi(f, rho_x) - eps * (one_x - other_masses(b, seg, f))
    grad_b = _phi(g, rho_y) - eps * (one_y - other_masses(a, None if seg is None else seg.T, g))
    return (*grads, grad_a, grad_b)
