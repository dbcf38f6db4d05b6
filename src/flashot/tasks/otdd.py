r"""Optimal Transport Dataset Distance (OTDD, Alvarez-Melis & Fusi 2020), streamed.

Two labeled datasets ``(x_i, c_i)`` and ``(y_j, c'_j)`` are compared by entropic OT
under the augmented cost

.. math::

    C((x, c), (y, c')) = \lambda_x \lVert x - y\rVert^2 + \lambda_y W(c, c')^2,

where ``W(c, c')`` is a distance between the classes' feature distributions:

- ``inner="gaussian"``: the Bures–Wasserstein distance between Gaussians with the
  classes' means and covariances (maximum-likelihood, 1/n_c, by default; with
  ``unbiased=True`` 1/(n_c − 1), microsoft/otdd's estimator: its distances are those
  of ``unbiased=True``, and the two differ by O(1/n_c) in each class's covariance),
  ``W² = |m − m'|² + tr(Σ + Σ' − 2 (Σ^{1/2} Σ' Σ^{1/2})^{1/2})``, or with
  ``diagonal=True`` ``|m − m'|² + |σ − σ'|²``;
- ``inner="exact"``: the debiased Sinkhorn divergence between the classes' clouds
  (:func:`flashot.sinkhorn_divergence`, squared Euclidean cost).

The table holds every pair of the union of both datasets' classes, so the self
problems of the debiased distance take ``W`` within one dataset. The outer problem
streams through :func:`flashot.labeled_cost`: the table is read per tile, nothing
of size n × m is formed. The distance is ``S_ε = OT_ε(A, B) − ½ OT_ε(A, A) −
½ OT_ε(B, B)`` (``debias=True``) or ``OT_ε(A, B)``, not square-rooted.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

import flashot
from flashot.autodiff.functional import refuse_transforms
from flashot.backends import entry_point
from flashot.geometry.costs import column_sum

__all__ = ["DatasetDistance", "class_table", "dataset_distance", "gaussian_table"]

INNER = ("gaussian", "exact")


@dataclass(frozen=True)
class DatasetDistance:
    """The result of :func:`dataset_distance`.

    Attributes:
        distance: 0-dim tensor, differentiable w.r.t. both datasets' features.
        result: the :class:`~flashot.SinkhornResult` of OT_ε(A, B): its lazy plan holds
            the features and labels given (without autograd it makes the labeled
            attention form again when used, so no operand copy outlives the call).
        class_mass: (K_a, K_b) mass the plan moves from each class of A to each of B.
        label_cost: (K_a + K_b, K_a + K_b) the ``W²`` table over A's classes then B's.
        classes_a: (K_a,) A's label values, in table order.  classes_b: (K_b,) B's.
    """

    distance: torch.Tensor
    result: flashot.SinkhornResult
    class_mass: torch.Tensor
    label_cost: torch.Tensor
    classes_a: torch.Tensor
    classes_b: torch.Tensor


def _check_dataset(x, labels, name: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(features, classes, label index into classes) of one dataset, checked.

    Numpy features are taken as a CPU tensor (sharing memory), numpy labels go to it.
    """
    if isinstance(x, np.ndarray):
        x = torch.as_tensor(x)
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.shape[0] == 0:
        raise ValueError(f"X{name} must be a nonempty (n, d) tensor")
    if not bool(torch.isfinite(x.detach()).all()):  # (else eigh fails inside the class table)
        raise ValueError(f"X{name} contains NaN or infinite values")
    labels = torch.as_tensor(labels, device=x.device)
    if labels.shape != (x.shape[0],) or labels.is_floating_point() or labels.is_complex():
        raise ValueError(f"y{name} must hold one integer label per row of X{name}, "
                         f"got shape {tuple(labels.shape)} dtype {labels.dtype}")  # fmt: skip
    classes, index = torch.unique(labels, sorted=True, return_inverse=True)
    return x, classes, index


