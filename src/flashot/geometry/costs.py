r"""Ground costs, compiled to the attention form that every backend consumes.

Every supported cost is a scaled squared Euclidean distance after an embedding
``u = φ(x)`` (identity, or normalization onto the unit sphere for cosine):

.. math::

    C_{ij} = s\,\lVert u_i - v_j \rVert^2
           = \alpha_i + \beta_j - \langle q_i, k_j \rangle,
    \qquad q = 2s\,(u - c),\; k = v - c,\;
    \alpha = s\lVert u - c\rVert^2,\; \beta = s\lVert v - c\rVert^2,

where ``c`` is the joint mean of both embedded clouds. Centering leaves ``C``
unchanged but keeps the norms small, so float32 accuracy does not depend on
where the data sit. Nothing downstream of :func:`attention_form` knows which
cost produced the form.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from flashot.geometry.segments import Segments

__all__ = [
    "COSTS",
    "AttentionForm",
    "Cost",
    "FeatureMap",
    "LazyForm",
    "attention_form",
    "bounding_diameter",
    "box_cost_bound",
    "box_diameter",
    "column_box",
    "column_sum",
    "get_cost",
    "joint_box",
    "joint_span",
    "round_operands",
    "self_attention_form",
]


@dataclass(frozen=True)
class AttentionForm:
    """A cost matrix in attention form, ``C_ij = alpha_i + beta_j - <q_i, k_j>``.

    Attributes:
        q: (n, d') row features.
        k: (m, d') column features.
        alpha: (n,) row offsets.
        beta: (m,) column offsets.
        row_features: maps new (r, d) row points to their (r, d') features, or None;
            lets a plan extend its maps to points outside the row cloud.
        col_features: the same for new column points (the rows of :attr:`T`).
        cost_bound: a host bound on ``max C_ij`` (None if unknown; up to the operands'
            rounding in reduced precision); backends use it to pick the near-uniform
            LSE at large ε (:mod:`flashot.backends.near`).
        segments: a :class:`~flashot.geometry.segments.Segments` packing of independent
            problems (the cost is ``+inf`` between them), or None for one problem.
    """

    q: torch.Tensor
    k: torch.Tensor
    alpha: torch.Tensor
    beta: torch.Tensor
    row_features: Callable[[torch.Tensor], torch.Tensor] | None = field(default=None, compare=False)
    col_features: Callable[[torch.Tensor], torch.Tensor] | None = field(default=None, compare=False)
    cost_bound: float | None = field(default=None, compare=False)
    segments: Segments | None = field(default=None, compare=False)

    @property
    def T(self) -> AttentionForm:
        """The transposed form, ``C^T``: rows and columns swap roles (with their feature maps)."""
        return AttentionForm(
            self.k, self.q, self.beta, self.alpha, self.col_features, self.row_features,
            self.cost_bound, None if self.segments is None else self.segments.T,
        )  # fmt: skip

    @property
    def shape(self) -> tuple[int, int]:
        """``(n, m)``, the shape of the (never materialized) cost matrix."""
        return self.q.shape[0], self.k.shape[0]

    def dense(self) -> torch.Tensor:
        """The full (n, m) cost matrix (``+inf`` between packed problems); for tests only."""
        c = self.alpha[:, None] + self.beta[None, :] - self.q @ self.k.T
        if self.segments is None:
            return c
        seg = self.segments
        same = seg.row_ids(c.device)[:, None] == seg.T.row_ids(c.device)[None, :]
        return c.masked_fill(~same, float("inf"))

    def segment(self, s: int) -> AttentionForm:
        """Problem ``s`` of a packed form, as a form of its own."""
        seg = self.segments
        assert seg is not None
        rows, cols = seg.row_slice(s), seg.col_slice(s)
        bound = self.cost_bound if seg.bounds is None else seg.bounds[s]
        return AttentionForm(self.q[rows], self.k[cols], self.alpha[rows], self.beta[cols],
                             cost_bound=bound)  # fmt: skip

    def rows(self, lo: int, hi: int) -> AttentionForm:
        """Rows ``lo:hi`` of a single problem's form (views of its operands)."""
        return AttentionForm(self.q[lo:hi], self.k, self.alpha[lo:hi], self.beta,
                             self.row_features, self.col_features, self.cost_bound)  # fmt: skip

    def detach(self) -> AttentionForm:
        """The same form cut from the autograd graph.

        Itself when it has no history: backends key conversions of q and k by identity.
        """
        if not any(t.requires_grad for t in (self.q, self.k, self.alpha, self.beta)):
            return self
        return AttentionForm(
            self.q.detach(),
            self.k.detach(),
            self.alpha.detach(),
            self.beta.detach(),
            self.row_features,
            self.col_features,
            self.cost_bound,
            self.segments,
        )


class LazyForm:
    """An attention form made again from its clouds when used, held weakly between uses.

    A plan that keeps it holds references to the clouds and the cost instead of the
    form's operands, two cloud-sized copies (OTDD: 60 000 × 804 floats each) that would
    otherwise live as long as the result. Making the form costs O((n + m) d), against
    O(n m d) for any use of the plan.

    Args:
        build: makes the form (the same one each time: a detached, deterministic compile).
        shape: its ``(n, m)``.  current: the form already made, kept weakly.
    """

    def __init__(self, build: Callable[[], AttentionForm], shape: tuple[int, int],
                 current: AttentionForm | None = None):  # fmt: skip
        self._build, self.shape = build, (int(shape[0]), int(shape[1]))
        self._ref = None if current is None else weakref.ref(current)

    def get(self) -> AttentionForm:
        """The form: the one in use if any, else made again."""
        form = None if self._ref is None else self._ref()
        if form is None:
            form = self._build()
            self._ref = weakref.ref(form)
        return form

    #: a single problem's (packed forms are kept as they are)
    segments = None

    @property
    def T(self) -> LazyForm:
        """The transposed form's, also lazy."""
        return LazyForm(lambda: self.get().T, self.shape[::-1])

    def rows(self, lo: int, hi: int) -> LazyForm:
        """Rows ``lo:hi`` (:meth:`AttentionForm.rows`), also lazy."""
        return LazyForm(lambda: self.get().rows(lo, hi), (hi - lo, self.shape[1]))


@dataclass(frozen=True)
class Cost:
    """A ground cost ``C(x, y) = scale * |φ(x) - φ(y)|²``.

    Attributes:
        name: public name (``cost=`` argument).
        scale: the factor ``s`` in front of the squared distance.
        normalize: whether ``φ`` projects onto the unit sphere (cosine cost).
    """

    name: str
    scale: float
    normalize: bool = False

    def embed(self, x: torch.Tensor) -> torch.Tensor:
        """Apply ``φ`` to a (n, d) cloud."""
        if self.normalize:
            return x / torch.linalg.vector_norm(x, dim=-1, keepdim=True)
        return x


COSTS: dict[str, Cost] = {
    "sqeuclidean": Cost("sqeuclidean", 1.0),
    "half_sqeuclidean": Cost("half_sqeuclidean", 0.5),
    "cosine": Cost("cosine", 0.5, normalize=True),
}


def get_cost(cost: str | Cost) -> Cost:
    """Look up a cost by name (``"sqeuclidean"``, ``"half_sqeuclidean"``, ``"cosine"``)."""
    if isinstance(cost, Cost):
        return cost
    if not isinstance(cost, str) or cost not in COSTS:
        raise ValueError(f"cost must be one of {sorted(COSTS)}, got {cost!r}")
    return COSTS[cost]


#: elements per block of the in-place passes (bounds their temporaries to 4 MB)
_BLOCK = 1 << 20


def _row_ranges(n: int, width: int):
    """``(lo, hi)`` row ranges of about ``_BLOCK`` elements for rows of ``width`` elements."""
    rows = max(1, _BLOCK // max(1, width))
    return ((i, min(n, i + rows)) for i in range(0, n, rows))


def _row_blocks(u: torch.Tensor):
    """Views of about ``_BLOCK`` elements covering the rows of u (n, ...)."""
    return (u[lo:hi] for lo, hi in _row_ranges(u.shape[0], u[:1].numel()))


def column_box(u: torch.Tensor) -> torch.Tensor:
    """(2, d) column minima and maxima of ``u`` (n, d), n ≥ 1, a block of rows at a time.

    NaN and ±inf reach the extremes. One reduction over all rows of a tall matrix
    stages its partial results in global memory on CUDA: a (20 000, 784) float32
    ``max(0)`` held a 462 MB workspace next to a solve's 61 MB operands (H200, torch
    2.11, the allocator's record). Blocks of rows bound that workspace by the block.
    """
    if u.shape[0] == 0:
        raise ValueError("column_box needs at least one row")
    blocks = _row_blocks(u)
    box = torch.stack(torch.aminmax(next(blocks), dim=0))
    for block in blocks:
        lo, hi = torch.aminmax(block, dim=0)
        torch.minimum(box[0], lo, out=box[0])
        torch.maximum(box[1], hi, out=box[1])
    return box


def joint_box(u: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """(2, d) the smallest box holding the rows of u (n, d) and v (m, d) (see column_box)."""
    box_u, box_v = column_box(u), column_box(v)
    return torch.stack([torch.minimum(box_u[0], box_v[0]), torch.maximum(box_u[1], box_v[1])])


def joint_span(u: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """(d,) side lengths of :func:`joint_box`."""
    lo, hi = joint_box(u, v)
    return hi - lo


def column_sum(u: torch.Tensor) -> torch.Tensor:
    """(d,) column sums of ``u`` (n, d), a block of rows at a time (see :func:`column_box`)."""
    if u.shape[0] == 0:
        return torch.zeros(u.shape[1], dtype=u.dtype, device=u.device)
    blocks = _row_blocks(u)
    total = next(blocks).sum(0)  # (one launch for a cloud within a block)
    for block in blocks:
        total += block.sum(0)
    return total


def _check_fp16_range(u: torch.Tensor, rounding) -> None:
    if rounding == torch.float16:
        lo, hi = torch.aminmax(u)
        if max(-float(lo), float(hi)) > 6.0e4:
            raise ValueError("precision='fp16' overflows: centered coordinates exceed 6e4")


def _round_block(block: torch.Tensor, rounding) -> None:
    """Round a block of coordinates in place (one block-sized temporary)."""
    if rounding == "tf32":  # keep 10 mantissa bits, round to nearest even
        bits = block.view(torch.int32)
        t = bits >> 13  # the only temporary: the rest is in place
        t.bitwise_and_(1).add_(0x0FFF)
        bits.add_(t).bitwise_and_(-0x2000)
    else:
        block.copy_(block.to(rounding))


def _round_in_place(u: torch.Tensor, rounding) -> torch.Tensor:
    """:func:`round_operands` in place on a tensor of its own, a block of rows at a time."""
    _check_fp16_range(u, rounding)
    for block in _row_blocks(u):
        _round_block(block, rounding)
    return u


def round_operands(u: torch.Tensor, rounding) -> torch.Tensor:
    """Round coordinates to the precision the matrix units will read (straight-through).

    With operands already representable in TF32/bf16/fp16, the products on tensor
    cores are exact in float32, so a reduced-precision solve is the exact (float32)
    solve between the rounded clouds: the cost stays a true squared distance.

    Args:
        u: (n, d) float32 coordinates.
        rounding: None, ``"tf32"``, ``torch.bfloat16`` or ``torch.float16``.
    """
    if rounding is None:
        return u
    with torch.no_grad():
        rounded = _round_in_place(u.detach().clone(memory_format=torch.contiguous_format), rounding)
    if not u.requires_grad:
        return rounded
    return u + (rounded - u).detach()


class _SquaredNorms(torch.autograd.Function):
    """``|w_i|²`` (…, n) of rows w (…, n, d), with a one-product backward ``2 w ⊙ ḡ``.

    ``vecdot(w, w)`` differentiates each factor apart: its double backward (an HVP)
    holds about five (n, d) temporaries at once where this one holds two.
    """

    @staticmethod
    def forward(w):
        return torch.linalg.vecdot(w, w)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(inputs[0])

    @staticmethod
    def backward(ctx, grad):
        (w,) = ctx.saved_tensors
        return w * (2 * grad).unsqueeze(-1)


def _centered(u: torch.Tensor, center: torch.Tensor, rounding, factor: float, scale: float):
    """``(factor · w, scale · |w|²)`` with ``w = round(u − c)``.

    Without autograd, one (n, d) allocation: ``w`` is rounded, measured and scaled in
    place, a block of rows at a time.
    """
    if u.requires_grad:
        w = round_operands(u - center, rounding)
        if factor == 1.0:
            return w, scale * _SquaredNorms.apply(w)
        # |w|² from q = factor · w, so that autograd keeps q alone (one (n, d) tensor, not
        # two); exact when factor is a power of two (2s ∈ {1, 2} for the shipped costs)
        q = factor * w
        return q, (scale / factor**2) * _SquaredNorms.apply(q)
    w = torch.empty_like(u)
    return w, scale * _centered_into(w, u, center, rounding, factor)


def _centered_into(w: torch.Tensor, u: torch.Tensor, center: torch.Tensor, rounding,
                   factor: float) -> torch.Tensor:  # fmt: skip
    """Write ``factor · round(u − c)`` into ``w`` (n, d), a block of rows at a time.

    ``w`` may be a view (a column range of a wider operand). Returns ``|round(u − c)|²``
    (n,). Not differentiable (the no-autograd path of :func:`_centered`).
    """
    torch.sub(u, center, out=w)
    _check_fp16_range(w, rounding)
    norms = torch.empty(w.shape[0], dtype=w.dtype, device=w.device)
    for lo, hi in _row_ranges(w.shape[0], w.shape[1]):
        block = w[lo:hi]
        if rounding is not None:
            _round_block(block, rounding)
        torch.linalg.vecdot(block, block, out=norms[lo:hi])
        if factor != 1.0:
            block.mul_(factor)
    return norms


def _joint_center(u: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The mean of both clouds' rows (no copy of either cloud).

    C does not depend on the center, which only keeps the coordinates small: a sum in
    the clouds' own precision is close enough.
    """
    return (column_sum(u) + column_sum(v)) / (u.shape[0] + v.shape[0])


def box_diameter(cost: Cost, bound: float | None) -> float | None:
    """:func:`bounding_diameter` from :func:`box_cost_bound`'s value, or None.

    For a cost whose bound is ``s |span|²`` the diagonal is ``√(bound / s)`` (up to
    rounding): no pass over the clouds, no wait for the device. None without a bound, at
    a zero one, and for costs that normalize or bound themselves.
    """
    if not bound or cost.normalize or hasattr(cost, "box_bound") or hasattr(cost, "diameter"):
        return None
    return math.sqrt(bound / cost.scale)


def box_cost_bound(cost: Cost, box_x: torch.Tensor, box_y: torch.Tensor) -> torch.Tensor:
    """A bound on ``C(x_i, y_j)`` from the clouds' bounding boxes (0-d float64, on the device).

    Args:
        cost: the ground cost.
        box_x: (2, d) coordinate minima and maxima of x.  box_y: (2, d) those of y.
    """
    if hasattr(cost, "box_bound"):
        return cost.box_bound(box_x, box_y)
    if cost.normalize:  # points on the unit sphere: |u − v|² ≤ 4
        return torch.tensor(4.0 * cost.scale, dtype=torch.float64, device=box_x.device)
    span = torch.maximum(box_x[1], box_y[1]).double() - torch.minimum(box_x[0], box_y[0]).double()
    return cost.scale * (span**2).sum()


def attention_form(
    cost: Cost,
    x: torch.Tensor,
    y: torch.Tensor,
    dtype: torch.dtype | None = None,
    rounding=None,
    cost_bound: float | None = None,
) -> AttentionForm:
    """Compile ``C(x_i, y_j)`` into attention form (differentiable in x and y).

    The scales sit on the row side, ``q = 2s (u − c)`` and ``k = v − c``: 2s is 1 or 2
    for every cost here, so rounded operands stay exactly representable. Without
    autograd the form costs one copy of each cloud and no larger temporary.

    Args:
        cost: the ground cost.
        x: (n, d) source cloud.
        y: (m, d) target cloud.
        dtype: compute dtype of the form (default: x's dtype).
        rounding: operand rounding of reduced-precision modes (see :func:`round_operands`).
        cost_bound: a bound on the cost (:func:`box_cost_bound`) when the caller has one;
            else it is measured here, with one wait for the device.

    Returns:
        The attention form; the joint center is detached (C does not depend on it).
    """
    if hasattr(cost, "compile"):  # costs with more than features (flashot.geometry.labeled)
        return cost.compile(x, y, dtype, rounding, cost_bound)
    dtype = dtype or x.dtype
    u, v = cost.embed(x.to(dtype)), cost.embed(y.to(dtype))
    with torch.no_grad():
        center = _joint_center(u.detach(), v.detach())
    q, alpha = _centered(u, center, rounding, 2.0 * cost.scale, cost.scale)
    k, beta = _centered(v, center, rounding, 1.0, cost.scale)
    return _assembled(cost, center, (q, k, alpha, beta), rounding, dtype, cost_bound, x, y)


def _assembled(cost: Cost, center: torch.Tensor, parts: tuple, rounding, dtype: torch.dtype,
               cost_bound: float | None, x: torch.Tensor, y: torch.Tensor | None = None,
               ) -> AttentionForm:  # fmt: skip
    """The form of centered ``parts = (q, k, α, β)``, with its feature maps and bound.

    ``cost_bound`` None: measured from the boxes of x and y (y None: x's serves both).
    """
    if cost_bound is None:
        box_x = column_box(x.detach())
        box_y = box_x if y is None else column_box(y.detach())
        cost_bound = float(box_cost_bound(cost, box_x, box_y))
    row_features = FeatureMap(cost, center, 2.0 * cost.scale, rounding, dtype)
    col_features = FeatureMap(cost, center, 1.0, rounding, dtype)
    q, k, alpha, beta = parts
    return AttentionForm(q, k, alpha, beta, row_features, col_features, cost_bound)


def self_attention_form(
    cost: Cost,
    x: torch.Tensor,
    dtype: torch.dtype | None = None,
    rounding=None,
    cost_bound: float | None = None,
) -> AttentionForm:
    """``attention_form(cost, x, x.detach(), ...)`` (a self problem's) from one centering.

    The column side is the row side's detached copy: ``k = q / 2s`` (a power of two, so
    exact, and no copy when 2s = 1) and ``β = α``, which is what the column side's own
    centering computes; the form is exactly symmetric. Costs with their own ``compile``
    take :func:`attention_form`.

    Args:
        cost, dtype, rounding, cost_bound: as in :func:`attention_form`.
        x: (n, d) the cloud; gradients flow to the row side only.
    """
    if hasattr(cost, "compile"):
        return attention_form(cost, x, x.detach(), dtype, rounding, cost_bound)
    dtype = dtype or x.dtype
    u = cost.embed(x.to(dtype))
    with torch.no_grad():
        center = column_sum(u.detach()) / u.shape[0]  # (the joint center of (u, u), exactly)
    two_s = 2.0 * cost.scale
    q, alpha = _centered(u, center, rounding, two_s, cost.scale)
    k = q.detach() if two_s == 1.0 else q.detach() / two_s
    return _assembled(cost, center, (q, k, alpha, alpha.detach()), rounding, dtype, cost_bound, x)


@dataclass(frozen=True, eq=False)
class FeatureMap:
    """New points' features in a form: ``z ↦ factor · round(φ(z) − center)`` (picklable).

    Attributes:
        cost: the ground cost (its embedding φ).  center: (d,) the form's joint center.
        factor: 2s on the row side, 1 on the column side.
        rounding: the form's operand rounding.  dtype: its compute dtype.
    """

    cost: Cost
    center: torch.Tensor
    factor: float
    rounding: object
    dtype: torch.dtype

    def __call__(self, z: torch.Tensor) -> torch.Tensor:
        """(r, d) points ↦ (r, d) features."""
        return self._both(z)[0]

    def offsets(self, z: torch.Tensor) -> torch.Tensor:
        """(r, d) points ↦ (r,) offsets ``s |round(φ(z) − center)|²`` (α or β of the form)."""
        return self._both(z)[1]

    def _both(self, z: torch.Tensor):
        # the form's own arithmetic: new points get what the cloud's points got
        embedded = self.cost.embed(z.to(self.dtype))
        return _centered(embedded, self.center, self.rounding, self.factor, self.cost.scale)


def bounding_diameter(cost: Cost, x: torch.Tensor, y: torch.Tensor) -> float:
    """Diagonal of the joint bounding box of the embedded clouds (GeomLoss' ``max_diameter``).

    Args:
        cost: the ground cost (its embedding is applied first).
        x: (..., d) source points.
        y: (..., d) target points.
    """
    if hasattr(cost, "diameter"):
        return cost.diameter(x, y)
    with torch.no_grad():
        u = cost.embed(x.detach()).reshape(-1, x.shape[-1])
        v = cost.embed(y.detach()).reshape(-1, y.shape[-1])
        return float(torch.linalg.vector_norm(joint_span(u, v).double()))
