r"""POT's point-cloud calls with POT's argument names and semantics, streamed by flashot.

POT (``import ot``) solves entropic OT between samples by building the n × m matrix
``M = ot.dist(X_s, X_t, metric)`` and iterating on it. These functions take the same
arguments, return the same quantities, and never build M: the solve is
:func:`flashot.sinkhorn` with ``eps = reg``, on any device and backend.

.. list-table::
   :header-rows: 1

   * - POT call
     - returns
     - in flashot's terms
   * - ``empirical_sinkhorn2``
     - ``⟨P, M⟩``, the linear part only (POT's ``sinkhorn2``)
     - ``SinkhornResult.transport_cost``
   * - ``empirical_sinkhorn_divergence``
     - ``max(0, ⟨P_ab, M⟩ − ½⟨P_aa, M_aa⟩ − ½⟨P_bb, M_bb⟩)``
     - three ``transport_cost``; not :func:`flashot.sinkhorn_divergence`, which
       debiases the entropic values
   * - ``sinkhorn2(a, b, M, reg)``
     - ``⟨P, M⟩`` for a given matrix (``sinkhorn``: the dense plan)
     - :mod:`flashot.compat.pot_matrix`: dense, log domain (M is already in memory)
   * - ``solve_sample(reg=...)``
     - ``OTResult``: ``value = ⟨P, M⟩ + reg·KL(P ‖ a⊗b)``, ``value_linear = ⟨P, M⟩``
     - ``SinkhornResult.cost`` and ``transport_cost``

Where it differs from POT, on purpose:

- **Stopping.** ``stopThr``/``tol`` bounds the L1 error of *both* marginals, checked
  every 10 iterations (POT: the L2 norm of one marginal's error), so a solve is at
  least as accurate as POT's at the same threshold. Below float64 a threshold under
  1e-6 (POT's default 1e-9 is one) cannot be met; it becomes ``tol="auto"`` (1e-6 or
  the dtype's precision floor), where POT would run all ``numIterMax`` iterations.
- **Gradients** (torch inputs) are the exact gradients at the solution (envelope
  theorem): POT's ``grad="autodiff"`` differentiates its iterations, which agrees at
  convergence and costs O(iterations · n · m) memory.
- **The plan** is flashot's lazy :class:`~flashot.TransportPlan` (``plan @ V``,
  ``plan.dense()`` for small problems), never a matrix.
- **Potentials** are POT's log-scalings, ``P = diag(e^{log u}) K diag(e^{log v})``
  with ``K = e^{−M/reg}``: ``log u = log a + f/reg``, ``log v = log b + g/reg`` with
  flashot's (f, g) (``log["f"]``, ``log["g"]``). They are defined up to a constant
  moved from one to the other.
- **Metrics**: ``"sqeuclidean"`` (``|x − y|²``, POT's default) and ``"cosine"``
  (``1 − cos``), the costs that are dot-product scores. Others are refused.
- **Self problems** (``X_s`` against ``X_s`` in the divergence) use flashot's
  symmetric updates, which converge in a few dozen iterations; POT's alternating ones
  can stall there (marginal error ~1e-7 after 20 000 iterations at reg = 0.2 on 23
  points), so divergences may differ from POT's by that much, POT's being the less
  converged.
- Numpy inputs give numpy values and potentials (as POT does); the plan is a
  :class:`~flashot.TransportPlan` over CPU tensors.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

import flashot
from flashot.compat.pot_matrix import sinkhorn, sinkhorn2
from flashot.problem import check_positive

__all__ = ["OTResult", "empirical_sinkhorn", "empirical_sinkhorn2",
           "empirical_sinkhorn_divergence", "sinkhorn", "sinkhorn2", "solve_sample"]  # fmt: skip

#: POT's metric → flashot's cost
METRICS = {"sqeuclidean": "sqeuclidean", "cosine": "cosine"}
#: POT's names of the Sinkhorn variants that compute the same solution
METHODS = (None, "sinkhorn", "sinkhorn_log", "sinkhorn_stabilized")
#: below float64, thresholds under this become ``tol="auto"``
LOW_PRECISION_TOL = 1e-6


@dataclass(frozen=True)
class _Solved:
    """One solve and what POT's quantities need from it."""

    result: flashot.SinkhornResult
    mass: torch.Tensor  # (0-dim) POT's plan is mass × flashot's (probability) plan
    a: torch.Tensor
    b: torch.Tensor
    numpy: bool
    log: dict = field(default_factory=dict)

    @property
    def value_linear(self) -> torch.Tensor:
        """``⟨P, M⟩``."""
        return self.mass * self.result.transport_cost

    @property
    def value(self) -> torch.Tensor:
        """The objective with its entropic term (see the class)."""
        """``⟨P, M⟩ + reg·Σ P log(P / a⊗b)`` (POT's KL term, without mass terms).

        ``P = s P̄`` with the mass s and flashot's probability plan P̄; at the solution
        ``⟨P̄, M⟩ + reg·KL(P̄ ‖ ā⊗b̄) = cost``, hence ``s·cost − reg·s log s``.
        """
        s, reg = self.mass, self.result.eps
        return s * self.result.cost - reg * s * torch.log(s)


