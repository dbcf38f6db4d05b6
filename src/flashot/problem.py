"""Validated inputs of an entropic OT problem.

Everything a user can get wrong is checked here, once, with an error that names
the argument. Downstream code assumes what this module guarantees: finite
clouds of one dtype on one device, nonnegative weights with positive mass, ε > 0.

Weights: for balanced OT both measures are normalized to probability vectors
(so unnormalized weights are accepted and only their ratios matter). With a
marginal relaxation ``rho`` the masses are kept as given, since unbalanced OT
depends on them.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from flashot.autodiff.functional import TRANSFORM_HELP
from flashot.backends import resolve_backend
from flashot.backends.base import Backend
from flashot.geometry.costs import (
    AttentionForm,
    Cost,
    _row_ranges,
    attention_form,
    box_cost_bound,
    column_box,
    get_cost,
)
from flashot.geometry.segments import Segments

__all__ = [
    "DeviceChecks",
    "Problem",
    "check_cloud",
    "check_eps_range",
    "check_init",
    "check_positive",
    "cloud_tensor",
    "eps_range",
    "make_problem",
    "mean_costs",
    "parse_rho",
    "read_finite",
    "weights_tensor",
]

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype rule: what a solve computes in and returns, for inputs of ``dtype``.

    float64 inputs compute in float64; float32, bfloat16 and float16 inputs in float32.
    Every value and potential returned (``cost``, ``f``, ``g``, ``transport_cost``,
    divergences, ``SamplesLoss`` values and potentials, OTDD distances) has this dtype:
    the precision it was computed at, since a debiased value rounded to bfloat16 would
    keep 2–3 digits. Tensors in the inputs' spaces follow those: gradients have their
    input's dtype, ``plan @ V`` V's, maps and HVPs the clouds'.
    """
    return torch.float64 if dtype == torch.float64 else torch.float32


def check_positive(value, name: str, allow_zero: bool = False) -> float:
    """A finite real number > 0 (or ≥ 0), as float; else ValueError naming ``name``."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"{name} must be a scalar, got a tensor of shape {tuple(value.shape)}")
        if value.requires_grad and torch.is_grad_enabled():  # (it would be read as a constant)
            raise ValueError(f"{name} is a tensor that requires grad, and flashot does not "
                             f"differentiate with respect to {name}: pass a number (or "
                             f"{name}.detach()) to use it as a constant")  # fmt: skip
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__}")
    value = float(value)
    if not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
        bound = "≥ 0" if allow_zero else "> 0"
        raise ValueError(f"{name} must be finite and {bound}, got {value}")
    return value


def check_count(value, name: str) -> int:
    """A positive integer (not a bool); else ValueError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return value


def probability_weights(name: str, w, size: int, like: torch.Tensor) -> torch.Tensor:
    """(size,) weights normalized to sum 1, in ``like``'s dtype and device (uniform if None).

    ValueError naming ``name`` unless they are finite, non-negative, with a positive sum.
    """
    if w is None:
        return torch.full((size,), 1.0 / size, dtype=like.dtype, device=like.device)
    w = torch.as_tensor(w).to(device=like.device, dtype=like.dtype).detach()
    if w.shape != (size,):
        raise ValueError(f"{name} must have shape ({size},), got {tuple(w.shape)}")
    if not bool(torch.isfinite(w).all()) or bool((w < 0).any()) or float(w.sum()) <= 0:
        raise ValueError(f"{name} must be finite, non-negative weights with a positive sum")
    return w / w.sum()


