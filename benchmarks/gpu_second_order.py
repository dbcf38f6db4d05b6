"""Second order at the settings users meet (issue 48), one process, flashot's defaults.

Parts (env PARTS, default "A,B,C"):

* A, the peer's HVP setting: ``SamplesLoss(blur=0.3, scaling=0.9, debias=False)``, randn
  clouds, d = 64, loss + gradient (create_graph) + one HVP by double backward; the
  double backward alone on a kept graph (``hvp``), the whole call on points that move
  every call (``moving_ms``: the replay's CUDA graphs key on the schedule and bound), and
  with the reverse sweep run to its start (``whole_sweep_ms``, ``tail_moved``: the HVP's
  change; the tail stops only eager sweeps, past 2^28 pairs, ``replay._Tail``), with the
  schedule run again instead of read from the solve's kept iterates (``rerun_ms``,
  ``kept_moved``), and the peak a value's graph adds (``value_graph_mib``: the iterates).
  flash-sinkhorn 0.4.1 the same way (``half_cost=True``, GeomLoss' convention) when
  installed. Accuracy against the same
  function in float64 (flashot's torch backend; SIZES_REF bounds n), and for reference
  against the converged problem's Hessian at those potentials (``dense_hvp_implicit``,
  dense float64, n ≤ DENSE_MAX).
* B, GeomLoss' defaults, debiased (blur 0.05, scaling 0.5), 10k, d ∈ {3, 64}: value and
  gradient against value, gradient and HVP: the ratio the issue bounds by 3.
* C, ``flashot.hvp`` (a solve to a tolerance, the dual CG): time, CG iterations and
  error against float64 for ``hvp_tol`` values (TOLS).
* P, where A's HVP spends its time (n = SIZES[0], d = P_D; P_CASE=geomloss profiles B's
  setting instead, without the float64 error; P_WHOLE=1 profiles the whole call, loss and
  gradient included): the profiler's top kernels and host calls, one row
  pass and one ``plan_vjp`` (as a replayed transform's backward makes it: one value
  column) timed alone; with FUSED=1 also with the column sums in the rows' launch
  (``_configs.VJP_FUSED_COLUMNS``), with SYM=1 with a symmetric step's two reverse
  products in one launch (``_configs.SYM_VJP``: the whole call too); with SWEEP=1 the
  ``plan_vjp`` kernel's tiles for one value column (``_configs.VJP_NARROW_TILES``), each
  with one launch, the whole HVP and its error against the float64 double backward;
  SYM_TILES="64,64,4,2;128,64,4,2" times the symmetric reverse's tiles
  (``_configs.SYM_VJP_TILES``, ``SYM_VJP_NARROW_TILES`` at P_D ≤ 16; SYM_VJP is on by
  default); MIRROR=1 a self problem's
  mirror off and on,
  twice (with P_CASE=geomloss: the debiased call); STABILIZED=1 the replay's LSEs from
  stabilized fused sums (``_configs.STABILIZED_LSE_FROM``) off and on, twice;
  MID="128,64,8,2" the wide reverse product's tiles for 17…64 values
  (``_configs.VJP_MID_TILES``: the envelope's row average) off, then each;
  SPLIT_VALUES=1 value products on triples (d ≤ 5) by 3xTF32 per tile, then split once
  (``Operands.splits_values``), twice; MIRROR_VJP=1 a mirror's reverse in two launches,
  then one (``TritonBackend.mirror_vjp``), twice. Toggles print ``from_first``, each
  HVP's distance from the first setting's. No float64 error past REF_MAX points.

Prints a short table last; rows also go to $OUT/second_order.json when OUT is set.
"""

import json
import os
import time
import warnings
from unittest import mock

import torch
from tests.references import dense_hvp_implicit
from triton.testing import do_bench

import flashot
from flashot.autodiff import replay

