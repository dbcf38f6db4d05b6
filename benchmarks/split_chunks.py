"""Speed and accuracy of ways to sum split-operand scores over feature chunks (d > 128).

v23 measured the default precision 12–22 % slower at d = 512 after v22's accuracy fix,
and the sm_90 SASS showed why: three dependent MMA groups per chunk, each followed by a
full wait. This script times the candidate chunk loops in one streaming kernel shaped
like the attend pass (a row block per program, column tiles streamed, an online
log-sum-exp of the scores), and measures each one's score error against float64 on
self scores that grow chunk after chunk (x ~ 2·U(0, 1), as the GPU test does):

0. TF32, one pass (the rate to beat; float32 operands);
1. 3xTF32 per tile;
2. the drifting form before v22: high and low products each accumulated across chunks;
3. v22's fix (the kernels now): per chunk the low terms, the high product on them, a
   float32 add;
4. the low products chained across chunks, the high product per chunk from a fresh
   accumulator, added by ``tl.fma(h, 1.0, s)`` (Triton folds an add of a dot, not an fma);
5. as 4 with the high product issued first;
6. as 3, two chunks per float32 add;
7. as 3 with the low parts stored pre-scaled (r = 2^-11 lo in float16: no multiply
   between the MMAs; entries below ~2^-17 of the largest lose bits as subnormals, an
   absolute error of 2^-38 of the largest, far below float32's rounding of a score);
8. one MMA per chunk: the reduction axis holds four slots, A = [r, hi, r, hi] and
   B = [r', r', hi', hi'] (pre-scaled r), so r·r' + hi·r' + r·hi' + hi·hi' is one dot
   (a third more MMA work, one wait per chunk instead of three; Triton 3.6 waits for
   every dot whose result the same iteration reads), chunks of 32 features;
9. as 8 with chunks of 64 features (half the waits, twice the shared memory);
10. as 8, each chunk's MMA issued before the previous chunk's result is added (Triton
    3.6 still waits for it at once: the same SASS as 8, so v24 did not time it);
11. the format of 3 (lo = 2^11 r): the low terms of a chunk as one dot of twice the
    chunk's width, [hi | lo]·[lo'; hi'], chained across chunks in the MMA's accumulator
    (its truncation drift is 2^-11 of the scores'), the high product from a fresh
    accumulator added in float32: one wait per chunk, no more MMA work (high issued
    first, so the wait for it may leave the low chain in flight);
12. as 11 with the low dot issued first.

    N=50000 D=512 python benchmarks/split_chunks.py      # on a GPU (do_bench medians)
    TRITON_INTERPRET=1 N=256 D=100 python benchmarks/split_chunks.py   # logic only
    V=0,3,8 ...                                                        # some variants
"""

import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src"))
from flashot.backends.triton._split import split_operand

VARIANTS = ("tf32", "3xtf32", "old (drifts)", "v22 fix", "low chain + fma",
            "low chain + fma, high first", "fix, 2 chunks per add",
            "fix, pre-scaled lows", "one dot/chunk, 4 slots, BD 32",
            "one dot/chunk, 4 slots, BD 64", "as 8, next MMA before the add",
            "low terms one chained dot, high first",
            "low terms one chained dot, low first")  # fmt: skip


@triton.jit
def _rows(P, rows, cols, n_rows, d):
    """A (rows, features) tile of row-major (n, d) data."""
    return tl.load(P + rows[:, None] * d + cols[None, :],
                   mask=(rows[:, None] < n_rows) & (cols[None, :] < d), other=0.0)  # fmt: skip


@triton.jit
def _cols(P, rows, cols, n_rows, d):
    """A (features, rows) tile of row-major (n, d) data."""
    return tl.load(P + rows[None, :] * d + cols[:, None],
                   mask=(rows[None, :] < n_rows) & (cols[:, None] < d), other=0.0)  # fmt: skip


