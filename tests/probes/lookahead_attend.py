"""Does issuing the next score tile's MMA before this tile's softmax pay? A standalone probe.

v63 (``benchmarks/NOTES.md``): on an H100 at 50k d64 the row attend with values (the
gradient's ``W k``) takes 3.4–4.4× a plain attend, and one value column already doubles
it. Offline counts explain ~1.6×. A candidate for the rest: each tile waits for two MMAs in
a row (the scores, then P·V) with 8 warps an SM to hide them. Here the scores of tile
j + 1 are issued before tile j's exponentials (FlashAttention-3's intra-warpgroup
overlap, written as a one-tile lookahead in the loop), so their MMA runs under the softmax.

**Read offline (``counts``, with the VM's Triton 3.8; the GPU's 3.6 unchecked):** the lookahead
does not overlap anything as written. Triton defers the wait of an asynchronous MMA only
where its result is the next MMA's accumulator (the P·V product, whose wait sits after the
loop); the next tile's scores are waited for at once (``warp_group_dot_wait`` with no
MMA pending right after it), so the shape only adds registers. The overlap needs explicit
asynchronous MMAs (Gluon's ``warpgroup_mma`` with a wait that leaves one in flight) or
warp specialization.

The kernel is a minimal row attend, ``lse_i = ln Σ_j e^{⟨q_i,k_j⟩/ε + h_j}`` and the
softmax average of V, with the library's online max in base 2 (not the library's kernel:
no splits, repairs, split operands or segments), in two loop shapes (LOOKAHEAD).

Run as a script:

* with a CUDA GPU: times both shapes at ``N`` (default 50 000) × d = 64 for p ∈ {0, 1, 64}
  value columns, tf32 and bf16 operands, beside the library's ``attend`` with the same
  inputs, and checks both against float64 on 4 096 rows;
* without one (Triton's interpreter, ``TRITON_INTERPRET=1``): checks both shapes against
  float64 at small sizes;
* ``python tests/probes/lookahead_attend.py counts`` (no GPU, not interpreted): sm_90
  registers, shared memory and loop instructions a score of each shape.
"""

from __future__ import annotations

import functools
import itertools
import os
import sys

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634