def _out(t, numpy: bool):
    """A result in the caller's array type (numpy in, numpy out, as POT does)."""
    if not isinstance(t, torch.Tensor):
        return t
    if numpy:
        out = t.detach().cpu().numpy()
        return out[()] if out.ndim == 0 else out
    return t


def _tensor(name: str, value, like: torch.Tensor | None = None) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value if like is None else value.to(like.device)
    if isinstance(value, (np.ndarray, list, tuple)):
        out = torch.as_tensor(np.asarray(value))
        if like is not None:
            out = out.to(device=like.device, dtype=like.dtype)
        return out
    raise TypeError(f"{name} must be a numpy array or a torch tensor, got {type(value).__name__}")


def _cost(metric) -> str:
    if metric not in METRICS:
        raise ValueError(
            f"metric={metric!r} cannot be streamed: flashot.compat.pot takes 'sqeuclidean' "
            "(|x − y|², POT's default) and 'cosine' (1 − cos), the costs that are "
            "dot-product scores; for another metric build M and call POT itself"
        )
    return METRICS[metric]


def _tol(value, name: str, dtype: torch.dtype):
    tol = check_positive(value, name, allow_zero=True)
    if dtype != torch.float64 and tol < LOW_PRECISION_TOL:
        return "auto"  # (the dtype cannot reach it: see the module's notes)
    return tol


def _weights(a, b, x, y) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(a, b, mass): POT's weights as given (uniform if None) and their common mass."""
    dtype = x.dtype if x.dtype.is_floating_point else torch.float64
    a = (torch.full((len(x),), 1.0 / len(x), dtype=dtype, device=x.device) if a is None
         else _tensor("a", a, x))  # fmt: skip
    b = (torch.full((len(y),), 1.0 / len(y), dtype=dtype, device=y.device) if b is None
         else _tensor("b", b, y))  # fmt: skip
    for w, pts, name in ((a, x, "a"), (b, y, "b")):
        if w.shape != (len(pts),):
            raise ValueError(f"{name} must have shape ({len(pts)},), got {tuple(w.shape)}")
    sa, sb = a.detach().sum(), b.detach().sum()
    if not bool(torch.isclose(sa, sb, rtol=1e-6, atol=0.0)):
        raise ValueError(f"a and b must have the same total mass for balanced OT, got "
                         f"{float(sa):.6g} and {float(sb):.6g}")  # fmt: skip
    return a, b, a.sum()


def _run(X_s, X_t, reg, a, b, metric, max_iter, tol, tol_name, verbose, warn, warmstart,
         record: bool) -> _Solved:  # fmt: skip
    """Solve POT's problem with flashot; keep what POT's outputs are made of."""
    numpy = not isinstance(X_s, torch.Tensor)
    x, y = _tensor("X_s", X_s), _tensor("X_t", X_t)
    if x.dim() != 2 or y.dim() != 2:
        raise ValueError(f"X_s and X_t must be (n, d) and (m, d) arrays, got shapes "
                         f"{tuple(x.shape)} and {tuple(y.shape)}")  # fmt: skip
    if not x.dtype.is_floating_point:
        x, y = x.double(), y.double()
    y = y.to(device=x.device, dtype=x.dtype)
    reg = check_positive(reg, "reg")
    a, b, mass = _weights(a, b, x, y)
    init = None
    if warmstart is not None:  # POT's (log u, log v) → flashot's (f, g)
        log_u, log_v = (_tensor("warmstart", w, x) for w in warmstart)
        init = (reg * (log_u - torch.log(a.detach() / mass.detach())),
                reg * (log_v - torch.log(b.detach())))  # fmt: skip
    if not isinstance(max_iter, int) or isinstance(max_iter, bool) or max_iter < 1:
        raise ValueError(f"the iteration limit must be a positive integer, got {max_iter!r}")
    res = flashot.sinkhorn(x, y, a, b, eps=reg, cost=_cost(metric), max_iter=max_iter,
                           tol=_tol(tol, tol_name, x.dtype), progress=bool(verbose),
                           warn=bool(warn), history=record, init=init)  # fmt: skip
    solved = _Solved(res, mass, a, b, numpy)
    if record:
        solved.log.update(_log(solved))
    return solved


