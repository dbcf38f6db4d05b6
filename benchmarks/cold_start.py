"""First calls in fresh processes (issue 14, item 1): compile-only cold start.

Each case runs twice in a new Python process: first with empty caches (``TRITON_CACHE_DIR``
and ``FLASHOT_CACHE_DIR`` pointed at new folders, per case; the tile tables as shipped),
then again with those caches warm. Env: ONLY (substrings of the case names, comma-separated),
COMPILES=1 (list the first call's kernel compilations), PROFILE=1 (the first call under
cProfile: its 30 costliest functions by cumulative time, e.g. compiling against building
launchers against CUDA's own first use; the time printed then includes the profiler's;
PROFILE=2: the second process's first call). Times are wall seconds of the call (import
excluded), synchronized.

Compiling ahead (:mod:`flashot.backends.triton._ahead`): ``RECORD=FILE`` records each
case's first-call compiles (Triton's specialization data, in order) and writes them as a
manifest to FILE (ship it as ``tiles/ahead_sm<cc>_triton<version>.json``);
``AHEAD=off,on`` runs each case's fresh process with compiling ahead off, then on.

    python benchmarks/cold_start.py
    RECORD=/tmp/ahead.json python benchmarks/cold_start.py
"""

import json
import os
import subprocess
import sys
import tempfile

CASES = {
    "SamplesLoss 10k d3 blur .05 value+grad": (
        "x = torch.rand(10000, 3, device='cuda', requires_grad=True)\n"
        "y = torch.rand(10000, 3, device='cuda')\n"
        "loss = flashot.SamplesLoss(p=2, blur=0.05, scaling=0.5, debias=True)\n"
        "call = lambda: torch.autograd.grad(loss(x, y), x)"
    ),
    "hvp 10k d64 eps 0.09": (
        "x, y, v = (torch.randn(10000, 64, device='cuda') for _ in range(3))\n"
        "call = lambda: flashot.hvp(x, y, v, eps=0.09, eps_schedule=flashot.EpsilonScaling(0.9))"
    ),
}
# the acceptance table: the default precision against the peer (its TF32 default), ε = 0.1,
# 10 fixed iterations
DATA = "x = torch.randn({n}, {d}, device='cuda'); y = torch.randn({n}, {d}, device='cuda')\n"
PEER = (
    "from flash_sinkhorn import SamplesLoss\n"
    "w = torch.full(({n},), 1.0 / {n}, device='cuda')\n"
    "loss = SamplesLoss('sinkhorn', backend='symmetric', use_epsilon_scaling=False, eps=0.1, "
    "n_iters=10, debias=False, potentials=False)\n"
    "call = lambda: loss(w, x, w, y)"
)
for n in (10_000, 50_000):
    for d in (64, 512):
        CASES[f"sinkhorn {n // 1000}k d{d} fp32, eps 0.1, 10 it"] = DATA.format(n=n, d=d) + (
            "call = lambda: flashot.sinkhorn(x, y, eps=0.1, max_iter=10, tol=None).cost"
        )
        CASES[f"peer {n // 1000}k d{d} (its TF32 default)"] = DATA.format(n=n, d=d) + PEER.format(
            n=n
        )
# more first calls for a compiling-ahead manifest (run only when ONLY names them)
EXTRA = {
    f"extra sinkhorn 50k d64 {mode}": DATA.format(n=50_000, d=64)
    + (
        f"call = lambda: flashot.sinkhorn(x, y, eps=0.1, max_iter=10, tol=None, "
        f"precision='{mode}').cost"
    )
    for mode in ("tf32", "bf16")
}
EXTRA["extra sinkhorn 50k d64 fp32 value+grad"] = (
    DATA.format(n=50_000, d=64) + "x.requires_grad_()\n"
    "call = lambda: torch.autograd.grad(flashot.sinkhorn(x, y, eps=0.1).cost, x)"
)
EXTRA["extra SamplesLoss 10k d64 value+grad"] = (
    DATA.format(n=10_000, d=64) + "x.requires_grad_()\n"
    "loss = flashot.SamplesLoss(p=2, blur=0.05, scaling=0.5, debias=True)\n"
    "call = lambda: torch.autograd.grad(loss(x, y), x)"
)
EXTRA["extra SamplesLoss 10k d64 peer setting, double backward"] = (
    DATA.format(n=10_000, d=64) + "x.requires_grad_(); v = torch.randn_like(x)\n"
    "loss = flashot.SamplesLoss(p=2, blur=0.3, scaling=0.9, debias=False)\n"
    "def call():\n"
    "    (g,) = torch.autograd.grad(loss(x, y), x, create_graph=True)\n"
    "    return torch.autograd.grad((g * v).sum(), x)"
)
ONLY = os.environ.get("ONLY")  # substrings of the case names to run, comma-separated
if ONLY:
    CASES.update(EXTRA)
