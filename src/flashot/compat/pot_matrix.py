r"""POT's ``ot.sinkhorn`` and ``ot.sinkhorn2`` for a cost matrix the caller already has.

Given an (n, m) matrix ``M`` there is nothing to stream: the matrix is in memory and
every iteration reads it. These calls are a dense log-domain Sinkhorn in torch, with
POT's argument names and return values and flashot's stopping rule, so that code
written for POT's matrix calls runs unchanged (numpy or torch, CPU or GPU) beside
:mod:`flashot.compat.pot`'s point-cloud calls. For point clouds, prefer those: they
never build ``M``.

The iterations alternate
:math:`f_i = -\mathrm{reg}\,\log\sum_j b_j e^{(g_j - M_{ij})/\mathrm{reg}}` and
:math:`g_j = -\mathrm{reg}\,\log\sum_i a_i e^{(f_i - M_{ij})/\mathrm{reg}}`, the plan is
:math:`P_{ij} = a_i b_j e^{(f_i + g_j - M_{ij})/\mathrm{reg}}` (POT's
``diag(u) K diag(v)`` with ``log u = log a + f/reg``, ``log v = log b + g/reg``).

Where it differs from POT, on purpose (as in :mod:`flashot.compat.pot`):

- **Stopping.** Every 10 iterations, the L1 error of the row marginal (the columns
  are exact after each column update), so both marginals' L1 error is under
  ``stopThr`` at a stop. Below float64 a threshold under 1e-6 cannot be met; it becomes
  1e-6 there. A missed threshold warns (:class:`flashot.ConvergenceWarning`) unless
  ``warn=False``.
- **Stability.** Always in the log domain (POT's ``method="sinkhorn"`` scales ``u, v``
  and overflows at small ``reg``; ``"sinkhorn_log"`` is this).
- **Gradients** (torch inputs that require grad): autodiff through the iterations, as
  POT's torch backend does; memory grows with the iterations (n·m per iteration).
"""

from __future__ import annotations

import math
import warnings

import numpy as np
import torch

import flashot
from flashot.problem import check_count, check_positive

__all__ = ["sinkhorn", "sinkhorn2"]

#: POT's names of the Sinkhorn variants that compute the same solution
METHODS = (None, "sinkhorn", "sinkhorn_log", "sinkhorn_stabilized")
#: below float64, thresholds under this become this (the dtype cannot reach less)
LOW_PRECISION_TOL = 1e-6
#: iterations between measurements of the marginal error (a host sync each)
CHECK_EVERY = 10


def _as_tensor(name: str, value, like: torch.Tensor | None = None) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value if like is None else value.to(like.device)
    if isinstance(value, (np.ndarray, list, tuple)) or np.isscalar(value):
        out = torch.as_tensor(np.asarray(value))
        return out if like is None else out.to(device=like.device, dtype=like.dtype)
    raise TypeError(f"{name} must be a numpy array or a torch tensor, got {type(value).__name__}")


