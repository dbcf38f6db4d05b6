r"""Block-diagonal problems: many independent (row, column) pairs packed in one form.

A batch of B problems packs its clouds end to end, as FlashAttention's ``cu_seqlens``
does: problem ``s`` owns rows ``[r_s, r_{s+1})`` and columns ``[c_s, c_{s+1})``. The
packed cost is block diagonal,

.. math::

    C_{ij} = \begin{cases} C^{(s)}_{ij} & i, j \text{ in problem } s \\
                           +\infty & \text{otherwise,} \end{cases}

so every row reduction of the packed form (a soft c-transform, a plan product) only
sees its own problem's columns, and the packed Sinkhorn iterates are exactly the B
problems' iterates side by side. Backends stream only the diagonal blocks (the
Triton kernels read a table of row blocks, one launch for the whole batch); sums over
the packed vectors (the marginal error, the value) are split back per problem with
:meth:`Segments.sum`.
"""

from __future__ import annotations

import itertools
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

__all__ = ["Segments", "other_masses", "problem_sums"]

#: device tables shared by packings of the same offsets (a training loop packs its batch
#: anew each call: without this, every call copied its tables from the host again)
SHARED_TABLES = 32
_SHARED: OrderedDict = OrderedDict()
_SHARED_LOCK = threading.RLock()  # (solves may run in several threads; builds nest)


