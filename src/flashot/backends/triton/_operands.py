"""How the Triton kernels read the clouds: float32, half copies, split parts or triples.

:class:`Operands` (a :class:`~flashot.backends.triton.TritonBackend`'s ``operands``) holds
that: per precision mode, the operand a kernel takes for a feature matrix, converted
once and shared by the launches that reuse it, and the MMA precisions the kernels use.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable

import torch

from flashot.backends.device import triton_interpreted
from flashot.backends.triton._scores import (
    auto_caches,
    cached_dot,
    cached_views,
    fits,
    score_matrix,
    scores_bytes,
)
from flashot.backends.triton._split import (
    SCORE_LO_BITS,
    VALUE_LO_BITS,
    SplitOperand,
    split_operand,
)
from flashot.backends.triton._triples import TRIPLE_UP_TO, triple_pair

__all__ = ["SPLIT_DOT", "Operands", "score_operands", "split_work"]

#: the eager calls' choices to cache scores, by :meth:`Operands._choice_key`: a capture
#: repeats its eager call's (it must not ask the driver for free memory while capturing)
#: and a replay counts what its capture formed. Shared by the backends as the captured
#: graphs are (:data:`flashot.solver.graphs.GRAPHS` keys on the backends' launch keys).
_CHOICES: dict = {}

# tl.dot input precisions per mode (float32 operands); the interpreter knows only IEEE
_DOT = {"fp32": "tf32x3", "tf32": "tf32", "bf16": "tf32", "fp16": "tf32"}
#: the tile tables' name for the split score operands' dot (:mod:`._split`)
SPLIT_DOT = "split16"

_HALF = {"bf16": torch.bfloat16, "fp16": torch.float16}
#: ``presplit=None`` splits a launch's operands when its :func:`split_work` reaches this:
#: below, the conversions cost more than the MMAs they save (H200, the GeomLoss call at
#: 10k d = 3: 10.8 → 7.3 ms without, v18), above they pay (50k d = 3 99 → 59 ms, 50k
#: d = 64 189 → 96 ms, 10k d = 512 with the gradient 44 → 24 ms; v26, with the call's
#: CUDA graphs, 10k d = 64 9.82 → 9.49 ms)
PRESPLIT_FROM = 1 << 34
#: ... and while both operands' copies (4 bytes per point and feature, as much as the
#: float32 operands themselves) stay within this many bytes; above, every pass reads the
#: operands with 3xTF32 per tile instead (OTDD at 60k, d' = 804: 386 MB of copies, a
#: whole-process peak of 1.32 GB on the H100 in v44, against 0.75 GB in tf32)
PRESPLIT_MAX_BYTES = 1 << 28


def split_work(elements: int, d: int) -> int:
    """A launch's size for :data:`PRESPLIT_FROM`: ``elements·max(4d, 64)``.

    ``elements``: its n·m scores. A tile costs at least what d = 16 costs (exps,
    reductions); from there the MMAs the split saves grow with d while its conversions
    stay per point, so wide features count four-fold (10k d = 64 splits, 10k d = 3 not).
    """
    return elements * max(4 * d, 64)


class Operands:
    """Conversions of q and k for the kernels, cached (one per Triton backend).

    Args:
        precision: the backend's mode (``"fp32"``, ``"tf32"``, ``"bf16"``, ``"fp16"``).
        presplit: the backend's ``presplit`` option (None, True or False).
        scores: the backend's ``scores`` option: ``"stream"`` or ``"cache"``
            (:meth:`cached_scores`).
    """

    def __init__(self, precision: str, presplit: bool | None, scores: str = "stream"):
        self.precision, self.presplit, self.scores = precision, presplit, scores
        self._reset()

    def _reset(self) -> None:
        self.cache: list = []  # (weakref to the source, its version, captured, kind, copy)
        # (weakrefs to q and k, their versions, captured, the score matrix)
        self.matrices: list = []
        self.scopes = 0
        #: the most bytes of score matrices held at once since :meth:`take_held`
        self.peak_held = 0
        self._forget = _forgetter(weakref.ref(self))

    def __getstate__(self) -> dict:
        """Options only (pickling): the cached operands are rebuilt on demand."""
        return {"precision": self.precision, "presplit": self.presplit, "scores": self.scores}

    def __setstate__(self, state: dict) -> None:
        self.precision, self.presplit = state["precision"], state["presplit"]
        self.scores = state.get("scores", "auto")
        self._reset()

    def dot(self, triples: bool = False) -> str:
        """The score MMAs' ``input_precision`` (``triples``: one TF32 product of triples)."""
        if triton_interpreted():
            return "ieee"
        return "tf32" if triples else _DOT[self.precision]

    def kernel_dot(self, dot: str) -> str:
        """The kernels' ``PRECISION`` for a tile key's dot (split parts do not read it)."""
        return self.dot() if dot == SPLIT_DOT else dot

    def splits_values(self, presplit: bool, d: int) -> bool:
        """Whether value products split their values once per launch (else per tile).

        Where the scores read split parts (``presplit``, from :meth:`for_launch`) or
        triples (d ≤ :data:`TRIPLE_UP_TO` in "fp32"): values into half parts
        (:func:`._split.split_keys`), the weights (at most 1) split per tile, three half
        MMAs. On triples this replaced 3xTF32 value products (sm_90: 21.0 → 15.4
        instructions a score at d = 3, NOTES.md). Not beside 3xTF32 score tiles: that loop
        faulted with an illegal address under Triton 3.6 (H100, v58).
        """
        return presplit or self.triples(d)

    def triples(self, d: int) -> bool:
        """Whether score operands of d features are triples (:mod:`._triples`).

        In "fp32" with ``presplit=None`` (``False`` asks for 3xTF32 per tile, ``True``
        for split parts), up to :data:`TRIPLE_UP_TO` features.
        """
        return self.precision == "fp32" and self.presplit is None and d <= TRIPLE_UP_TO

    def score_pair(self, q: torch.Tensor, k: torch.Tensor, keep_q: bool = True,
                   work: int | None = None):  # fmt: skip
        """``(Q, K, split_args, presplit, triples)``: a launch's score operands.

        As :func:`score_operands`, or triples (:mod:`._triples`; then ``triples`` is True
        and the kernels read plain float32 operands of 16 features with one TF32 MMA).
        ``keep_q``: cache q's copy; ``work``: the launch's :func:`split_work`.
        """
        if self.triples(q.shape[1]):
            qt, kt = self.operand(q, keep_q, triples=True)[0], self.operand(k, triples=True)[1]
            return qt, kt, _split_args(qt, kt, 0, 0), False, True
        copies = 4 * (q.shape[0] + k.shape[0]) * q.shape[1]
        qs = self.operand(q, keep_q, work, copies=copies)
        return (*score_operands(qs, self.operand(k, work=work, copies=copies)), False)

    def for_launch(self, q: torch.Tensor, k: torch.Tensor, segments=None, keep_q: bool = True):
        """``(Q, K, split_args, presplit, dot)``: a score launch's operands and its tile dot.

        :meth:`score_pair` with the launch's :func:`split_work` (a packed batch's
        ``segments`` count their diagonal blocks only); ``dot`` is the tile tables' name
        of the score MMAs (:data:`SPLIT_DOT` for split parts; :meth:`kernel_dot` maps it
        to the kernels' ``PRECISION``).
        """
        if segments is None:
            cached = self.cached_scores(q, k)
            if cached is not None:  # (one-column views of the matrix: see ._scores)
                qv, kv, transposed = cached
                return qv, kv, _split_args(qv, kv, 0, 0), False, cached_dot(transposed)
        elements = q.shape[0] * k.shape[0] if segments is None else segments.elements
        qs, ks, split_args, presplit, triples = self.score_pair(
            q, k, keep_q, split_work(elements, q.shape[1])
        )
        return qs, ks, split_args, presplit, SPLIT_DOT if presplit else self.dot(triples)

    def splits(self, work: int | None = None, copies: int | None = None) -> bool:
        """Whether score operands are split once per solve (:mod:`._split`).

        ``work``: the launch's :func:`split_work`, which decides for ``presplit=None``
        (:data:`PRESPLIT_FROM`), with ``copies``, the bytes the split copies of both
        operands take (:data:`PRESPLIT_MAX_BYTES`); None asks whether this backend
        ever splits.
        """
        if self.precision != "fp32" or self.presplit is False:
            return False
        if self.presplit is True or work is None:
            return True
        return work >= PRESPLIT_FROM and (copies is None or copies <= PRESPLIT_MAX_BYTES)

    def cached_scores(self, q: torch.Tensor, k: torch.Tensor):
        """``(Q, K, transposed)``: views of the score matrix of q and k, or None.

        ``q`` (n, d), ``k`` (m, d); the views are :func:`._scores.cached_views`'s
        (``transposed``: the matrix was formed for (k, q)).

        Within a :meth:`scope` (a solve), where :meth:`caches` says so: the scores formed
        once (:func:`._scores.score_matrix`, this mode's precision, stored as ``k qᵀ``;
        ``transposed`` is then True) and shared by
        every launch of the scope, the transposed problem's (k, q) included; dropped when
        the scope ends. A CUDA graph capture forms its own (in the graph's memory pool,
        held while the graph is) and reads no matrix formed outside it. None otherwise:
        the launch streams.
        """
        if self.scopes == 0 or not self._wants(q.shape[1]):
            return None  # (before any other check: every launch of a solve asks)
        capturing = q.is_cuda and torch.cuda.is_current_stream_capturing()
        for ref_q, ref_k, versions, captured, matrix in self.matrices:
            if captured != capturing:
                continue  # (a graph reads only what it formed, and nothing outlives it)
            if ref_q() is q and ref_k() is k and versions == (_version(q), _version(k)):
                return (*cached_views(matrix), False)
            if ref_q() is k and ref_k() is q and versions == (_version(k), _version(q)):
                return (*cached_views(matrix, transposed=True), True)
        if not self.caches(q, k, capturing):
            return None
        # formed as k qᵀ: the kernels read a tile of the transpose with its rows in
        # contiguous lanes, where the row reductions stay in a thread (sm_90 count,
        # tests/probes/sass_loops.py: the symmetric step's pass 15.4 → 8.4 instructions
        # a score, a row pass 26.3 → 11.3); the symmetric and SamplesLoss' steps
        # mostly launch (q, k), the alternating one both ways alike
        matrix = score_matrix(self, k, q)
        # (kept until the scope ends: a debiased solve's steps visit three pairs in turn)
        entry = (weakref.ref(k), weakref.ref(q), (_version(k), _version(q)), capturing, matrix)
        self.matrices.append(entry)
        self.peak_held = max(self.peak_held, self._held())
        return (*cached_views(matrix, transposed=True), True)

    def caches(self, q: torch.Tensor, k: torch.Tensor, capturing: bool = False) -> bool:
        """Whether a scope forms the score matrix of q (n, d) and k (m, d).

        ``scores="cache"``: where the matrix fits (:func:`._scores.fits`); ``"auto"``:
        also only from :data:`._scores.AUTO_FROM_D` features. A capture (``capturing``)
        repeats the choice of the eager call of its shapes (a graph's first call is
        eager), and streams without one.
        """
        key = self._choice_key(q, k)
        if not self._wants(q.shape[1]):
            return False
        if capturing:
            return _CHOICES.get(key, False)
        held = self._held(eager=True)
        choice = _CHOICES[key] = fits(q.shape[0], k.shape[0], q.device, held)
        if len(_CHOICES) > 64:  # (varying shapes: the oldest choices go)
            _CHOICES.pop(next(iter(_CHOICES)))
        return choice

    def _wants(self, d: int) -> bool:
        """Whether the ``scores`` option asks for cached scores of d-feature operands."""
        return self.scores == "cache" or (self.scores == "auto"
                                          and auto_caches(self.precision, d))  # fmt: skip

    def _held(self, eager: bool = False) -> int:
        """Bytes of the matrices held now (``eager``: those formed outside captures)."""
        return sum(scores_bytes(*e[-1].shape) for e in self.matrices if not (eager and e[3]))

    def _choice_key(self, q: torch.Tensor, k: torch.Tensor) -> tuple:
        """What a choice depends on besides free memory: shapes, device and options."""
        return (q.shape[0], k.shape[0], q.shape[1], q.device, self.precision, self.scores)

    def replayed(self, q: torch.Tensor, k: torch.Tensor) -> None:
        """A graph of a solve of q and k replayed: its capture's matrix counts as held."""
        if _CHOICES.get(self._choice_key(q, k)):
            self.peak_held = max(self.peak_held, scores_bytes(q.shape[0], k.shape[0]))

    def take_held(self) -> int:
        """The most bytes of score matrices held at once since the last call (0: none)."""
        held, self.peak_held = self.peak_held, 0
        return held

    @contextlib.contextmanager
    def scope(self, carry: list | None = None):
        """See :meth:`flashot.backends.base.Backend.operand_scope`.

        Split operands are made and shared within (a solve's launches), dropped after;
        with ``carry`` its entries are served within and the block's are left in it.
        """
        self.scopes += 1
        if carry:
            held = [e for e in carry if not any(e is h for h in self.cache)]
            self.cache = [*self.cache, *held][-4:]
        try:
            yield
        finally:
            self.scopes -= 1
            if carry is not None:
                carry[:] = [e for e in self.cache if e[0]() is not None]
            if self.scopes == 0:
                self.matrices = []
                if self.splits():
                    self.cache = []

    def operand(self, t: torch.Tensor, keep: bool = True, work: int | None = None,
                triples: bool = False, copies: int | None = None, value: bool = False):  # fmt: skip
        """A feature matrix as the kernels read it: float32, a half copy, parts or triples.

        ``triples``: both sides' triples (:func:`._triples.triple_pair`); ``value``: a
        value product's values (split parts keep their low part scaled, :mod:`._split`),
        not score operands. Copies are cached
        (``keep``); ``work`` is the launch's :func:`split_work` and ``copies`` the bytes
        of both operands' split copies (see :meth:`splits`).
        Split parts (``"fp32"``) are made only within
        :meth:`scope` (a solve's many passes share them); a pass outside one
        reads the float32 features with 3xTF32 and needs no copy.
        """
        if t.dtype != torch.float32:
            raise TypeError(f"the triton backend computes in float32, got {t.dtype}")
        convert: Callable[[torch.Tensor], torch.Tensor | SplitOperand]
        if triples:
            convert = triple_pair
        elif self.splits(work, copies):
            if self.scopes == 0:  # a one-off pass: 3xTF32 per tile, no copy
                return t
            convert = self.value_parts if value else self.split_parts
        elif self.precision in _HALF:
            convert = self.half
        else:
            return t
        if not keep or t.is_inference():  # a one-off sample; no version counter to key on
            return convert(t)
        # the solver reuses q and k: convert each once. Entries hold a weak reference to
        # their source, so a new tensor at a freed one's address never hits a stale copy
        # (aliases have version counters of their own: only the source itself hits). A
        # CUDA graph being captured converts for itself (a copy made outside would be
        # stale on replay).
        capturing = t.is_cuda and torch.cuda.is_current_stream_capturing()
        self.cache = [e for e in self.cache if e[0]() is not None]
        role = "triples" if triples else "value" if value else "score"
        for ref, version, inside, kind, half in self.cache:
            if ref() is t and version == t._version and inside == capturing and kind == role:
                return half
        half = convert(t)
        # (a copy dies with its source: a result keeps its backend, and with it this
        # cache, long after the solve's operands are gone: OTDD bf16 held 184 MiB)
        entry = (weakref.ref(t, self._forget), t._version, capturing, role, half)
        self.cache = [*self.cache[-3:], entry]
        return half

    def split_parts(self, t: torch.Tensor) -> SplitOperand:
        return split_operand(t, triton_interpreted(), SCORE_LO_BITS)

    def value_parts(self, t: torch.Tensor) -> SplitOperand:
        return split_operand(t, triton_interpreted(), VALUE_LO_BITS)

    def half(self, t: torch.Tensor) -> torch.Tensor:
        half = t.to(_HALF[self.precision])
        if triton_interpreted():  # numpy has no bfloat16: round, compute in float32
            half = half.float()  # (exact: products of halves fit in float32)
        return half