class DeviceChecks:
    """Checks of tensor values, resolved together with one wait for the device.

    Each wait costs tens of microseconds on a GPU, as much as a small solve's
    iterations, so the inputs' checks queue their tensors and :meth:`verify` reads
    them all at once (one copy to the host), then runs each check's test on the host
    values in the order queued, raising the first failure's error. Reading values
    (a box's extremes, weights' least and largest) and testing them on the host costs
    fewer device launches than forming each verdict on the device.
    """

    def __init__(self):
        #: queued (tensors, test): ``test(host values)`` returns the error or None
        self._items: list[tuple[tuple[torch.Tensor, ...], Callable | None]] = []
        self._host: list[torch.Tensor] = []

    def read(self, values, test=None) -> int:
        """Queue a tensor (or a tuple of tensors) for the host; returns its handle.

        ``test``: None, or ``test(values)`` on the host values (a 1-d float64 CPU tensor,
        the tensors' elements in order) returning the exception to raise or None.
        After :meth:`verify`, :meth:`host` gives the values.
        """
        tensors = values if isinstance(values, tuple) else (values,)
        self._items.append((tuple(t.detach() for t in tensors), test))
        return len(self._items) - 1

    def add(self, ok: torch.Tensor, error: Exception) -> None:
        """Queue a 0-d boolean verdict and the error to raise when it is False."""
        self.read(ok, lambda v: None if bool(v[0]) else error)

    def host(self, handle: int) -> torch.Tensor:
        """The host values of a :meth:`read` handle (after :meth:`verify`): 1-d float64."""
        return self._host[handle]

    def verify(self) -> None:
        """Wait once for every queued tensor; raise the first failed check's error.

        Tensors of one dtype are concatenated before their one conversion to float64,
        so the read costs a few launches however many checks are queued; the host
        values stay a CPU tensor (no Python float per element: a box is 2·d values).
        """
        if not self._items:
            return
        if self._items[0][0][0].is_cuda and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                "flashot cannot run inside a CUDA graph capture: it checks its inputs and "
                "results on the host. Fixed-iteration solves (tol=None) of launch-bound size "
                "are replayed as CUDA graphs by flashot itself"
            )
        flat = [t.reshape(-1) for tensors, _ in self._items for t in tensors]
        groups: dict[torch.dtype, list[int]] = {}
        for i, t in enumerate(flat):
            groups.setdefault(t.dtype, []).append(i)
        parts, starts, at = [], [0] * len(flat), 0
        for members in groups.values():
            block = flat[members[0]] if len(members) == 1 else torch.cat([flat[i] for i in members])
            parts.append(block.to(torch.float64))
            for i in members:
                starts[i], at = at, at + flat[i].numel()
        read = (parts[0] if len(parts) == 1 else torch.cat(parts)).cpu()
        self._host, k = [], 0
        for tensors, _ in self._items:
            pieces = [
                read[starts[i] : starts[i] + flat[i].numel()] for i in range(k, k + len(tensors))
            ]
            k += len(tensors)
            self._host.append(pieces[0] if len(pieces) == 1 else torch.cat(pieces))
        for (_, test), values in zip(self._items, self._host, strict=True):
            error = None if test is None else test(values)
            if error is not None:
                raise error


def finite_or(error: Exception) -> Callable[[torch.Tensor], Exception | None]:
    """A :meth:`DeviceChecks.read` test: ``error`` unless every host value is finite."""
    return lambda values: None if bool(torch.isfinite(values).all()) else error


def read_finite(f: torch.Tensor, g: torch.Tensor, errors: torch.Tensor | None = None):
    """The host values of ``errors`` (None: None), after checking f, g and them finite.

    One device read. FloatingPointError when a potential or an error is NaN or
    infinite: the potentials' float64 sum is finite exactly when each of them is (a
    float32 sum cannot overflow it; a float64 one only at potentials beyond 1e300, which
    no solve the ε range admits reaches), three launches instead of an elementwise test.
    """
    diverged = FloatingPointError("Sinkhorn produced non-finite potentials; try a larger eps, "
                                  "an eps_schedule, or float64 inputs")  # fmt: skip
    finite = finite_or(diverged)
    checks = DeviceChecks()
    checks.read(f.sum(dtype=torch.float64) + g.sum(dtype=torch.float64), finite)
    at = None if errors is None else checks.read(errors, finite)
    checks.verify()
    return None if at is None else checks.host(at).tolist()


def eps_range(cost_bound: float, dtype: torch.dtype) -> tuple[float, float]:
    """``(lo, hi)``: the temperatures a solve in ``dtype`` supports for costs up to ``cost_bound``.

    Below ``lo`` the scores ``C/ε`` leave the dtype's range (``√max`` keeps sums of
    products of them finite); above ``hi``, ``1/ε`` falls into subnormals and the scores
    lose their digits.
    """
    info = torch.finfo(dtype)
    return cost_bound / math.sqrt(info.max), info.max**0.75