def _weights(a, b, M: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """POT's weights: an empty list or None is uniform; both must have the same mass."""
    n, m = M.shape
    out = []
    for w, size, name in ((a, n, "a"), (b, m, "b")):
        if w is None or (isinstance(w, (list, tuple)) and len(w) == 0):
            out.append(torch.full((size,), 1.0 / size, dtype=M.dtype, device=M.device))
            continue
        w = _as_tensor(name, w, M)
        if w.dim() == 2 and name == "b":
            raise ValueError("b with several columns (POT's batch of target histograms) is "
                             "not supported: call sinkhorn2 once per column")  # fmt: skip
        if w.shape != (size,):
            raise ValueError(f"{name} must have shape ({size},) to match M {tuple(M.shape)}, "
                             f"got {tuple(w.shape)}")  # fmt: skip
        wd = w.detach()
        if not bool(torch.isfinite(wd).all()) or bool((wd < 0).any()) or float(wd.sum()) <= 0:
            raise ValueError(f"{name} must be finite, non-negative weights with a positive sum")
        out.append(w.to(M.dtype))
    sa, sb = out[0].detach().sum(), out[1].detach().sum()
    if not bool(torch.isclose(sa, sb, rtol=1e-6, atol=0.0)):
        raise ValueError(f"a and b must have the same total mass for balanced OT, got "
                         f"{float(sa):.6g} and {float(sb):.6g}")  # fmt: skip
    return out[0], out[1]


def _solve(a, b, M, reg, method, numItermax, stopThr, verbose, warn, warmstart, kwargs,
           where: str):  # fmt: skip
    """The converged duals and what POT's outputs are made of."""
    if method not in METHODS:
        raise ValueError(f"{where}: method={method!r} is not a Sinkhorn variant flashot "
                         f"computes; use one of {METHODS}")  # fmt: skip
    if kwargs:
        raise TypeError(f"{where} got unexpected keyword arguments {sorted(kwargs)}")
    numpy = not isinstance(M, torch.Tensor)
    M = _as_tensor("M", M)
    if M.dim() != 2 or 0 in M.shape:
        raise ValueError(f"M must be a non-empty (n, m) matrix, got shape {tuple(M.shape)}")
    if not M.dtype.is_floating_point:
        M = M.double()
    if not bool(torch.isfinite(M.detach()).all()):
        raise ValueError("M must be finite (an infinite cost forbids a pair: give it a "
                         "large finite value or a zero weight)")  # fmt: skip
    reg = check_positive(reg, "reg")
    check_count(numItermax, "numItermax")
    tol = check_positive(stopThr, "stopThr", allow_zero=True)
    if M.dtype != torch.float64:
        tol = max(tol, LOW_PRECISION_TOL)
    a, b = _weights(a, b, M)
    log_a, log_b = torch.log(a), torch.log(b)
    f = torch.zeros_like(a)
    g = torch.zeros_like(b)
    if warmstart is not None:  # POT's (log u, log v) → (f, g)
        log_u, log_v = (_as_tensor("warmstart", w, M) for w in warmstart)
        f, g = reg * (log_u - log_a.detach()), reg * (log_v - log_b.detach())
    errors: list[float] = []
    converged, it = False, 0
    while it < numItermax:
        it += 1
        f = -reg * torch.logsumexp(log_b[None, :] + (g[None, :] - M) / reg, dim=1)
        g = -reg * torch.logsumexp(log_a[:, None] + (f[:, None] - M) / reg, dim=0)
        if it % CHECK_EVERY == 0 or it == numItermax:
            rows = torch.exp(log_a + f / reg + torch.logsumexp(
                log_b[None, :] + (g[None, :] - M) / reg, dim=1))  # fmt: skip
            err = float((rows - a).detach().abs().sum())
            errors.append(err)
            if verbose:
                print(f"{it:5d}|{err:8.6e}|")
            if not math.isfinite(err):
                raise FloatingPointError(f"{where}: the marginal error became {err} at "
                                         f"iteration {it} (reg={reg:g} too small for "
                                         f"{M.dtype}?)")  # fmt: skip
            if err <= tol:
                converged = True
                break
    if not converged and warn:
        warnings.warn(f"{where}: the marginal error {errors[-1]:.3g} is above stopThr={tol:g} "
                      f"after numItermax={numItermax} iterations; raise numItermax or reg",
                      flashot.ConvergenceWarning, stacklevel=3)  # fmt: skip
    log_u, log_v = log_a + f / reg, log_b + g / reg
    plan = torch.exp(log_u[:, None] + log_v[None, :] - M / reg)
    log = {"niter": it, "err": errors, "log_u": log_u, "log_v": log_v, "u": log_u.exp(),
           "v": log_v.exp(), "f": f, "g": g, "converged": converged}  # fmt: skip
    return plan, M, log, numpy


def _out(t, numpy: bool):
    if not isinstance(t, torch.Tensor) or not numpy:
        return t
    out = t.detach().cpu().numpy()
    return out[()] if out.ndim == 0 else out


def _outputs(value, log: dict, numpy: bool, want_log: bool):
    if not want_log:
        return _out(value, numpy)
    return _out(value, numpy), {k: _out(v, numpy) for k, v in log.items()}


def sinkhorn(a, b, M, reg, method="sinkhorn", numItermax=1000, stopThr=1e-9, verbose=False,
             log=False, warn=True, warmstart=None, **kwargs):  # fmt: skip
    """POT's ``ot.sinkhorn``: the entropic plan of a given cost matrix.

    Args:
        a: (n,) source weights (None or ``[]``: uniform).  b: (m,) target weights.
        M: (n, m) cost matrix, finite.
        reg: the entropic regularization, > 0.
        method: a Sinkhorn variant of POT's (all compute this log-domain solution).
        numItermax: iterations at most.  stopThr: the L1 marginal error to stop at.
        verbose: print the measured errors.  log: also return the log dict.
        warn: warn (:class:`flashot.ConvergenceWarning`) when ``stopThr`` was missed.
        warmstart: POT's initial (log u, log v), or None.
        **kwargs: none accepted (an unknown keyword is an error).

    Returns:
        The (n, m) plan (numpy for numpy ``M``), and with ``log=True`` a dict: ``niter``,
        ``err`` (the measured errors), ``log_u``, ``log_v``, ``u``, ``v``, the dual
        potentials ``f``, ``g`` and ``converged``.
    """
    plan, _, out, numpy = _solve(a, b, M, reg, method, numItermax, stopThr, verbose, warn,
                                 warmstart, kwargs, "sinkhorn")  # fmt: skip
    return _outputs(plan, out, numpy, bool(log))


def sinkhorn2(a, b, M, reg, method="sinkhorn", numItermax=1000, stopThr=1e-9, verbose=False,
              log=False, warn=True, warmstart=None, **kwargs):  # fmt: skip
    """POT's ``ot.sinkhorn2``: ``⟨P, M⟩`` of the entropic plan (the linear part only).

    Arguments and the log dict as :func:`sinkhorn`. Differentiable for torch inputs
    (autodiff through the iterations, as POT's).
    """
    plan, M, out, numpy = _solve(a, b, M, reg, method, numItermax, stopThr, verbose, warn,
                                 warmstart, kwargs, "sinkhorn2")  # fmt: skip
    return _outputs((plan * M).sum(), out, numpy, bool(log))
