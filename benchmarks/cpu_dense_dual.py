"""HVP products on the CPU: the dual system by CG against the direct (dense) solve.

One HessianOperator per row (a solve), then the median of three products; the error is
against a float64 HVP solved to tol 1e-12 with cg_tol 1e-13. Prints a markdown table.
"""

import time, torch, flashot, warnings
from flashot.autodiff import dense_dual
warnings.simplefilter("ignore")
g=torch.Generator().manual_seed(0)
rows=[]
for n, eps in [(500, 0.1), (500, 0.02), (1000, 0.05)]:
    x=torch.randn(n,3,generator=g,dtype=torch.float64); y=torch.randn(n,3,generator=g,dtype=torch.float64)+0.5
    v=torch.randn(n,3,generator=g,dtype=torch.float64)
    saved = dense_dual.DENSE_UP_TO
    dense_dual.DENSE_UP_TO = 0
    ref = flashot.hvp(x,y,v,eps=eps,cg_tol=1e-13,tol=1e-12,max_iter=100000)
    for dtype in [torch.float32, torch.float64]:
        for mode in ["cg", "direct"]:
            dense_dual.DENSE_UP_TO = 0 if mode == "cg" else saved
            xs, ys, vs = x.to(dtype), y.to(dtype), v.to(dtype)
            H = flashot.HessianOperator(xs, ys, eps=eps)
            H(vs)  # warm (factor)
            t=time.perf_counter(); reps=3
            for _ in range(reps): out = H(vs)
            dt=(time.perf_counter()-t)/reps
            err = float((out.double()-ref).norm()/ref.norm())
            with flashot.record_dual_solves() as log: H(vs)
            rows.append((n, eps, str(dtype).split('.')[-1], mode, round(dt*1000,1), f"{err:.1e}", log.last.n_iter))
    dense_dual.DENSE_UP_TO = saved
print("| n = m | ε | dtype | dual solve | ms per product | rel. error vs float64 | CG iterations |")
print("|---|---|---|---|---|---|---|")
for r in rows: print("| " + " | ".join(map(str, r)) + " |")
