"""Second order on a GPU (issue 13): HVPs by double backward against flash-sinkhorn 0.4.1.

The peer's HVP setup: GeomLoss convention p=2 (|x−y|²/2; the peer's half_cost=True),
blur 0.3 (ε = 0.09), scaling 0.9, not debiased, uniform weights, randn clouds, one
direction. Each side is timed as a user runs it: loss, gradient with create_graph,
HVP (do_bench median), and the double backward alone on a kept first-order graph
(``hvp ms``: what each further HVP of a Newton step costs). Accuracy: against the dense float64 implicit HVP
(``tests.references.dense_hvp_implicit``) at float64 potentials of the same schedule,
for n ≤ REF_MAX. Env: SIZES ("10000x64,..."), TOLS (dual CG tolerances to sweep),
PEER (0 to skip), EAGER (1: also time the CG without CUDA graphs), CAPTURED (1: also
with them at any size). Prints a table last.
"""

import os
import sys
import time
import warnings

import torch
from triton.testing import do_bench

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import flashot  # noqa: E402
import flashot.numerics.linalg  # noqa: E402
from flashot.autodiff.second_order import dual_solve_options  # noqa: E402
from tests.references import dense_hvp_implicit  # noqa: E402

warnings.simplefilter("ignore")
SIZES = [tuple(map(int, c.split("x"))) for c in os.environ.get("SIZES", "10000x64").split(",")]
TOLS = [float(t) for t in os.environ.get("TOLS", "1e-1,3e-2,1e-2,1e-3").split(",")]
REF_MAX = int(os.environ.get("REF_MAX", "20000"))
PeerLoss = None
if os.environ.get("PEER", "1") == "1":
    try:
        from flash_sinkhorn import SamplesLoss as PeerLoss
    except Exception as exc:  # noqa: BLE001
        print("peer unavailable:", exc)


def ours(x, y, v, tol=None, backend="auto"):
    xs = x.detach().requires_grad_()
    with dual_solve_options(cg_tol=tol, cg_max_iter=5000):
        loss = flashot.SamplesLoss(blur=0.3, scaling=0.9, debias=False, backend=backend)(xs, y)
        (g,) = torch.autograd.grad(loss, xs, create_graph=True)
        (h,) = torch.autograd.grad((g * v).sum(), xs)
    return h


def first_order(x, y, tol=None, who="ours"):
    """(xs, gradient with create_graph): what a Newton user holds before asking for HVPs."""
    xs = x.detach().requires_grad_()
    if who == "peer":
        loss = PeerLoss(p=2, blur=0.3, scaling=0.9, debias=False, half_cost=True)(xs, y)
    else:
        with dual_solve_options(cg_tol=tol, cg_max_iter=5000):
            loss = flashot.SamplesLoss(blur=0.3, scaling=0.9, debias=False)(xs, y)
    return xs, torch.autograd.grad(loss, xs, create_graph=True)[0]


def hvp_only_ms(x, y, v, tol=None, who="ours"):
    """Median time of the double backward alone, on one first-order graph."""
    xs, g = first_order(x, y, tol, who)
    return bench(lambda: torch.autograd.grad((g * v).sum(), xs, retain_graph=True))


def peer(x, y, v):
    xs = x.detach().requires_grad_()
    loss = PeerLoss(p=2, blur=0.3, scaling=0.9, debias=False, half_cost=True)(xs, y)
    (g,) = torch.autograd.grad(loss, xs, create_graph=True)
    (h,) = torch.autograd.grad((g * v).sum(), xs)
    return h


def reference(x, y, v):
    x, y, v = x.double(), y.double(), v.double()
    f, g = flashot.SamplesLoss(blur=0.3, scaling=0.9, debias=False, potentials=True,
                               backend="torch")(x, y)  # fmt: skip
    h1 = dense_hvp_implicit(x, y, f, g, v, 0.09, tikhonov=1e-10)
    h2 = dense_hvp_implicit(x, y, f, g, v, 0.09, tikhonov=1e-8)
    return h1, rel(h2, h1)


def rel(u, w):
    return float((u.double() - w.double()).norm() / w.double().norm())


def bench(fn):
    return do_bench(fn, warmup=1, rep=300, return_mode="median")


def extra_mb(fn):
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