def gaussian_table(feats: Sequence[torch.Tensor], diagonal: bool = False,
                   unbiased: bool = False) -> torch.Tensor:  # fmt: skip
    """Bures–Wasserstein ``W²`` between Gaussian fits of clouds (float64, (K, K)).

    Args:
        feats: K clouds (n_c, d), each of at least one point.
        diagonal: use only the covariances' diagonals (for large d).
        unbiased: covariances over ``n_c − 1`` (microsoft/otdd's) instead of ``n_c``;
            every class then needs two points.
    """
    _check_flag(unbiased, "unbiased")
    centers: list[torch.Tensor] = []
    moments: list[torch.Tensor] = []
    for f in feats:  # one class at a time: a float64 copy of one class, not of all
        c = f.detach().double()
        del f
        count = c.shape[0]
        if unbiased and count < 2:
            raise ValueError(f"unbiased=True needs at least two points in every class; class "
                             f"{len(centers)} of the union has {count}")  # fmt: skip
        centers.append(column_sum(c) / count)
        c.sub_(centers[-1])  # in place: the copy is ours
        norm = count - 1 if unbiased else count
        moments.append(column_sum(c.square_()) / norm if diagonal else c.T @ c / norm)
        del c
    means = torch.stack(centers)
    table = torch.cdist(means, means).square()
    if diagonal:
        sd = torch.stack(moments).sqrt()
        table = table + torch.cdist(sd, sd).square()
    else:
        covs = torch.stack(moments)
        vals, vecs = torch.linalg.eigh(covs)
        roots = (vecs * vals.clamp_min(0.0).sqrt()[:, None, :]) @ vecs.transpose(1, 2)
        traces = torch.diagonal(covs, dim1=1, dim2=2).sum(-1)
        cross = torch.zeros_like(table)
        for i in range(len(feats)):  # tr (Σ_i^½ Σ_j Σ_i^½)^½ for every j, one batched eigvalsh
            mids = roots[i] @ covs @ roots[i]
            mids = 0.5 * (mids + mids.transpose(1, 2))
            cross[i] = torch.linalg.eigvalsh(mids).clamp_min(0.0).sqrt().sum(-1)
        table = table + traces[:, None] + traces[None, :] - (cross + cross.T)
    return (0.5 * (table + table.T)).clamp_min(0.0).fill_diagonal_(0.0)


def class_table(feats: Sequence[torch.Tensor], inner: str = "gaussian", diagonal: bool = False,
                eps: float | None = None, unbiased: bool = False,
                **sinkhorn_options) -> torch.Tensor:  # fmt: skip
    """``W²`` between every pair of class clouds (float64, (K, K), zero diagonal).

    Args:
        feats: K clouds (n_c, d).
        inner: ``"gaussian"`` (Bures–Wasserstein of Gaussian fits) or ``"exact"``
            (debiased Sinkhorn divergences at ``eps``, with ``sinkhorn_options``).
        diagonal: diagonal covariances (``"gaussian"`` only).
        unbiased: covariances over ``n_c − 1`` (``"gaussian"`` only; see
            :func:`gaussian_table`).
    """
    if inner not in INNER:
        raise ValueError(f"inner must be one of {INNER}, got {inner!r}")
    if inner == "gaussian":
        return gaussian_table(feats, diagonal, unbiased)
    if unbiased:
        raise ValueError("unbiased applies to inner='gaussian' (covariances) only")
    if eps is None:
        raise ValueError("inner='exact' needs the inner eps")
    k = len(feats)
    table = torch.zeros(k, k, dtype=torch.float64, device=feats[0].device)
    with torch.no_grad():
        for i in range(k):
            for j in range(i + 1, k):
                s = flashot.sinkhorn_divergence(feats[i].detach(), feats[j].detach(), eps=eps,
                                                **sinkhorn_options)  # fmt: skip
                table[i, j] = table[j, i] = float(s)
    return table.clamp_min(0.0)


class _ClassClouds(Sequence):
    """The class clouds of labeled datasets, each copied out when read.

    ``class_table`` reads one class (two for ``"exact"``) at a time, so at most those
    copies exist, not a copy of every class (two clouds) at once.
    """

    def __init__(self, *datasets: tuple[torch.Tensor, torch.Tensor, int]):
        self._parts = [(x, index, c) for x, index, k in datasets for c in range(k)]

    def __len__(self) -> int:
        return len(self._parts)

    def __getitem__(self, i):  # type: ignore[override]  # (ints only)
        x, index, c = self._parts[i]
        return x[index == c]


def _label_cost(xa, index_a, ka, xb, index_b, kb, inner, diagonal, inner_eps, lambda_x,
                lambda_y, unbiased: bool = False) -> flashot.LabeledCost:  # fmt: skip
    """The augmented cost of two datasets: ``W²`` over the union of their classes."""
    feats = _ClassClouds((xa, index_a, ka), (xb, index_b, kb))
    table = class_table(feats, inner, diagonal, inner_eps, unbiased)
    return flashot.labeled_cost(table, lambda_x=lambda_x, lambda_y=lambda_y)