def _log_scalings(s: _Solved) -> tuple[torch.Tensor, torch.Tensor]:
    """POT's (log u, log v): ``P = s·ā_i b̄_j e^{(f_i + g_j − M_ij)/reg}``."""
    res, reg = s.result, s.result.eps
    return (torch.log(s.a / s.mass) + res.f / reg,
            torch.log(s.b / s.mass) + res.g / reg + torch.log(s.mass))  # fmt: skip


def _log(s: _Solved) -> dict:
    log_u, log_v = (t.detach() for t in _log_scalings(s))
    res = s.result
    errors = res.history.errors if res.history is not None and res.history.errors else []
    out = {"niter": res.n_iter, "err": [*errors, res.marginal_error], "log_u": log_u,
           "log_v": log_v, "u": log_u.exp(), "v": log_v.exp(), "f": res.f.detach(),
           "g": res.g.detach(), "converged": res.converged}  # fmt: skip
    out = {k: _out(v, s.numpy) for k, v in out.items()}
    out["result"] = res
    return out


def _check_kwargs(kwargs: dict, where: str) -> None:
    method = kwargs.pop("method", None)
    if method not in METHODS:
        raise ValueError(f"{where}: method={method!r} is not a Sinkhorn variant flashot "
                         f"computes; use one of {METHODS}")  # fmt: skip
    if kwargs:
        raise TypeError(f"{where} got unexpected keyword arguments {sorted(kwargs)}")


def empirical_sinkhorn2(X_s, X_t, reg, a=None, b=None, metric="sqeuclidean",
                        numIterMax=10000, stopThr=1e-9, isLazy=False, batchSize=100,
                        verbose=False, log=False, warn=True, warmstart=None, **kwargs):  # fmt: skip
    """POT's ``ot.bregman.empirical_sinkhorn2``: ``⟨P, M⟩`` of the entropic plan.

    Args:
        X_s: (n, d) source samples.  X_t: (m, d) target samples.
        reg: the entropic regularization (flashot's ε), > 0.
        a: (n,) source weights, None for uniform.  b: (m,) target weights.
        metric: ``"sqeuclidean"`` or ``"cosine"``.
        numIterMax: iterations at most.  stopThr: the L1 marginal error to stop at.
        isLazy, batchSize: accepted for POT's signature; flashot always streams.
        verbose: a progress line.  log: also return the log dict.  warn: warn
            (:class:`flashot.ConvergenceWarning`) when ``stopThr`` was missed.
        warmstart: POT's initial (log u, log v), or None.

    Returns:
        ``⟨P, M⟩`` (0-dim; differentiable for torch inputs), and with ``log=True`` a
        dict: ``niter``, ``err`` (the measured errors), ``log_u``, ``log_v``, ``u``,
        ``v``, flashot's potentials ``f``, ``g``, ``converged`` and the
        :class:`~flashot.SinkhornResult` as ``result``.
    """
    _check_kwargs(dict(kwargs), "empirical_sinkhorn2")
    s = _run(X_s, X_t, reg, a, b, metric, numIterMax, stopThr, "stopThr", verbose, warn,
             warmstart, bool(log))  # fmt: skip
    value = _out(s.value_linear, s.numpy)
    return (value, s.log) if log else value


def empirical_sinkhorn(X_s, X_t, reg, a=None, b=None, metric="sqeuclidean",
                       numIterMax=10000, stopThr=1e-9, isLazy=False, batchSize=100,
                       verbose=False, log=False, warn=True, warmstart=None, **kwargs):  # fmt: skip
    """POT's ``ot.bregman.empirical_sinkhorn``: the entropic plan, lazy.

    Arguments as :func:`empirical_sinkhorn2`. POT returns the dense (n, m) matrix (or,
    with ``isLazy``, its log-scalings); this returns the plan as a lazy
    :class:`~flashot.TransportPlan` scaled to POT's mass (``plan @ V``,
    ``plan.dense()`` when small), and the log dict with ``log=True``.
    """
    _check_kwargs(dict(kwargs), "empirical_sinkhorn")
    s = _run(X_s, X_t, reg, a, b, metric, numIterMax, stopThr, "stopThr", verbose, warn,
             warmstart, bool(log))  # fmt: skip
    plan = _scaled_plan(s)
    return (plan, s.log) if log else plan