rows = []
for n, d in SIZES:
    torch.manual_seed(0)
    x, y, v = (torch.randn(n, d, device="cuda") for _ in range(3))
    t0 = time.time()
    ours(x, y, v)
    print(f"n={n} d={d}: first call {time.time() - t0:.1f} s", flush=True)
    ref = ref_spread = None
    if n <= REF_MAX:
        try:  # dense float64: a few n × m matrices (about 100 GB at 50k)
            ref, ref_spread = reference(x, y, v)
        except torch.OutOfMemoryError as exc:
            print("  reference out of memory:", str(exc)[:120], flush=True)
        torch.cuda.empty_cache()
    if ref is not None:
        print(f"  reference ready (tikhonov 1e-10 vs 1e-8: {ref_spread:.1e})", flush=True)
    xs = x.detach().requires_grad_()
    loss_ms = bench(lambda: flashot.SamplesLoss(blur=0.3, scaling=0.9, debias=False)(xs, y))

    def grad_only():
        loss = flashot.SamplesLoss(blur=0.3, scaling=0.9, debias=False)(xs, y)
        return torch.autograd.grad(loss, xs, create_graph=True)

    grad_ms = bench(grad_only)
    print(f"  loss {loss_ms:.1f} ms, loss+grad(create_graph) {grad_ms:.1f} ms", flush=True)
    for tol in TOLS:
        with flashot.record_dual_solves() as log:
            h = ours(x, y, v, tol)
        cg = dict(n_iter=log.last.n_iter, residual=log.last.residual) if log else {}
        row = dict(case=f"n={n} d={d}", who=f"flashot tol={tol:g}", ms=bench(lambda: ours(x, y, v, tol)),
                   cg=cg.get("n_iter"), res=cg.get("residual"), mb=extra_mb(lambda: ours(x, y, v, tol)),
                   err=None if ref is None else rel(h, ref), hvp_ms=hvp_only_ms(x, y, v, tol))  # fmt: skip
        if os.environ.get("EAGER") == "1":  # the dual CG never captured
            import flashot.autodiff.implicit as implicit

            captures, implicit._captures = implicit._captures, lambda backend, form: False
            row["eager_ms"] = bench(lambda: ours(x, y, v, tol))
            implicit._captures = captures
        if os.environ.get("CAPTURED") == "1":  # the dual CG captured whatever the size
            import flashot.autodiff.implicit as implicit

            up_to, implicit.CAPTURE_UP_TO = implicit.CAPTURE_UP_TO, float("inf")
            row["captured_ms"] = bench(lambda: ours(x, y, v, tol))
            row["captured_hvp_ms"] = hvp_only_ms(x, y, v, tol)
            implicit.CAPTURE_UP_TO = up_to
        if os.environ.get("COMPARE_TILES") == "1":  # the fused plan_vjp against PyTorch tiles
            from flashot.backends.base import Backend
            from flashot.backends.triton import TritonBackend

            fused = TritonBackend.plan_vjp
            TritonBackend.plan_vjp = Backend.plan_vjp
            h_tiles = ours(x, y, v, tol)
            row["tiles_ms"] = bench(lambda: ours(x, y, v, tol))
            TritonBackend.plan_vjp = fused
            row["fused_vs_tiles"] = rel(h, h_tiles)
        rows.append(row)
        print(row, flush=True)
    if PeerLoss is not None:
        try:
            t0 = time.time()
            hp = peer(x, y, v)
            print(f"  peer first call {time.time() - t0:.1f} s", flush=True)
            row = dict(case=f"n={n} d={d}", who="flash-sinkhorn", ms=bench(lambda: peer(x, y, v)),
                       cg=None, res=None, mb=extra_mb(lambda: peer(x, y, v)),
                       err=None if ref is None else rel(hp, ref),
                       hvp_ms=hvp_only_ms(x, y, v, who="peer"))  # fmt: skip
            rows.append(row)
            print(row, flush=True)
        except Exception as exc:  # noqa: BLE001
            print("peer failed:", str(exc)[:200], flush=True)
    del ref
    k = int(os.environ.get("BATCH", "0"))
    if k:  # k directions in one call (one CG with k columns) against k separate calls
        V = torch.randn(k, n, d, device="cuda")
        kw = dict(eps=0.09, cost="half_sqeuclidean", max_iter=100, tol=None)
        H = flashot.hvp(x, y, V, cg_tol=TOLS[0], **kw)
        worst = max(rel(H[i], flashot.hvp(x, y, V[i], cg_tol=TOLS[0], **kw)) for i in range(k))
        solve = bench(lambda: flashot.sinkhorn(x, y, **kw))
        one = bench(lambda: flashot.hvp(x, y, V, cg_tol=TOLS[0], **kw))
        each = bench(lambda: flashot.hvp(x, y, V[0], cg_tol=TOLS[0], **kw))
        print(f"  {k} directions, cg_tol {TOLS[0]:g} (solve of 100 iterations {solve:.1f} ms): "
              f"one call {one:.1f} ms, one direction {each:.1f} ms; HVP part: batched "
              f"{one - solve:.1f} ms vs {k} x {each - solve:.1f} ms; worst difference {worst:.1e}",
              flush=True)

print(f"\n{torch.cuda.get_device_name()}, torch {torch.__version__}")
print("case            who                     ms   hvp ms  CG it  CG res   extra MB  err vs f64")
for r in rows:
    err = f"{r['err']:.2e}" if r["err"] is not None else "      -"
    cgi = f"{r['cg']:5d}" if r["cg"] is not None else "    -"
    res = f"{r['res']:.1e}" if r["res"] is not None else "      -"
    eager = f"  (eager {r['eager_ms']:.1f})" if "eager_ms" in r else ""
    if "captured_ms" in r:
        eager += f"  (captured {r['captured_ms']:.1f}, hvp {r['captured_hvp_ms']:.1f})"
    print(f"{r['case']:15s} {r['who']:20s} {r['ms']:7.1f} {r['hvp_ms']:7.1f}  {cgi}  {res}  "
          f"{r['mb']:8.1f}  {err}{eager}")