warnings.simplefilter("ignore")
PARTS = os.environ.get("PARTS", "A,B,C").split(",")
SIZES = [int(n) for n in os.environ.get("SIZES", "10000,50000").split(",")]
REF_MAX = int(os.environ.get("REF_MAX", "50000"))
DENSE_MAX = int(os.environ.get("DENSE_MAX", "10000"))
P_D = int(os.environ.get("P_D", "64"))
TOLS = [float(t) for t in os.environ.get("TOLS", "1e-2,1e-3,1e-4").split(",")]
try:  # (PEER=0: without the peer, whose first call autotunes for about a minute)
    if os.environ.get("PEER") == "0":
        raise ImportError("PEER=0")
    from flash_sinkhorn import SamplesLoss as PeerLoss
except Exception as exc:
    PeerLoss = None
    print("peer unavailable:", exc)
rows: list[dict] = []


def rel(u, w):
    return float((u.double() - w.double()).norm() / w.double().norm())


def bench(fn):
    fn()
    torch.cuda.synchronize()
    return do_bench(fn, warmup=1, rep=400, return_mode="median")


def double_backward(make_loss, x, v):
    xs = x.detach().requires_grad_()
    (g,) = torch.autograd.grad(make_loss(xs), xs, create_graph=True)
    (h,) = torch.autograd.grad((g * v).sum(), xs)
    return h


def hvp_only_ms(make_loss, x, v):
    xs = x.detach().requires_grad_()
    (g,) = torch.autograd.grad(make_loss(xs), xs, create_graph=True)
    return bench(lambda: torch.autograd.grad((g * v).sum(), xs, retain_graph=True))


def part_a():
    ours = flashot.SamplesLoss(blur=0.3, scaling=0.9, debias=False)
    ref_loss = flashot.SamplesLoss(blur=0.3, scaling=0.9, debias=False, backend="torch")
    for n in SIZES:
        torch.manual_seed(0)
        x, y, v = (torch.randn(n, 64, device="cuda") for _ in range(3))
        t0 = time.time()
        h = double_backward(lambda t: ours(t, y), x, v)
        torch.cuda.synchronize()
        print(f"A n={n}: first call {time.time() - t0:.1f} s", flush=True)
        ref = dense = None
        if n <= REF_MAX:
            t0 = time.time()
            ref = double_backward(lambda t: ref_loss(t, y.double()), x.double(), v.double())
            print(f"  float64 reference {time.time() - t0:.1f} s", flush=True)
        if n <= DENSE_MAX:
            f, g = flashot.SamplesLoss(blur=0.3, scaling=0.9, debias=False, potentials=True,
                                       backend="torch")(x.double(), y.double())  # fmt: skip
            dense = dense_hvp_implicit(x.double(), y.double(), f, g, v.double(), 0.09)
            torch.cuda.empty_cache()
        full = bench(lambda: double_backward(lambda t: ours(t, y), x, v))
        # what an optimizer meets: the points move every call (a new schedule and bound,
        # so the replay's CUDA graphs do not apply and it runs eagerly)
        moved = iter(range(10**9))
        moving = bench(lambda: double_backward(lambda t: ours(t, y),
                                               x + 1e-3 * next(moved), v))  # fmt: skip
        xs = x.detach().requires_grad_()
        grad = bench(lambda: torch.autograd.grad(ours(xs, y), xs))
        with mock.patch.object(replay, "TAIL_TOL", {}):  # (the reverse sweep run whole)
            whole_sweep = bench(lambda: double_backward(lambda t: ours(t, y), x, v))
            h_whole = double_backward(lambda t: ours(t, y), x, v)
        with mock.patch.object(replay, "_kept", lambda *t: None):  # (the schedule run again)
            rerun = bench(lambda: double_backward(lambda t: ours(t, y), x, v))
            h_rerun = double_backward(lambda t: ours(t, y), x, v)
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        value = ours(xs, y)  # (a first-order step's graph: the kept iterates live in it)
        kept_mib = (torch.cuda.max_memory_allocated() - base) / 2**20
        del value
        row = dict(part="A", case=f"peer setting n={n} d=64", who="flashot", ms=full,
                   whole_sweep_ms=whole_sweep, tail_moved=rel(h, h_whole), moving_ms=moving,
                   rerun_ms=rerun, kept_moved=rel(h, h_rerun), value_graph_mib=kept_mib,
                   grad_ms=grad, hvp_ms=hvp_only_ms(lambda t: ours(t, y), x, v),
                   err=None if ref is None else rel(h, ref),
                   err_converged_hessian=None if dense is None else rel(h, dense),
                   ref_vs_converged=None if (dense is None or ref is None)
                   else rel(ref, dense))  # fmt: skip
        rows.append(row)
        print(row, flush=True)
        if PeerLoss is not None:
            peer = PeerLoss(p=2, blur=0.3, scaling=0.9, debias=False, half_cost=True)
            hp = double_backward(lambda t: peer(t, y), x, v)
            row = dict(part="A", case=f"peer setting n={n} d=64", who="flash-sinkhorn",
                       ms=bench(lambda: double_backward(lambda t: peer(t, y), x, v)),
                       hvp_ms=hvp_only_ms(lambda t: peer(t, y), x, v),
                       err=None if ref is None else rel(hp, ref),
                       err_converged_hessian=None if dense is None else rel(hp, dense))  # fmt: skip
            rows.append(row)
            print(row, flush=True)


