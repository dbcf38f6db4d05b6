"""A fused Sinkhorn step on the Triton backend: plan sums, exact repair, then the update.

:func:`fused_step` serves the backend's Jacobi steps, extrapolations and marginals: one
fused pass (:mod:`._plan_sums`, one exponential per score for rows *and* columns) where a
device-side gate expects every sum in its exact window, the exact attend pass
(:mod:`._attend`) with a repair bound for the rows and columns outside it, and the
update launch (:mod:`._update`). Nothing waits for the host. In "fp32" from
:data:`ONE_PASS_FROM_D` features a step is one exact pass instead (:mod:`._one_pass`).
"""

from __future__ import annotations

import math

import torch

from flashot.backends.dual import log_residual
from flashot.backends.temperature import follows
from flashot.backends.triton._attend import attend
from flashot.backends.triton._gate import _HI, _LO_PER_TERM, sum_ranges
from flashot.backends.triton._one_pass import exact_lse
from flashot.backends.triton._update import update

__all__ = ["GATE_LIMIT", "ONE_PASS_FROM_D", "SUM_SHIFT", "fused_step", "probe", "window"]

#: relaxed problems skip the fused pass when the last step's largest |ln R| (nats)
#: exceeded this: the sums would mostly fall outside their window and need repair anyway
GATE_LIMIT = 100.0
#: the fused sums of a step carry a factor 2^SUM_SHIFT: their window of exact residuals
#: ln R is then about ±70 nats around 0 for n up to 10^6 (unshifted: −58…+83 at 50k)
SUM_SHIFT = 18.0
#: after the first (exact) step the span bound is loose (the initial residuals are all
#: large): the second step estimates its residual range from PROBE_ROWS strided rows and
#: as many columns, times PROBE_MARGIN, on clouds of at least PROBE_FROM points each
PROBE_ROWS, PROBE_MARGIN, PROBE_FROM = 256, 1.1, 4096
#: from this feature width (None: never), in "fp32" with ``fused``, a Jacobi step streams
#: its score tiles once with two exps each and no window (:mod:`._one_pass`) instead of the
#: one-exp fused pass, whose gate sends a small-ε solve's first steps to two exact passes
#: (H200, 50k, ε = 0.1: d = 512 340 → 272 ms, d = 256 179 → 162, d = 128 69 → 116; NOTES.md)
ONE_PASS_FROM_D: int | None = 256


