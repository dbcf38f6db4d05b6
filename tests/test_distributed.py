"""flashot.distributed with gloo in two CPU processes against the single-process solve."""

import os
import re
import socket
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import flashot
from flashot import distributed
from flashot.backends import sharded

WORLD = 2
EPS = 1.0  # (a few dozen iterations: every one is a collective)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _data(dtype=torch.float64):
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(37, 3, generator=gen, dtype=dtype)
    y = torch.randn(29, 3, generator=gen, dtype=dtype) * 0.7 + 0.4
    a = torch.rand(37, generator=gen, dtype=dtype) + 0.1
    return x, y, a


def _values():
    """(V (29, 2), U (37,)): values on y and on x; each rank passes its rows."""
    return (torch.arange(58, dtype=torch.float64).reshape(29, 2).sin(),
            torch.arange(37, dtype=torch.float64).cos())  # fmt: skip


#: uneven shards (the last rank's slices are larger)
X_CUT, Y_CUT = [0, 15, 37], [0, 17, 29]


def _worker(rank, port, case, out_dir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    torch.set_num_threads(1)
    try:
        result = _CASES[case](rank)
    except Exception as err:  # the test reads what each rank raised
        result = ("raised", type(err).__name__, str(err), traceback.format_exc())
    finally:
        dist.destroy_process_group()
    torch.save(result, os.path.join(out_dir, f"{rank}.pt"))


def _slices(rank):
    x, y, a = _data()
    rows, cols = slice(X_CUT[rank], X_CUT[rank + 1]), slice(Y_CUT[rank], Y_CUT[rank + 1])
    return x[rows].clone(), y[cols].clone(), a[rows].clone()


def _solve_case(rank, mode="gather", update="auto"):
    x, y, a = _slices(rank)
    x.requires_grad_()
    wide = []  # gathers of 2-D tensors during the solve: the features, once per side
    real = sharded.Comm.gather
    sharded.Comm.gather = lambda self, t, side: (
        (wide.append(t.dim() == 2) and False) or real(self, t, side)
    )
    res = distributed.sinkhorn(x, y, a, eps=EPS, tol=1e-11, max_iter=3000, backend="torch",
                               mode=mode, update=update, eps_schedule="geomloss")  # fmt: skip
    (gx,) = torch.autograd.grad(res.cost, x)
    v, u = _values()
    v, u = v[Y_CUT[rank] : Y_CUT[rank + 1]], u[X_CUT[rank] : X_CUT[rank + 1]]
    sharded.Comm.gather = real
    return dict(wide_gathers=sum(wide), iterations=res.n_iter,
                f=res.f.detach(), g=res.g.detach(), cost=float(res.cost.detach()), gx=gx,
                pv=res.plan @ v, ptu=res.plan.T @ u, converged=res.converged,
                error=res.marginal_error)  # fmt: skip


#: options the one loop brings to sharded solves: relaxed sides, ε-scaling, min_iter,
#: momentum, history (each compared with flashot.sinkhorn on the whole problem)
LOOP_OPTIONS = {
    "unbalanced": dict(rho=0.5, eps_schedule="geomloss", min_iter=60, tol=1e-10, history=True),
    "semi_unbalanced": dict(rho=(None, 0.7), update="symmetric", tol=1e-10, max_iter=4000),
    "momentum": dict(momentum=1.3, tol=1e-10, min_iter=25),
}


def _options_case(rank, name):
    x, y, a = _slices(rank)
    x.requires_grad_()
    res = distributed.sinkhorn(x, y, a, eps=EPS, backend="torch", **LOOP_OPTIONS[name])
    (gx,) = torch.autograd.grad(res.cost, x)
    hist = res.history
    return dict(f=res.f.detach(), g=res.g.detach(), cost=float(res.cost.detach()), gx=gx,
                n_iter=res.n_iter, error=res.marginal_error, converged=res.converged,
                history=None if hist is None else (hist.iterations, hist.errors))  # fmt: skip


def _auto_case(rank):
    """mode="auto" with too little free memory on rank 1 only: both ranks take the ring."""
    x, y, a = _slices(rank)
    real = distributed.free_bytes
    if rank == 1:
        distributed.free_bytes = lambda device: 1000
    try:
        res = distributed.sinkhorn(x, y, a, eps=EPS, tol=1e-11, max_iter=3000, backend="torch")
    finally:
        distributed.free_bytes = real
    roomy = distributed.sinkhorn(x, y, a, eps=EPS, tol=1e-11, max_iter=3000, backend="torch")
    return dict(
        mode=res.mode,
        cost=float(res.cost.detach()),
        roomy=roomy.mode,
        roomy_cost=float(roomy.cost.detach()),
    )


def _mismatch_case(rank):
    x, y, a = _slices(rank)
    return distributed.sinkhorn(x, y, a, eps=0.3 if rank == 0 else 0.4, backend="torch")


def _bad_input_case(rank):
    x, y, a = _slices(rank)
    if rank == 1:
        x = x.clone()
        x[0, 0] = float("nan")
    return distributed.sinkhorn(x, y, a, eps=0.3, backend="torch")


def _bad_option_case(rank):
    """An invalid option on rank 1 only: rank 0 must not wait for it."""
    x, y, a = _slices(rank)
    return distributed.sinkhorn(x, y, a, eps=0.3, backend="torch",
                                cost="euclid" if rank == 1 else "sqeuclidean")  # fmt: skip


def _nan_eps_case(rank):
    x, y, a = _slices(rank)
    return distributed.sinkhorn(x, y, a, eps=float("nan"), backend="torch")


def _zero_weights_case(rank):
    x, y, a = _slices(rank)
    return distributed.sinkhorn(x, y, torch.zeros_like(a), eps=0.3, backend="torch")


def _max_iter_case(rank):
    x, y, a = _slices(rank)
    return distributed.sinkhorn(x, y, a, eps=0.3, backend="torch",
                                max_iter=0 if rank == 0 else 10)  # fmt: skip


def _missed_tol_case(rank):
    import warnings

    x, y, a = _slices(rank)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        res = distributed.sinkhorn(x, y, a, eps=0.05, backend="torch", max_iter=20,
                                   tol=1e-12, check_every=1)  # fmt: skip
    return dict(converged=res.converged, warnings=[
        (w.category.__name__, str(w.message)) for w in caught])  # fmt: skip


def _raised(fn, rank):
    try:
        return fn(rank)
    except Exception as err:
        return ("raised", type(err).__name__, str(err), traceback.format_exc())


#: every case in one spawn (a spawn costs seconds); a collectively raised error leaves the
#: group usable for the next case
_CASES = {
    "all": lambda rank: {
        "gather": _raised(_solve_case, rank),
        "ring": _raised(lambda r: _solve_case(r, mode="ring"), rank),
        "symmetric": _raised(lambda r: _solve_case(r, update="symmetric"), rank),
        "auto": _raised(_auto_case, rank),
        "mismatch": _raised(_mismatch_case, rank),
        "bad_input": _raised(_bad_input_case, rank),
        "bad_option": _raised(_bad_option_case, rank),
        "nan_eps": _raised(_nan_eps_case, rank),
        "zero_weights": _raised(_zero_weights_case, rank),
        "max_iter": _raised(_max_iter_case, rank),
        "missed_tol": _raised(_missed_tol_case, rank),
        **{name: _raised(lambda r, n=name: _options_case(r, n), rank) for name in LOOP_OPTIONS},
    },
}


def _run(case, tmp_path):
    mp.start_processes(_worker, args=(_free_port(), case, str(tmp_path)), nprocs=WORLD,
                       start_method="spawn")  # fmt: skip
    return [torch.load(tmp_path / f"{r}.pt", weights_only=False) for r in range(WORLD)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every case, in one spawn of two gloo ranks."""
    return {group: _run(group, tmp_path_factory.mktemp(group)) for group in _CASES}


@pytest.mark.parametrize("case", ["gather", "ring", "symmetric"])
def test_two_gloo_ranks_match_the_single_process_solve(case, runs):
    outs = [r[case] for r in runs["all"]]
    for out in outs:
        assert not (isinstance(out, tuple) and out[0] == "raised"), out
    x, y, a = _data()
    x = x.clone().requires_grad_()
    ref = flashot.sinkhorn(x, y, a, eps=EPS, tol=1e-11, max_iter=3000, backend="torch",
                           eps_schedule="geomloss")  # fmt: skip
    (gx,) = torch.autograd.grad(ref.cost, x)
    f = torch.cat([o["f"] for o in outs])
    g = torch.cat([o["g"] for o in outs])
    shift = (f - ref.f.detach()).mean()
    assert torch.allclose(f - shift, ref.f.detach(), atol=1e-8)
    assert torch.allclose(g + shift, ref.g.detach(), atol=1e-8)
    if case != "ring":  # the clouds travel once (x's and y's features), however many iterations
        assert all(o["wide_gathers"] == 2 and o["iterations"] > 10 for o in outs), [
            (o["wide_gathers"], o["iterations"]) for o in outs
        ]
    for out in outs:  # the global value on every rank
        assert out["cost"] == pytest.approx(float(ref.cost.detach()), rel=1e-9)
        assert out["converged"] and out["error"] <= 1e-10
    assert torch.allclose(torch.cat([o["gx"] for o in outs]), gx, atol=1e-9)
    v, u = _values()
    dense = ref.plan.dense()
    assert torch.allclose(torch.cat([o["pv"] for o in outs]), dense @ v, atol=1e-10)
    assert torch.allclose(torch.cat([o["ptu"] for o in outs]), dense.T @ u, atol=1e-10)


@pytest.mark.parametrize(
    "case,match",
    [
        ("mismatch", r"disagree on the options \['eps'\]"),
        ("bad_input", "rank 1: x_local contains NaN"),
        ("bad_option", "rank 1: .*cost.*euclid"),
        ("nan_eps", "rank 0: eps must be finite"),
        ("zero_weights", "a_local: the weights sum to zero"),
        ("max_iter", "rank 0: max_iter must be a positive"),
    ],
)
def test_every_rank_gets_the_same_clear_error(case, match, runs):
    outs = [r[case] for r in runs["all"]]
    for out in outs:
        assert isinstance(out, tuple) and out[0] == "raised" and out[1] == "ValueError"
        assert re.search(match, out[2]), out[2]


def test_auto_mode_rings_when_a_rank_lacks_room_and_gathers_otherwise(runs):
    outs = [r["auto"] for r in runs["all"]]
    assert all(not (isinstance(o, tuple) and o[0] == "raised") for o in outs), outs
    assert [o["mode"] for o in outs] == ["ring", "ring"]  # decided together
    assert [o["roomy"] for o in outs] == ["gather", "gather"]
    for o in outs:
        assert o["cost"] == pytest.approx(o["roomy_cost"], rel=1e-10)


def test_a_missed_tol_warns_on_every_rank(runs):
    """The single-process solve's warning, on every rank."""
    import warnings

    x, y, a = _data()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        flashot.sinkhorn(x, y, a, eps=0.05, backend="torch", max_iter=20, tol=1e-12,
                         check_every=1)  # fmt: skip
    (single,) = [str(w.message) for w in caught]
    for out in (r["missed_tol"] for r in runs["all"]):
        assert not (isinstance(out, tuple) and out[0] == "raised"), out
        assert out["converged"] is False
        assert [c for c, _ in out["warnings"]] == ["ConvergenceWarning"], out["warnings"]
        assert out["warnings"][0][1] == "flashot.distributed.sinkhorn: " + single


@pytest.mark.parametrize("name", sorted(LOOP_OPTIONS))
def test_the_sharded_solve_is_the_single_process_loop(name, runs):
    """Relaxed sides, ε-scaling, min_iter, momentum and history over two ranks: the same
    iterations, potentials, value, gradient and checks as the whole problem's solve."""
    outs = [r[name] for r in runs["all"]]
    for out in outs:
        assert not (isinstance(out, tuple) and out[0] == "raised"), out
    x, y, a = _data()
    x = x.clone().requires_grad_()
    ref = flashot.sinkhorn(x, y, a, eps=EPS, backend="torch", **LOOP_OPTIONS[name])
    (gx,) = torch.autograd.grad(ref.cost, x)
    f, g = torch.cat([o["f"] for o in outs]), torch.cat([o["g"] for o in outs])
    if LOOP_OPTIONS[name].get("rho") is None:  # (balanced: potentials up to a constant)
        shift = (f - ref.f.detach()).mean()
        f, g = f - shift, g + shift
    assert torch.allclose(f, ref.f.detach(), atol=1e-8, rtol=0)
    assert torch.allclose(g, ref.g.detach(), atol=1e-8, rtol=0)
    assert torch.allclose(torch.cat([o["gx"] for o in outs]), gx, atol=1e-8, rtol=0)
    for out in outs:
        assert out["n_iter"] == ref.n_iter
        assert out["cost"] == pytest.approx(float(ref.cost.detach()), rel=1e-9, abs=1e-12)
        assert out["converged"] is ref.converged is True
        assert out["error"] == pytest.approx(ref.marginal_error, rel=1e-6, abs=1e-13)
        if ref.history is not None:
            its, errs = out["history"]
            assert list(its) == list(ref.history.iterations)
            assert errs == pytest.approx(list(ref.history.errors), rel=1e-6, abs=1e-13)
