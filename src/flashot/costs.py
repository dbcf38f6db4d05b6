r"""Ground costs, compiled to the attention form that every backend consumes.

Every supported cost is a scaled squared Euclidean distance after an embedding
``u = φ(x)`` (identity, or normalization onto the unit sphere for cosine):

.. math::

    C_{ij} = s\,\lVert u_i - v_j \rVert^2
           = \alpha_i + \beta_j - \langle q_i, k_j \rangle,
    \qquad q = \sqrt{2s}\,(u - c),\; k = \sqrt{2s}\,(v - c),\;
    \alpha = s\lVert u - c\rVert^2,\; \beta = s\lVert v - c\rVert^2,

where ``c`` is the joint mean of both embedded clouds. Centering leaves ``C``
unchanged but keeps the norms small, so float32 accuracy does not depend on
where the data sit. Nothing downstream of :func:`attention_form` knows which
cost produced the form.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

__all__ = ["COSTS", "AttentionForm", "Cost", "attention_form", "bounding_diameter", "get_cost"]


@dataclass(frozen=True)
class AttentionForm:
    """A cost matrix in attention form, ``C_ij = alpha_i + beta_j - <q_i, k_j>``.

    Attributes:
        q: (n, d') row features.
        k: (m, d') column features.
        alpha: (n,) row offsets.
        beta: (m,) column offsets.
        row_features: maps new (r, d) row points to their (r, d') features, or None;
            lets a plan extend its barycentric map to points outside the source cloud.
    """

    q: torch.Tensor
    k: torch.Tensor
    alpha: torch.Tensor
    beta: torch.Tensor
    row_features: Callable[[torch.Tensor], torch.Tensor] | None = field(default=None, compare=False)

    @property
    def T(self) -> AttentionForm:
        """The transposed form, ``C^T``: rows and columns swap roles."""
        return AttentionForm(self.k, self.q, self.beta, self.alpha, self.row_features)

    @property
    def shape(self) -> tuple[int, int]:
        """``(n, m)``, the shape of the (never materialized) cost matrix."""
        return self.q.shape[0], self.k.shape[0]

    def dense(self) -> torch.Tensor:
        """The full (n, m) cost matrix; for tests and tiny problems only."""
        return self.alpha[:, None] + self.beta[None, :] - self.q @ self.k.T

    def detach(self) -> AttentionForm:
        """The same form cut from the autograd graph."""
        return AttentionForm(
            self.q.detach(),
            self.k.detach(),
            self.alpha.detach(),
            self.beta.detach(),
            self.row_features,
        )


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


def attention_form(
    cost: Cost, x: torch.Tensor, y: torch.Tensor, dtype: torch.dtype | None = None
) -> AttentionForm:
    """Compile ``C(x_i, y_j)`` into attention form (differentiable in x and y).

    Args:
        cost: the ground cost.
        x: (n, d) source cloud.
        y: (m, d) target cloud.
        dtype: compute dtype of the form (default: x's dtype).

    Returns:
        The attention form; the joint center is detached (C does not depend on it).
    """
    dtype = dtype or x.dtype
    u, v = cost.embed(x.to(dtype)), cost.embed(y.to(dtype))
    with torch.no_grad():
        n, m = u.shape[0], v.shape[0]
        center = (u.double().sum(0) + v.double().sum(0)) / (n + m)
        center = center.to(dtype)
    u, v = u - center, v - center
    root = math.sqrt(2.0 * cost.scale)
    alpha = cost.scale * (u * u).sum(-1)
    beta = cost.scale * (v * v).sum(-1)

    def features(z: torch.Tensor) -> torch.Tensor:
        return root * (cost.embed(z.to(dtype)) - center)

    return AttentionForm(root * u, root * v, alpha, beta, features)


def bounding_diameter(cost: Cost, x: torch.Tensor, y: torch.Tensor) -> float:
    """Diagonal of the joint bounding box of the embedded clouds (GeomLoss' ``max_diameter``).

    Args:
        cost: the ground cost (its embedding is applied first).
        x: (..., d) source points.
        y: (..., d) target points.
    """
    with torch.no_grad():
        u = cost.embed(x.detach()).reshape(-1, x.shape[-1])
        v = cost.embed(y.detach()).reshape(-1, y.shape[-1])
        lo = torch.minimum(u.min(0).values, v.min(0).values)
        hi = torch.maximum(u.max(0).values, v.max(0).values)
        return float(torch.linalg.vector_norm((hi - lo).double()))
