r"""The row LSE at large ε, where every score of a row is within a few nats of the others.

For ε above the cost's range the soft c-transform is nearly a weighted mean,

.. math::

    \varepsilon \log \sum_j w_j e^{t_{ij}/\varepsilon}
        = \varepsilon \log W + \bar t_i + O(\mathrm{spread}^2/\varepsilon),
    \qquad t_{ij} = \langle q_i, k_j\rangle + h_j,

and the usual evaluation (weights folded into the bias as ``h + ε log w``, then a sum
of exponentials near W) loses it: ``ε log w`` swallows ``h``, and ``ε log(sum)`` turns
the sum's rounding into an error of ``ε·ulp``. At ε = 10⁸ and unit data that error is
larger than the answer. Here the weights stay separate and normalized, ``π = w/W``,
and each row keeps two sums after the usual max shift ``M``,

.. math::

    s_i = \sum_j \pi_j e^{S_{ij} - M_i}, \qquad
    E_i = \sum_j \pi_j \operatorname{expm1}(S_{ij} - M_i) = s_i - 1,

whose terms all have one sign, so ``E`` keeps its relative accuracy when ``s ≈ 1``.
The LSE is ``ε (M + log1p(E))`` when ``s ≥ ½`` and ``ε (M + log s)`` otherwise, plus
``ε log W``: the error is a few ulps of ``max |t|``, whatever ε. A total weight within
rounding of 1 (:func:`log_mass`) is taken as exactly 1, since balanced problems give
probability vectors whose float sum is only approximately 1.

This path costs two transcendentals per element; backends take it only when
``ε ≥ cost_bound`` (:func:`is_near_uniform`), where the usual path's ``ε·ulp`` error
would exceed a few ulps of the cost's range (a schedule's warm-up temperatures from a
few times higher, :func:`flashot.solver.blocks.warm_form`).
"""

from __future__ import annotations

import math

import torch

from flashot.backends.row_pool import run_row_blocks, tile_sizes

__all__ = ["NEAR_FROM", "WARM_NEAR_FROM", "is_near_uniform", "log_mass", "near_attend",
           "warm_bounds"]  # fmt: skip

#: the near-uniform path runs when ε ≥ NEAR_FROM × (bound on the cost)
NEAR_FROM = 1.0
#: a schedule's warm-up temperatures take it from this multiple of the bound only
#: (:func:`flashot.solver.blocks.warm_form`; a replay of the schedule follows the same rule)
WARM_NEAR_FROM = 4.0


def warm_bounds(cost_bound: float | None, segments):
    """``(cost_bound, segments)`` as a warm-up temperature reads them.

    Both × :data:`WARM_NEAR_FROM` (a packed form's per problem): the near path starts
    from that multiple of the bound (:func:`flashot.solver.blocks.warm_form`).
    """
    bound = None if cost_bound is None else WARM_NEAR_FROM * cost_bound
    return bound, None if segments is None else segments.scaled_bounds(WARM_NEAR_FROM)


def is_near_uniform(form, eps: float) -> bool:
    """Whether the row LSEs of ``form`` at ``eps`` take :func:`near_attend`."""
    return form.cost_bound is not None and eps >= NEAR_FROM * form.cost_bound


def log_mass(log_w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(log π, log W)``: normalized log weights and the log of the total, on the device.

    ``W`` is summed in float64 and taken as exactly 1 when it is within the rounding of
    a normalized vector of this size and dtype, ``4 (log2 m + 2)`` ulps.
    """
    m = log_w.shape[0]
    top = log_w.max()
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    total = torch.exp((log_w - top).double()).sum() * torch.exp(top.double())
    slack = 4.0 * (math.log2(max(m, 1)) + 2.0) * torch.finfo(log_w.dtype).eps
    log_total = torch.where((total - 1.0).abs() <= slack, 0.0, torch.log(total))
    return (log_w.double() - torch.log(total)).to(log_w.dtype), log_total


def near_attend(form, h, eps, v=None, log_w=None, budget: int | None = None):
    """:meth:`~flashot.backends.base.Backend.row_attend`, accurate for any ε (see module).

    Args:
        form: attention form, q (n, d'), k (m, d').
        h: (m,) column bias without weights (may hold ``-inf``).
        eps: ε > 0.
        v: optional (m, p) values.
        log_w: (m,) log weights, None for unit weights.
        budget: largest score tile, in elements (default 2^22 on a GPU, where launches
            cost more than the 16 MB temporaries, 2^20 elsewhere).

    Returns:
        ``(lse (n,), out (n, p) or None)``.
    """
    q, k = form.q, form.k
    n, m = q.shape[0], k.shape[0]
    dtype, dev = q.dtype, q.device
    if log_w is None:
        log_pi = torch.full((m,), -math.log(m), dtype=dtype, device=dev)
        log_total = torch.tensor(math.log(m), dtype=torch.float64, device=dev)
    else:
        log_pi, log_total = log_mass(log_w)

    pi = torch.exp(log_pi)
    budget = budget or (1 << 22 if q.is_cuda else 1 << 20)
    block_m, block_n = tile_sizes(n, m, budget)
    lse = torch.empty(n, dtype=dtype, device=dev)
    out = None if v is None else torch.empty(n, v.shape[1], dtype=dtype, device=dev)

    def near_rows(i0, i1):
        top = torch.full((i1 - i0,), -math.inf, dtype=dtype, device=dev)
        s = torch.zeros(i1 - i0, dtype=dtype, device=dev)
        e = torch.zeros_like(s)
        seen = torch.zeros_like(s)  # Σ π over the columns streamed so far
        acc = None if v is None else torch.zeros(i1 - i0, v.shape[1], dtype=dtype, device=dev)
        for j0 in range(0, m, block_n):
            j1 = min(m, j0 + block_n)
            t = torch.addmm(h[j0:j1], q[i0:i1], k[j0:j1].T, beta=1.0 / eps, alpha=1.0 / eps)
            t = t.masked_fill(pi[j0:j1] == 0, -math.inf)
            new_top = torch.maximum(top, t.amax(1))
            shift = torch.where(torch.isfinite(new_top), new_top, torch.zeros_like(new_top))
            delta = torch.where(torch.isfinite(top), top - shift, torch.full_like(top, -math.inf))
            decay = torch.exp(delta)
            z = t - shift[:, None]
            w = pi[j0:j1]
            ez = torch.exp(z)
            # all terms ≤ 0: e keeps its relative accuracy through every rescale
            e = e * decay + seen * torch.expm1(delta) + torch.expm1(z) @ w
            s = s * decay + ez @ w
            seen = seen + w.sum()
            if v is not None and acc is not None:
                acc = acc * decay[:, None] + (ez * w) @ v[j0:j1]
            top = shift
        near = s >= 0.5
        log_sum = torch.where(near, torch.log1p(e), torch.log(torch.where(near, 1.0, s)))
        lse[i0:i1] = eps * top + eps * log_sum + (eps * log_total).to(dtype)
        if out is not None and acc is not None:
            out[i0:i1] = acc / s[:, None]

    run_row_blocks(near_rows, n, block_m, n * m, q, k, h, v)
    return lse, out