@triton.jit
def _score(Q, K, QL, KL, om, on, n, m, d, BD: tl.constexpr, CHUNKS: tl.constexpr,
           VARIANT: tl.constexpr):  # fmt: skip
    od = tl.arange(0, BD)
    s = tl.zeros((om.shape[0], on.shape[0]), dtype=tl.float32)
    c = tl.zeros((om.shape[0], on.shape[0]), dtype=tl.float32)
    step: tl.constexpr = 2 if VARIANT == 6 else 1
    for ch in range(0, CHUNKS, step):
        dd = ch * BD + od
        q = _rows(Q, om, dd, n, d)
        kt = _cols(K, on, dd, m, d)
        if VARIANT >= 11:
            # low terms as one dot over [hi | lo]·[lo'; hi'] chained across chunks in the
            # MMA (their drift is 2^-11 smaller); the high product fresh, a float32 add
            j = tl.arange(0, 2 * BD)
            f = ch * BD + j % BD
            a_ok = (om[:, None] < n) & (f[None, :] < d)
            b_ok = (on[None, :] < m) & (f[:, None] < d)
            a_off = om[:, None] * d + f[None, :]
            b_off = on[None, :] * d + f[:, None]
            a = tl.load(tl.where(j[None, :] < BD, Q + a_off, QL + a_off), mask=a_ok, other=0.0)
            b = tl.load(tl.where(j[:, None] < BD, KL + b_off, K + b_off), mask=b_ok, other=0.0)
            if VARIANT == 11:
                high = tl.dot(q, kt)
                c = tl.dot(a, b, c)
            else:
                c = tl.dot(a, b, c)
                high = tl.dot(q, kt)
            s = tl.fma(high, 1.0, s)
        elif VARIANT >= 8:
            # K = 4 BD slots: A = [r, hi, r, hi], B = [r', r', hi', hi'] (r = x − hi, pre-
            # scaled): r·r' + hi·r' + r·hi' + hi·hi' in one MMA chain, smallest first
            j = tl.arange(0, 4 * BD)
            f = ch * BD + j % BD
            a_hi = (j // BD) % 2 == 1
            b_hi = j // BD >= 2
            a_ok = (om[:, None] < n) & (f[None, :] < d)
            b_ok = (on[None, :] < m) & (f[:, None] < d)
            a_off = om[:, None] * d + f[None, :]
            b_off = on[None, :] * d + f[:, None]
            a = tl.load(tl.where(a_hi[None, :], Q + a_off, QL + a_off), mask=a_ok, other=0.0)
            b = tl.load(tl.where(b_hi[:, None], K + b_off, KL + b_off), mask=b_ok, other=0.0)
            if VARIANT == 10:  # this chunk's MMA in flight while the last one is added
                cur = tl.dot(a, b)
                s = tl.fma(c, 1.0, s)
                c = cur
            else:
                s = tl.fma(tl.dot(a, b), 1.0, s)  # a float32 add: `s +=` folds into the MMA
        elif VARIANT == 0:
            s = tl.dot(q, kt, s, input_precision="tf32")
        elif VARIANT == 1:
            s = tl.dot(q, kt, s, input_precision="tf32x3")
        else:
            ql = _rows(QL, om, dd, n, d)
            kl = _cols(KL, on, dd, m, d)
            if VARIANT == 2:
                s = tl.dot(q, kt, s)
                c = tl.dot(q, kl, c)
                c = tl.dot(ql, kt, c)
            elif VARIANT == 3:
                low = tl.dot(q, kl)
                low = tl.dot(ql, kt, low)
                s += tl.dot(q, kt, low * 0.00048828125)
            elif VARIANT == 7:
                low = tl.dot(q, kl)
                low = tl.dot(ql, kt, low)
                s += tl.dot(q, kt, low)
            elif VARIANT == 4:
                c = tl.dot(q, kl, c)
                c = tl.dot(ql, kt, c)
                s = tl.fma(tl.dot(q, kt), 1.0, s)
            elif VARIANT == 5:
                high = tl.dot(q, kt)
                c = tl.dot(q, kl, c)
                c = tl.dot(ql, kt, c)
                s = tl.fma(high, 1.0, s)
            else:
                d2 = dd + BD
                q2, kt2 = _rows(Q, om, d2, n, d), _cols(K, on, d2, m, d)
                low = tl.dot(q, kl)
                low = tl.dot(ql, kt, low)
                low = tl.dot(q2, _cols(KL, on, d2, m, d), low)
                low = tl.dot(_rows(QL, om, d2, n, d), kt2, low)
                high = tl.dot(q, kt, low * 0.00048828125)
                s += tl.dot(q2, kt2, high)
    if VARIANT == 2 or VARIANT == 4 or VARIANT == 5 or VARIANT >= 11:
        s = s + c * 0.00048828125
    if VARIANT == 10:
        s = tl.fma(c, 1.0, s)
    return s


@triton.jit
def _tile(Q, K, QL, KL, OUT, n, m, d, unscale, BD: tl.constexpr, CHUNKS: tl.constexpr,
          VARIANT: tl.constexpr):  # fmt: skip
    om = tl.program_id(0) * 64 + tl.arange(0, 64)
    on = tl.program_id(1) * 64 + tl.arange(0, 64)
    s = _score(Q, K, QL, KL, om, on, n, m, d, BD, CHUNKS, VARIANT) * unscale
    tl.store(OUT + om[:, None] * m + on[None, :], s, mask=(om[:, None] < n) & (on[None, :] < m))


@triton.jit
def _stream(Q, K, QL, KL, LSE, n, m, d, unscale, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
            BD: tl.constexpr, CHUNKS: tl.constexpr, VARIANT: tl.constexpr):  # fmt: skip
    om = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    top = tl.full((BLOCK_M,), -1e30, dtype=tl.float32)
    total = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for start in range(0, m, BLOCK_N):
        on = start + tl.arange(0, BLOCK_N)
        s = _score(Q, K, QL, KL, om, on, n, m, d, BD, CHUNKS, VARIANT) * unscale
        s = tl.where(on[None, :] < m, s, -1e30)
        new = tl.maximum(top, tl.max(s, 1))
        total = total * tl.exp2(top - new) + tl.sum(tl.exp2(s - new[:, None]), 1)
        top = new
    tl.store(LSE + om, top + tl.log2(total), mask=om < n)


def operands(x, variant):
    """(Q, K, QL, KL, unscale, BD) for a variant: float32 or split half parts."""
    if variant <= 1:
        return x, x, x, x, 1.0, 32
    sx = split_operand(x, not x.is_cuda)
    low = sx.parts[1]
    if variant in (7, 8, 9, 10):
        low = (low.float() * 2.0**-11).to(low.dtype)
    bd = 32 if variant in (8, 10) else 64
    return sx.parts[0], sx.parts[0], low, low, float(sx.inv) ** 2, bd


def score_error(x, variant, rows=1024, outlier=False):
    """Max |score − float64| over a (rows, rows) block of self scores ⟨x_i, x_j⟩.

    outlier: all rows but the first scaled by 2^-20; the error is then relative, over
    the scores of the small rows (one large entry per cloud sets the split's scale).
    """
    x = x[:rows].clone()
    if outlier:
        x[1:] *= 2.0**-20
    q, k, ql, kl, unscale, bd = operands(x, variant)
    n, d = x.shape
    out = torch.empty(n, n, device=x.device)
    grid = (triton.cdiv(n, 64), triton.cdiv(n, 64))
    _tile[grid](q, k, ql, kl, out, n, n, d, unscale, BD=bd, CHUNKS=triton.cdiv(d, bd),
                VARIANT=variant)  # fmt: skip
    ref = x.double() @ x.double().T
    if outlier:
        ref, out = ref[1:, 1:], out[1:, 1:]
        return float(((out.double() - ref).abs() / ref.abs().max()).max()), float(ref.abs().max())
    return float((out.double() - ref).abs().max()), float(ref.abs().max())


def stream_ms(x, variant, tiles):
    q, k, ql, kl, unscale, bd = operands(x, variant)
    n, d = x.shape
    lse = torch.empty(n, device=x.device)
    bm, bn, warps, stages = tiles
    kw = dict(BLOCK_M=bm, BLOCK_N=bn, BD=bd, CHUNKS=triton.cdiv(d, bd), VARIANT=variant)
    if x.is_cuda:
        kw.update(num_warps=warps, num_stages=stages)

    def run():
        _stream[(triton.cdiv(n, bm),)](q, k, ql, kl, lse, n, n, d, unscale, **kw)

    if not x.is_cuda:
        run()
        return float("nan"), lse
    return triton.testing.do_bench(run, return_mode="median"), lse


if __name__ == "__main__":
    DEV = "cuda" if torch.cuda.is_available() else "cpu"
    N, D = int(os.environ.get("N", "50000")), int(os.environ.get("D", "512"))
    TILES = [(64, 128, 4, 3), (128, 64, 8, 3), (128, 64, 8, 2), (128, 128, 8, 2)]
    if DEV == "cpu":
        TILES = [(16, 16, 1, 1)]
    gen = torch.Generator(device=DEV).manual_seed(0)
    x = torch.rand(N, D, device=DEV, generator=gen) * 2.0
    small = torch.rand(min(N, 1024), 804 if DEV == "cuda" else D, device=DEV, generator=gen) * 2.0
    print(f"{torch.cuda.get_device_name() if DEV == 'cuda' else 'cpu'}, n = m = {N}, d = {D}; "
          f"score error on self scores at d = {small.shape[1]}", flush=True)  # fmt: skip
    ref_lse = None
    chosen = os.environ.get("V", ",".join(map(str, range(len(VARIANTS)))))
    for v in [int(v) for v in chosen.split(",")]:
        err, top = score_error(small, v)
        rel = score_error(small, v, outlier=True)[0]
        times = []
        for tiles in TILES:
            try:
                ms, lse = stream_ms(x, v, tiles)
            except Exception as exc:  # a tile that does not fit: say so, go on
                times.append(f"{tiles[0]}x{tiles[1]}/{tiles[2]}w: {type(exc).__name__}")
                continue
            ref_lse = lse if ref_lse is None else ref_lse
            drift = float((lse - ref_lse).abs().max())
            times.append(f"{tiles[0]}x{tiles[1]}/{tiles[2]}w {ms:.2f} ms (lse vs v0 {drift:.1e})")
        print(f"v{v} {VARIANTS[v]:28s} score err {err:.1e} of {top:.3g}, outlier rel {rel:.1e} | "
              + " | ".join(times),
              flush=True)  # fmt: skip
