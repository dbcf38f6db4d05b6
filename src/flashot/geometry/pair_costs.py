r"""Pair costs: costs outside the attention form, as an elementwise function of a tile.

The attention form covers costs ``α_i + β_j − ⟨q_i, k_j⟩``. Others (the Euclidean
distance of GeomLoss' ``p = 1``, ``|x − y|^p``, robust costs) are still a function of a
few per-pair and per-point statistics that a streaming kernel has on chip:

.. math::

    C_{ij} = \varphi(s_{ij}, t_{ij}, a_i, b_j), \quad s_{ij} = |x_i - y_j|^2,\;
    t_{ij} = \langle x_i, y_j \rangle,\; a_i = |x_i|^2,\; b_j = |y_j|^2.

A :class:`PairCost` holds φ twice, in the spirit of FlexAttention's ``score_mod``:

* ``torch_fn(s, t, a, b)``: PyTorch, elementwise on broadcastable tensors (``s``, ``t``
  of shape (r, c), ``a`` (r, 1), ``b`` (1, c)). It is the reference: PyTorch tiles on
  every device (:mod:`flashot.backends.kernel_sums`), second derivatives by autograd.
* ``triton_fn(s, t, a, b)`` (optional): the same function decorated with
  ``@triton.jit``, applied per tile after the product inside the fused soft-minimum
  kernel (:mod:`flashot.backends.triton._pairwise`); with ``triton_grad(s, t, a, b)``
  returning ``(∂φ/∂s, ∂φ/∂t, ∂φ/∂a, ∂φ/∂b)`` its gradients stream too (without it, and
  for second derivatives, the backward recomputes in PyTorch tiles).

What the solver needs from φ: finite values for finite inputs, derivatives where the
gradient is asked for (a kink, such as ``|x − y|`` at 0, takes a subgradient: choose one
that stays finite), and a scale comparable to ``diameter^p`` for the ε schedule.
``s`` is formed from coordinate differences for d ≤ :data:`DIFFERENCES_UP_TO` (exact:
coincident points are at 0) and as ``max(a + b − 2t, 0)`` beyond, where float32 carries
an absolute error of about 1e-7 (a + b); ``translation_invariant`` costs (φ of ``s``
alone) are computed on clouds centred by one common shift, which keeps a and b small.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "DIFFERENCES_UP_TO",
    "KERNEL_COSTS",
    "PairCost",
    "distance_cost",
    "half_square_cost",
    "pair_stats",
]

#: widest features for which the kernels form ``|x − y|²`` from coordinate differences
DIFFERENCES_UP_TO = 8


def pair_stats(x: torch.Tensor, y: torch.Tensor, full: bool = True):
    """``(s, t, a, b)`` of two blocks: (r, c), (r, c), (r, 1), (1, c).

    ``s`` from coordinate differences (exactly 0 for coincident points); ``full=False``:
    ``s`` alone, t, a and b None (a φ of ``s`` alone needs no product or norms).
    """
    s = (x[:, None, :] - y[None, :, :]).square().sum(-1)
    if not full:
        return s, None, None, None
    return s, x @ y.T, x.square().sum(1, keepdim=True), y.square().sum(1)[None, :]


@dataclass(frozen=True, eq=False)
class PairCost:
    r"""A cost ``C_ij = φ(|x_i − y_j|², ⟨x_i, y_j⟩, |x_i|², |y_j|²)``.

    Calling it on two blocks gives the cost tile, so it serves wherever a cost callable
    ``cost(x_block, y_block)`` does (``SamplesLoss(cost=...)``); on CUDA (or with
    ``backend="triton"``) its soft-minima run in the fused kernel when ``triton_fn`` is set.

    Args:
        torch_fn: ``φ(s, t, a, b)`` on broadcastable tensors ((r, c), (r, c), (r, 1),
            (1, c)) → the (r, c) cost; differentiable by autograd.
        triton_fn: the same φ as a ``@triton.jit`` function of tiles, or None (PyTorch
            tiles on every device); the built-in costs name theirs by a string.
        triton_grad: a ``@triton.jit`` function returning ``(∂φ/∂s, ∂φ/∂t, ∂φ/∂a,
            ∂φ/∂b)`` (each a tile or a scalar), or None: first derivatives then
            recompute in PyTorch tiles.
        translation_invariant: φ depends on ``s`` alone, so the kernels may centre
            both clouds first (smaller ``a``, ``b``: less cancellation in ``s``), and
            the PyTorch tiles pass None for t, a and b.
        name: shown in messages.

    Example:
        A Huber-like robust cost, with its Triton twin::

            @triton.jit
            def huber(s, t, a, b):
                return tl.sqrt(1.0 + s) - 1.0

            @triton.jit
            def huber_grad(s, t, a, b):
                return 0.5 / tl.sqrt(1.0 + s), 0.0, 0.0, 0.0

            cost = flashot.PairCost(lambda s, t, a, b: (1 + s).sqrt() - 1, huber, huber_grad,
                                    translation_invariant=True)
            loss = flashot.SamplesLoss(p=1, blur=0.05, cost=cost)
    """

    torch_fn: Callable[..., torch.Tensor]
    triton_fn: Any = None
    triton_grad: Any = None
    translation_invariant: bool = False
    name: str = "custom"

    def __post_init__(self):
        if not callable(self.torch_fn):
            raise TypeError(
                f"torch_fn must be callable (s, t, a, b) -> cost, got "
                f"{type(self.torch_fn).__name__}"
            )
        for value, field in ((self.triton_fn, "triton_fn"), (self.triton_grad, "triton_grad")):
            if value is not None and not (isinstance(value, str) or callable(value)):
                raise TypeError(
                    f"{field} must be a @triton.jit function or None, got {type(value).__name__}"
                )
        if self.triton_grad is not None and self.triton_fn is None:
            raise ValueError("triton_grad needs triton_fn: the gradient kernel recomputes the cost")

    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The (r, c) cost tile of (r, D) and (c, D) blocks."""
        c = self.torch_fn(*pair_stats(x, y, full=not self.translation_invariant))
        if not isinstance(c, torch.Tensor) or c.shape != (x.shape[0], y.shape[0]):
            got = tuple(c.shape) if isinstance(c, torch.Tensor) else type(c).__name__
            raise ValueError(
                f"PairCost {self.name!r}: torch_fn must return an ({x.shape[0]}, "
                f"{y.shape[0]}) tile, got {got}"
            )
        return c


