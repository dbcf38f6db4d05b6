r"""Solver results and the lazy transport plan.

The entropic plan is never stored. In attention form

.. math::

    P_{ij} = a_i b_j e^{(f_i + g_j - C_{ij})/\varepsilon}
           = \underbrace{a_i e^{(f_i - \alpha_i + \ell_i)/\varepsilon}}_{r_i}\;
             \mathrm{softmax}_j\Big(\frac{\langle q_i, k_j\rangle + h_j}{\varepsilon}\Big),
    \qquad h_j = g_j - \beta_j + \varepsilon \log b_j,

so ``P @ V`` is a row-scaled attention average of V, computed by the backend's
streaming ``row_attend`` pass with O((n + m)(d + p)) memory.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from flashot.autodiff.implicit import DualSpec, implicit_potentials, plan_product
from flashot.backends import entry_point
from flashot.backends.base import Backend, _given
from flashot.backends.dual import (
    Potentials,
    marginal_error,
    mass_excess,
    phi_sum,
    plan_times,
    row_mass,
)
from flashot.geometry.costs import AttentionForm, LazyForm

__all__ = ["SinkhornResult", "SolveHistory", "TransportPlan"]


class TransportPlan:
    """The entropic transport plan ``P`` (n × m) as a lazy operator.

    Supports ``plan @ V``, ``plan.T @ U``, marginals, the barycentric map and,
    for small problems only, :meth:`dense`. ``plan @ V``, :meth:`transport_cost` and
    :meth:`barycentric_map` (on the cloud) are differentiable in V and, through the
    potentials' implicit derivatives (:mod:`flashot.autodiff.implicit`), exactly in
    x, y, a and b. The plan refuses to run after its inputs (x, y or the potentials)
    were modified in place.

    Args:
        form: cost in attention form (detached).
        f: (n,) row potential.  g: (m,) column potential.
        log_a: (n,) log row weights.  log_b: (m,) log column weights.
        eps: ε.
        backend: the streaming primitives.
        x: (n, d) row points.  y: (m, d) column points (original coordinates).
        rho: (ρ_x, ρ_y) of the problem (None entries are balanced sides).
        exact: ``(θ, spec)``: the problem's (q, α, k, β, a, b) with their autograd
            history and its :class:`~flashot.autodiff.implicit.DualSpec`, when any of
            them needs a gradient (None otherwise).
    """

    def __init__(
        self,
        form: AttentionForm | LazyForm,
        f: torch.Tensor,
        g: torch.Tensor,
        log_a: torch.Tensor,
        log_b: torch.Tensor,
        eps: float,
        backend: Backend,
        x: torch.Tensor,
        y: torch.Tensor,
        rho: tuple[float | None, float | None] = (None, None),
        exact: tuple | None = None,
    ):
        # (a LazyForm: the form made again when used, not kept; see LazyForm)
        self._source, self._shape = form, (int(form.shape[0]), int(form.shape[1]))
        self._f, self._g = f.detach(), g.detach()
        self._log_a, self._log_b, self._eps, self._backend = log_a, log_b, eps, backend
        self._x, self._y, self._rho = x.detach(), y.detach(), (rho[0], rho[1])
        self._x_graph, self._y_graph = x, y  # the maps' values, differentiable
        self._exact = exact
        self._versions = self._state()

    def __getstate__(self) -> dict:
        """A snapshot for pickling: the plan's values without their autograd history."""
        state = dict(self.__dict__)
        state["_x_graph"], state["_y_graph"], state["_exact"] = self._x, self._y, None
        state["_log_a"], state["_log_b"] = self._log_a.detach(), self._log_b.detach()
        state["_source"] = self._form  # (a snapshot holds its form: nothing to rebuild from)
        del state["_versions"]
        return state

    def __setstate__(self, state: dict) -> None:
        if "_form" in state:  # (a plan pickled before its form could be made again)
            state["_source"] = state.pop("_form")
            state["_shape"] = tuple(int(s) for s in state["_source"].shape)
        self.__dict__.update(state)
        self._versions = self._state()

    def _state(self) -> tuple[int | None, ...]:
        # inference tensors keep no version counter; they cannot change in place outside
        # inference mode, where a plan's results are no one's graph either
        return tuple(None if t.is_inference() else t._version
                     for t in (self._x, self._y, self._f, self._g))  # fmt: skip

    def _check_fresh(self) -> None:
        """Raise if x, y or the potentials changed in place since the solve."""
        if self._state() != self._versions:
            names = [n for n, a, b in zip(("x", "y", "f", "g"), self._state(), self._versions,
                                          strict=True) if a != b]  # fmt: skip
            raise RuntimeError(
                f"{', '.join(names)} changed in place after the solve (e.g. an optimizer step); "
                "this plan belongs to the old values: solve again"
            )

    @property
    def backend(self) -> Backend:
        """The backend the solve ran on (its ``name`` and ``precision``)."""
        return self._backend

    @property
    def _form(self) -> AttentionForm:
        source = self._source
        return source.get() if isinstance(source, LazyForm) else source

    @property
    def shape(self) -> tuple[int, int]:
        """``(n, m)``."""
        return self._shape

    @property
    def T(self) -> TransportPlan:
        """The transposed plan ``Pᵀ`` (m × n), also lazy."""
        return TransportPlan(
            self._source.T,
            self._g,
            self._f,
            self._log_b,
            self._log_a,
            self._eps,
            self._backend,
            self._y_graph,
            self._x_graph,
            (self._rho[1], self._rho[0]),
            None if self._exact is None else _transposed(*self._exact),
        )

    def __getitem__(self, rows: slice) -> TransportPlan:
        """The rows ``P[lo:hi]`` (hi − lo, m), also lazy: products a block of rows at a time.

        ``plan[lo:hi] @ V`` streams every column for those rows only, so a product's
        output, and what is made from it, can be built a block at a time instead of
        holding all n rows. Slices of step 1 only. Not differentiable in x, y, a or b:
        a plan whose inputs need gradients refuses (its blocks would silently drop them);
        solve under ``torch.no_grad()`` or with detached inputs. Products stay
        differentiable in V.
        """
        if not isinstance(rows, slice):
            raise TypeError(f"a plan takes a slice of rows, plan[lo:hi], got {type(rows).__name__}")
        lo, hi, step = rows.indices(self.shape[0])
        if step != 1:
            raise ValueError(f"a plan's row slice must have step 1, got {rows.step}")
        if self._exact is not None:
            raise RuntimeError("row blocks of a plan are not differentiable in x, y, a or b, "
                               "which need gradients here: solve under torch.no_grad() or "
                               "with detached inputs")  # fmt: skip
        if self._source.segments is not None:
            raise ValueError("a packed batch's plan has no row blocks (slice its problems)")
        self._check_fresh()
        hi = max(lo, hi)
        out = TransportPlan(self._source.rows(lo, hi), self._f[lo:hi], self._g,
                            self._log_a[lo:hi], self._log_b, self._eps, self._backend,
                            self._x_graph[lo:hi], self._y_graph, self._rho)  # fmt: skip
        out._versions = self._versions  # (slices share their base's version counters)
        return out

    def __repr__(self) -> str:
        n, m = self.shape
        return f"TransportPlan(shape=({n}, {m}), eps={self._eps:g}, backend={self._backend.name!r})"

    def _attend(self, v: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Row masses r (n,) and the softmax averages of v (n, p)."""
        self._check_fresh()
        with torch.no_grad():
            form = self._form
            lse, out = self._backend.row_attend(form, self._g - form.beta, self._eps, v,
                                                self._log_b)  # fmt: skip
            return row_mass(self._f, lse, form.alpha, self._log_a, self._eps), out

    def _potentials(self) -> Potentials:
        return Potentials(self._form, self._f, self._g, self._log_a, self._log_b, self._eps)

    def _sums(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(r, c, m(P) − m(a) m(b))``: the marginals and the mass excess (detached).

        One fused pass, and a second at ε above the cost's bound (see
        :func:`~flashot.backends.dual.mass_excess`).
        """
        pot = self._potentials()
        with torch.no_grad():
            r, c = self._backend.marginals(pot)
            return r, c, mass_excess(self._backend, pot, r)

    def _marginal_error(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(L1 violation of both marginal conditions, ``m(P) − m(a) m(b)``)."""
        r, c, excess = self._sums()
        error = marginal_error(self._f, r, self._log_a, self._rho[0])
        return error + marginal_error(self._g, c, self._log_b, self._rho[1]), excess

    def _objectives(self) -> dict:
        r"""The primal and dual objectives at this plan and its potentials (detached).

        With the marginals ``r = P1``, ``c = Pᵀ1`` and ``μ = m(P) − m(a) m(b)``:

        .. math::

            \text{primal} = \langle r, f\rangle + \langle c, g\rangle - \varepsilon\mu
                + \rho_x \mathrm{KL}(r \| a) + \rho_y \mathrm{KL}(c \| b),
            \qquad
            \text{dual} = \langle a, \varphi_x(f)\rangle + \langle b, \varphi_y(g)\rangle
                - \varepsilon\mu,

        the first being ``⟨P, C⟩ + ε KL(P ‖ a⊗b) + ρ KL(marginals)`` (``log P`` is
        ``f ⊕ g − C`` up to the weights, so ``⟨P, C⟩`` cancels). Also returned:
        ``rf_cg = ⟨r, f⟩ + ⟨c, g⟩`` and ``μ``, from which
        ``KL(P ‖ a⊗b) = (rf_cg − ⟨P, C⟩)/ε − μ``.
        """
        f, g, eps, (rho_x, rho_y) = self._f, self._g, self._eps, self._rho
        r, c, excess = self._sums()
        with torch.no_grad():
            a, b = self._log_a.exp(), self._log_b.exp()
            rf_cg = (r * f).sum() + (c * g).sum()
            primal = rf_cg - eps * excess
            for mass, w, rho in ((r, a, rho_x), (c, b, rho_y)):
                if rho is not None:  # generalized KL(mass ‖ w), zero weights hold no mass
                    ratio = torch.where(mass > 0, torch.log(mass / w), 0.0)
                    primal = primal + rho * ((mass * ratio).sum() - mass.sum() + w.sum())
            dual = phi_sum(f, a, rho_x) + phi_sum(g, b, rho_y) - eps * excess
            return dict(primal=primal, dual=dual, rf_cg=rf_cg, excess=excess)

    def _values(self, v, name: str) -> torch.Tensor:
        if not isinstance(v, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(v).__name__}")
        m = self.shape[1]
        if v.dim() not in (1, 2) or v.shape[0] != m:
            raise ValueError(f"{name} must have shape ({m},) or ({m}, p), got {tuple(v.shape)}")
        if v.device != self._f.device:
            raise ValueError(f"{name} is on {v.device} but the plan is on {self._f.device}")
        if not v.is_floating_point():
            raise TypeError(f"{name} must have a floating dtype, got {v.dtype}")
        v = v.to(self._f.dtype)
        return v[:, None] if v.dim() == 1 else v

    @entry_point
    def __matmul__(self, v: torch.Tensor) -> torch.Tensor:
        """``P @ V`` for V of shape (m,) or (m, p); returns (n,) or (n, p) in V's dtype.

        Differentiable in V and (exactly, once) in x, y, a and b.
        """
        vv = self._values(v, "V")
        res = self._exact_product(vv) if self._needs_grad(v) else self._apply(vv)
        return (res[:, 0] if v.dim() == 1 else res).to(v.dtype)

    def _needs_grad(self, *values) -> bool:
        return torch.is_grad_enabled() and (
            self._exact is not None or any(t.requires_grad for t in values)
        )

    def _exact_product(self, vv: torch.Tensor, transpose: bool = False) -> torch.Tensor:
        """``P V`` (or ``Pᵀ V``) as a function of θ, the implicit potentials and V."""
        self._check_fresh()
        if self._exact is not None:
            theta, spec = self._exact
            z = implicit_potentials(theta, self._f, self._g, spec, check_gauge=False)
            return plan_product(theta, z, vv, spec, transpose)
        # only V needs a gradient: θ and the potentials are constants (no dual solve runs)
        form = self._form
        theta = (form.q, form.alpha, form.k, form.beta, self._log_a.exp(), self._log_b.exp())
        spec = DualSpec(self._eps, self._rho, self._backend, form.cost_bound, cg_tol=1.0)
        return plan_product(theta, (self._f, self._g), vv, spec, transpose)

    def _apply(self, vv: torch.Tensor) -> torch.Tensor:
        self._check_fresh()
        with torch.no_grad():
            return plan_times(self._backend, self._potentials(), vv)

    @entry_point
    def row_sums(self) -> torch.Tensor:
        """``P 1`` (n,): the plan's first marginal."""
        return self._attend(None)[0]

    def col_sums(self) -> torch.Tensor:
        """``Pᵀ 1`` (m,): the plan's second marginal."""
        return self.T.row_sums()

    @entry_point
    def barycentric_map(self, points: torch.Tensor | None = None) -> torch.Tensor:
        """Barycentric projection ``T(x_i) = Σ_j P_ij y_j / Σ_j P_ij`` (n, d).

        Args:
            points: optional (r, d) new source points: the map is then the entropic
                map ``Σ_j softmax_j((g_j − C(z, y_j))/ε + log b_j) y_j`` at each point z,
                which agrees with the barycentric projection on the source cloud.
        """
        self._check_fresh()
        y = self._y.to(self._f.dtype)
        if points is None:
            yg = self._y_graph.to(self._f.dtype)
            if self._needs_grad(yg):
                rows = self._exact_product(torch.cat([torch.ones_like(yg[:, :1]), yg], 1))
                return (rows[:, 1:] / rows[:, :1]).to(self._y.dtype)
            return _given(self._attend(y)[1]).to(self._y.dtype)
        if self._needs_grad(points):
            raise RuntimeError(MAP_GRADIENT)
        form = self._form
        if form.row_features is None:
            raise ValueError("this plan cannot evaluate its map at new points")
        if (
            not isinstance(points, torch.Tensor)
            or points.dim() != 2
            or points.shape[1] != self._x.shape[1]
        ):
            raise ValueError(f"points must have shape (r, {self._x.shape[1]})")
        with torch.no_grad():
            qz = form.row_features(points.detach().to(self._x.dtype))
            form_z = AttentionForm(qz, form.k, torch.zeros_like(qz[:, 0]), form.beta)
            h = self._g - form.beta
            _, avg = self._backend.row_attend(form_z, h, self._eps, y, self._log_b)
            return _given(avg).to(self._y.dtype)

    @entry_point
    def source_potential(self, points: torch.Tensor) -> torch.Tensor:
        r"""The row potential at new points: the soft c-transform of g (detached).

        .. math::

            f(z) = \lambda_x \Big(-\varepsilon \log \sum_j b_j
                \exp\big((g_j - C(z, y_j))/\varepsilon\big)\Big),

        ``λ_x = ρ_x/(ρ_x + ε)`` on a relaxed side (1 balanced): one streaming pass. On
        the cloud itself it is the solve's ``f`` once converged; with
        :meth:`barycentric_map` at new points, the entropic map of the solve (pickle
        the plan to keep it). ``plan.T.source_potential`` is g at new target points.

        Args:
            points: (r, d) new row points.

        Returns:
            (r,) potentials.
        """
        self._check_fresh()
        form = self._form
        if form.row_features is None or not hasattr(form.row_features, "offsets"):
            raise ValueError("this plan cannot evaluate its potentials at new points")
        if (not isinstance(points, torch.Tensor) or points.dim() != 2
                or points.shape[1] != self._x.shape[1]):  # fmt: skip
            raise ValueError(f"points must have shape (r, {self._x.shape[1]})")
        rho, eps = self._rho[0], self._eps
        lam = 1.0 if rho is None else rho / (rho + eps)
        with torch.no_grad():
            z = points.detach().to(self._x.dtype)
            qz, alpha_z = form.row_features(z), form.row_features.offsets(z)
            form_z = AttentionForm(qz, form.k, alpha_z, form.beta)
            lse, _ = self._backend.row_attend(form_z, self._g - form.beta, eps, None,
                                              self._log_b)  # fmt: skip
            return lam * (alpha_z - lse)

    @entry_point
    def transport_cost(self) -> torch.Tensor:
        """``⟨P, C⟩ = Σ_i r_i (α_i + E_w[β] − ⟨q_i, E_w[k]⟩)``, one streaming pass.

        Differentiable (exactly, once) in x, y, a and b: the value is this pass's, the
        derivative that of ``⟨P1, α⟩ + ⟨Pᵀ1, β⟩ − Σ_i ⟨q_i, (P k)_i⟩``.
        """
        value = self._transport_cost()
        if self._exact is None or not torch.is_grad_enabled():
            return value
        q, alpha, k, beta = self._exact[0][:4]
        rows = self._exact_product(torch.cat([torch.ones_like(beta)[:, None], k], 1))
        cols = self._exact_product(torch.ones_like(alpha)[:, None], transpose=True)
        expr = (rows[:, 0] * alpha).sum() + (cols[:, 0] * beta).sum() - (q * rows[:, 1:]).sum()
        return value + (expr - expr.detach())

    def _transport_cost(self) -> torch.Tensor:
        form = self._form
        v = torch.cat([form.k, form.beta[:, None]], dim=1)
        r, avg = self._attend(v)
        out = _given(avg)
        row_cost = form.alpha + out[:, -1] - (form.q * out[:, :-1]).sum(1)
        return (r * row_cost).sum()

    @entry_point
    def dense(self, max_elements: int = 10**7) -> torch.Tensor:
        """The full (n, m) matrix, for small problems only.

        Raises:
            ValueError: if n·m > max_elements (the point of this library is to never do this).
        """
        n, m = self.shape
        if n * m > max_elements:
            raise ValueError(
                f"dense plan of shape ({n}, {m}) has {n * m} elements > "
                f"max_elements={max_elements}; "
                "use plan @ V instead"
            )
        self._check_fresh()
        form = self._form
        log_p = (
            self._log_a[:, None]
            + self._log_b[None, :]
            + (self._f[:, None] + self._g[None, :] - form.dense()) / self._eps
        )
        return torch.exp(log_p)


MAP_GRADIENT = (
    "the entropic map at new points is not differentiable; call barycentric_map() on the "
    "cloud itself (differentiable), or compute the map under torch.no_grad()"
)


def _transposed(theta, spec):
    q, alpha, k, beta, a, b = theta
    return (k, beta, q, alpha, b, a), spec.T


@dataclass(frozen=True)
class SolveHistory:
    """What a solve recorded (``flashot.sinkhorn(..., history=True)``).

    Attributes:
        iterations: the iterations at which the L1 marginal error was measured (every
            ``check_every``, the ε schedule's warm-up included).
        eps: ε at each of them.
        errors: the error there, at the potentials of that iteration (before the final
            extrapolation: the result's :attr:`SinkhornResult.marginal_error` is after it).
        schedule: the ε schedule, one temperature per iteration; its last one is kept
            until the end.
    """

    iterations: list[int]
    eps: list[float]
    errors: list[float]
    schedule: list[float]

    def __repr__(self) -> str:
        last = f", last error {self.errors[-1]:.3e}" if self.errors else ""
        return (f"SolveHistory({len(self.iterations)} checks, {len(self.schedule)} "
                f"temperatures{last})")  # fmt: skip


@dataclass(frozen=True)
class SinkhornResult:
    """The outcome of :func:`flashot.sinkhorn` (immutable).

    Attributes:
        f: (n,) potential on x, ``P_ij = a_i b_j exp((f_i + g_j − C_ij)/ε)``.
        g: (m,) potential on y.
        cost: entropic OT value (a 0-dim tensor, differentiable w.r.t. x, y, a, b);
            ``⟨a, f⟩ + ⟨b, g⟩`` when balanced, the dual objective when relaxed.
        n_iter: Sinkhorn iterations run.
        converged: ``marginal_error <= tol`` (None when ``tol`` was None).
        eps: the final ε.
        plan: the lazy :class:`TransportPlan`.
        measured_error: the marginal error if the solve measured it (it does when it
            had a ``tol`` or a relaxed side), else None: :attr:`marginal_error` then
            measures it on first access.
        cause: why ``tol`` was missed, one of ``flashot.solver.stopping.CAUSES``
            (``"max_iter"``, ``"no_progress"``, ``"oscillation"``, ``"precision_floor"``,
            ``"eps_too_small"``, ``"final_step"``); None when converged or without tol.
            The :class:`ConvergenceWarning` says the same in words.
        history: the :class:`SolveHistory` when the solve recorded one (``history=True``).
        score_memory: bytes of n × m score matrices the solve held at once: 0 when every
            pass streamed (memory O((n + m) d)); the Triton backend's ``scores`` option
            (``"auto"`` by default) caches them where that is faster and they fit.
    """

    f: torch.Tensor
    g: torch.Tensor
    cost: torch.Tensor
    n_iter: int
    converged: bool | None
    eps: float
    plan: TransportPlan
    measured_error: float | None = None
    cause: str | None = None
    history: SolveHistory | None = None
    score_memory: int = 0

    def __getstate__(self) -> dict:
        """A snapshot for pickling (``torch.save``): values and the lazy plan, detached."""
        state = dict(self.__dict__)
        for name in ("f", "g", "cost"):
            state[name] = state[name].detach()
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)  # (frozen: no __setattr__)

    def __repr__(self) -> str:
        """One line: sizes, ε, the value and how the solve ended (no tensors printed)."""
        value = float(self.cost.detach())
        end = "" if self.cause is None else f", cause={self.cause!r}"
        if self.score_memory:
            end += f", scores cached ({self.score_memory / 2**20:.3g} MiB)"
        return (
            f"SinkhornResult(n={len(self.f)}, m={len(self.g)}, eps={self.eps:g}, "
            f"cost={value:.6g}, n_iter={self.n_iter}, converged={self.converged}{end})"
        )

    @functools.cached_property
    @entry_point
    def marginal_error(self) -> float:
        """L1 violation of the plan's marginal conditions (one streaming pass if not measured)."""
        if self.measured_error is not None:
            return self.measured_error
        return float(self.plan._marginal_error()[0])

    @functools.cached_property
    @entry_point
    def _objectives(self) -> dict:
        return self.plan._objectives()

    @property
    def primal_cost(self) -> torch.Tensor:
        """The entropic primal objective at the plan P (detached).

        ``⟨P, C⟩ + ε KL(P‖a⊗b)``, plus ``ρ KL`` of each relaxed marginal. Relaxed on
        both sides, every P is feasible: it bounds the OT value from above.
        """
        return self._objectives["primal"]

    @property
    def dual_cost(self) -> torch.Tensor:
        """The dual objective at (f, g), mass term included (detached).

        A lower bound on the OT value; :attr:`cost` up to the term ``ε (m(P) − m(a)m(b))``.
        """
        return self._objectives["dual"]

    @property
    def duality_gap(self) -> float:
        """``primal_cost − dual_cost``: 0 at the optimum.

        Relaxed on both sides it is ≥ 0 (to rounding) and bounds the distance to the OT
        value; with a balanced side it may take either sign while that marginal is off
        (balanced: ``⟨r − a, f⟩ + ⟨c − b, g⟩``).
        """
        return float(self._objectives["primal"] - self._objectives["dual"])

    @functools.cached_property
    @entry_point
    def kl(self) -> torch.Tensor:
        """``KL(P ‖ a⊗b)``, the primal's entropic term over ε (detached).

        Its absolute error is ulps of the cost over ε (cost-sized terms cancel). One
        more pass (for ``⟨P, C⟩``) than the objectives.
        """
        obj = self._objectives
        with torch.no_grad():
            return (obj["rf_cg"] - self.plan._transport_cost()) / self.eps - obj["excess"]

    @functools.cached_property
    @entry_point
    def transport_cost(self) -> torch.Tensor:
        """``⟨P, C⟩``, streamed on first access (differentiable once, exactly)."""
        return self.plan.transport_cost()
