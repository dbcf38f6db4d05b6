r"""Streamed sums of pairwise functions: kernel products and soft-minima, in PyTorch tiles.

GeomLoss' kernel losses and Hausdorff divergences reduce a function of the distance
:math:`r_{ij} = |x_i - y_j|` over one cloud:

* :func:`kernel_matvec`: :math:`(K w)_i = \sum_j k(r_{ij})\, w_j`;
* :func:`softmin`: :math:`s_i = -\varepsilon \log \sum_j e^{h_j - c(r_{ij})/\varepsilon}`
  for log-weights h (:math:`h = \log w`: the soft distance to the measure (w, y)).

Both run over (row block, column tile) pairs with at most ``budget`` elements of
coordinate differences per tile, each tile under activation checkpointing when a
gradient is wanted: memory is O((n + m) d + budget) for the value, the gradient and a
double backward alike, and autograd gives every derivative exactly. Distances are
formed from coordinate differences (not the expanded ``|x|² + |y|² − 2⟨x, y⟩``), so
coincident points are at distance exactly 0, where :math:`r` has the derivative 0 (its
subgradient at the origin) instead of NaN.

These are the reference engines of those losses on every device. A soft-minimum of a
:class:`~flashot.geometry.pair_costs.PairCost` with a Triton function (the built-in
``|x − y|`` and ``|x − y|²/2`` have one) runs instead in one fused kernel
(:mod:`flashot.backends.triton._pairwise`) on CUDA float32 clouds, or wherever
``backend="triton"`` is asked for and Triton runs; its gradient streams too, and a second
derivative recomputes here, in tiles.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator

import torch
from torch.utils.checkpoint import checkpoint

from flashot.geometry.pair_costs import KERNEL_COSTS, PairCost, distance_cost, half_square_cost

__all__ = ["KERNELS", "block_intervals", "block_sparse_softmin", "cost_of", "distance",
           "half_square", "kernel_matvec", "pair_scope", "softmin", "window_step",
           "window_transforms"]  # fmt: skip

#: the largest tile of coordinate differences, in elements
BUDGET = 1 << 20
#: the row blocks of a block-sparse layout (the fused kernel's BLOCK_M there)
SPARSE_BLOCK = 64
#: a block's column intervals separated by at most this many columns stream as one: the
#: fused kernel pads each interval to its 64-column tiles, and the few columns between
#: two kept runs cost less than a tile's padding (v50, two 20k spheres, cluster_scale
#: 0.02: tile work 9.2 → 4.2 % of the dense pairs, 8 363 → 2 370 intervals a pass)
SPARSE_GAP = 32


#: ``|x_i − y_j|`` (r, c) from differences; derivative 0 where the points coincide
distance = distance_cost
#: ``|x_i − y_j|² / 2`` (r, c) from differences
half_square = half_square_cost


def _kernel(name: str) -> Callable:
    """GeomLoss' kernel ``k(x, y)`` with its σ as ``blur`` (the pair cost of scaled clouds)."""
    cost, scaled = KERNEL_COSTS[name]

    def kernel(x, y, blur):
        return cost(x / blur, y / blur) if scaled else cost(x, y)

    return kernel


#: GeomLoss' kernels ``k(x, y)`` of the distance, by name (``blur`` = σ; energy ignores it)
KERNELS: dict[str, Callable] = {name: _kernel(name) for name in KERNEL_COSTS}


def cost_of(p: int) -> PairCost:
    """GeomLoss' ``C(x, y) = |x − y|^p / p`` for p = 1 or 2, a cost of two blocks."""
    if p == 1:
        return distance_cost
    if p == 2:
        return half_square_cost
    raise ValueError(f"p must be 1 or 2, got {p!r}")


