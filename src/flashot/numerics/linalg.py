r"""Matrix-free linear algebra on callables: conjugate gradients and Lanczos.

Both take the operator as a function ``matvec(v) -> A v`` on tensors of any shape
(the vector space is that of ``b`` or of the start vector), so Hessians of OT losses
given by :func:`flashot.hvp` and the dual systems of the implicit derivatives can be
used without ever forming a matrix. Inner products are taken in float64 whatever the
operands' dtype.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch

__all__ = [
    "CGResult",
    "CGWarning",
    "LanczosResult",
    "LanczosWarning",
    "NegativeCurvature",
    "cg",
    "lanczos",
]

Matvec = Callable[[torch.Tensor], torch.Tensor]


class CGWarning(UserWarning):
    """Conjugate gradients stopped above the requested tolerance."""


class NegativeCurvature(RuntimeError):  # noqa: N818  (a public name since 0.1 development)
    """The operator is not positive definite along a CG direction ``p`` (``⟨p, Ap⟩ ≤ 0``).

    Attributes:
        direction: the direction ``p``.  curvature: ``⟨p, Ap⟩ / ⟨p, p⟩``.
    """

    def __init__(self, direction: torch.Tensor, curvature: float):
        super().__init__(
            f"the operator has nonpositive curvature {curvature:.3e} along a CG direction; "
            "it is not positive definite (pass on_negative_curvature='return' to get it)"
        )
        self.direction, self.curvature = direction, curvature


@dataclass(frozen=True)
class CGResult:
    """Outcome of :func:`cg`.

    Attributes:
        x: the solution, shaped like ``b``.
        n_iter: CG iterations (one ``matvec`` each).
        residual: ``‖b − A x‖ / ‖b‖``, recomputed from ``x`` at the end (one more matvec).
        converged: ``residual ≤ tol``.
        negative_curvature: a direction ``p`` with ``⟨p, Ap⟩ ≤ 0`` when CG met one and
            was asked to return it, else None.
    """

    x: torch.Tensor
    n_iter: int
    residual: float
    converged: bool
    negative_curvature: torch.Tensor | None = None


def _dot(u: torch.Tensor, v: torch.Tensor) -> float:
    return float(_ddot(u, v))


def _ddot(u: torch.Tensor, v: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """``⟨u, v⟩`` accumulated in float64 on the operands' device (no sync).

    A 0-d tensor, or with ``dim=0`` one product per column (last dimension).
    """
    if dim is None:
        return torch.sum(u * v, dtype=torch.float64)
    return torch.sum(u * v, dim=0, dtype=torch.float64)


class _CGState:
    """CG's iterate, residual, direction and scalars, updated in place on the device.

    Every scalar lives in a 0-d tensor and every update is masked by ``active``, so a
    block of :meth:`step` calls needs no host round trip (and can be replayed as a CUDA
    graph): once converged, or once a direction of nonpositive curvature is met, the
    remaining steps of a block change nothing (``p`` then keeps that direction). A step
    is a matvec, a preconditioner call and about 25 small launches.
    """

    #: the state's tensors, in the order of :meth:`tensors`
    FIELDS = ("x", "r", "p", "rz", "goal", "active", "n_iter", "negative")

    def __init__(self, matvec, precond, b, x0, tol, columns=False):
        self.matvec, self.precond = matvec, precond
        self.dim = 0 if columns else None  # columns: one CG per column, in lockstep
        self.x = torch.zeros_like(b) if x0 is None else x0.clone()
        self.r = b - matvec(self.x) if x0 is not None else b.clone()
        self.p = precond(self.r).clone()
        self.rz = _ddot(self.r, self.p, self.dim)
        self.goal = tol**2 * _ddot(b, b, self.dim)
        self.active = _ddot(self.r, self.r, self.dim) > self.goal
        self.n_iter = torch.zeros((), dtype=torch.int64, device=b.device)
        self.negative = torch.zeros_like(self.active)

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return tuple(getattr(self, name) for name in self.FIELDS)

    def assign(self, tensors) -> None:
        for name, t in zip(self.FIELDS, tensors, strict=True):
            setattr(self, name, t)

    def run(self, count: int, *tensors) -> tuple[torch.Tensor, ...]:
        """``count`` steps from the given state tensors, updated in place (and returned)."""
        self.assign(tensors)
        for _ in range(count):
            self.step()
        return self.tensors()

    def step(self) -> None:
        ap = self.matvec(self.p)
        pap = _ddot(self.p, ap, self.dim)
        go = self.active & (pap > 0)
        self.negative |= self.active & (pap <= 0)  # (nan: stops, no direction)
        # masked by where (not by multiplying): 0 · inf would be nan
        step = torch.where(go, self.rz / pap, 0.0).to(self.x.dtype)
        self.x.addcmul_(self.p, step)
        self.r.addcmul_(ap, step, value=-1.0)
        z = self.precond(self.r)
        rz = _ddot(self.r, z, self.dim)
        beta = torch.where(go, rz / self.rz, 0.0).to(self.x.dtype)
        self.p.copy_(torch.where(go, torch.addcmul(z, self.p, beta), self.p))
        self.rz.copy_(rz)  # unchanged where inactive: r, hence z, did not move
        self.n_iter += go.any()
        self.active &= go & (_ddot(self.r, self.r, self.dim) > self.goal)


def _graph_of(block: Callable[[], None]):
    """``block`` captured as a CUDA graph (a callable replaying it), or None if it cannot be."""
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    try:
        with torch.cuda.graph(graph, stream=stream):
            block()
    except RuntimeError:  # something in it synchronizes: stay eager
        torch.cuda.synchronize()
        return None
    return graph.replay


def cg(
    matvec: Matvec,
    b: torch.Tensor,
    *,
    x0: torch.Tensor | None = None,
    tol: float = 1e-6,
    max_iter: int | None = None,
    preconditioner: Matvec | None = None,
    on_negative_curvature: str = "raise",
    check_every: int | None = None,
    capture: bool | tuple = False,
    columns: bool = False,
    warn: bool = True,
) -> CGResult:
    r"""Preconditioned conjugate gradients for ``A x = b``, A symmetric positive definite.

    Stops when the recursive residual satisfies ``‖r‖ ≤ tol ‖b‖``, then measures the true
    residual ``‖b − A x‖ / ‖b‖`` once more (recursions drift in finite precision) and
    warns with :class:`CGWarning` if it is above ``tol``. The scalars stay on the
    operands' device; the host looks at them every ``check_every`` iterations (the
    iterations run past convergence within a block are masked out: they cost matvecs,
    not accuracy).

    Args:
        matvec: ``v -> A v`` for tensors shaped like ``b``.
        b: right-hand side (any shape).
        x0: starting point (default 0).
        tol: relative residual to reach.
        max_iter: iterations at most (default ``10 · b.numel()``, at least 100).
        preconditioner: ``r -> M⁻¹ r`` for a symmetric positive definite M ≈ A.
        on_negative_curvature: ``"raise"`` (:class:`NegativeCurvature`) or
            ``"return"``: stop and return the current iterate with the direction in
            :attr:`CGResult.negative_curvature`.
        check_every: iterations between convergence checks on the host (default 1 on
            the CPU, 8 on a GPU, where each check waits for the device).
        capture: on a GPU, capture a block of ``check_every`` iterations as a CUDA graph
            and replay it (``matvec`` and ``preconditioner`` must then launch only
            asynchronous work with fixed shapes); falls back to eager launches if the
            capture fails. A pair ``(cache, key)`` (a :class:`~flashot.solver.graphs.GraphCache`
            and a hashable) keeps the capture in ``cache`` for later calls with the same
            key, which then replay every block: their ``matvec`` and ``preconditioner``
            must read the same buffers (refreshed in place by the caller) as the
            captured ones, and ``b`` must keep its shape.
        columns: ``b`` is (N, k): solve ``A x_j = b_j`` for each column, one CG per
            column with its own step sizes and stopping, sharing every ``matvec`` (so
            an operator that streams can serve k right-hand sides per pass). ``tol``
            holds per column; ``residual`` is the largest.
        warn: warn with :class:`CGWarning` when ``tol`` is not reached (callers that
            report it themselves pass False).

    Returns:
        A :class:`CGResult`.
    """
    if on_negative_curvature not in ("raise", "return"):
        raise ValueError(
            f"on_negative_curvature must be 'raise' or 'return', got {on_negative_curvature!r}"
        )
    if not (isinstance(tol, (int, float)) and tol > 0):
        raise ValueError(f"tol must be a positive float, got {tol!r}")
    max_iter = max(100, 10 * b.numel()) if max_iter is None else int(max_iter)
    if max_iter < 0:
        raise ValueError(f"max_iter must be ≥ 0, got {max_iter}")
    if check_every is None:
        check_every = 8 if b.is_cuda else 1
    if isinstance(check_every, bool) or not isinstance(check_every, int) or check_every < 1:
        raise ValueError(f"check_every must be an integer ≥ 1, got {check_every!r}")
    if columns and b.dim() != 2:
        raise ValueError(f"columns=True needs b of shape (N, k), got {tuple(b.shape)}")
    precond = preconditioner or (lambda r: r)
    b_norm = math.sqrt(_dot(b, b))
    if b_norm == 0.0:
        return CGResult(torch.zeros_like(b), 0, 0.0, True)
    state = _CGState(matvec, precond, b, x0, tol, columns)
    replay, done = None, 0
    kept = capture if isinstance(capture, tuple) else None
    while done < max_iter and bool(state.active.any()):
        count = min(check_every, max_iter - done)

        def block(count=count):
            state.run(count, *state.tensors())

        if kept is not None and count == check_every:  # eager once, captured, then replayed
            cache, key = kept
            state.assign(cache((key, count, b.shape), partial(state.run, count), state.tensors()))
        else:
            wanted = capture is True and b.is_cuda and count == check_every and done > 0
            if wanted and replay is None:
                replay = _graph_of(block)  # the first block ran eagerly: kernels are compiled
                capture = replay is not None
            (replay if replay is not None and count == check_every else block)()
        done += count
        if bool(state.negative.all()):
            break
    x, it = state.x, int(state.n_iter)
    curvature_dir = state.p if bool(state.negative.any()) else None
    if curvature_dir is not None and on_negative_curvature == "raise":
        p = curvature_dir
        raise NegativeCurvature(p, _dot(p, matvec(p)) / max(_dot(p, p), 1e-300))
    true_r = b - matvec(x)
    if columns:  # the worst column (a zero column is solved exactly by x = 0)
        norms = _ddot(b, b, 0).sqrt()
        ratios = _ddot(true_r, true_r, 0).sqrt() / torch.where(norms > 0, norms, 1.0)
        residual = float(ratios.max())
    else:
        residual = math.sqrt(_dot(true_r, true_r)) / b_norm
    converged = residual <= tol
    if warn and not converged and curvature_dir is None:
        warnings.warn(
            f"cg did not reach tol={tol:g}: relative residual {residual:.3e} after {it} "
            "iterations (ill-conditioned operator or max_iter too small)",
            CGWarning,
            stacklevel=2,
        )
    return CGResult(x, it, residual, converged, curvature_dir)


class LanczosWarning(UserWarning):
    """Lanczos stopped before its eigenpairs reached the requested residual."""


@dataclass(frozen=True)
class LanczosResult:
    """Outcome of :func:`lanczos`; unpacks as ``values, vectors``.

    Attributes:
        values: (k,) Ritz values, ascending for ``"smallest"``, descending for ``"largest"``.
        vectors: ``(k, *shape)`` orthonormal Ritz vectors.
        residuals: (k,) ``‖A v − λ v‖`` of each pair (from the operator's own products).
        converged: every residual is within ``tol`` times the operator's estimated norm.
        n_matvec: operator applications used.
    """

    values: torch.Tensor
    vectors: torch.Tensor
    residuals: torch.Tensor
    converged: bool
    n_matvec: int

    def __iter__(self):
        return iter((self.values, self.vectors))

    def __len__(self) -> int:
        return 2

    def __getitem__(self, i):
        return (self.values, self.vectors)[i]


def _orthonormal_block(W: torch.Tensor, V: torch.Tensor, gen, dtype, device) -> torch.Tensor:
    """Rows of W made orthonormal to V's rows and each other (two Gram–Schmidt passes).

    Rows that vanish (W's span lies in V's: an invariant subspace) are replaced by random
    rows, so the basis keeps growing until it spans the space.
    """
    dim = W.shape[1]
    out: list[torch.Tensor] = []
    for w in W:
        for _attempt in range(3):
            norm0 = float(w.norm())
            for _ in range(2):  # twice is enough (Kahan)
                if V.shape[0]:
                    w = w - (V @ w) @ V
                for u in out:
                    w = w - (u @ w) * u
            norm = float(w.norm())
            if norm > 1e-10 * max(norm0, 1e-300) and norm > 0:
                out.append(w / norm)
                break
            if V.shape[0] + len(out) >= dim:
                return torch.stack(out) if out else W.new_zeros(0, dim)
            w = torch.randn(dim, generator=gen, dtype=torch.float64).to(dtype=dtype, device=device)
    return torch.stack(out) if out else W.new_zeros(0, dim)


def lanczos(
    matvec: Matvec,
    n: int | torch.Tensor,
    k: int = 1,
    which: str = "smallest",
    *,
    tol: float = 1e-8,
    max_iter: int | None = None,
    block_size: int | None = None,
    batched: bool = False,
    warn: bool = True,
    generator: torch.Generator | None = None,
    dtype: torch.dtype = torch.float64,
    device: torch.device | str | None = None,
) -> LanczosResult:
    r"""Extreme eigenpairs of a symmetric operator by block Lanczos with thick restarts.

    A block of ``block_size`` vectors (default k) grows an orthonormal basis ``V``
    (full reorthogonalization) with the operator's products ``A V`` kept beside it; Ritz
    pairs come from ``Vᵀ A V`` (Rayleigh–Ritz), and the next block is the residuals
    ``A x − θ x`` of the wanted pairs not yet converged, which continues the block Krylov
    space. A block of k vectors finds an eigenvalue k times when it is repeated (a single
    vector sees a repeated eigenvalue once, and would report the next one as its copy).
    Stops when every wanted pair has ``‖A x − θ x‖ ≤ tol · max|θ|``, when the basis
    spans the whole space (then exact), or after ``max_iter`` products (then it warns
    with :class:`LanczosWarning` unless ``warn=False``; ``converged`` says so and the
    residuals bound the error: some eigenvalue lies within ``‖r‖`` of each θ). Past
    ``max(4 (k + p), 100)`` basis vectors it restarts from its best Ritz vectors. All
    vectors stay on ``device``; ``k`` should stay small against the dimension.

    Args:
        matvec: ``v -> A v`` on tensors of the vector shape; with ``batched=True``,
            ``(p, *shape) -> (p, *shape)`` on a block (e.g. :func:`flashot.hvp` with a
            batch of directions, which shares its dual solve).
        n: the dimension, or a tensor whose shape is the vector shape.
        k: number of eigenpairs.
        which: ``"smallest"`` or ``"largest"`` (algebraic).
        tol: residual tolerance relative to the operator's estimated norm.
        max_iter: operator applications at most (default ``max(300, 20 k)``).
        block_size: vectors per block, p (default k).
        batched: ``matvec`` takes blocks.
        warn: warn when not converged.
        generator: RNG of the start block (default: a fixed seed, so that a call repeats
            and the global RNG is left alone).
        dtype, device: of the vectors (``n`` a tensor: its dtype and device).

    Returns:
        A :class:`LanczosResult` (``values, vectors = lanczos(...)`` still works).
    """
    if which not in ("smallest", "largest"):
        raise ValueError(f"which must be 'smallest' or 'largest', got {which!r}")
    if isinstance(n, torch.Tensor):
        shape, dtype, device = tuple(n.shape), n.dtype, n.device
    else:
        shape = (int(n),)
    dim = math.prod(shape)
    if not 1 <= k <= dim:
        raise ValueError(f"k must be in [1, {dim}], got {k}")
    p = k if block_size is None else int(block_size)
    if not 1 <= p <= dim:
        raise ValueError(f"block_size must be in [1, {dim}], got {block_size}")
    max_iter = max(300, 20 * k) if max_iter is None else int(max_iter)
    if max_iter < k:
        raise ValueError(f"max_iter must be ≥ k = {k}, got {max_iter}")
    if not (isinstance(tol, (int, float)) and tol > 0):
        raise ValueError(f"tol must be a positive float, got {tol!r}")
    cap = min(dim, max(4 * (k + p), 100))  # basis vectors before a restart
    gen = generator if generator is not None else torch.Generator().manual_seed(0)

    def apply(W: torch.Tensor) -> torch.Tensor:
        if batched:
            out = matvec(W.reshape(W.shape[0], *shape))
            return out.reshape(W.shape[0], dim).to(dtype=dtype, device=W.device)
        return torch.stack([matvec(w.reshape(shape)).reshape(dim).to(dtype=dtype, device=W.device)
                            for w in W])  # fmt: skip

    start = torch.randn(p, dim, generator=gen, dtype=torch.float64).to(dtype=dtype, device=device)
    V = start.new_zeros(0, dim)
    AV = start.new_zeros(0, dim)
    H = start.new_zeros(0, 0)
    W, used = start, 0
    while True:
        W = _orthonormal_block(W[: max(1, min(p, max_iter - used, dim - V.shape[0]))], V, gen,
                               dtype, start.device)  # fmt: skip
        if W.shape[0]:
            AW = apply(W)
            used += W.shape[0]
            cross = V @ AW.T  # (m, p): H's new columns; rows from the products' symmetry
            corner = W @ AW.T
            H = torch.cat([torch.cat([H, cross], 1),
                           torch.cat([cross.T, 0.5 * (corner + corner.T)], 1)], 0)  # fmt: skip
            V, AV = torch.cat([V, W]), torch.cat([AV, AW])
        theta, S = torch.linalg.eigh(0.5 * (H + H.T))
        if which == "largest":
            theta, S = theta.flip(0), S.flip(1)
        top = min(k, theta.shape[0])
        X, AX = S[:, :top].T @ V, S[:, :top].T @ AV
        R = AX - theta[:top, None] * X
        residuals = R.norm(dim=1)
        scale = max(float(theta.abs().max()) if theta.numel() else 0.0, 1e-300)
        done = top == k and bool((residuals <= tol * scale).all())
        if done or used >= max_iter or V.shape[0] >= dim or not W.shape[0]:
            break
        # the next block: residuals of the first unconverged wanted pairs, then of the
        # Ritz pairs beyond the k wanted (a block Krylov step from the Ritz vectors)
        order = [i for i in range(top) if float(residuals[i]) > tol * scale]
        order += list(range(top, theta.shape[0]))
        pick = torch.tensor(order[:p] or [0], device=S.device)
        W = S[:, pick].T @ AV - theta[pick, None] * (S[:, pick].T @ V)
        if cap < dim and V.shape[0] + W.shape[0] > cap:  # thick restart: the best Ritz vectors
            keep = min(cap - p, max(k + p, cap // 2), theta.shape[0])
            V, AV = S[:, :keep].T @ V, S[:, :keep].T @ AV
            H = torch.diag(theta[:keep])
    if top < k:  # (only an operator whose space has fewer than k dimensions)
        raise RuntimeError(f"lanczos: the space has dimension {top} < k = {k}")
    converged = done or V.shape[0] >= dim
    if not converged and warn:
        warnings.warn(
            f"lanczos did not reach tol={tol:g} after {used} operator applications: "
            f"residuals up to {float(residuals.max()):.3e} (relative "
            f"{float(residuals.max()) / scale:.1e}); each value is within its residual of "
            "an eigenvalue, not necessarily the wanted one (raise max_iter, or block_size "
            "for clustered eigenvalues)",
            LanczosWarning,
            stacklevel=2,
        )
    return LanczosResult(theta[:k].clone(), X.reshape(k, *shape), residuals, converged, used)