def part_b():
    loss = flashot.SamplesLoss()  # blur 0.05, scaling 0.5, debiased
    for d in (3, 64):
        torch.manual_seed(1)
        x, y, v = (torch.randn(10_000, d, device="cuda") for _ in range(3))
        double_backward(lambda t: loss(t, y), x, v)
        xs = x.detach().requires_grad_()
        grad = bench(lambda: torch.autograd.grad(loss(xs, y), xs))
        full = bench(lambda: double_backward(lambda t: loss(t, y), x, v))
        only = hvp_only_ms(lambda t: loss(t, y), x, v)
        row = dict(part="B", case=f"geomloss defaults 10k d={d}", who="flashot", grad_ms=grad,
                   ms=full, hvp_ms=only, ratio=full / grad)  # fmt: skip
        rows.append(row)
        print(row, flush=True)


def part_c():
    cases = [(10_000, 3, 0.05, 1.0), (10_000, 64, 5.0, 0.0), (50_000, 3, 0.05, 1.0)]
    for n, d, eps, shift in cases:
        torch.manual_seed(2)
        x, y, v = (torch.randn(n, d, device="cuda") for _ in range(3))
        y = y + shift
        ref = None
        if n <= 10_000:
            ref = flashot.hvp(x.double(), y.double(), v.double(), eps=eps, tol=1e-10,
                              max_iter=20_000)  # fmt: skip
        for tol in TOLS:
            with flashot.record_dual_solves() as log:
                h = flashot.hvp(x, y, v, eps=eps, hvp_tol=tol)
            ms = bench(lambda: flashot.hvp(x, y, v, eps=eps, hvp_tol=tol))
            row = dict(part="C", case=f"hvp n={n} d={d} eps={eps}", who=f"hvp_tol={tol:g}",
                       ms=ms, cg=log.last.n_iter, res=log.last.residual,
                       err=None if ref is None else rel(h, ref))  # fmt: skip
            rows.append(row)
            print(row, flush=True)