def empirical_sinkhorn_divergence(X_s, X_t, reg, a=None, b=None, metric="sqeuclidean",
                                  numIterMax=10000, stopThr=1e-9, verbose=False, log=False,
                                  warn=True, warmstart=None, **kwargs):  # fmt: skip
    """POT's ``ot.bregman.empirical_sinkhorn_divergence``.

    ``max(0, ⟨P_ab, M_ab⟩ − ½ (⟨P_aa, M_aa⟩ + ⟨P_bb, M_bb⟩))`` with each plan the
    entropic one: POT debiases the *linear* parts (flashot's
    :func:`~flashot.sinkhorn_divergence` debiases the entropic values, GeomLoss' S_ε).
    Arguments as :func:`empirical_sinkhorn2`; ``warmstart`` (log u, log v) starts the
    cross problem, and (u, u), (v, v) the two self problems, as in POT.

    Returns:
        The divergence, and with ``log=True`` a dict with ``sinkhorn_loss_ab``,
        ``sinkhorn_loss_a``, ``sinkhorn_loss_b`` and each solve's log.
    """
    _check_kwargs(dict(kwargs), "empirical_sinkhorn_divergence")
    starts = (None, None, None) if warmstart is None else (
        warmstart, (warmstart[0], warmstart[0]), (warmstart[1], warmstart[1]))  # fmt: skip
    pairs = ((X_s, X_t, a, b), (X_s, X_s, a, a), (X_t, X_t, b, b))
    solved = []
    for (x, y, u, v), start in zip(pairs, starts, strict=True):
        solved.append(_run(x, y, reg, u, v, metric, numIterMax, stopThr, "stopThr", verbose,
                           warn, start, bool(log)))  # fmt: skip
    ab, aa, bb = (s.value_linear for s in solved)
    value = torch.clamp(ab - 0.5 * (aa + bb), min=0.0)
    numpy = solved[0].numpy
    if not log:
        return _out(value, numpy)
    out = {"sinkhorn_loss_ab": _out(ab, numpy), "sinkhorn_loss_a": _out(aa, numpy),
           "sinkhorn_loss_b": _out(bb, numpy), "log_sinkhorn_ab": solved[0].log,
           "log_sinkhorn_a": solved[1].log, "log_sinkhorn_b": solved[2].log}  # fmt: skip
    return _out(value, numpy), out


def _scaled_plan(s: _Solved):
    """The plan at POT's mass (flashot's plans have mass 1)."""
    mass = float(s.mass.detach())
    return s.result.plan if mass == 1.0 else _MassScaledPlan(s.result.plan, mass)


class _MassScaledPlan:
    """``mass × plan``: POT's plan for weights of total mass ≠ 1."""

    def __init__(self, plan: flashot.TransportPlan, mass: float):
        self._plan, self._mass = plan, mass

    shape = property(lambda self: self._plan.shape)
    T = property(lambda self: _MassScaledPlan(self._plan.T, self._mass))

    def __matmul__(self, v: torch.Tensor) -> torch.Tensor:
        return self._mass * (self._plan @ v)

    def row_sums(self) -> torch.Tensor:
        return self._mass * self._plan.row_sums()

    def col_sums(self) -> torch.Tensor:
        return self._mass * self._plan.col_sums()

    def barycentric_map(self, points=None) -> torch.Tensor:
        return self._plan.barycentric_map(points)

    def dense(self, max_elements: int = 10**7) -> torch.Tensor:
        return self._mass * self._plan.dense(max_elements)