def _outer(xa, index_a, xb, index_b, cost, eps, debias, self_b=None, solve=None,
           **sinkhorn_options):  # fmt: skip
    """``(value, result of OT(A, B), OT(B, B) or None)`` of labeled datasets.

    ``index_b`` already offset past A's classes. The cost holds each problem's labels
    (:meth:`~flashot.geometry.labeled.LabeledCost.with_labels`): no labeled copy of a cloud. The
    self problems go first: a solve's attention form is two cloud-sized operands, and
    only the cross problem's stays (its result holds the lazy plan). ``solve(x, y,
    cost, name)`` (``name`` ``"aa"``, ``"bb"`` or ``"ab"``) replaces ``flashot.sinkhorn``
    (the flows' warm starts).
    """
    if solve is None:

        def solve(x, y, c, name):
            return flashot.sinkhorn(x, y, eps=eps, cost=c, **sinkhorn_options)

    self_a = None
    if debias:
        self_a = solve(xa, xa, cost.with_labels(index_a, index_a), "aa").cost
        if self_b is None:
            self_b = solve(xb, xb, cost.with_labels(index_b, index_b), "bb").cost
    res = solve(xa, xb, cost.with_labels(index_a, index_b), "ab")
    value = res.cost if not debias else res.cost - 0.5 * self_a - 0.5 * self_b
    return value, res, self_b


def _streaming(sinkhorn_options: dict, x: torch.Tensor) -> dict:
    """``sinkhorn_options`` with a backend that streams every score.

    OTDD's memory stays O((n + m) d) (60k MNIST against itself in under 1 GB): a backend
    named by a string is made with ``scores="stream"`` (the Triton backend's ``"auto"``
    would cache a 60k × 60k matrix, 14 GB); a backend instance is the caller's choice.
    """
    backend = sinkhorn_options.get("backend", "auto")
    if not isinstance(backend, str):
        return sinkhorn_options
    made = flashot.backends.resolve_backend(backend, x.device, sinkhorn_options.get(
        "precision", "auto"), x.dtype, scores="stream")  # fmt: skip
    return {**sinkhorn_options, "backend": made}


def _check_flag(value, name: str) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {value!r}")


def _prepare(xa, ya, xb, yb):
    xa, classes_a, index_a = _check_dataset(xa, ya, "a")
    xb, classes_b, index_b = _check_dataset(xb, yb, "b")
    if xa.shape[1] != xb.shape[1]:
        raise ValueError(f"Xa and Xb must have the same feature size, got {xa.shape[1]} "
                         f"and {xb.shape[1]}")  # fmt: skip
    return xa, classes_a, index_a, xb, classes_b, index_b


@entry_point
@refuse_transforms
def dataset_distance(
    xa: torch.Tensor,
    ya,
    xb: torch.Tensor,
    yb,
    *,
    eps: float,
    lambda_x: float = 1.0,
    lambda_y: float = 1.0,
    inner: str = "gaussian",
    diagonal: bool = False,
    inner_eps: float | None = None,
    debias: bool = True,
    unbiased: bool = False,
    **sinkhorn_options,
) -> DatasetDistance:
    """OTDD between labeled datasets A = (xa, ya) and B = (xb, yb) (see module).

    Args:
        xa: (n, d) features of A.  ya: (n,) integer labels of A.
        xb: (m, d) features of B.  yb: (m,) integer labels of B (any label values).
            Numpy arrays are taken as CPU tensors.
        eps: ε of the outer problem.
        lambda_x, lambda_y: weights of the feature and label terms.
        inner: ``"gaussian"`` or ``"exact"``.
        diagonal: diagonal covariances for ``"gaussian"`` (large d).
        inner_eps: ε of the ``"exact"`` class-to-class divergences (default: eps).
        debias: the debiased divergence (else OT_ε(A, B)).
        unbiased: class covariances over ``n_c − 1``, as microsoft/otdd computes them
            (default: ``n_c``, the maximum-likelihood fit); ``"gaussian"`` only.
        **sinkhorn_options: passed to :func:`flashot.sinkhorn` for the outer problems
            (tol, max_iter, eps_schedule, backend, precision, ...).

    Returns:
        A :class:`DatasetDistance`; its distance is differentiable in the features
        through the outer problems (the class table is held fixed).
    """
    xa, classes_a, index_a, xb, classes_b, index_b = _prepare(xa, ya, xb, yb)
    sinkhorn_options = _streaming(sinkhorn_options, xa)
    ka, kb = len(classes_a), len(classes_b)
    cost = _label_cost(xa, index_a, ka, xb, index_b, kb, inner, diagonal, inner_eps or eps,
                       lambda_x, lambda_y, unbiased)  # fmt: skip
    value, res, _ = _outer(xa, index_a, xb, index_b + ka, cost, eps, debias, **sinkhorn_options)
    with torch.no_grad():
        onehot_b = torch.nn.functional.one_hot(index_b, kb).to(res.f.dtype)
        to_b = res.plan @ onehot_b  # (n, K_b): mass from each point to each class of B
        mass = torch.zeros(ka, kb, dtype=to_b.dtype, device=to_b.device)
        mass.index_add_(0, index_a, to_b)
    return DatasetDistance(value, res, mass, cost.table, classes_a, classes_b)