def _tiles(n: int, m: int, d: int, budget: int) -> tuple[int, int]:
    side = max(1, int(math.sqrt(max(1, budget // max(1, d)))))
    return min(n, side), min(m, max(1, budget // (max(1, d) * min(n, side))))


def _run(fn, *args):
    """``fn(*args)``, checkpointed when autograd records it (its tile is then recomputed)."""
    if torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad
                                       for t in args):  # fmt: skip
        return checkpoint(fn, *args, use_reentrant=False)
    return fn(*args)


def kernel_matvec(x: torch.Tensor, y: torch.Tensor, w: torch.Tensor, kernel: Callable,
                  budget: int = BUDGET, backend: str = "auto") -> torch.Tensor:  # fmt: skip
    r"""``(K w)_i = Σ_j k(x_i, y_j) w_j``.

    Args:
        x: (n, d) rows.  y: (m, d) columns.  w: (m,) weights.
        kernel: ``kernel(x_block, y_block)`` → the (r, c) kernel tile; a
            :class:`~flashot.geometry.pair_costs.PairCost` (φ = k) may run fused.
        budget: the largest tile of coordinate differences, in elements.
        backend: as :func:`softmin`'s.

    Returns:
        (n,) in x's dtype; differentiable (twice) in x, y and w.
    """
    if isinstance(kernel, PairCost) and _fused(x, y, kernel, backend):
        if torch.is_grad_enabled() and any(t.requires_grad for t in (x, y, w)):
            return _Fused.apply(x, y, w, None, kernel, budget, None)
        from flashot.backends.triton._pairwise import fused_kernel_sum

        return fused_kernel_sum(x, y, w, kernel)
    n, m = x.shape[0], y.shape[0]
    bm, bn = _tiles(n, m, x.shape[1], budget)

    def tile(xb, yb, wb):
        return kernel(xb, yb) @ wb

    rows = []
    for i0 in range(0, n, bm):
        xb = x[i0 : i0 + bm]
        parts = [_run(tile, xb, y[j0 : j0 + bn], w[j0 : j0 + bn]) for j0 in range(0, m, bn)]
        rows.append(torch.stack(parts).sum(0))
    return torch.cat(rows)


def softmin(x: torch.Tensor, y: torch.Tensor, log_w: torch.Tensor, eps: float, cost: Callable,
            budget: int = BUDGET, backend: str = "auto") -> torch.Tensor:  # fmt: skip
    r"""``s_i = −ε log Σ_j exp(h_j − C(x_i, y_j)/ε)`` (GeomLoss' soft C-transform).

    With ``h = log w`` it is the soft distance from x_i to the measure (w, y); Sinkhorn
    steps pass ``h = log b + g/ε``.

    Args:
        x: (n, d) rows.  y: (m, d) columns.  log_w: (m,) the log-weights h, not all −∞.
        eps: ε > 0.  cost: ``cost(x_block, y_block)`` → the (r, c) cost tile.
        budget: the largest tile of coordinate differences, in elements.
        backend: ``"auto"`` (the fused kernel for a PairCost with a Triton function on
            CUDA float32 clouds), ``"triton"`` (the same wherever Triton runs, its
            interpreter included) or ``"torch"`` (tiles).

    Returns:
        (n,); differentiable (twice) in x, y and h.
    """
    if isinstance(cost, PairCost) and _fused(x, y, cost, backend):
        if torch.is_grad_enabled() and any(t.requires_grad for t in (x, y, log_w)):
            return _Fused.apply(x, y, log_w, eps, cost, budget, None)
        from flashot.backends.triton._pairwise import fused_softmin

        return fused_softmin(x, y, log_w, eps, cost)[0]
    n, m = x.shape[0], y.shape[0]
    bm, bn = _tiles(n, m, x.shape[1], budget)

    def tile(xb, yb, lw):
        return torch.logsumexp(lw[None, :] - cost(xb, yb) / eps, dim=1)

    rows = []
    for i0 in range(0, n, bm):
        xb = x[i0 : i0 + bm]
        parts = [_run(tile, xb, y[j0 : j0 + bn], log_w[j0 : j0 + bn]) for j0 in range(0, m, bn)]
        rows.append(torch.logsumexp(torch.stack(parts), dim=0))
    return -eps * torch.cat(rows)


def window_step(x, y, la, lb, f, g, eps: float, cost: Callable, backend: str = "auto",
                sparse=None, lse: bool = False):  # fmt: skip
    r"""``(softmin(x, y, lb + g/ε), softmin(y, x, la + f/ε))`` from one fused pass, or None.

    The pass (:mod:`flashot.backends.triton._pair_sums`) forms each cost once for both
    sides, stabilized by the current potentials f, g (any finite values give the same
    result; the nearer the fixed point, the fewer rows need the exact kernel after it).
    A self problem (``y is x``, ``la is lb``, ``f is g``) streams half the work. None
    where it does not run: a cost without a Triton function, the torch backend, float64,
    d > 128, inputs that need gradients, or ``torch.use_deterministic_algorithms`` (its
    row sums are atomic).

    Args:
        x: (n, d), y: (m, d) clouds.  la: (n,), lb: (m,) log-weights.
        f: (n,), g: (m,) the current potentials.  eps: ε.  cost, backend: as :func:`softmin`.
        sparse: None, or the layouts ``(rows, cols)`` of a cluster-pair mask and of its
            transpose (:func:`block_intervals`; x's blocks over y's intervals, y's over
            x's): each side's soft-minimum over its kept pairs, as
            :func:`block_sparse_softmin`'s.
        lse: each side as ``(soft-minimum, lse2)``, lse2 the base-2 LSE its gradient
            kernel takes.
    """
    if not (isinstance(cost, PairCost) and _fused(x, y, cost, backend)):
        return None
    if torch.are_deterministic_algorithms_enabled() or (
        torch.is_grad_enabled() and any(t.requires_grad for t in (x, y, la, lb, f, g))
    ):
        return None
    from flashot.backends.triton._pair_sums import MAX_D, window_softmins

    if x.shape[1] > MAX_D:
        return None
    _check_layout(*(sparse or ()))
    return window_softmins(x, y, la, lb, f, g, eps, cost, sparse, lse)


def window_transforms(x, y, la, lb, f, g, eps: float, cost: Callable, backend: str = "auto",
                      sparse=None):  # fmt: skip
    r"""GeomLoss' final extrapolation from one window pass (:func:`window_step`), or None.

    ``(softmin(x, ȳ, lb + g/ε), softmin(y, x̄, la + f/ε))``, each differentiable in its
    first cloud only (x, then y; the bar: held fixed, with the weights and potentials),
    as :func:`~flashot.solver.tiled_loop.geomloss_potentials` differentiates them: the
    forward from one pass, the gradient by the fused kernel from the pass's LSEs. A self
    problem (``y is x``, ``la is lb``, ``f is g``) returns its one soft-minimum twice,
    from half a pass. ``sparse``: as :func:`window_step`'s (the gradient streams each
    side's own layout; its normalizer came from the pass, whose rows may see a differently
    padded set of kept pairs: a difference below the truncation). None where the window
    pass does not run.

    Args:
        x: (n, d), y: (m, d) clouds (x may need a gradient).  la: (n,), lb: (m,)
        log-weights.  f: (n,), g: (m,) the current potentials.  eps, cost, backend: as
        :func:`softmin`.
    """
    self_problem = y is x and la is lb and f is g
    xd, f, la = x.detach(), f.detach(), la.detach()
    yd, g, lb = (xd, f, la) if self_problem else (y.detach(), g.detach(), lb.detach())
    got = window_step(xd, yd, la, lb, f, g, eps, cost, backend, sparse, lse=True)
    if got is None:
        return None
    rows, cols = sparse if sparse is not None else (None, None)
    f_new = _given(x, yd, lb + g / eps, eps, cost, rows, got[0])
    if self_problem:
        return f_new, f_new
    return f_new, _given(y, xd, la + f / eps, eps, cost, cols, got[1])


def _given(x, y, h, eps, cost, sparse, given):
    """The soft-minimum ``given`` as (value, lse2), differentiable in x where it needs it."""
    if torch.is_grad_enabled() and x.requires_grad:
        return _Fused.apply(x, y, h, eps, cost, BUDGET, sparse, given)
    return given[0]


@contextlib.contextmanager
def pair_scope(x: torch.Tensor, y: torch.Tensor, cost: Callable, backend: str = "auto"
               ) -> Iterator[None]:  # fmt: skip
    """Inside, the fused kernels prepare each pair of clouds once (a schedule's many calls).

    Centring, norms and split parts (:mod:`flashot.backends.triton._pair_operands`) are
    then made once per pair instead of once per soft-minimum; results are unchanged. A
    no-op where the soft-minima of ``x`` and ``y`` under ``cost`` do not run fused.
    """
    if isinstance(cost, PairCost) and _fused(x, y, cost, backend):
        from flashot.backends.triton._pair_operands import pair_scope as scope

        with scope():
            yield
    else:
        yield


def _fused(x, y, cost: PairCost, backend: str) -> bool:
    """Whether the fused kernel computes this soft-minimum or kernel sum."""
    if backend not in ("auto", "triton", "torch"):
        raise ValueError(f"backend must be 'auto', 'triton' or 'torch', got {backend!r}")
    if backend == "torch" or cost.triton_fn is None:
        return False
    if any(t.dtype != torch.float32 for t in (x, y)) or (backend == "auto" and not x.is_cuda):
        return False
    from flashot.backends import available_backends

    return "triton" in available_backends(x.device)


class _Fused(torch.autograd.Function):
    """The fused soft-minimum (``eps`` a float) or kernel sum (``eps`` None), differentiable.

    Its gradient streams when the cost has ``triton_grad`` and d ≤ GRAD_UP_TO; otherwise,
    and for second derivatives, it recomputes in PyTorch tiles under autograd.
    """

    @staticmethod
    def forward(ctx, x, y, vec, eps, cost, budget, sparse=None, given=None):
        """``given``: the soft-minimum's ``(value, lse2)``, computed already (a window pass)."""
        from flashot.backends.triton import _pairwise

        if given is not None:
            out, lse = given
        elif eps is None:
            out, lse = _pairwise.fused_kernel_sum(x, y, vec, cost), None
        else:
            out, lse = _pairwise.fused_softmin(x, y, vec, eps, cost, sparse)
        ctx.save_for_backward(x, y, vec, lse)
        ctx.eps, ctx.cost, ctx.budget, ctx.sparse = eps, cost, budget, sparse
        return out

    @staticmethod
    def backward(ctx, grad_out):
        from flashot.backends.triton._pairwise import GRAD_UP_TO, fused_grads

        x, y, vec, lse = ctx.saved_tensors
        need = ctx.needs_input_grad[:3]
        d = x.shape[1]
        create_graph = torch.is_grad_enabled()  # (backward runs with grad mode = create_graph)
        sparse = ctx.sparse
        if (not create_graph and ctx.cost.triton_grad is not None and d <= GRAD_UP_TO
                and not (sparse is not None and (need[1] or need[2]))):  # fmt: skip
            got3 = fused_grads(x, y, vec, ctx.eps, ctx.cost, lse, grad_out, need[0],
                               need[1] or need[2], sparse)  # fmt: skip
            grads = [t if want else None for t, want in zip(got3, need, strict=True)]
            return (*grads, None, None, None, None, None)
        with torch.enable_grad():  # (create_graph: the saved inputs carry their graphs)
            ins = [t if create_graph else t.detach().requires_grad_(w)
                   for t, w in zip((x, y, vec), need, strict=True)]  # fmt: skip
            if ctx.eps is None:
                out = kernel_matvec(*ins, ctx.cost, ctx.budget, backend="torch")
            elif sparse is not None:
                out = _intervals_softmin(*ins, ctx.eps, ctx.cost, sparse, ctx.budget)
            else:
                out = softmin(*ins, ctx.eps, ctx.cost, ctx.budget, backend="torch")
            wanted = [t for t, w in zip(ins, need, strict=True) if w]
            got = iter(torch.autograd.grad(out, wanted, grad_out, create_graph=create_graph))
        return (*[next(got) if w else None for w in need], None, None, None, None, None)


def _ranges(starts: torch.Tensor, stops: torch.Tensor, total: int):
    """``(owner, index)``: every index of the ranges ``[starts[k], stops[k])``, with its k.

    ``total``: the ranges' summed length (read by the caller, so this waits for nothing).
    """
    span = stops - starts
    owner = torch.repeat_interleave(torch.arange(len(span), device=span.device), span,
                                    output_size=total)  # fmt: skip
    first = torch.cumsum(span, 0) - span  # (each range's place in the output)
    return owner, starts[owner] + torch.arange(total, device=span.device) - first[owner]


def block_intervals(row_starts, col_starts, pairs, bm: int = SPARSE_BLOCK,
                    gap: int | None = None, n_rows: int | None = None):  # fmt: skip
    """A block-sparse layout ``(ptr, iv, BLOCK_M)`` for rows and columns sorted by cluster.

    Row block b (BLOCK_M sorted rows) streams the column intervals ``iv[ptr[b]:ptr[b+1]]``:
    the column clusters paired with any row cluster meeting the block, runs at most
    ``gap`` columns apart merged (adjacent clusters always). A row thus sees every
    column its own cluster keeps, and perhaps more: more terms of the same soft-minimum,
    never fewer. Two waits for the device (the pairs the blocks meet, then the
    intervals' count; three without ``n_rows``): a fine step builds several layouts.

    Args:
        row_starts: (K_r + 1,) offsets of the row clusters in sorted order.
        col_starts: (K_c + 1,) of the column clusters.
        pairs: ``(I, J)``, the kept cluster pairs, sorted by I (then J); a pair given
            twice is covered once.
        bm: BLOCK_M, the rows of a block (≥ 16: the fused kernel's tiles).
        gap: the widest run of unkept columns an interval may span (0: exact cover;
            None: :data:`SPARSE_GAP`).
        n_rows: the rows' count, ``row_starts[-1]`` (None: read from the device).
    """
    gap = SPARSE_GAP if gap is None else gap
    dev = row_starts.device
    kr, kc = len(row_starts) - 1, len(col_starts) - 1
    n = int(row_starts[-1]) if n_rows is None else n_rows
    blocks = -(-n // bm)
    first = torch.arange(blocks, device=dev) * bm
    last = torch.clamp(first + bm, max=n) - 1
    lo = torch.searchsorted(row_starts[1:].contiguous(), first, right=True)
    hi = torch.searchsorted(row_starts[1:].contiguous(), last, right=True)
    # each block's row clusters lo..hi own a contiguous run of the sorted pairs
    by_row = torch.searchsorted(pairs[0].contiguous(), torch.arange(kr + 1, device=dev))
    begin, end = by_row[lo], by_row[hi + 1]
    total = int((end - begin).sum())
    if total == 0:  # (nothing kept anywhere)
        return (torch.zeros(blocks + 1, dtype=torch.int32, device=dev),
                torch.zeros(0, 2, dtype=torch.int32, device=dev), bm)  # fmt: skip
    blk, idx = _ranges(begin, end, total)
    # sorted by block, then column cluster; a repeated cluster merges like an adjacent one
    key = torch.sort(blk * kc + pairs[1][idx]).values
    kb, kcl = key // kc, key % kc
    new = torch.ones_like(kb, dtype=torch.bool)
    new[1:] = (kb[1:] != kb[:-1]) | (col_starts[kcl[1:]] - col_starts[kcl[:-1] + 1] > gap)
    starts = torch.nonzero(new).flatten()
    ends = torch.cat([starts[1:], starts.new_tensor([len(kcl)])]) - 1
    iv = torch.stack([col_starts[kcl[starts]], col_starts[kcl[ends] + 1]], 1).to(torch.int32)
    # (interval k belongs to block kb[starts[k]], ascending: each block's first interval)
    ptr = torch.searchsorted(kb[starts], torch.arange(blocks + 1, device=dev)).to(torch.int32)
    return ptr, iv.contiguous(), bm


def block_sparse_softmin(x, y, log_w, eps: float, cost, layout, backend: str = "auto"):
    r""":func:`softmin` of each row over its block's column intervals only.

    Args:
        x: (n, d) rows, sorted by cluster.  y: (m, d) columns, sorted by cluster.
        log_w: (m,) log-weights h.  eps: ε.  cost: the cost (a PairCost runs fused).
        layout: ``(ptr, iv, BLOCK_M)`` (:func:`block_intervals`):
            the rows ``[b·BLOCK_M, (b + 1)·BLOCK_M)`` reduce over the columns of the
            intervals ``iv[ptr[b]:ptr[b + 1]]``.
        backend: ``"auto"``/``"triton"``: the fused kernel where :func:`softmin` would
            take it (and no gradient reaches y or h); otherwise PyTorch, block by block.

    Returns:
        (n,); differentiable (twice) in x (and in y, h through the PyTorch path).
    """
    _check_layout(layout)
    if (isinstance(cost, PairCost) and _fused(x, y, cost, backend)
            and not (y.requires_grad or log_w.requires_grad)):  # fmt: skip
        if torch.is_grad_enabled() and x.requires_grad:
            return _Fused.apply(x, y, log_w, eps, cost, BUDGET, layout)
        from flashot.backends.triton._pairwise import fused_softmin

        return fused_softmin(x, y, log_w, eps, cost, layout)[0]
    return _intervals_softmin(x, y, log_w, eps, cost, layout, BUDGET)


def _check_layout(*layouts) -> None:
    """Layouts whose every row block streams an interval (else its soft-minimum is +inf).

    One wait for the device however many layouts.
    """
    empty = [(ptr[1:] == ptr[:-1]).any() for ptr, *_ in layouts]
    if empty and bool(torch.stack(empty).any()):
        raise ValueError("a row block of the layout has no column interval: its soft-minimum "
                         "would be +inf")  # fmt: skip


def _intervals_softmin(x, y, log_w, eps, cost, layout, budget):
    """The PyTorch reference of :func:`block_sparse_softmin` (a loop over row blocks)."""
    ptr, iv, bm = (t.tolist() if isinstance(t, torch.Tensor) else t for t in layout)
    parts = []
    for blk in range(len(ptr) - 1):
        cols = torch.cat([torch.arange(c0, c1, device=y.device)
                          for c0, c1 in iv[ptr[blk] : ptr[blk + 1]]])  # fmt: skip
        rows = x[blk * bm : (blk + 1) * bm]
        parts.append(softmin(rows, y[cols], log_w[cols], eps, cost, budget, backend="torch"))
    return torch.cat(parts)
