"""Accuracy of ways to form split-operand scores on the tensor cores (issue 14/15 stall).

One (64, 64) score tile per program over the labeled MNIST operands of OTDD (d' = 804,
13 chunks of 64 half features), against float64. Variants (VARIANT constexpr):

0. the kernels' way: hi·hi' and the lo terms each accumulated across chunks by the MMA;
1. hi·hi' of each chunk from a zero accumulator, added in float32 outside the MMA;
2. as 1, per 16 features (one MMA K-step);
3. 3xTF32 per tile (``input_precision="tf32x3"``), accumulated across chunks;
4. float32 FMA (``"ieee"``): the control;
5. as 1, with the fourth product lo·lo' (2^-22);
6–8. hi·hi' alone against its exact value: the float16 MMA, the same values through the
   TF32 MMA (exact products), float32 FMA;
9. the kernels' fix: per chunk the low terms, then the high product on them, chunks
   summed by rounded float32 adds.

    N=8192 python benchmarks/split_mma.py
"""

import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src"))
from flashot.tasks import datasets
from flashot.backends.triton._split import split_operand
from flashot.geometry.costs import attention_form
from flashot.tasks.otdd import _label_cost, _prepare


@triton.jit
def _tile(Q, K, QL, KL, OUT, d, unscale, BD: tl.constexpr, CHUNKS: tl.constexpr,
          VARIANT: tl.constexpr):
    pm, pn = tl.program_id(0), tl.program_id(1)
    om, on, od = pm * 64 + tl.arange(0, 64), pn * 64 + tl.arange(0, 64), tl.arange(0, BD)
    s = tl.zeros((64, 64), dtype=tl.float32)
    c = tl.zeros((64, 64), dtype=tl.float32)
    for ch in range(CHUNKS):
        dd = ch * BD + od
        qp = om[:, None] * d + dd[None, :]
        kp = on[None, :] * d + dd[:, None]
        qm, km = dd[None, :] < d, dd[:, None] < d
        q = tl.load(Q + qp, mask=qm, other=0.0)
        kt = tl.load(K + kp, mask=km, other=0.0)
        if VARIANT == 3:
            s = tl.dot(q, kt, s, input_precision="tf32x3")
        elif VARIANT == 6:
            s = tl.dot(q, kt, s)
        elif VARIANT == 7:
            s = tl.dot(q, kt, s, input_precision="tf32")
        elif VARIANT == 4 or VARIANT == 8:
            s = tl.dot(q, kt, s, input_precision="ieee")
        else:
            if VARIANT == 9:
                c = tl.dot(q, tl.load(KL + kp, mask=km, other=0.0))
                c = tl.dot(tl.load(QL + qp, mask=qm, other=0.0), kt, c)
                s += tl.dot(q, kt, c * 0.00048828125)
            elif VARIANT == 0:
                s = tl.dot(q, kt, s)
            else:
                s += tl.dot(q, kt)
            if VARIANT != 9:
                c = tl.dot(q, tl.load(KL + kp, mask=km, other=0.0), c)
                c = tl.dot(tl.load(QL + qp, mask=qm, other=0.0), kt, c)
            if VARIANT == 5:
                c2 = tl.dot(tl.load(QL + qp, mask=qm, other=0.0),
                            tl.load(KL + kp, mask=km, other=0.0))
                c += c2 * 0.00048828125
    if VARIANT >= 6:
        s = s * unscale
    if VARIANT == 9:
        c = c * 0.0
    if VARIANT < 3 or VARIANT == 5:
        s = (s + c * 0.00048828125) * unscale
    tl.store(OUT + om[:, None] * tl.num_programs(1) * 64 + on[None, :], s)


def scores(q, k, variant):
    n, d = q.shape
    out = torch.empty(n, k.shape[0], device=q.device)
    grid = (n // 64, k.shape[0] // 64)
    if variant == 9:  # the kernels' fix: per chunk, low terms first, rounded adds across chunks
        sq, sk = split_operand(q, not q.is_cuda), split_operand(k, not q.is_cuda)
        _tile[grid](sq.parts[0], sk.parts[0], sq.parts[1], sk.parts[1], out, d,
                    float(sq.inv * sk.inv), BD=64, CHUNKS=triton.cdiv(d, 64), VARIANT=9)
        return out
    if variant >= 6:  # the high parts alone: fp16 MMA (6), the same values as tf32 (7), FMA (8)
        sq, sk = split_operand(q, not q.is_cuda), split_operand(k, not q.is_cuda)
        hq, hk = sq.parts[0], sk.parts[0]
        if variant > 6:
            hq, hk = hq.float(), hk.float()
        _tile[grid](hq, hk, hq, hk, out, d, float(sq.inv * sk.inv), BD=64 if variant == 6 else 32,
                    CHUNKS=triton.cdiv(d, 64 if variant == 6 else 32), VARIANT=variant)
        exact = (hq.double() @ hk.double().T) * float(sq.inv * sk.inv)
        return out.double() - exact + q.double() @ k.double().T
    if variant in (3, 4):
        _tile[grid](q, k, q, k, out, d, 1.0, BD=32, CHUNKS=triton.cdiv(d, 32), VARIANT=variant)
        return out
    sq, sk = split_operand(q, not q.is_cuda), split_operand(k, not q.is_cuda)
    unscale = float(sq.inv * sk.inv)
    bd = 16 if variant == 2 else 64
    _tile[grid](sq.parts[0], sk.parts[0], sq.parts[1], sk.parts[1], out, d, unscale, BD=bd,
                CHUNKS=triton.cdiv(d, bd), VARIANT=variant if variant == 5 else min(variant, 1))
    return out


if __name__ == "__main__":
    N = int(os.environ.get("N", "8192"))
    DEV = "cuda" if torch.cuda.is_available() else "cpu"
    xa, ya = datasets.load("mnist", n=N, seed=0)
    xb, yb = datasets.load("mnist:rot90", n=N, seed=0)
    xa, ca, ia, xb, cb, ib = _prepare(*(t.to(DEV) for t in (xa, ya, xb, yb)))
    cost = _label_cost(xa, ia, len(ca), xb, ib, len(cb), "gaussian", True, 5.0, 1.0, 1.0)
    rows = int(os.environ.get("ROWS", "1024"))
    for name, (x, y, c) in {"cross": (xa, xb, cost.with_labels(ia, ib + len(ca))),
                            "self A": (xa, xa, cost.with_labels(ia, ia))}.items():
        form = attention_form(c, x, y, torch.float32)
        q, k = form.q[:rows].contiguous(), form.k[:rows].contiguous()
        ref = q.double() @ k.double().T
        for feats in ("all", "pixels", "labels"):
            qq, kk = q, k
            if feats != "all":
                cols = slice(0, 784) if feats == "pixels" else slice(784, None)
                qq, kk = q[:, cols].contiguous(), k[:, cols].contiguous()
            r = qq.double() @ kk.double().T
            line = []
            for v in range(10):
                e = scores(qq, kk, v).double() - r
                line.append(f"v{v} mean {e.mean():+.1e} max {e.abs().max():.1e}")
            print(f"{name} {feats:6s} |s| max {r.abs().max():.3g}: " + " | ".join(line), flush=True)
