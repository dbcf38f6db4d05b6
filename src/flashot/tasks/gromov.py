r"""Entropic Gromov–Wasserstein between point clouds, streamed: O((n + m) d) memory.

Gromov–Wasserstein compares clouds that live in different spaces (x in R^d, y in
R^{d'}) through their inner costs :math:`C^x_{ik} = |x_i - x_k|^2`,
:math:`C^y_{jl} = |y_j - y_l|^2`:

.. math::

    \mathrm{GW}(T) = \sum_{ijkl} (C^x_{ik} - C^y_{jl})^2\, T_{ij} T_{kl},
    \qquad T \in \Pi(a, b).

The entropic solver (Peyré, Cuturi & Solomon 2016; POT's
``entropic_gromov_wasserstein``) repeats: linearize GW at the current plan, solve an
entropic OT problem with that cost, take its plan. The linearized cost is

.. math::

    2 L(T)_{ij} = 2 u_i + 2 w_j - 4\, \phi(x_i)^\top M(T)\, \phi(y_j),
    \qquad M(T) = \Psi_x^\top T \Psi_y \in \mathbb{R}^{(d+2) \times (d'+2)},

with :math:`\phi(z) = (|z|^2, 1, -2z)`, :math:`\psi(z) = (1, |z|^2, z)` (so that
:math:`C^x_{ik} = \langle \phi(x_i), \psi(x_k) \rangle`), and
:math:`u_i = \sum_k a_k (C^x_{ik})^2`, :math:`w_j = \sum_l b_l (C^y_{jl})^2` from the
clouds' moments. It is a squared distance between embedded points,
:math:`|X'_i - Y'_j|^2` with :math:`X' = \lambda \phi(x)`,
:math:`Y' = 2 \phi(y) M^\top / \lambda`, plus the row and column offsets
:math:`2u - |X'|^2` and :math:`2w - |Y'|^2`, which leave a balanced plan unchanged. So
every step is one streamed :func:`flashot.sinkhorn` on (d + 2)-dimensional points and
one streamed plan product ``T Ψ_y``: nothing of size n × n, m × m or n × m is formed.

The outer iterations stop when ``M(T)`` (all the next step depends on) moves by less
than ``tol`` relative to its norm after a step solved to ``inner_tol``: a fixed point of
the iteration (POT stops on the plan's change, every 10 iterations). Steps before that
solve loosely (to 0.1 × M's last relative change, :data:`INEXACT`): the next
linearization replaces their plans anyway.

Example (a 3-D cloud against a 2-D one)::

    import torch, flashot
    x, y = torch.randn(5000, 3), torch.randn(4000, 2)
    res = flashot.gromov_wasserstein(x, y, eps=0.05, relative_eps=True)
    res.cost, res.plan @ y  # the GW value, and y's points averaged by the plan

The cosine inner cost ``1 − cos(z, z')`` (``cost="cosine"``) is bilinear too, with
``φ(z) = (1, −ẑ)``, ``ψ(z) = (1, ẑ)``: the same steps on (d + 1)-dimensional features.

With ``rho`` the problem is unbalanced GW (:func:`_solve_unbalanced`): the plan's
marginals are penalized by KL⊗ terms instead of fixed, and each step is an unbalanced
Sinkhorn solve on the same embedded points.

Limits: the squared-Euclidean and cosine inner costs; the result is not differentiable
(the iterations run without autograd); an unbalanced step folds the linearized cost's
offsets into weights ``e^{−o/(ε+ρ)}``, so ρ far below the cost's spread raises a
FloatingPointError in float32 (float64 reaches further).
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field

import torch

import flashot
from flashot.problem import check_count, check_positive, probability_weights
from flashot.solver.stopping import AUTO_TOL

__all__ = ["GromovWassersteinPlan", "GromovWassersteinResult", "gromov_wasserstein"]

#: an outer step solves its Sinkhorn problem to INEXACT × the last relative change of
#: M (at most INEXACT_MAX), and to ``inner_tol`` once that is tighter or M moved by less
#: than ``tol``: early steps, whose plans the next linearization replaces anyway, take a
#: few warm-started iterations. CPU, float64, n = 100, d = 3, relative ε 0.05: 8 120 →
#: 2 140 inner iterations, the same 47 outer steps, the value to 3e-7 (v49, NOTES.md)
INEXACT, INEXACT_MAX = 0.1, 1e-2


class GromovWassersteinPlan:
    """The GW plan T (n × m), lazy: products, marginals and maps in the clouds' own spaces.

    The solve's :class:`~flashot.TransportPlan` lives on the embedded points of the last
    linearization; this view keeps only what means the same for T (no transport cost, no
    entropic map at new points: those belong to the linearized problem).
    """

    def __init__(self, plan: flashot.TransportPlan, x: torch.Tensor, y: torch.Tensor,
                 scale: float = 1.0):  # fmt: skip
        # (unbalanced GW's plan is the last solve's, rescaled to the previous one's mass)
        self._plan, self._x, self._y, self._scale = plan, x, y, scale

    @property
    def shape(self) -> tuple[int, int]:
        """``(n, m)``."""
        return self._plan.shape

    @property
    def T(self) -> GromovWassersteinPlan:
        """``Tᵀ`` (m × n), also lazy."""
        return GromovWassersteinPlan(self._plan.T, self._y, self._x, self._scale)

    def __matmul__(self, v: torch.Tensor) -> torch.Tensor:
        """``T @ v`` for v (m,) or (m, p)."""
        return self._scale * (self._plan @ v)

    def row_sums(self) -> torch.Tensor:
        """``T 1`` (n,)."""
        return self._scale * self._plan.row_sums()

    def col_sums(self) -> torch.Tensor:
        """``Tᵀ 1`` (m,)."""
        return self._scale * self._plan.col_sums()

    def barycentric_map(self) -> torch.Tensor:
        """``Σ_j T_ij y_j / Σ_j T_ij`` (n, d'): x's points carried into y's space."""
        y = self._y.to(self._plan.row_sums().dtype)
        return (self._plan @ y) / self._plan.row_sums()[:, None]

    def dense(self, max_elements: int = 10**7) -> torch.Tensor:
        """The (n, m) matrix, for small problems."""
        return self._scale * self._plan.dense(max_elements)

    def __repr__(self) -> str:
        n, m = self.shape
        return f"GromovWassersteinPlan(n={n}, m={m})"


@dataclass(frozen=True)
class GromovWassersteinResult:
    """The entropic Gromov–Wasserstein solution.

    Attributes:
        cost: ``GW(T) = Σ_ijkl (C^x_ik − C^y_jl)² T_ij T_kl`` at the returned plan (0-dim;
            POT's ``gw_dist``); with ``rho``, the whole unbalanced objective (UGW: GW(T)
            plus its KL⊗ terms; POT's ``fugw_cost``).
        plan: the plan T, a lazy :class:`GromovWassersteinPlan` (``plan @ V``,
            ``plan.row_sums()``, ``plan.barycentric_map()``, ``plan.dense()`` when small).
        n_iter: outer iterations run (each one entropic OT solve).
        converged: the relative change of ``M(T)`` fell under ``tol``.
        errors: that relative change at every outer iteration.
        inner_iterations: Sinkhorn iterations of each outer iteration's solve.
        eps: ε of the entropic solves (balanced), or of the objective (unbalanced).
        rho: ``(ρ_x, ρ_y)`` of an unbalanced problem (None on a balanced side), or None.
    """

    cost: torch.Tensor
    plan: GromovWassersteinPlan
    n_iter: int
    converged: bool
    errors: list[float] = field(default_factory=list)
    inner_iterations: list[int] = field(default_factory=list)
    eps: float = math.nan
    rho: tuple[float | None, float | None] | None = None


def _cloud(name: str, z) -> torch.Tensor:
    if not isinstance(z, torch.Tensor):
        z = torch.as_tensor(z)
    if z.dim() != 2 or z.shape[0] == 0 or z.shape[1] == 0:
        raise ValueError(f"{name} must be a non-empty (points, dim) array, got shape "
                         f"{tuple(z.shape)}")  # fmt: skip
    if not z.dtype.is_floating_point:
        z = z.double()
    if not bool(torch.isfinite(z).all()):
        raise ValueError(f"{name} holds non-finite coordinates")
    return z


#: the inner costs, each written ``C_ik = ⟨φ(z_i), ψ(z_k)⟩`` by :func:`_features`
INNER_COSTS = ("sqeuclidean", "cosine")


def _features(z: torch.Tensor, cost: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(φ(z), ψ(z))`` with ``C(z_i, z_k) = ⟨φ(z_i), ψ(z_k)⟩``.

    ``"sqeuclidean"``: ``|z_i − z_k|²`` with ``φ = (|z|², 1, −2z)``, ``ψ = (1, |z|², z)``;
    ``"cosine"``: ``1 − ⟨ẑ_i, ẑ_k⟩`` with ``φ = (1, −ẑ)``, ``ψ = (1, ẑ)``. ψ's first
    column is 1 in both: a plan's ``T Ψ`` carries its row sums.
    """
    if cost == "cosine":
        zn = z / z.norm(dim=1, keepdim=True)
        ones = torch.ones_like(zn[:, :1])
        return torch.cat([ones, -zn], 1), torch.cat([ones, zn], 1)
    sq = (z * z).sum(1, keepdim=True)
    ones = torch.ones_like(sq)
    return torch.cat([sq, ones, -2.0 * z], 1), torch.cat([ones, sq, z], 1)


def _second_moments(phi: torch.Tensor, psi: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    r"""``u_i = Σ_k w_k C_ik² = φ_iᵀ S φ_i`` with ``S = Σ_k w_k ψ_k ψ_kᵀ`` (no n × n matrix)."""
    moments = (psi * w[:, None]).T @ psi
    return ((phi @ moments) * phi).sum(1)


def gromov_wasserstein(
    x,
    y,
    a=None,
    b=None,
    *,
    eps: float,
    rho=None,
    cost: str = "sqeuclidean",
    max_iter: int = 1000,
    tol: float = 1e-5,
    relative_eps: bool = False,
    inner_tol: float | str | None = "auto",
    inner_max_iter: int = 1000,
    backend="auto",
    precision: str = "auto",
    warn: bool = True,
) -> GromovWassersteinResult:
    r"""Entropic Gromov–Wasserstein between point clouds (see the module).

    Each outer iteration solves :math:`\min_T \langle 2L(T_{prev}), T\rangle + \varepsilon
    \mathrm{KL}(T \| a \otimes b)` (POT's ``entropic_gromov_wasserstein`` with
    ``loss_fun="square_loss"``, the same ε and the product plan ``a bᵀ`` to start from).

    Args:
        x: (n, d) points of the first space.  y: (m, d') points of the second (d' may
            differ from d); same dtype and device.
        a: (n,) weights of x, None for uniform.  b: (m,) weights of y.  Both are
            normalized to probability vectors when balanced; with ``rho`` they keep
            their mass (uniform: 1/n each).
        eps: ε of the entropic solves, in units of the linearized cost 2L (about twice
            the squared inner costs' scale squared); with ``rho``, ε of the unbalanced
            objective (units of L, POT's ``epsilon``).
        rho: None (balanced), or ρ > 0, or a pair (ρ_x, ρ_y) with None for a balanced
            side: unbalanced GW (Séjourné, Vialard & Peyré 2021, :func:`_solve_unbalanced`;
            POT's ``fused_unbalanced_gromov_wasserstein`` with ``alpha=0``,
            ``divergence="kl"``, ``reg_marginals=rho``, ``epsilon=eps``).
        cost: the inner cost of both spaces: ``"sqeuclidean"`` ``|z − z'|²`` or
            ``"cosine"`` ``1 − cos(z, z')`` (no zero points).
        max_iter: outer iterations at most.
        tol: stop when ``‖M(T) − M(T_prev)‖_F ≤ tol · ‖M(T)‖_F`` (the inner solves'
            own accuracy bounds what is reachable: ``inner_tol="auto"`` leaves changes
            of about 1e-6).
        relative_eps: ``eps`` is a fraction of the mean linearized cost at the product
            plan, ``Σ a_i b_j 2L(a bᵀ)_ij`` (the result's ``eps`` holds it multiplied
            out): a scale-free choice.
        inner_tol: the Sinkhorn solves' ``tol`` (see :func:`flashot.sinkhorn`); steps
            while M still moves by more than ``tol`` solve to 0.1 × its last relative
            change where that is looser (:data:`INEXACT`), and convergence counts only
            after a step solved to ``inner_tol`` itself.
        inner_max_iter: each Sinkhorn solve's ``max_iter``.
        backend: as :func:`flashot.sinkhorn`.  precision: as :func:`flashot.sinkhorn`.
        warn: warn (:class:`flashot.ConvergenceWarning`) when ``tol`` or an inner
            solve's tolerance was missed.

    Returns:
        A :class:`GromovWassersteinResult`.
    """
    eps, tol = check_positive(eps, "eps"), check_positive(tol, "tol", allow_zero=True)
    check_count(max_iter, "max_iter"), check_count(inner_max_iter, "inner_max_iter")
    if inner_tol is not None and not (isinstance(inner_tol, str) and inner_tol == "auto"):
        inner_tol = check_positive(inner_tol, "inner_tol", allow_zero=True)
    if cost not in INNER_COSTS:
        raise ValueError(f"cost must be one of {INNER_COSTS}, got {cost!r}")
    x, y = _cloud("x", x), _cloud("y", y)
    if cost == "cosine":
        for z, name in ((x, "x"), (y, "y")):
            if bool((z.norm(dim=1) == 0).any()):
                raise ValueError(f"{name} holds a zero point, whose cosine cost is undefined")
    if (x.dtype, x.device) != (y.dtype, y.device):
        raise ValueError(f"x and y must share dtype and device, got {x.dtype} on {x.device} "
                         f"and {y.dtype} on {y.device}")  # fmt: skip
    if relative_eps not in (True, False):
        raise TypeError(f"relative_eps must be True or False, got {relative_eps!r}")
    if rho is not None:
        rho = _rho_pair(rho)
        wa, wb = _masses("a", a, x), _masses("b", b, y)
        with torch.no_grad():
            return _solve_unbalanced(x.detach(), y.detach(), wa, wb, eps, rho, cost,
                                     relative_eps, max_iter, tol, inner_tol, inner_max_iter,
                                     backend, precision, warn)  # fmt: skip
    with torch.no_grad():
        return _solve(x.detach(), y.detach(), probability_weights("a", a, len(x), x),
                      probability_weights("b", b, len(y), y), eps, cost, relative_eps,
                      max_iter, tol, inner_tol,
                      inner_max_iter, backend, precision, warn)  # fmt: skip


def _solve(x, y, a, b, eps, cost, relative_eps, max_iter, tol, inner_tol, inner_max_iter,
           backend, precision, warn) -> GromovWassersteinResult:  # fmt: skip
    x0, y0 = x, y
    if cost == "sqeuclidean":  # (translation-invariant: centered, the moments cancel less)
        x = x - (a[:, None] * x).sum(0)
        y = y - (b[:, None] * y).sum(0)
    phi_x, psi_x = _features(x, cost)
    phi_y, psi_y = _features(y, cost)
    u, w = _second_moments(phi_x, psi_x, a), _second_moments(phi_y, psi_y, b)
    moments = torch.outer(psi_x.T @ a, psi_y.T @ b)  # M of the product plan a bᵀ
    if relative_eps:  # × Σ a_i b_j 2L_ij at the product plan
        mean = 2.0 * (a @ u + b @ w) - 4.0 * (phi_x.T @ a) @ moments @ (phi_y.T @ b)
        eps = eps * float(mean)
    errors: list[float] = []
    inner: list[int] = []
    init, offsets = None, None
    res = None
    missed_inner = 0
    converged = False
    step_tol, exact = _step_tol(inner_tol, math.inf, tol)
    for _ in range(max_iter):
        x_emb, y_emb, row_off, col_off = _embedded(phi_x, phi_y, moments, u, w)
        if init is not None and offsets is not None:  # potentials of the true cost → new embedding
            init = (init[0] + offsets[0] - row_off, init[1] + offsets[1] - col_off)
        res = flashot.sinkhorn(x_emb, y_emb, a, b, eps=eps, tol=step_tol,
                               max_iter=inner_max_iter, init=init, backend=backend,
                               precision=precision, warn=False)  # fmt: skip
        inner.append(res.n_iter)
        missed_inner += exact and res.converged is False
        init, offsets = (res.f, res.g), (row_off, col_off)
        t_psi = (res.plan @ psi_y.to(res.f.dtype)).to(x.dtype)  # T Ψ_y; column 0: T 1
        new = psi_x.T @ t_psi
        change = _relative_change(new, moments, eps)
        errors.append(change)
        moments = new
        if change <= tol and exact:
            converged = True
            break
        step_tol, exact = _step_tol(inner_tol, change, tol)
    assert res is not None
    _warn_missed(warn, converged, errors, max_iter, tol, missed_inner, inner, inner_tol,
                 inner_max_iter)  # fmt: skip
    plan = res.plan
    # GW(T) = ⟨T1, u⟩ + ⟨Tᵀ1, w⟩ − 2⟨Φ_xᵀ T Φ_y, M(T)⟩; M(T) and T1 are the last step's
    # (``moments``, ``t_psi``), the rest one more pass: T [Φ_y, w]
    extra = (plan @ torch.cat([phi_y, w[:, None]], 1).to(res.f.dtype)).to(x.dtype)
    cross = (phi_x.T @ extra[:, :-1] * moments).sum()
    value = (t_psi[:, 0] * u).sum() + extra[:, -1].sum() - 2.0 * cross
    return GromovWassersteinResult(value, GromovWassersteinPlan(plan, x0, y0), len(errors),
                                   converged, errors, inner, eps)  # fmt: skip


def _relative_change(new: torch.Tensor, old: torch.Tensor, eps: float, other: float = 0.0):
    """``max(‖new − old‖_F / ‖new‖_F, other)``; FloatingPointError when not finite."""
    size = torch.linalg.matrix_norm(new).clamp_min(torch.finfo(new.dtype).tiny)
    change = float(torch.linalg.matrix_norm(new - old) / size)
    if not (math.isfinite(change) and math.isfinite(other)):
        raise FloatingPointError(f"gromov_wasserstein: the iteration became non-finite "
                                 f"(eps={eps:g} too small for {new.dtype}?)")  # fmt: skip
    return max(change, other)


def _step_tol(inner_tol, change: float, tol: float):
    """``(the next Sinkhorn solve's tol, whether it is inner_tol)`` after M moved by ``change``.

    Loose (:data:`INEXACT` × change) while M still moves by more than ``tol`` and that is
    looser than ``inner_tol`` (``"auto"``: its :data:`~flashot.solver.stopping.AUTO_TOL`); a
    fixed iteration count (None) as asked.
    """
    if inner_tol is None or change <= tol:
        return inner_tol, True
    loose = min(INEXACT_MAX, INEXACT * change)
    asked = AUTO_TOL if inner_tol == "auto" else float(inner_tol)
    return (loose, False) if loose > asked else (inner_tol, True)


def _warn_missed(warn, converged, errors, max_iter, tol, missed_inner, inner, inner_tol,
                 inner_max_iter) -> None:  # fmt: skip
    """The ConvergenceWarnings of a solve that missed ``tol`` or an inner tolerance."""
    if warn and not converged:
        warnings.warn(f"gromov_wasserstein: the plan's moments still moved by {errors[-1]:.3g} "
                      f"(relative) after max_iter={max_iter} iterations, above tol={tol:g}",
                      flashot.ConvergenceWarning, stacklevel=4)  # fmt: skip
    if warn and missed_inner:
        warnings.warn(f"gromov_wasserstein: {missed_inner} of {len(inner)} Sinkhorn solves "
                      f"missed inner_tol={inner_tol!r} within inner_max_iter="
                      f"{inner_max_iter}", flashot.ConvergenceWarning, stacklevel=4)  # fmt: skip


def _embedded(phi_x, phi_y, moments, u, w):
    """Points whose squared distances are ``2L`` up to the returned row and column offsets."""
    y_emb = 2.0 * phi_y @ moments.T
    rx, ry = phi_x.square().sum(1).mean().sqrt(), y_emb.square().sum(1).mean().sqrt()
    lam = float((ry / rx).sqrt()) if float(rx) > 0 and float(ry) > 0 else 1.0
    x_emb, y_emb = lam * phi_x, y_emb / lam
    return (x_emb, y_emb, 2.0 * u - x_emb.square().sum(1), 2.0 * w - y_emb.square().sum(1))


def _rho_pair(rho) -> tuple[float | None, float | None]:
    """``(ρ_x, ρ_y)`` from ρ or a pair (None: a balanced side); ValueError naming ``rho``."""
    pair = tuple(rho) if isinstance(rho, (tuple, list)) else (rho, rho)
    if len(pair) != 2 or all(r is None for r in pair):
        raise ValueError(f"rho must be a positive number or a pair with at least one, got {rho!r}")
    return tuple(None if r is None else check_positive(r, "rho") for r in pair)  # type: ignore[return-value]


def _masses(name: str, w, z: torch.Tensor) -> torch.Tensor:
    """Weights that keep their mass (uniform: 1/n each), validated as probabilities are."""
    checked = probability_weights(name, w, len(z), z)  # (shape, sign, finiteness, sum > 0)
    return checked if w is None else torch.as_tensor(w).to(z).detach()


def _kl(mu: torch.Tensor, alpha: torch.Tensor) -> torch.Tensor:
    """``Σ μ log(μ / α)`` (0 where μ = 0), the KL without its mass terms."""
    return torch.xlogy(mu, mu).sum() - torch.xlogy(mu, alpha).sum()


def _tensor_kl(mu_mass, kl, alpha_mass):
    """``KL(μ⊗μ | α⊗α) = 2 m(μ) KL(μ|α) + (m(μ) − m(α))²`` from ``KL(μ|α)`` (mass terms in)."""
    return 2.0 * mu_mass * kl + (mu_mass - alpha_mass) ** 2


def _check_range(la1: torch.Tensor, lb1: torch.Tensor, dtype) -> None:
    """FloatingPointError when a step's folded weights ``e^{la1}``, ``e^{lb1}`` overflow.

    Offsets far above ε + ρ (ρ far below the spread of the linearized cost) give weights
    beyond the dtype; the step's problem is then not representable in it.
    """
    top = max(float(la1.max()), float(lb1.max()))
    limit = math.log(torch.finfo(dtype).max) - math.log(la1.numel() + lb1.numel()) - 1.0
    if not top < limit:
        raise FloatingPointError(
            f"gromov_wasserstein: an unbalanced step's weights reach e^{top:.3g}, beyond "
            f"{dtype}: rho is far below the spread of the linearized cost (take rho of the "
            "order of the mean cost, or float64)"
        )


def _solve_unbalanced(x, y, a, b, eps, rho, cost, relative_eps, max_iter, tol, inner_tol,
                      inner_max_iter, backend, precision, warn):  # fmt: skip
    r"""Unbalanced entropic GW (Séjourné, Vialard & Peyré 2021, their Algorithm 1), streamed.

    The objective, for a plan T of any mass,

    .. math::

        \mathrm{UGW}(T) = \mathrm{GW}(T) + \rho_x \mathrm{KL}^\otimes(T 1 | a)
            + \rho_y \mathrm{KL}^\otimes(T^\top 1 | b)
            + \varepsilon \mathrm{KL}^\otimes(T | a \otimes b),
        \qquad \mathrm{KL}^\otimes(\mu | \alpha) = \mathrm{KL}(\mu\otimes\mu | \alpha\otimes\alpha),

    is decreased by repeating, from ``T = a bᵀ``: with ``m = m(T)``, solve the unbalanced
    entropic OT problem of cost :math:`L(T)_{ij} + K(T)` (``L`` the GW linearization with
    ``T``'s own marginals, ``K`` the scalar :math:`\rho_x \langle T1, \log(T1/a)\rangle
    + \rho_y \langle T^\top 1, \log(T^\top 1/b)\rangle + \varepsilon \langle T, \log(T/ab)\rangle`)
    at ``(ε m, ρ m)``, and rescale its plan to mass ``√(m · m(plan))``.

    The linearized cost is ``|X'_i − Y'_j|² + o_i + o'_j`` (:func:`_embedded`). Row and
    column offsets change an unbalanced plan, yet they fold into the weights: for any
    cost ``C``, the problem with ``C + o ⊕ o'`` and weights ``(a, b)`` has the same
    plan as the one with ``C`` and weights ``a e^{−o/(ε+ρ_x)}``, ``b e^{−o'/(ε+ρ_y)}``
    (the objectives differ by a constant; a balanced side keeps its weights, its
    potential takes the offset). So each step is one :func:`flashot.sinkhorn` with
    ``rho`` on the embedded points, and one plan pass ``T [Ψ_y, Φ_y]``; its entropy
    :math:`\langle T, \log(T/ab)\rangle` follows from the potentials.
    """
    big = math.inf
    rho_x, rho_y = (big if r is None else r for r in rho)
    x0, y0 = x, y
    if cost == "sqeuclidean":
        x = x - x.mean(0)
        y = y - y.mean(0)
    phi_x, psi_x = _features(x, cost)
    phi_y, psi_y = _features(y, cost)
    log_a, log_b = torch.log(a), torch.log(b)
    mass_a, mass_b = a.sum(), b.sum()
    # the product plan a bᵀ: marginals, moments M = Ψxᵀ T Ψy, entropy ⟨T, log(T/ab)⟩ = 0
    rows, cols, mass = a * mass_b, b * mass_a, mass_a * mass_b
    moments = torch.outer(psi_x.T @ a, psi_y.T @ b)
    entropy = torch.zeros((), dtype=x.dtype, device=x.device)
    if relative_eps:  # × the mean linearized cost at the product plan, ⟨L(ab), ab⟩ / m
        u, w = _second_moments(phi_x, psi_x, rows), _second_moments(phi_y, psi_y, cols)
        mean = (rows @ u + cols @ w - 2.0 * (phi_x.T @ a) @ moments @ (phi_y.T @ b)) / mass
        eps = eps * float(mean)
    errors: list[float] = []
    inner: list[int] = []
    init = None
    missed_inner, converged = 0, False
    scale, res, cross_pass = 1.0, None, None
    step_tol, exact = _step_tol(inner_tol, math.inf, tol)
    for _ in range(max_iter):
        u, w = _second_moments(phi_x, psi_x, rows), _second_moments(phi_y, psi_y, cols)
        constant = eps * entropy
        if rho_x < big:
            constant = constant + rho_x * _kl(rows, a)
        if rho_y < big:
            constant = constant + rho_y * _kl(cols, b)
        # L = |X' − Y'|² + offsets (the embedding of 2L, halved)
        x_emb, y_emb, row_off, col_off = _embedded(phi_x, phi_y, moments / 2, u / 2, w / 2)
        row_off = row_off + constant
        e1, r1 = eps * float(mass), (rho_x * float(mass), rho_y * float(mass))
        # the share of an offset the potential holds (all of it on a balanced side)
        fold = tuple(1.0 if r == big else r / (e1 + r) for r in r1)
        if r1[0] < big and r1[1] < big:  # a constant moves freely between the sides: balance
            mid = 0.5 * (row_off.mean() - col_off.mean())
            row_off, col_off = row_off - mid, col_off + mid
        la1 = log_a - (0.0 if r1[0] == big else 1.0 / (e1 + r1[0])) * row_off
        lb1 = log_b - (0.0 if r1[1] == big else 1.0 / (e1 + r1[1])) * col_off
        _check_range(la1, lb1, x.dtype)
        if init is not None:  # the last potentials of the true cost, in this step's terms
            init = (
                init[0] - fold[0] * row_off.to(init[0]),
                init[1] - fold[1] * col_off.to(init[1]),
            )
        res = flashot.sinkhorn(x_emb, y_emb, torch.exp(la1), torch.exp(lb1), eps=e1,
                               rho=tuple(None if r == big else r for r in r1), tol=step_tol,
                               max_iter=inner_max_iter, init=init, backend=backend,
                               precision=precision, warn=False)  # fmt: skip
        inner.append(res.n_iter)
        missed_inner += exact and res.converged is False
        f, g = res.f.to(x.dtype), res.g.to(x.dtype)
        init = (res.f + fold[0] * row_off.to(res.f), res.g + fold[1] * col_off.to(res.g))
        # T' [Ψ_y, Φ_y] (column 0 of Ψ_y: the row sums) and T'ᵀ 1, then the rescaled plan
        cross_pass = (res.plan @ torch.cat([psi_y, phi_y], 1).to(res.f.dtype)).to(x.dtype)
        rows_new, cols_new = cross_pass[:, 0], res.plan.col_sums().to(x.dtype)
        mass_new = rows_new.sum()
        scale = float(torch.sqrt(mass / mass_new))
        cross_pass = scale * cross_pass
        rows_new, cols_new, mass_new = scale * rows_new, scale * cols_new, scale * mass_new
        new = psi_x.T @ cross_pass[:, : psi_y.shape[1]]
        # ⟨T, log(T/ab)⟩ with T = s a' b' e^{(f ⊕ g − C')/ε'}, C' = |X' − Y'|²:
        # ⟨T, C'⟩ = ⟨T1, |X'|²⟩ + ⟨Tᵀ1, |Y'|²⟩ − 2⟨Φxᵀ T Φy, M⟩ (Y' = Φy Mᵀ/λ, X' = λ Φx)
        cross = (phi_x.T @ cross_pass[:, psi_y.shape[1] :] * moments).sum()
        transport = rows_new @ x_emb.square().sum(1) + cols_new @ y_emb.square().sum(1) - 2 * cross
        entropy = (mass_new * math.log(scale) + rows_new @ (la1 - log_a) + cols_new @ (lb1 - log_b)
                   + (rows_new @ f + cols_new @ g - transport) / e1)  # fmt: skip
        change = _relative_change(new, moments, eps, abs(float(mass_new / mass) - 1.0))
        errors.append(change)
        moments, rows, cols, mass = new, rows_new, cols_new, mass_new
        if change <= tol and exact:
            converged = True
            break
        step_tol, exact = _step_tol(inner_tol, change, tol)
    assert res is not None and cross_pass is not None
    _warn_missed(warn, converged, errors, max_iter, tol, missed_inner, inner, inner_tol,
                 inner_max_iter)  # fmt: skip
    # UGW at the last plan T: ⟨L(T), T⟩ + ρ KL⊗ terms + ε KL⊗(T | a ⊗ b)
    u, w = _second_moments(phi_x, psi_x, rows), _second_moments(phi_y, psi_y, cols)
    gw = rows @ u + cols @ w - 2.0 * (phi_x.T @ cross_pass[:, psi_y.shape[1] :] * moments).sum()
    value = gw + eps * _tensor_kl(mass, entropy - mass + mass_a * mass_b, mass_a * mass_b)
    for r, marg, ref in ((rho_x, rows, a), (rho_y, cols, b)):
        if r < big:
            value = value + r * _tensor_kl(mass, _kl(marg, ref) - mass + ref.sum(), ref.sum())
    plan = GromovWassersteinPlan(res.plan, x0, y0, scale)
    return GromovWassersteinResult(value, plan, len(errors), converged, errors, inner, eps, rho)