def check_eps_range(eps: float, cost_bound: float | None, dtype: torch.dtype, name: str) -> None:
    """ValueError naming ``name`` when ``eps`` is outside :func:`eps_range`.

    Without a bound on the cost there is no lower limit.
    """
    bound = 0.0 if cost_bound is None else cost_bound
    lo, hi = eps_range(bound, dtype)
    if not lo <= eps <= hi:
        raise ValueError(
            f"{name}={eps:g} is outside the range {dtype} supports for these points "
            f"({lo:.3g} ≤ {name} ≤ {hi:.3g}, the costs reaching {bound:.3g}): scores C/eps "
            "would overflow or lose all their digits; rescale the data or use float64"
        )


def cloud_tensor(x):
    """A numpy array as a CPU tensor sharing its memory; anything else unchanged."""
    return torch.from_numpy(np.ascontiguousarray(x)) if isinstance(x, np.ndarray) else x


def weights_tensor(w, like: torch.Tensor, name: str):
    """Numpy weights as a tensor of their cloud's dtype and device; others unchanged.

    (Numpy has no device and defaults to float64: the cloud decides both.)
    """
    if not isinstance(w, np.ndarray):
        return w
    if not np.issubdtype(w.dtype, np.floating):
        raise TypeError(f"{name} must hold floats, got numpy dtype {w.dtype}")
    return torch.as_tensor(np.ascontiguousarray(w), dtype=like.dtype, device=like.device)


def check_cloud(x, name: str, checks: DeviceChecks) -> tuple[torch.Tensor, int]:
    """A finite (n, d) floating-point tensor with n, d ≥ 1, and its bounding box's handle.

    The finiteness test goes to ``checks``. Returns ``(x, box)``: ``box`` the
    :meth:`DeviceChecks.read` handle of the (2, d) coordinate minima and maxima, whose
    host values ``checks.host(box)`` gives after :meth:`DeviceChecks.verify`. A numpy
    array is taken as a CPU tensor (sharing its memory).
    """
    x = cloud_tensor(x)
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must have a floating dtype {FLOAT_DTYPES}, got {x.dtype}")
    if x.dim() != 2:
        raise ValueError(f"{name} must have shape (n, d), got {tuple(x.shape)}")
    if x.shape[0] == 0 or x.shape[1] == 0:
        raise ValueError(f"{name} must be non-empty, got shape {tuple(x.shape)}")
    # NaN and ±inf reach the extremes: no (n, d) temporary
    box = column_box(x.detach())
    return x, checks.read(box, finite_or(ValueError(f"{name} contains NaN or infinite values")))