# COMPILES=1: each first call also lists its kernel compilations (Triton's JIT hooks), with
# the constexprs that made each one a new specialization and its seconds
HOOKS = (
    """
import time as _t
from triton import knobs as _knobs
_start = {}
def _pre(*, key, fn, compile, **_):
    _start[str(key)] = _t.perf_counter()
def _post(*, key, fn, compile, **_):
    secs = _t.perf_counter() - _start.get(str(key), _t.perf_counter())
    try:
        names = fn.jit_function.arg_names
        flags = {names[k[0]] if isinstance(k, tuple) else k: v
                 for k, v in compile["constants"].items()}
        flags = {k: v for k, v in flags.items() if isinstance(k, str) and k.isupper()}
    except Exception as err:  # another Triton's hook arguments
        flags = repr(err)
    print(f"  compile {fn.name} {secs:.2f}s {flags}", flush=True)
_knobs.runtime.jit_cache_hook, _knobs.runtime.jit_post_compile_hook = _pre, _post
"""
    if os.environ.get("COMPILES") == "1"
    else ""
)
# RECORD: the first process's compiles as Triton serializes them (its serializer made
# tolerant: a constexpr that is a function, as the pair kernels take, is not recorded)
RECORDER = """
import json as _json
import triton.runtime.jit as _jit
from triton import knobs as _knobs
_serialize = _jit.serialize_specialization_data
def _tolerant(*a, **k):
    try:
        return _serialize(*a, **k)
    except TypeError:
        return None
_jit.serialize_specialization_data = _tolerant
def _record(*, key, fn, compile, **_):
    data = compile.get("specialization_data")
    if data and fn.module.startswith("flashot."):
        with open({path!r}, "a") as _f:
            _f.write(_json.dumps({{"kernel": fn.module + ":" + fn.name, "key": str(key),
                                  "data": data}}) + "\\n")
_knobs.runtime.jit_post_compile_hook = _record
"""
RECORD = os.environ.get("RECORD")
AHEAD = os.environ.get("AHEAD", "").split(",") if os.environ.get("AHEAD") else [None]
TIMER = """
import time, torch, flashot, warnings
warnings.simplefilter("ignore")
{hooks}
{setup}
{profile}torch.cuda.synchronize(); t0 = time.perf_counter(); call(); torch.cuda.synchronize()
t1 = time.perf_counter(){report}
print(f"{{t1 - t0:.2f}}")
"""
PROFILED = (
    "import cProfile, io, pstats\n_prof = cProfile.Profile(); _prof.enable()\n",
    "\n_prof.disable(); _out = io.StringIO()\n"
    "pstats.Stats(_prof, stream=_out).sort_stats('cumulative').print_stats(30)\n"
    "print('\\n'.join('  prof ' + l for l in _out.getvalue().splitlines() if l.strip()))",
)

print("case                                       cold s   warm-cache s", flush=True)
recorded = {}
for (name, setup), ahead in ((c, a) for c in CASES.items() for a in AHEAD):
    if ONLY and not any(part in name for part in ONLY.split(",")):
        continue
    # a fresh environment per case: empty Triton and flashot caches
    env = dict(os.environ, TRITON_CACHE_DIR=tempfile.mkdtemp(prefix="cold_triton_"),
               FLASHOT_CACHE_DIR=tempfile.mkdtemp(prefix="cold_flashot_"))  # fmt: skip
    env.pop("FLASHOT_AUTOTUNE", None)
    if ahead is not None or RECORD:  # (a recording compiles in launch order)
        env["FLASHOT_COMPILE_AHEAD"] = "1" if ahead == "on" and not RECORD else "0"
    log = tempfile.mktemp(suffix=".jsonl")
    times = []
    for _ in range(2):
        # (PROFILE=1: the fresh process under cProfile; 2: the second, warm-cache one)
        profile = PROFILED if os.environ.get("PROFILE") == str(1 + len(times)) else ("", "")
        hooks = HOOKS + (RECORDER.format(path=log) if RECORD and not times else "")
        code = TIMER.format(setup=setup, hooks=hooks, profile=profile[0], report=profile[1])
        run = subprocess.run([sys.executable, "-c", code], env=env,
                             capture_output=True, text=True, timeout=300)  # fmt: skip
        lines = run.stdout.strip().splitlines()
        times.append(lines[-1] if run.returncode == 0 else "failed")
        if len(times) == 1 or profile[0]:
            print("\n".join(line for line in lines if line.startswith(("  compile", "  prof"))),
                  flush=True)  # fmt: skip
        if run.returncode:
            print(run.stderr[-2000:], flush=True)
    label = name if ahead is None else f"{name} (ahead {ahead})"
    print(f"{label:42s} {times[0]:>7s}   {times[1]:>7s}", flush=True)
    if RECORD and os.path.exists(log):
        with open(log) as f:
            recorded[name] = [json.loads(line) for line in f]
        import triton

        with open(RECORD, "w") as f:  # (after every case: a run cut short keeps what it had)
            json.dump({"triton": triton.__version__, "runs": recorded}, f)
if RECORD:
    print(f"recorded {sum(map(len, recorded.values()))} compiles of {len(recorded)} cases "
          f"to {RECORD}")  # fmt: skip
