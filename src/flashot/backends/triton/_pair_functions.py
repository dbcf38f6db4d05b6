"""The built-in pair costs' Triton functions φ(s, t, a, b) and their partial derivatives.

``s = |x − y|²``, ``t = ⟨x, y⟩``, ``a = |x|²``, ``b = |y|²`` per tile; each ``*_grad``
returns ``(∂φ/∂s, ∂φ/∂t, ∂φ/∂a, ∂φ/∂b)``. A kink at coincident points takes the
subgradient 0 (:mod:`flashot.geometry.pair_costs`).
"""

from __future__ import annotations

import triton
import triton.language as tl

from flashot.geometry.pair_costs import PairCost

__all__ = ["BUILT_IN", "triton_functions"]


@triton.jit
def distance(s, t, a, b):
    """``|x − y|`` (GeomLoss' p = 1)."""
    return tl.sqrt(s)


@triton.jit
def distance_grad(s, t, a, b):
    """``∂|x − y|/∂s = 1 / (2|x − y|)``, 0 at coincident points (the subgradient 0)."""
    # (one reciprocal square root: a special-function op where 0.5 / sqrt took two)
    return tl.where(s > 0, 0.5 * tl.rsqrt(tl.where(s > 0, s, 1.0)), 0.0), 0.0, 0.0, 0.0


@triton.jit
def half_square(s, t, a, b):
    """``|x − y|² / 2`` (GeomLoss' p = 2)."""
    return 0.5 * s


@triton.jit
def half_square_grad(s, t, a, b):
    return 0.5, 0.0, 0.0, 0.0


@triton.jit
def gaussian(s, t, a, b):
    """``exp(−|x − y|²/2)`` (GeomLoss' Gaussian kernel on clouds scaled by 1/σ)."""
    return tl.exp(-0.5 * s)


@triton.jit
def gaussian_grad(s, t, a, b):
    return -0.5 * tl.exp(-0.5 * s), 0.0, 0.0, 0.0


@triton.jit
def laplacian(s, t, a, b):
    """``exp(−|x − y|)`` (GeomLoss' Laplacian kernel on clouds scaled by 1/σ)."""
    return tl.exp(-tl.sqrt(s))


@triton.jit
def laplacian_grad(s, t, a, b):
    inv = tl.rsqrt(tl.where(s > 0, s, 1.0))  # (1/r; r = s/r)
    return tl.where(s > 0, -0.5 * tl.exp(-s * inv) * inv, 0.0), 0.0, 0.0, 0.0


@triton.jit
def energy(s, t, a, b):
    """``−|x − y|`` (GeomLoss' energy kernel)."""
    return -tl.sqrt(s)


@triton.jit
def energy_grad(s, t, a, b):
    return tl.where(s > 0, -0.5 * tl.rsqrt(tl.where(s > 0, s, 1.0)), 0.0), 0.0, 0.0, 0.0


#: the built-in costs' Triton functions, by the names their PairCost carries
BUILT_IN = {
    "distance": (distance, distance_grad),
    "half_square": (half_square, half_square_grad),
    "gaussian": (gaussian, gaussian_grad),
    "laplacian": (laplacian, laplacian_grad),
    "energy": (energy, energy_grad),
}


#: gradients of functions of s = |x − y|² alone (φ_t = φ_a = φ_b = 0): their kernels skip
#: those terms (a user's cost may be translation invariant and still use t, a and b)
RADIAL = frozenset(grad for _, grad in BUILT_IN.values())
#: radial gradients with a constant φ_s: Σ_j w_ij (x_i − y_j) as value products, even for
#: differences (``_pairwise._grad_kernel``'s LINEAR)
LINEAR = frozenset({half_square_grad})


def triton_functions(cost: PairCost):
    """``(φ, ∂φ)``: the cost's Triton functions (a built-in's looked up by name)."""
    fn, grad = cost.triton_fn, cost.triton_grad
    if isinstance(fn, str):
        fn = BUILT_IN[fn][0]
    if isinstance(grad, str):
        grad = BUILT_IN[grad][1]
    return fn, grad