class OTResult:
    """POT's ``OTResult`` for an entropic solve between samples (see the module).

    ``value`` is ``⟨P, M⟩ + reg·KL(P ‖ a⊗b)`` (``reg_type="KL"``) or ``⟨P, M⟩ +
    reg·Σ P log P`` (``"entropy"``), 0-dim and differentiable for torch inputs; the
    plan is lazy (never a matrix); ``potentials`` are POT's (log u, log v); ``status``
    is ``"converged"`` or why ``tol`` was missed; ``log`` holds ``niter``, ``err``,
    ``f``, ``g`` and flashot's result (debiased solves: ``res_ab``, ``res_aa``,
    ``res_bb``). POT's ``value_quad`` and ``sparse_plan`` raise NotImplementedError.
    """

    def __init__(self, value, value_linear, solved: _Solved | None, log: dict,
                 X_a=None, X_b=None):  # fmt: skip
        self._value, self._value_linear, self._solved, self._log = value, value_linear, solved, log
        self._x, self._y = X_a, X_b

    def _need(self) -> _Solved:
        if self._solved is None:
            raise NotImplementedError("this result has no plan")
        return self._solved

    @property
    def value(self):
        """The objective with its entropic term (see the class)."""
        return self._value

    @property
    def value_linear(self):
        """``⟨P, M⟩``."""
        return self._value_linear

    @property
    def value_quad(self):
        """Not defined for linear OT (POT raises too)."""
        raise NotImplementedError("value_quad belongs to Gromov–Wasserstein solves")

    @property
    def plan(self):
        """The lazy plan at POT's mass."""
        return _scaled_plan(self._need())

    lazy_plan = plan

    @property
    def sparse_plan(self):
        """Not available: an entropic plan is dense."""
        raise NotImplementedError("an entropic plan is dense: use plan (lazy)")

    @property
    def potentials(self):
        """POT's (log u, log v)."""
        s = self._need()
        return tuple(_out(t.detach(), s.numpy) for t in _log_scalings(s))

    @property
    def potential_a(self):
        """POT's log u."""
        return self.potentials[0]

    @property
    def potential_b(self):
        """POT's log v."""
        return self.potentials[1]

    @property
    def marginal_a(self):
        """``P 1`` (one streamed pass)."""
        s = self._need()
        return _out(self.plan.row_sums(), s.numpy)

    @property
    def marginal_b(self):
        """``Pᵀ 1`` (one streamed pass)."""
        s = self._need()
        return _out(self.plan.col_sums(), s.numpy)

    @property
    def marginals(self):
        """(``P 1``, ``Pᵀ 1``)."""
        return self.marginal_a, self.marginal_b

    @property
    def a_to_b(self):
        """(n, d) barycentric displacements ``Σ_j P_ij y_j / Σ_j P_ij − x_i``."""
        s = self._need()
        x = _tensor("X_a", self._x).to(s.result.f.dtype)
        return _out(s.result.plan.barycentric_map() - x, s.numpy)

    @property
    def b_to_a(self):
        """(m, d) barycentric displacements of the second cloud."""
        s = self._need()
        y = _tensor("X_b", self._y).to(s.result.f.dtype)
        return _out(s.result.plan.T.barycentric_map() - y, s.numpy)

    @property
    def status(self) -> str | None:
        """``"converged"``, or flashot's cause of a missed ``tol``."""
        s = self._need()
        if s.result.converged is None:
            return None
        return "converged" if s.result.converged else str(s.result.cause)

    @property
    def log(self) -> dict:
        """The log dict."""
        return self._log

    @property
    def citation(self) -> str:
        """What to cite for this result."""
        return ("FlashSinkhorn: Ye, Li, Yu, Chang, Chu, Wertheimer (2026), IO-aware entropic "
                "optimal transport on GPU; the conventions of POT: Flamary et al. (2021), "
                "POT: Python Optimal Transport, JMLR 22(78).")  # fmt: skip

    def __repr__(self) -> str:
        value = self._value
        shown = float(value.detach()) if isinstance(value, torch.Tensor) else float(value)
        return f"OTResult(value={shown:.6g}, status={self.status!r})"