def _root(s, t, a, b):
    # (the inner where keeps sqrt's derivative off s = 0: coincident points get 0)
    apart = s > 0
    return torch.where(apart, torch.where(apart, s, 1.0).sqrt(), 0.0)


def _half(s, t, a, b):
    return 0.5 * s


#: GeomLoss' p = 1 cost ``|x − y|`` (subgradient 0 at coincident points)
distance_cost = PairCost(_root, "distance", "distance", translation_invariant=True, name="distance")
#: GeomLoss' p = 2 cost ``|x − y|² / 2``
half_square_cost = PairCost(
    _half, "half_square", "half_square", translation_invariant=True, name="half_square"
)


def _gaussian(s, t, a, b):
    return torch.exp(-0.5 * s)


def _laplacian(s, t, a, b):
    return torch.exp(-_root(s, t, a, b))


def _energy(s, t, a, b):
    return -_root(s, t, a, b)


#: GeomLoss' kernels as pair costs of clouds scaled by 1/blur (second item True) or not:
#: ``exp(−|x − y|²/2σ²)``, ``exp(−|x − y|/σ)``, ``−|x − y|`` (subgradient 0 at coincident
#: points, as :data:`distance_cost`)
KERNEL_COSTS = {
    "gaussian": (PairCost(_gaussian, "gaussian", "gaussian", True, "gaussian"), True),
    "laplacian": (PairCost(_laplacian, "laplacian", "laplacian", True, "laplacian"), True),
    "energy": (PairCost(_energy, "energy", "energy", True, "energy"), False),
}