def part_p():
    from torch.profiler import ProfilerActivity, profile

    from flashot.autodiff.replay import REPLAY_GRAPHS
    from flashot.backends import resolve_backend
    from flashot.backends.triton import _configs as vjp
    from flashot.geometry.costs import AttentionForm

    n, geomloss = SIZES[0], os.environ.get("P_CASE") == "geomloss"
    torch.manual_seed(0)
    x, y, v = (torch.randn(n, P_D, device="cuda") for _ in range(3))
    loss = flashot.SamplesLoss() if geomloss else flashot.SamplesLoss(blur=0.3, scaling=0.9,
                                                                      debias=False)  # fmt: skip

    def loss_y(t):
        return loss(t, y)

    def hvp_of(xx, yy, vv):
        xl = xx.detach().requires_grad_()
        (gg,) = torch.autograd.grad(loss(xl, yy), xl, create_graph=True)
        return lambda: torch.autograd.grad((gg * vv).sum(), xl, retain_graph=True)[0]

    run = hvp_of(x, y, v)
    if os.environ.get("P_WHOLE"):  # the whole call (loss, gradient, HVP), not the HVP alone
        run = lambda: double_backward(loss_y, x, v)  # noqa: E731
    run(), run()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=12,
                                    max_name_column_width=60))  # fmt: skip
    print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=20,
                                    max_name_column_width=60))  # fmt: skip
    # one row pass and one plan_vjp as the replay makes them, timed alone
    be = resolve_backend("auto", x.device)
    al, bl = (x * x).sum(1), (y * y).sum(1)
    form = AttentionForm(2**0.5 * x, 2**0.5 * y, al, bl,
                         cost_bound=float(4 * (al.max() + bl.max())))  # fmt: skip
    h = torch.zeros(n, device="cuda")
    lw = torch.full((n,), -float(torch.log(torch.tensor(n))), device="cuda")
    r = -be.row_attend(form, h - bl, 0.09, log_w=lw)[0]

    def one_vjp():
        return be.plan_vjp(form, r, h, torch.ones_like(r), torch.exp(lw), 0.09,
                           r.new_ones(n, 1), r[:, None], frozenset({"row_k", "col"}))  # fmt: skip

    ra = bench(lambda: be.row_attend(form, h - bl, 0.09, log_w=lw))
    case = f"n={n} d={P_D}" + (" geomloss" if geomloss else "")
    rows.append(dict(part="P", case=case, who="one row pass", ms=ra))
    settings = [vjp.VJP_NARROW_TILES]
    if os.environ.get("SWEEP"):
        settings = [(64, 64, 4, 2), (64, 64, 4, 3), (128, 64, 4, 2), (128, 64, 8, 2),
                    (64, 128, 4, 2), (128, 32, 4, 2), (32, 64, 4, 2), (128, 128, 8, 2),
                    (256, 64, 8, 2), (64, 32, 4, 2)]  # fmt: skip
    # (GeomLoss' defaults: no float64 double backward, which takes minutes at 10k)
    ref = None if geomloss or n > REF_MAX else hvp_of(x.double(), y.double(), v.double())()
    kept = vjp.VJP_NARROW_TILES, vjp.VJP_FUSED_COLUMNS, vjp.SYM_VJP

    def toggle(module, name, labelled):  # module.name at each (label, value), then restored
        kept_value, first = getattr(module, name), None
        for label, value in labelled:
            setattr(module, name, value)
            REPLAY_GRAPHS.clear()  # (captured replays keep the launches they were made with)
            run = hvp_of(x, y, v)
            out = run()
            first = out if first is None else first
            rows.append(dict(part="P", case=case, who=label, ms=0.0, hvp_ms=bench(run),
                             err=None if ref is None else rel(out, ref),
                             from_first=rel(out, first),
                             whole_ms=bench(lambda: double_backward(loss_y, x, v))))  # fmt: skip
            print(rows[-1], flush=True)
        setattr(module, name, kept_value)
        REPLAY_GRAPHS.clear()

    def tiles(text):  # "128,64,8,2;64,64,4,2" → tuples
        return [tuple(int(t) for t in one.split(",")) for one in text.split(";")]

    if os.environ.get("MID"):  # VJP_MID_TILES off, then each
        toggle(vjp, "VJP_MID_TILES", [(f"mid tiles {t}", t)
                                      for t in [None, *tiles(os.environ["MID"])]])  # fmt: skip
    if os.environ.get("STABILIZED"):  # replayed LSEs from stabilized fused sums, off and on
        toggle(vjp, "STABILIZED_LSE_FROM", [(f"stabilized={on}", 0 if on else None)
                                            for on in (False, True, False, True)])  # fmt: skip
    if os.environ.get("MIRROR"):  # a self problem as a mirror, off and on (P_CASE=geomloss)
        from flashot.autodiff import replay, second_order

        off = lambda *t: False  # noqa: E731
        toggle(second_order, "mirrors", [(f"mirror={on}", replay.mirrors if on else off)
                                         for on in (False, True, False, True)])  # fmt: skip
    if os.environ.get("SPLIT_VALUES"):  # value products on triples: 3xTF32 (off), split (on)
        from flashot.backends.triton._operands import Operands

        on, off = Operands.splits_values, lambda self: False
        toggle(Operands, "splits_values", [(f"split values={v}", on if v else off)
                                           for v in (False, True, False, True)])  # fmt: skip
    if os.environ.get("MIRROR_VJP"):  # a mirror's reverse in one launch (on) or two (off)
        from flashot.backends.triton import TritonBackend

        on, off = TritonBackend.mirror_vjp, lambda self, *a: None
        toggle(TritonBackend, "mirror_vjp", [(f"mirror one launch={v}", on if v else off)
                                             for v in (False, True, False, True)])  # fmt: skip
    if os.environ.get("SYM_TILES"):  # SYM_VJP's tiles (on by default), each
        name = "SYM_VJP_NARROW_TILES" if P_D <= 16 else "SYM_VJP_TILES"
        toggle(vjp, name, [(f"sym tiles {t}", t)
                                      for t in tiles(os.environ["SYM_TILES"])])  # fmt: skip
    # FUSED=1: each setting also with the columns' sums in the rows' launch; SYM=1: also
    # with a symmetric step's two reverse products in one launch (_configs.SYM_VJP)
    fusions = (False, True) if os.environ.get("FUSED") else (kept[1],)
    syms = (False, True) if os.environ.get("SYM") else (kept[2],)
    for tiles in settings:
        for fused in fusions:
            for sym in syms:
                vjp.VJP_NARROW_TILES, vjp.VJP_FUSED_COLUMNS, vjp.SYM_VJP = tiles, fused, sym
                REPLAY_GRAPHS.clear()  # (captured replays keep the launches they were made with)
                run = hvp_of(x, y, v)
                err = None if ref is None else rel(run(), ref)
                whole = bench(lambda: double_backward(loss_y, x, v))
                rows.append(dict(part="P", case=case, who=f"plan_vjp p=1 {tiles} fused={fused} "
                                 f"sym={sym}", ms=bench(one_vjp), hvp_ms=bench(run), err=err,
                                 whole_ms=whole))  # fmt: skip
                print(rows[-1], flush=True)
    vjp.VJP_NARROW_TILES, vjp.VJP_FUSED_COLUMNS, vjp.SYM_VJP = kept


print(torch.cuda.get_device_name(), torch.__version__, flashot.__version__, flush=True)
for part, fn in (("A", part_a), ("B", part_b), ("C", part_c), ("P", part_p)):
    if part in PARTS:
        try:
            fn()
        except Exception as exc:
            print(f"part {part} failed: {type(exc).__name__}: {exc}", flush=True)
if os.environ.get("OUT"):
    with open(os.path.join(os.environ["OUT"], "second_order.json"), "w") as fh:
        json.dump(rows, fh, indent=1)
print("\npart | case | who | ms | grad ms | hvp ms | err | other")
for r in rows:
    other = {k: v for k, v in r.items() if k not in ("part", "case", "who", "ms", "grad_ms",
                                                    "hvp_ms", "err")}  # fmt: skip
    print(
        f"{r['part']} | {r['case']} | {r['who']} | {r.get('ms', 0):.1f} | "
        f"{r.get('grad_ms') or 0:.1f} | {r.get('hvp_ms') or 0:.1f} | {r.get('err')} | {other}"
    )