@triton.jit
def _probe_attend(Q, K, H, V, LSE, OUT, n, m, scale, stride_q, stride_k, stride_v,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr,
                  P: tl.constexpr, HAS_V: tl.constexpr, LOOKAHEAD: tl.constexpr):  # fmt: skip
    """One program: BLOCK_M rows against every column, online max in base 2."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < n
    feats = tl.arange(0, D)
    q = tl.load(Q + rows[:, None] * stride_q + feats[None, :], mask=row_ok[:, None], other=0.0)
    run_max = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    run_sum = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, P), tl.float32)
    vals = tl.arange(0, P)
    cols = tl.arange(0, BLOCK_N)
    if LOOKAHEAD:  # the first tile's scores before the loop
        k = tl.load(K + cols[:, None] * stride_k + feats[None, :], mask=(cols < m)[:, None],
                    other=0.0)  # fmt: skip
        s = tl.dot(q, tl.trans(k))
    for start in range(0, m, BLOCK_N):
        offs = start + cols
        ok = offs < m
        if LOOKAHEAD:  # the next tile's scores, issued before this tile's exponentials
            nxt = offs + BLOCK_N
            k_next = tl.load(K + nxt[:, None] * stride_k + feats[None, :],
                             mask=(nxt < m)[:, None], other=0.0)  # fmt: skip
            s_next = tl.dot(q, tl.trans(k_next))
        else:
            k = tl.load(K + offs[:, None] * stride_k + feats[None, :], mask=ok[:, None],
                        other=0.0)  # fmt: skip
            s = tl.dot(q, tl.trans(k))
        h = tl.load(H + offs, mask=ok, other=float("-inf"))
        t = s * scale + h[None, :]
        new_max = tl.maximum(run_max, tl.max(t, 1))
        shift = tl.where(new_max == float("-inf"), 0.0, new_max)
        e = tl.exp2(t - shift[:, None])
        decay = tl.exp2(run_max - shift)
        run_sum = run_sum * decay + tl.sum(e, 1)
        run_max = new_max
        if HAS_V:
            v = tl.load(V + offs[:, None] * stride_v + vals[None, :], mask=ok[:, None],
                        other=0.0)  # fmt: skip
            acc = tl.dot(e.to(v.dtype), v, acc * decay[:, None])
        if LOOKAHEAD:
            s = s_next
    tl.store(LSE + rows, (run_max + tl.log2(run_sum)) / 1.4426950408889634, mask=row_ok)
    if HAS_V:
        out = acc / run_sum[:, None]
        tl.store(OUT + rows[:, None] * P + vals[None, :], out, mask=row_ok[:, None])


def probe_attend(q, k, h, eps, v=None, lookahead=False, tiles=(128, 64, 4, 3)):
    """``(lse (n,), out (n, p) or None)``: ``ε·lse`` of the scores ``⟨q_i,k_j⟩/ε + h_j``
    (h in nats) and the softmax average of ``v``; q, k of one dtype, d and p powers of 2."""
    n, d = q.shape
    bm, bn, warps, stages = tiles
    p = 16 if v is None else v.shape[1]
    lse = torch.empty(n, device=q.device, dtype=torch.float32)
    out = torch.empty(n, p, device=q.device, dtype=torch.float32)
    vv = out if v is None else v
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    options = {} if interpreted else {"num_warps": warps, "num_stages": stages}
    _probe_attend[(triton.cdiv(n, bm),)](
        q, k, h * LOG2E, vv, lse, out, n, k.shape[0], LOG2E / eps, q.stride(0), k.stride(0),
        vv.stride(0), BLOCK_M=bm, BLOCK_N=bn, D=d, P=p, HAS_V=v is not None,
        LOOKAHEAD=lookahead, **options,
    )  # fmt: skip
    return eps * lse, (out if v is not None else None)


def reference(q, k, h, eps, v=None):
    """Float64 dense ``(ε·lse, softmax average)``."""
    t = (q.double() @ k.double().T) / eps + h.double()[None, :]
    lse = torch.logsumexp(t, 1)
    out = None if v is None else torch.softmax(t, 1) @ v.double()
    return eps * lse, out


def check(n=300, m=200, d=16, p=16, eps=0.5, device="cpu", tiles=(32, 32, 4, 2)) -> None:
    """Both loop shapes against float64 (raises on a mismatch)."""
    g = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(n, d, generator=g, device=device)
    k = torch.randn(m, d, generator=g, device=device)
    h = -0.5 * (k * k).sum(1)
    v = torch.randn(m, p, generator=g, device=device)
    want_lse, want_out = reference(q, k, h, eps, v)
    for lookahead in (False, True):
        lse, out = probe_attend(q, k, h, eps, v, lookahead, tiles)
        lse_err = float((lse.double() - want_lse).abs().max() / want_lse.abs().max())
        out_err = float((out.double() - want_out).norm() / want_out.norm())
        tol = 1e-5 if device == "cpu" else 5e-3  # (tf32 scores on a GPU)
        if not (lse_err < tol and out_err < tol):
            raise AssertionError(f"lookahead={lookahead}: lse {lse_err:.1e}, out {out_err:.1e}")
        print(f"lookahead={lookahead}: lse {lse_err:.1e}, out {out_err:.1e} (float64)")


def counts() -> None:
    """sm_90 registers, shared memory and loop instructions a score, offline."""
    from sass_loops import compile_like_jit, loops
    from value_pass import usage

    for dtype in ("fp32", "fp16"):
        half = ("Q", "K", "V") if dtype == "fp16" else ()
        for p, has_v in ((16, False), (16, True), (64, True)):
            for look in (False, True):
                for bm, bn, warps, stages in ((128, 64, 4, 3), (128, 64, 8, 2)):
                    consts = dict(BLOCK_M=bm, BLOCK_N=bn, D=64, P=p, HAS_V=has_v,
                                  LOOKAHEAD=look)  # fmt: skip
                    kernel = compile_like_jit(_probe_attend, consts, half, warps, stages)
                    regs, stack = usage(kernel.asm["cubin"])
                    size = max(loops(kernel.asm["cubin"]), key=lambda loop: loop[0])[0]
                    ir = kernel.asm["ttgir"].splitlines()
                    at_once = sum("pendings = 0" in b and "warp_group_dot_wait" in b
                                  and "warp_group_dot " in a and "%q" in a
                                  for a, b in itertools.pairwise(ir))  # fmt: skip
                    print(f"{dtype} p={p if has_v else 0} lookahead={look:d} {bm}x{bn} w{warps} "
                          f"s{stages}: regs {regs} stack {stack} smem "
                          f"{kernel.metadata.shared // 1024}K /score "
                          f"{size * 32 * warps / (bm * bn):.1f}, score MMAs waited "
                          f"for at once: {at_once}")  # fmt: skip


def timings(n: int) -> None:
    """Both shapes and the library's attend at n × 64, p ∈ {0, 1, 64}, ms (do_bench).

    Operands tf32, tf32 with float16 values and weights (one MMA of the precision of TF32
    for values of moderate range), and bf16.
    """
    from triton.testing import do_bench

    from flashot.backends.triton import TritonBackend
    from flashot.backends.triton._attend import attend

    g = torch.Generator(device="cuda").manual_seed(0)
    q = 1.41 * torch.randn(n, 64, device="cuda", generator=g)
    k = 1.41 * torch.randn(n, 64, device="cuda", generator=g)
    h = -0.5 * (k * k).sum(1)
    eps = 0.1
    cases = (("tf32", torch.float32, torch.float32), ("tf32, V float16", torch.float32,
             torch.float16), ("bf16", torch.bfloat16, torch.bfloat16))  # fmt: skip
    for name, dtype, vdtype in cases:
        qd, kd = q.to(dtype), k.to(dtype)
        backend = TritonBackend(name.split(",")[0])
        for p in (0, 1, 64):
            v = None if p == 0 else k[:, : max(16, p)].to(vdtype).contiguous()
            row = [f"{name} p={p}"]
            lib_v = None if p == 0 else k[:, :p].contiguous()
            ms = do_bench(lambda b=backend, w=lib_v: attend(b, q, k, eps, (h * eps,), v=w), rep=60)
            row.append(f"library {ms:.2f}")
            for look in (False, True):
                for tiles in ((128, 64, 4, 3), (128, 64, 8, 2), (64, 64, 4, 3)):
                    run = functools.partial(probe_attend, qd, kd, h, eps, v, look, tiles)
                    ms = do_bench(run, rep=60)
                    row.append(
                        f"look={look:d} {tiles[0]}x{tiles[1]}w{tiles[2]}s{tiles[3]} {ms:.2f}"
                    )
            print(" | ".join(row), flush=True)
    sub = slice(0, 4096)
    want = reference(q[sub], k, h, eps, k)
    for look in (False, True):
        lse, out = probe_attend(q[sub].contiguous(), k, h, eps, k, look)
        print(f"tf32 lookahead={look:d} against float64: lse "
              f"{float((lse.double() - want[0]).abs().max()):.1e}, out "
              f"{float((out.double() - want[1]).norm() / want[1].norm()):.1e}")  # fmt: skip


if __name__ == "__main__":
    if sys.argv[1:] == ["counts"]:
        counts()
    elif torch.cuda.is_available():
        check(device="cuda", tiles=(64, 64, 4, 2))
        timings(int(os.environ.get("N", "50000")))
    else:
        check()
