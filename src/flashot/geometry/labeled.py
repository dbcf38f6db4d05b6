r"""Costs between labeled points: a feature cost plus a table of label-to-label costs.

A point carries its label's index in its last column, ``(x, c)``, and

.. math::

    C((x, c), (y, c')) = \lambda_x\, s \lVert x - y\rVert^2 + \lambda_y\, T_{c c'},

for a (K, K) table ``T ≥ 0`` over all labels of both clouds (OTDD's augmented cost,
with ``T = W²`` between the classes). It compiles to attention form exactly, with
K more features per point,

.. math::

    q_i = \big(2\lambda_x s\,(x_i - \mu),\; -\lambda_y T_{c_i,\cdot}\big),\qquad
    k_j = \big(y_j - \mu,\; e_{c'_j}\big),

so ``⟨q_i, k_j⟩`` picks ``−λ_y T[c_i, c'_j]`` out of the table and every backend
streams it like any other cost: nothing of size n × m exists, and gradients reach
the features (the label column gets none).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import torch

from flashot.geometry.costs import (
    COSTS,
    AttentionForm,
    Cost,
    FeatureMap,
    _joint_center,
    column_box,
    get_cost,
    joint_span,
    round_operands,
)
from flashot.geometry.labeled_operands import augmented_rows

__all__ = ["LabeledCost", "labeled_cost"]


@dataclass(frozen=True, eq=False)
class LabeledCost(Cost):
    """``λ_x · base(x, y) + λ_y · table[c, c']`` between points ``(x, c)`` (see module).

    Build it with :func:`labeled_cost`. Attributes: ``table`` (K, K), ``lambda_y``,
    ``base`` (the feature cost, λ_x folded into ``scale``), ``labels_x``/``labels_y``
    (None, or the labels of plain feature clouds: :meth:`with_labels`).
    """

    table: torch.Tensor = field(default=None, repr=False)  # type: ignore[assignment]  # (always set)
    lambda_y: float = 1.0
    base: Cost = COSTS["sqeuclidean"]
    labels_x: torch.Tensor | None = field(default=None, repr=False)
    labels_y: torch.Tensor | None = field(default=None, repr=False)

    def with_labels(self, labels_x, labels_y) -> LabeledCost:
        """This cost between plain feature clouds x (n, d) and y (m, d) with these labels.

        The points then carry no label column, so no (n, d + 1) labeled copy of a cloud
        is made (what :mod:`flashot.tasks.otdd` and the flows use at scale). New points given
        to a plan's feature maps still carry their label in the last column.

        Args:
            labels_x: (n,) integer indices into the table.  labels_y: (m,) the same.
        """
        k = self.table.shape[0]
        out = []
        for lab, name in ((labels_x, "labels_x"), (labels_y, "labels_y")):
            lab = torch.as_tensor(lab)
            bad = lab.dim() != 1 or lab.is_floating_point() or lab.is_complex()
            if bad or (lab.numel() and not bool(((lab >= 0) & (lab < k)).all())):
                raise ValueError(f"{name} must be a 1-D integer tensor of indices 0 … {k - 1}")
            out.append(lab.long())
        return dataclasses.replace(self, labels_x=out[0], labels_y=out[1])

    def split(self, x: torch.Tensor, name: str,
              labels: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """(features (n, d), label indices (n,) int64) of labeled points (n, d + 1).

        Or of plain features (n, d) whose ``labels`` the cost holds.
        """
        if labels is not None:
            if x.dim() != 2 or x.shape[0] != labels.shape[0]:
                raise ValueError(f"{name} must be ({labels.shape[0]}, d) features: this cost "
                                 f"holds its labels, got shape {tuple(x.shape)}")  # fmt: skip
            return x, labels.to(x.device)
        if x.dim() != 2 or x.shape[1] < 2:
            raise ValueError(f"{name} must be (n, d + 1) with labels in its last column, "
                             f"got shape {tuple(x.shape)}")  # fmt: skip
        lab = x[:, -1].detach()
        k = self.table.shape[0]
        if not bool(((lab == lab.round()) & (lab >= 0) & (lab < k)).all()):
            raise ValueError(f"{name}'s last column must hold label indices 0 … {k - 1} "
                             "(integers into the cost's table)")  # fmt: skip
        return x[:, :-1], lab.long()

    def _features(self, t: torch.Tensor) -> torch.Tensor:
        """The feature columns of points (or of their bounding boxes) as this cost takes them."""
        return t if self.labels_x is not None else t[:, :-1]

    def compile(self, x, y, dtype, rounding, cost_bound) -> AttentionForm:
        """The attention form of labeled clouds (``costs.attention_form`` delegates here).

        q and k are built in one allocation each, features and label parts together
        (:func:`~flashot.geometry.labeled_operands.augmented_rows`): no centered or concatenated
        temporary of a cloud's size.
        """
        (fx, lx), (fy, ly) = self.split(x, "x", self.labels_x), self.split(y, "y", self.labels_y)
        dtype = dtype or x.dtype
        u, v = fx.to(dtype), fy.to(dtype)
        with torch.no_grad():
            center = _joint_center(u.detach(), v.detach())
        table = self.table.to(dtype=dtype, device=x.device)
        eye = torch.eye(table.shape[0], dtype=table.dtype, device=table.device)
        # row labels c ↦ −λ_y T[c, ·], rounded like the other operands; columns one-hot
        label_rows = round_operands(-self.lambda_y * table, rounding)
        two_s = 2.0 * self.scale
        q, alpha = augmented_rows(u, center, label_rows, lx, rounding, two_s, self.scale)
        k, beta = augmented_rows(v, center, eye, ly, rounding, 1.0, self.scale)
        feat = Cost(self.name, self.scale)
        row_features = LabeledFeatures(self, FeatureMap(feat, center, two_s, rounding, dtype),
                                       label_rows)  # fmt: skip
        col_features = LabeledFeatures(self, FeatureMap(feat, center, 1.0, rounding, dtype), eye)
        if cost_bound is None:
            boxes = [column_box(t.detach()) for t in (x, y)]
            cost_bound = float(self.box_bound(*boxes))
        return AttentionForm(q, k, alpha, beta, row_features, col_features, cost_bound)

    def box_bound(self, box_x: torch.Tensor, box_y: torch.Tensor) -> torch.Tensor:
        """A bound on the cost from the clouds' bounding boxes (0-d float64).

        Boxes (2, d + 1) of labeled points, or (2, d) when the cost holds the labels.
        """
        box_x, box_y = self._features(box_x), self._features(box_y)
        span = torch.maximum(box_x[1], box_y[1]).double()
        span = span - torch.minimum(box_x[0], box_y[0]).double()
        top = self.table.detach().double().max().clamp_min(0.0).to(span.device)
        return self.scale * (span**2).sum() + self.lambda_y * top

    def diameter(self, x: torch.Tensor, y: torch.Tensor) -> float:
        """``D`` with ``s D²`` the largest cost: the start of an ε-scaling schedule."""
        with torch.no_grad():
            u, v = self._features(x.detach()), self._features(y.detach())
            feat = float((joint_span(u, v).double() ** 2).sum())
            top = max(0.0, float(self.table.detach().max()))
        return math.sqrt(feat + self.lambda_y * top / self.scale)


def labeled_cost(table, lambda_x: float = 1.0, lambda_y: float = 1.0,
                 base: str | Cost = "sqeuclidean") -> LabeledCost:  # fmt: skip
    """The cost ``λ_x · base(x, y) + λ_y · table[c, c']`` between labeled points.

    Args:
        table: (K, K) finite, nonnegative label-to-label costs (tensor or array).
        lambda_x: weight of the feature cost (> 0).  lambda_y: weight of the table (≥ 0).
        base: ``"sqeuclidean"`` or ``"half_sqeuclidean"``.

    Returns:
        A :class:`LabeledCost` for ``cost=`` of :func:`flashot.sinkhorn` and friends;
        its points are (n, d + 1) with label indices in the last column.
    """
    table = torch.as_tensor(table)
    if table.dim() != 2 or table.shape[0] != table.shape[1] or table.shape[0] == 0:
        raise ValueError(f"table must be a square (K, K) matrix, got shape {tuple(table.shape)}")
    if not table.is_floating_point():
        table = table.double()
    if not bool(torch.isfinite(table).all()) or bool((table < 0).any()):
        raise ValueError("table must hold finite, nonnegative costs")
    for value, name, low in ((lambda_x, "lambda_x", 0.0), (lambda_y, "lambda_y", -1.0)):
        ok = isinstance(value, (int, float)) and math.isfinite(value) and value > low
        if not ok or (name == "lambda_y" and value < 0):
            raise ValueError(f"{name} must be a finite number {'> 0' if low == 0 else '≥ 0'}, "
                             f"got {value!r}")  # fmt: skip
    base = get_cost(base)
    if base.normalize:
        raise ValueError("labeled costs take base='sqeuclidean' or 'half_sqeuclidean'")
    return LabeledCost(f"labeled_{base.name}", float(lambda_x) * base.scale, False,
                       table.detach(), float(lambda_y), base)  # fmt: skip


@dataclass(frozen=True, eq=False)
class LabeledFeatures:
    """New labeled points' features: ``(z, c) ↦ [features(z), labels[c]]`` (picklable).

    Attributes:
        cost: the :class:`LabeledCost` (splits off the label column).
        features: the feature form's map of the same side.
        labels: (K, K') the label part of a feature row, by class.
    """

    cost: LabeledCost
    features: FeatureMap
    labels: torch.Tensor

    def __call__(self, z: torch.Tensor) -> torch.Tensor:
        """(r, d + 1) labeled points ↦ (r, d' + K') features."""
        zf, zl = self.cost.split(z, "points")
        return torch.cat([self.features(zf), self.labels[zl]], 1)

    def offsets(self, z: torch.Tensor) -> torch.Tensor:
        """(r, d + 1) labeled points ↦ (r,) offsets: the features' (the table enters the dot)."""
        return self.features.offsets(self.cost.split(z, "points")[0])