def solve_sample(X_a, X_b, a=None, b=None, metric="sqeuclidean", reg=None, c=None,
                 reg_type="KL", unbalanced=None, unbalanced_type="KL", lazy=False,
                 batch_size=None, method=None, n_threads=1, max_iter=None, plan_init=None,
                 rank=100, scaling=0.95, potentials_init=None, X_init=None, tol=None,
                 verbose=False, grad="autodiff", random_state=None, debias=False,
                 n_projections=50, projections=None, scaler=None) -> OTResult:  # fmt: skip
    """POT's ``ot.solve_sample`` for entropic OT (``reg > 0``), streamed.

    Args:
        X_a: (n, d) samples.  X_b: (m, d) samples.  a, b: weights or None (uniform).
        metric: ``"sqeuclidean"`` or ``"cosine"``.
        reg: the entropic regularization, > 0 (flashot does not solve exact OT).
        reg_type: ``"KL"`` (POT's default, ``KL(P ‖ a⊗b)``) or ``"entropy"``
            (``Σ P log P``); the plan is the same, the value differs.
        max_iter: iterations at most (None: POT's 1000).  tol: the L1 marginal error
            to stop at (None: POT's 1e-9; see the module for lower precisions).
        potentials_init: POT's (log u, log v) to start from.
        grad: ``"autodiff"``, ``"envelope"``, ``"last_step"`` (all: the exact gradient
            at the solution) or ``"detach"`` (no gradient).
        debias: ``True`` for ``value = V_ab − ½(V_aa + V_bb)`` (value_linear likewise),
            with the cross problem's plan and potentials; ``log`` holds the three results.
        verbose: a progress line.

    POT's other options (``c``, ``unbalanced``, ``unbalanced_type``, ``lazy``,
    ``batch_size``, ``n_threads``, ``plan_init``, ``rank``, ``scaling``, ``X_init``,
    ``random_state``, ``n_projections``, ``projections``, ``scaler``): those that change
    nothing here are accepted; a reference measure ``c``, unbalanced marginals, a dense
    ``plan_init``, ``X_init``, a ``scaler``, ``debias="split"`` and the non-Sinkhorn
    methods are refused by name.

    Returns:
        An :class:`OTResult`.
    """
    refused = {"c": c is not None, "unbalanced": unbalanced is not None,
               "plan_init": plan_init is not None, "scaler": scaler is not None,
               "X_init": X_init is not None}  # fmt: skip
    for name, given in refused.items():
        if given:
            hint = (" (flashot.sinkhorn(..., rho=...) solves unbalanced OT)"
                    if name == "unbalanced" else "")  # fmt: skip
            raise ValueError(f"solve_sample: {name} is not supported by flashot.compat.pot{hint}")
    if reg is None or (isinstance(reg, (int, float)) and reg == 0):
        raise ValueError("solve_sample: reg must be > 0: flashot solves entropic OT only "
                         "(POT's exact solvers are ot.solve_sample(reg=None))")  # fmt: skip
    if method not in METHODS:
        raise ValueError(f"solve_sample: method={method!r} is not a Sinkhorn variant; use "
                         f"one of {METHODS}")  # fmt: skip
    if not isinstance(reg_type, str) or reg_type.lower() not in ("kl", "entropy"):
        raise ValueError(f"solve_sample: reg_type must be 'KL' or 'entropy', got {reg_type!r}")
    if grad not in ("autodiff", "envelope", "last_step", "detach"):
        raise ValueError(f"solve_sample: unknown grad={grad!r}")
    if debias not in (False, True):
        raise ValueError(f"solve_sample: debias={debias!r} is not supported (True or False)")
    options: dict[str, Any] = dict(metric=metric, reg=reg, reg_type=reg_type,
                                   max_iter=max_iter, tol=tol, verbose=verbose, grad=grad,
                                   potentials_init=potentials_init)  # fmt: skip
    if not debias:
        return _solve_one(X_a, X_b, a, b, **options)
    options["potentials_init"] = None
    ab = _solve_one(X_a, X_b, a, b, **{**options, "potentials_init": potentials_init})
    aa = _solve_one(X_a, X_a, a, a, **options)
    bb = _solve_one(X_b, X_b, b, b, **options)
    value = ab.value - 0.5 * (aa.value + bb.value)
    linear = ab.value_linear - 0.5 * (aa.value_linear + bb.value_linear)
    return OTResult(value, linear, ab._solved, {"res_ab": ab, "res_aa": aa, "res_bb": bb},
                    X_a, X_b)  # fmt: skip


def _solve_one(X_a, X_b, a, b, *, metric, reg, reg_type, max_iter, tol, verbose, grad,
               potentials_init) -> OTResult:  # fmt: skip
    detach = grad == "detach"
    if detach:
        X_a, X_b, a, b = (t.detach() if isinstance(t, torch.Tensor) else t
                          for t in (X_a, X_b, a, b))  # fmt: skip
    s = _run(X_a, X_b, reg, a, b, metric, 1000 if max_iter is None else max_iter,
             1e-9 if tol is None else tol, "tol", verbose, True, potentials_init, True)  # fmt: skip
    value, linear = s.value, s.value_linear
    if reg_type.lower() == "entropy":  # Σ P log P = Σ P log(P/ab) + ⟨a, log a⟩ + ⟨b, log b⟩
        value = value + s.result.eps * (torch.xlogy(s.a, s.a).sum() + torch.xlogy(s.b, s.b).sum())
    if detach:
        value, linear = value.detach(), linear.detach()
    return OTResult(_out(value, s.numpy), _out(linear, s.numpy), s, s.log, X_a, X_b)
