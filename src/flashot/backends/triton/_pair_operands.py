r"""The pair-cost kernels' operands: clouds centred, normed and split, once per scope.

:mod:`._pairwise` reads each cloud centred (translation-invariant costs), with its
squared norms, and, for the product form, split into scaled half parts
(:mod:`._split`). A GeomLoss schedule asks for the soft-minima of the same clouds dozens
of times: inside :func:`pair_scope` those operands are made once.
"""

from __future__ import annotations

import contextlib
import threading

import torch

from flashot.backends.device import triton_interpreted
from flashot.backends.triton import _operands
from flashot.backends.triton._split import split_operand
from flashot.geometry.pair_costs import DIFFERENCES_UP_TO, PairCost

__all__ = ["pair_scope", "prepared", "score_operands"]


#: clouds of at most DIFFERENCES_UP_TO features reach the kernels feature-major (strides
#: (1, n)): the differences' loop reads one feature of a tile's rows and columns at a time,
#: which then needs no address arithmetic per element (sm_90, the block-sparse p = 2 tile at
#: d = 3: 1 027 → 939 instructions; row-major, 66 integer adds a feature)
FEATURE_MAJOR = True


def _laid_out(z: torch.Tensor) -> torch.Tensor:
    """``z`` (n, d) in the kernels' layout: feature-major for differences, else row-major."""
    if FEATURE_MAJOR and z.shape[1] <= DIFFERENCES_UP_TO:
        return z.t().contiguous().t()
    return z.contiguous()


def prepared(x, y, cost: PairCost):
    """Float32 clouds in the kernels' layout (:func:`_laid_out`) and their squared norms.

    Centred by one common shift for translation-invariant costs. A self problem (``y is
    x``) prepares its cloud once and returns it twice (its split parts are then made once
    too, :func:`score_operands`). Within a :func:`pair_scope` a pair is prepared once.
    """
    key, given, memo = None, (x, y), _SCOPE.memo
    if memo is not None:
        key = ("clouds", _identity(x), _identity(y), cost.translation_invariant)
        swapped = ("clouds", key[2], key[1], key[3])  # (the same shift: y, x is x, y)
        if key in memo:
            return memo[key]
        if swapped in memo:
            xs, ys, xn, yn = memo[swapped]
            return ys, xs, yn, xn
    if y is x:
        x = x.detach().float()
        if cost.translation_invariant:  # (0.5 (μ + μ) = μ exactly: the pair's shift)
            x = x - x.mean(0)
        x = _laid_out(x)
        norms = x.square().sum(1)
        out = x, x, norms, norms
    else:
        x, y = x.detach().float(), y.detach().float()
        if cost.translation_invariant:
            shift = 0.5 * (x.mean(0) + y.mean(0))
            x, y = x - shift, y - shift
        x, y = _laid_out(x), _laid_out(y)
        out = x, y, x.square().sum(1), y.square().sum(1)
    if memo is not None:
        memo[key] = out
        _SCOPE.keep.append(given)
    return out


def score_operands(xs, ys, diff: bool):
    """``(args, presplit)``: the kernels' score operands ``XP, YP, INV_X, INV_Y, x_lo, y_lo``.

    See :mod:`._pairwise`'s ``_pair_stats``. Split once per launch into scaled half
    parts (:mod:`._split`: three half MMAs, the accuracy of 3xTF32 without its split of
    both tiles in every loop iteration) while both clouds' parts fit
    :data:`~._operands.PRESPLIT_MAX_BYTES`; else the clouds themselves (3xTF32 per
    tile). Differences (small d) read no score operands. Within a :func:`pair_scope`
    each prepared cloud is split once.
    """
    n, m, d = xs.shape[0], ys.shape[0], xs.shape[1]
    if diff or 4 * (n + m) * d > _operands.PRESPLIT_MAX_BYTES:
        return (xs, ys, xs, ys, 0, 0), False
    interpreted = triton_interpreted()
    px = _split_once(xs, interpreted)
    py = px if ys is xs else _split_once(ys, interpreted)
    # (parts[0] is (n, d) contiguous: the clouds' own strides)
    return (px.parts[0], py.parts[0], px.inv, py.inv, px.parts.stride(0), py.parts.stride(0)), True


def _split_once(t, interpreted: bool):
    """:func:`split_operand` of a prepared cloud, kept for the scope's other calls."""
    memo = _SCOPE.memo
    if memo is None:
        return split_operand(t, interpreted)
    key = ("split", _identity(t))
    if key not in memo:
        memo[key] = split_operand(t, interpreted)
        _SCOPE.keep.append(t)
    return memo[key]


def _identity(t: torch.Tensor) -> tuple:
    """What makes two tensors the same data: storage, offset, layout and version.

    ``x`` and ``x.detach()`` share it; an in-place change (a new version) does not.
    Inference tensors (``torch.inference_mode``) keep no version: theirs is −1, and an
    in-place change to one inside a scope goes unseen (flashot's own calls make none).
    """
    version = -1 if t.is_inference() else t._version
    return (t.data_ptr(), version, tuple(t.shape), t.stride(), t.dtype, t.device)


class _Scope(threading.local):
    def __init__(self):
        self.memo: dict | None = None
        self.keep: list = []  # the keys' tensors, alive: none other takes their storage


_SCOPE = _Scope()


@contextlib.contextmanager
def pair_scope():
    """Prepare each pair of clouds once for all the soft-minima inside (this thread).

    A GeomLoss schedule calls the soft-minima of the same two clouds dozens of times;
    each call would centre both clouds, form their norms and split them (about a dozen
    launches, and as many temporaries). Inside the scope those results are kept, keyed
    by the clouds' storage, layout and version (an in-place change misses), and dropped
    on exit. Results are bit for bit those of unscoped calls. Nested scopes share the
    outermost's memo.
    """
    if _SCOPE.memo is not None:
        yield
        return
    _SCOPE.memo, _SCOPE.keep = {}, []
    try:
        yield
    finally:
        _SCOPE.memo, _SCOPE.keep = None, []