def check_weights(w, n: int, like: torch.Tensor, name: str, checks: DeviceChecks) -> torch.Tensor:
    """Nonnegative finite (n,) weights with positive total; uniform when ``w`` is None.

    The value checks go to ``checks``.
    """
    if w is None:
        return torch.full((n,), 1.0 / n, dtype=like.dtype, device=like.device)
    w = weights_tensor(w, like, name)
    if not isinstance(w, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor or None, got {type(w).__name__}")
    if w.dim() == 2 and w.shape[1] == 1:
        w = w[:, 0]
    if w.dim() != 1 or w.shape[0] != n:
        raise ValueError(f"{name} must have shape ({n},) to match its cloud, got {tuple(w.shape)}")
    if w.device != like.device:
        raise ValueError(f"{name} is on {w.device} but its cloud is on {like.device}")
    if w.dtype != like.dtype:
        raise TypeError(f"{name} has dtype {w.dtype} but its cloud has dtype {like.dtype}")
    # NaN and ±inf reach the extremes; the host tests them (fewer launches than verdicts)
    checks.read(tuple(torch.aminmax(w.detach())), lambda v: _weight_error(name, *v.tolist()))
    return w


def _weight_error(name: str, lo: float, hi: float) -> ValueError | None:
    """The error of weights whose least and largest entries are ``lo``, ``hi``, or None."""
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return ValueError(f"{name} contains NaN or infinite values")
    if lo < 0:
        return ValueError(f"{name} has negative entries; weights must be nonnegative")
    if not hi > 0:
        return ValueError(f"{name} sums to zero; at least one weight must be positive")
    return None


def parse_rho(rho) -> tuple[float | None, float | None]:
    """``rho`` as ``(rho_x, rho_y)``: from None, a float, or a pair (None entries stay balanced)."""
    if rho is None:
        return None, None
    if isinstance(rho, Sequence) and not isinstance(rho, str):
        if len(rho) != 2:
            raise ValueError(f"rho must be a float or a pair (rho_x, rho_y), got {rho!r}")
        rx, ry = (None if r is None else check_positive(r, "rho") for r in rho)
        return rx, ry
    r = check_positive(rho, "rho")
    return r, r


@dataclass(frozen=True)
class Problem:
    """One validated EOT problem between ``(a, x)`` and ``(b, y)``.

    Attributes:
        x: (n, d) source cloud as given (keeps its autograd history).
        y: (m, d) target cloud as given.
        a: (n,) source weights (normalized when balanced), compute dtype.
        b: (m,) target weights, compute dtype.
        eps: entropic regularization ε > 0.
        rho_x: KL relaxation of the source marginal, None when balanced.
        rho_y: KL relaxation of the target marginal, None when balanced.
        cost: the ground cost.
        form: the cost in attention form (compute dtype, differentiable in x, y).
        engine: the backend that streams it.
    """

    x: torch.Tensor
    y: torch.Tensor
    a: torch.Tensor
    b: torch.Tensor
    eps: float
    rho_x: float | None
    rho_y: float | None
    cost: Cost
    form: AttentionForm
    engine: Backend

    @property
    def balanced(self) -> bool:
        """True when neither marginal is relaxed."""
        return self.rho_x is None and self.rho_y is None

    @property
    def log_a(self) -> torch.Tensor:
        """(n,) log source weights (``-inf`` where a weight is 0), detached."""
        return torch.log(self.a.detach())

    @property
    def log_b(self) -> torch.Tensor:
        """(m,) log target weights, detached."""
        return torch.log(self.b.detach())

    def damping(self, eps: float) -> tuple[float, float]:
        """Unbalanced damping ``λ = ρ / (ρ + ε)`` of the (f, g) updates at temperature ε."""
        lam = [1.0 if r is None else r / (r + eps) for r in (self.rho_x, self.rho_y)]
        return lam[0], lam[1]


def make_problem(
    x,
    y,
    a=None,
    b=None,
    *,
    eps,
    cost="sqeuclidean",
    rho=None,
    normalize: bool = True,
    backend="auto",
    precision: str = "auto",
    relative_eps: bool = False,
) -> Problem:
    """Validate the user's inputs and build a :class:`Problem`.

    Args:
        x: (n, d) source points.
        y: (m, d) target points (same d, dtype and device as x).
        a: (n,) nonnegative source weights, or None for uniform.
        b: (m,) nonnegative target weights, or None for uniform.
        eps: ε > 0.
        cost: a cost name or :class:`~flashot.geometry.costs.Cost`.
        rho: None, a float, or a pair ``(rho_x, rho_y)``.
        normalize: rescale balanced weights to probability vectors (GeomLoss does not).
        backend: backend name or instance (see :func:`flashot.backends.resolve_backend`).
        precision: precision mode; reduced modes round the clouds once, here.
        relative_eps: ``eps`` is relative to the mean cost (:func:`mean_costs`); the
            problem holds the absolute one.
    """
    if not isinstance(relative_eps, bool):
        raise TypeError(f"relative_eps must be True or False, got {relative_eps!r}")
    if torch._C._are_functorch_transforms_active():  # an entry point with no functional path
        raise RuntimeError(TRANSFORM_HELP.format(what="a torch.func transform of this call"))
    checks = DeviceChecks()  # the value checks wait for the device once, at the end
    (x, box_x), (y, box_y) = check_cloud(x, "x", checks), check_cloud(y, "y", checks)
    if x.device != y.device:
        raise ValueError(f"x is on {x.device} but y is on {y.device}")
    if x.dtype != y.dtype:
        raise TypeError(f"x has dtype {x.dtype} but y has dtype {y.dtype}")
    if x.shape[1] != y.shape[1]:
        raise ValueError(
            f"x and y must have the same feature dimension, got {x.shape[1]} and {y.shape[1]}"
        )
    eps = check_positive(eps, "eps")
    cost = get_cost(cost)
    rho_x, rho_y = parse_rho(rho)
    if cost.normalize:
        for cloud, name in ((x, "x"), (y, "y")):
            nonzero = (torch.linalg.vector_norm(cloud.detach(), dim=1) > 0).all()
            checks.add(
                nonzero, ValueError(f"{name} has a zero vector; the cosine cost is undefined there")
            )
    a = check_weights(a, x.shape[0], x, "a", checks)
    b = check_weights(b, y.shape[0], y, "b", checks)
    checks.verify()
    host_boxes = [checks.host(h).view(2, -1) for h in (box_x, box_y)]  # (float64 copies)
    bound = float(box_cost_bound(cost, *host_boxes))
    dtype = compute_dtype(x.dtype)
    a, b = a.to(dtype), b.to(dtype)
    if normalize and rho_x is None and rho_y is None:
        a, b = a / a.sum(), b / b.sum()
    engine = resolve_backend(backend, x.device, precision, dtype)
    form = attention_form(cost, x, y, dtype, engine.rounding, bound)
    if relative_eps:
        mean = float(mean_costs(form, a, b)[0])
        if not mean > 0:
            raise ValueError(f"relative_eps needs a positive mean cost, got {mean:g} "
                             "(coinciding points?): pass an absolute eps")  # fmt: skip
        eps = eps * mean
    check_eps_range(eps, form.cost_bound, dtype, "eps")
    return Problem(x, y, a, b, eps, rho_x, rho_y, cost, form, engine)


def mean_costs(form, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``Σ_ij a_i b_j C_ij / (m(a) m(b))`` per problem, the weighted mean cost, in closed form.

    In attention form ``C_ij = α_i + β_j − ⟨q_i, k_j⟩`` it is
    ``⟨â, α⟩ + ⟨b̂, β⟩ − ⟨qᵀâ, kᵀb̂⟩`` with weights normalized within each problem:
    O((n + m) d), no pass (OTT's ``relative_epsilon="mean"`` scale). (B,) float64 on the
    host for a packed form (:mod:`flashot.geometry.segments`), (1,) for one problem; waits for
    the device.
    """
    seg = form.segments or Segments((0, len(a)), (0, len(b)))
    wa, wb = a.detach().double(), b.detach().double()
    rows, cols = seg.sum, seg.T.sum
    wa = wa / rows(wa)[seg.row_ids(wa.device)]
    wb = wb / cols(wb)[seg.T.row_ids(wb.device)]
    offsets = rows(wa * form.alpha.detach().double()) + cols(wb * form.beta.detach().double())
    qa = _weighted_rows(seg, wa, form.q.detach())
    kb = _weighted_rows(seg.T, wb, form.k.detach())
    return (offsets - (qa * kb).sum(1)).cpu()


def _weighted_rows(seg: Segments, w: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """``Σ_i w_i u_i`` per problem (B, d) in float64, a block of rows at a time.

    A float64 copy of a whole operand would be two clouds (OTDD at 60k: 380 MB each).
    """
    out = torch.zeros(seg.count, u.shape[1], dtype=torch.float64, device=u.device)
    ids = seg.row_ids(u.device)
    for lo, hi in _row_ranges(u.shape[0], u.shape[1]):
        out.index_add_(0, ids[lo:hi], w[lo:hi, None] * u[lo:hi].double())
    return out


def check_init(init, a: torch.Tensor, b: torch.Tensor):
    """``init`` checked against the weights ``a`` (n,), ``b`` (m,): (f, g) detached, or None."""
    if init is None:
        return None
    if not (isinstance(init, Sequence) and len(init) == 2):
        raise TypeError("init must be None or a pair (f, g) of tensors")
    out = []
    for pot, like, name in zip(init, (a, b), ("init[0] (f)", "init[1] (g)"), strict=True):
        if not isinstance(pot, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor")
        if pot.shape != like.shape:
            raise ValueError(f"{name} must have shape {tuple(like.shape)}, got {tuple(pot.shape)}")
        if pot.device != like.device:
            raise ValueError(f"{name} is on {pot.device} but the data is on {like.device}")
        if not bool(torch.isfinite(pot).all()):
            raise ValueError(f"{name} contains NaN or infinite values")
        out.append(pot.detach().to(like.dtype))
    return tuple(out)