def _forgetter(owner: weakref.ref) -> Callable[[weakref.ref], None]:
    """A weakref callback dropping the owner's cache entry of a source that died.

    It holds the :class:`Operands` weakly (a bound method would keep it alive through
    its own entries).
    """

    def forget(ref: weakref.ref) -> None:
        operands = owner()
        if operands is not None:
            operands.cache = [e for e in operands.cache if e[0] is not ref]

    return forget


def _version(t: torch.Tensor) -> int | None:
    """``t``'s version counter; None for an inference tensor, which has none.

    A score matrix lives for one solve, which cannot change its operands in place, so
    identity alone serves there.
    """
    return None if t.is_inference() else t._version


def score_operands(q, k):
    """``(Q, K, split_args, presplit)``: the kernels' score operands.

    For :class:`~._split.SplitOperand` s, the high parts, and as ``split_args`` the
    kernels' ``Q_INV``, ``K_INV`` (the scales) and ``q_lo``, ``k_lo`` (the low parts'
    offsets); otherwise the tensors themselves (the split arguments are then unused).
    """
    if isinstance(q, SplitOperand):
        return (q.parts[0], k.parts[0],
                _split_args(q.inv, k.inv, q.parts.stride(0), k.parts.stride(0)), True)  # fmt: skip
    return q, k, _split_args(q, k, 0, 0), False


def _split_args(q_inv, k_inv, q_lo: int, k_lo: int) -> dict:
    return {"Q_INV": q_inv, "K_INV": k_inv, "q_lo": q_lo, "k_lo": k_lo}