@dataclass(frozen=True, eq=False)
class Segments:
    """The packing of a batch of problems (see module).

    Attributes:
        rows: B + 1 row offsets, ``rows[0] = 0``, nondecreasing, host integers.
        cols: B + 1 column offsets, the same for the columns.
        bounds: a bound on each problem's cost (B floats), or None when unknown; it
            decides per problem whether the near-uniform LSE runs
            (:mod:`flashot.backends.near`).
    """

    rows: tuple[int, ...]
    cols: tuple[int, ...]
    bounds: tuple[float, ...] | None = None
    _cache: dict = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self):
        if len(self.rows) != len(self.cols) or len(self.rows) < 2:
            raise ValueError("row and column offsets must both have B + 1 ≥ 2 entries")
        for off, name in ((self.rows, "row"), (self.cols, "column")):
            if off[0] != 0 or any(b < a for a, b in itertools.pairwise(off)):
                raise ValueError(f"{name} offsets must start at 0 and never decrease")

    @property
    def count(self) -> int:
        """B, the number of problems."""
        return len(self.rows) - 1

    @property
    def T(self) -> Segments:
        """The packing of the transposed problems (one object per packing: caches stay)."""
        t = self._cache.get("T")
        if t is None:
            t = self._cache["T"] = Segments(self.cols, self.rows, self.bounds)
            t._cache["T"] = self
        return t

    def scaled_bounds(self, factor: float) -> Segments:
        """The same packing with every problem's cost bound times ``factor``.

        Itself when the bounds are unknown; the device tables built so far are shared.
        """
        if self.bounds is None:
            return self
        out = Segments(self.rows, self.cols, tuple(factor * b for b in self.bounds))
        out._cache.update((k, v) for k, v in self._cache.items() if k != "T")
        return out

    @property
    def elements(self) -> int:
        """``Σ_s n_s m_s``: the entries of the diagonal blocks (what a pass streams)."""
        key = "elements"
        if key not in self._cache:
            sizes = zip(itertools.pairwise(self.rows), itertools.pairwise(self.cols),
                        strict=True)  # fmt: skip
            self._cache[key] = sum((r1 - r0) * (c1 - c0) for (r0, r1), (c0, c1) in sizes)
        return self._cache[key]

    @property
    def widest_cols(self) -> int:
        """The most columns of any problem (what a split of a packed launch cuts)."""
        if "widest_cols" not in self._cache:
            self._cache["widest_cols"] = max(self.T.row_counts)
        return self._cache["widest_cols"]

    @property
    def row_counts(self) -> tuple[int, ...]:
        """Each problem's number of rows (host integers)."""
        return tuple(b - a for a, b in itertools.pairwise(self.rows))

    def row_slice(self, s: int) -> slice:
        """Problem ``s``'s rows."""
        return slice(self.rows[s], self.rows[s + 1])

    def col_slice(self, s: int) -> slice:
        """Problem ``s``'s columns."""
        return slice(self.cols[s], self.cols[s + 1])

    def device_table(self, key: tuple, build: Callable[[], object]):
        """``build()``, cached on this packing and shared with packings of its offsets.

        For tables that depend on the offsets and ``key`` alone (the key names the
        device and dtype); callers must not write to what it returns.
        """
        if key not in self._cache:
            shared = (self.rows, self.cols, *key)
            with _SHARED_LOCK:
                table = _SHARED.get(shared)
                if table is None:
                    table = _SHARED[shared] = build()
                _SHARED.move_to_end(shared)
                while len(_SHARED) > SHARED_TABLES:
                    _SHARED.popitem(last=False)
            self._cache[key] = table
        return self._cache[key]

    def row_ids(self, device: torch.device) -> torch.Tensor:
        """(n,) int64: the problem of every packed row (cached per device)."""

        def build():
            sizes = torch.tensor(self.row_counts)
            return torch.repeat_interleave(torch.arange(self.count), sizes).to(device)

        return self.device_table(("row_ids", str(device)), build)

    def sum(self, t: torch.Tensor) -> torch.Tensor:
        """Per-problem sums (B, ...) of a packed row vector ``t`` (n, ...); differentiable."""
        out = t.new_zeros((self.count, *t.shape[1:]))
        return out.index_add(0, self.row_ids(t.device), t)

    def blocks(self, block: int, device: torch.device) -> torch.Tensor:
        """(programs, 4) int32 table of row blocks: ``(row_lo, row_hi, col_lo, col_hi)``.

        Each problem's rows are cut into blocks of ``block`` rows, so that a program never
        holds rows of two problems; the columns are its problem's. Cached per size.
        """

        def build():  # (vectorized: a batch has thousands of blocks)
            rows, cols = torch.tensor(self.rows), torch.tensor(self.cols)
            count = (rows[1:] - rows[:-1] + block - 1) // block  # blocks per problem
            owner = torch.repeat_interleave(torch.arange(self.count), count)
            first = torch.cumsum(count, 0) - count  # each problem's first block
            lo = rows[owner] + (torch.arange(len(owner)) - first[owner]) * block
            hi = torch.minimum(rows[owner + 1], lo + block)
            table = torch.stack([lo, hi, cols[owner], cols[owner + 1]], 1)
            if len(table) == 0:
                table = torch.zeros(1, 4, dtype=torch.int64)
            return table.to(torch.int32).to(device)

        return self.device_table(("blocks", block, str(device)), build)

    def sample_rows(self, step: int, device: torch.device) -> tuple[torch.Tensor, Segments]:
        """Every ``step``-th row of each problem, from its first: ``(index, packing)``.

        ``index``: (k,) int64 packed row numbers on ``device``; ``packing``: the sampled
        rows' offsets with these columns. Cached per step and device.
        """

        def build():
            picks = [range(a, b, step) for a, b in itertools.pairwise(self.rows)]
            index = torch.tensor([i for rows in picks for i in rows], dtype=torch.int64)
            rows = tuple(itertools.accumulate((len(r) for r in picks), initial=0))
            return index.to(device), Segments(rows, self.cols, self.bounds)

        return self.device_table(("sample", step, str(device), self.bounds), build)

    def near(self, eps: float, near_from: float) -> bool:
        """Whether any problem takes the near-uniform LSE at ``eps``."""
        return self.bounds is not None and eps >= near_from * min(self.bounds, default=0.0)


def problem_sums(t: torch.Tensor, segments: Segments | None) -> torch.Tensor:
    """``Σ t`` over the problem of each entry, for every entry of t (n, ...).

    Unpacked (one problem): the sum over all, shape ``t.shape[1:]``.
    """
    if segments is None:
        return t.sum(0)
    return segments.sum(t)[segments.row_ids(t.device)]


def other_masses(w: torch.Tensor, segments: Segments | None, like: torch.Tensor):
    """The mass of the other side's weights ``w`` in the problem of each entry of ``like``.

    ``segments``: the packing seen from ``like``'s side (None: ``w.sum()``).
    """
    if segments is None:
        return w.sum()
    return segments.T.sum(w)[segments.row_ids(like.device)]