def fused_step(backend, pot, w_old, w_new, *, rho=(None, None), check=False, state=None,
               log_sums=False, damped=False):  # fmt: skip
    """``(f', g', err or None)``: fused sums (when allowed), exact repair, both updates.

    The gate: a balanced averaged step ``f' = f − ½ε ln R``, ``g' = g − ½ε ln C``
    gives ``ln R'_i = ½ ln R_i + ln Σ_j π_ij C_j^{−1/2}`` (``π`` the row-normalized
    plan), so every residual of the new potentials lies within half the span of the
    old ones: a bound with no lag, checked against the sums' window. After the
    initialization that bound is loose, so a solve's second step takes a sampled
    estimate instead (:func:`probe`, on clouds of :data:`PROBE_FROM` points or more).
    Relaxed steps compare the last residual itself with :data:`GATE_LIMIT`.

    Args:
        backend: the :class:`~flashot.backends.triton.TritonBackend`.
        pot: the step's :class:`~flashot.backends.dual.Potentials`.
        w_old, w_new, rho, check, log_sums, damped: see :func:`._update.update`.
        state: the solve's :class:`~._gate.Gate`, or None (every row exact).
    """
    form, f, g, log_a, log_b, eps = pot.parts()
    n, m = f.shape[0], g.shape[0]
    dev = f.device
    gate = None if state is None else state.swap()
    out = dict(shift=SUM_SHIFT, check=check, gate=None if gate is None else gate[1],
               log_sums=log_sums, damped=damped)  # fmt: skip
    wide = backend.fused and backend.precision == "fp32" and ONE_PASS_FROM_D is not None
    wide = wide and form.q.shape[1] >= ONE_PASS_FROM_D
    both = exact_lse(backend, pot) if wide else None
    if both is not None:
        if state is not None:  # the update records this step's residual range
            gate[1].zero_()
            state.eps, state.steps = eps, state.steps + 1
        lo, hi = sum_ranges(log_a, log_b, state)  # (no sum is in range: all LSEs)
        zeros = torch.zeros(n, device=dev), torch.zeros(m, device=dev)
        return update(pot, w_old, w_new, rho, (*zeros, lo, hi), *both, **out)
    span = rho == (None, None) and w_old == w_new == (0.5, 0.5)
    ratio = False
    limit = window(n, m) if span else GATE_LIMIT
    probing = span and backend.fused and state is not None and state.steps == 1
    probing = probing and min(n, m) >= PROBE_FROM
    if probing:  # an estimate at this ε replaces the bound
        probe(backend, pot, gate[0])
    elif state is not None:  # |ln R| scales as 1/ε: after an ε-scaling step, predict it
        ratio = follows(eps, state.eps)
        if not ratio:  # (else on the device: a replayed schedule's ratio)
            limit *= min(1.0, eps / (state.eps or eps))
    if state is not None:
        state.eps, state.steps = eps, state.steps + 1
    if backend.fused:
        # (through the backend: the primitive a subclass or a test may wrap)
        r, c = backend.plan_sums(pot, gate, limit, span and not probing, SUM_SHIFT, ratio=ratio)
    else:
        r, c = torch.zeros(n, device=dev), torch.zeros(m, device=dev)
    lo, hi = sum_ranges(log_a, log_b, state)
    seg = form.segments
    lse_r = attend(backend, form.q, form.k, eps, (g, form.beta, log_b),
                   repair=(r, lo[0:1], hi), segments=seg)[0]  # fmt: skip
    lse_c = attend(backend, form.k, form.q, eps, (f, form.alpha, log_a),
                   repair=(c, lo[1:2], hi), segments=None if seg is None else seg.T)[0]  # fmt: skip
    return update(pot, w_old, w_new, rho, (r, c, lo, hi), lse_r, lse_c, **out)


def probe(backend, pot, slot) -> None:
    """Write an estimate of this step's largest ``ln R`` and ``−ln R`` into ``slot``.

    The exact residuals of :data:`PROBE_ROWS` strided rows and as many columns
    (of a packed batch: every problem's first row and each step-th after it),
    times :data:`PROBE_MARGIN`: a sample, not a bound. Where it is wrong the fused
    pass's out-of-range sums are repaired exactly, at the cost of that pass.
    """
    form, f, g, log_a, log_b, eps = pot.parts()
    logs = []
    seg = form.segments
    for q, k, p, offset, bias, sides in (
        (form.q, form.k, f, form.alpha, (g, form.beta, log_b), seg),
        (form.k, form.q, g, form.beta, (f, form.alpha, log_a), None if seg is None else seg.T),
    ):
        step = max(1, len(p) // PROBE_ROWS)
        pick, sub = slice(None, None, step), None
        if sides is not None:  # a packed batch: each problem's rows, its own columns
            pick, sub = sides.sample_rows(step, p.device)
        lse = attend(backend, q[pick], k, eps, bias, keep_q=False, segments=sub)[0]
        logs.append(log_residual(p[pick], lse, offset[pick], eps))
    ln = torch.cat(logs)
    slot.copy_(torch.stack([ln.max(), -ln.min()]).clamp_min(0.0) * PROBE_MARGIN)


def window(n: int, m: int) -> float:
    """Half-width (nats) of the residuals ``|ln R|`` that balanced fused sums hold exactly.

    :meth:`TritonBackend.valid_range` with weights ≤ 1 and the :data:`SUM_SHIFT`, less
    one nat of rounding slack.
    """
    shift = SUM_SHIFT * math.log(2.0)
    low = -math.log(_LO_PER_TERM * max(n, m)) + shift
    return min(low, math.log(_HI) - shift) - 1.0
