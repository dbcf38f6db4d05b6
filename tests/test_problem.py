"""Every input a user can get wrong is refused with an error naming the argument."""

import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import flashot

F64 = torch.float64


def good(n=6, m=5, d=2):
    g = torch.Generator().manual_seed(1)
    return torch.randn(n, d, generator=g, dtype=F64), torch.randn(m, d, generator=g, dtype=F64)


BAD_VALUES = st.sampled_from([math.nan, math.inf, -math.inf])


@settings(max_examples=25, deadline=None)
@given(which=st.sampled_from(["x", "y", "a", "b"]), value=BAD_VALUES, pos=st.integers(0, 4))
def test_non_finite_inputs_are_named(which, value, pos):
    x, y = good()
    a, b = torch.full((6,), 1 / 6, dtype=F64), torch.full((5,), 1 / 5, dtype=F64)
    args = dict(x=x, y=y, a=a, b=b)
    args[which].view(-1)[pos] = value
    with pytest.raises(ValueError, match=rf"^{which} contains NaN"):
        flashot.sinkhorn(args["x"], args["y"], args["a"], args["b"], eps=0.1)


@settings(max_examples=25, deadline=None)
@given(eps=st.one_of(st.floats(max_value=0.0), st.just(math.nan), st.just(math.inf)))
def test_bad_eps(eps):
    x, y = good()
    with pytest.raises(ValueError, match="eps"):
        flashot.sinkhorn(x, y, eps=eps)


@settings(max_examples=20, deadline=None)
@given(which=st.sampled_from(["a", "b"]), neg=st.floats(max_value=-1e-12, min_value=-1e6))
def test_negative_weights(which, neg):
    x, y = good()
    w = {"a": torch.full((6,), 1 / 6, dtype=F64), "b": torch.full((5,), 1 / 5, dtype=F64)}
    w[which][0] = neg
    with pytest.raises(ValueError, match=rf"^{which} has negative"):
        flashot.sinkhorn(x, y, w["a"], w["b"], eps=0.1)


@settings(max_examples=20, deadline=None)
@given(n=st.integers(1, 8), d=st.integers(1, 4), dn=st.integers(-3, 3).filter(lambda v: v != 0))
def test_shape_mismatches(n, d, dn):
    x = torch.randn(n, d, dtype=F64)
    y = torch.randn(n, d + dn, dtype=F64) if d + dn > 0 else torch.randn(n, 1, 1, dtype=F64)
    with pytest.raises(ValueError, match=r"y|feature dimension"):
        flashot.sinkhorn(x, y, eps=0.1)
    a = torch.ones(n + abs(dn), dtype=F64)
    with pytest.raises(ValueError, match=r"^a must have shape"):
        flashot.sinkhorn(x, x.clone(), a, eps=0.1)


@pytest.mark.parametrize(
    "kwargs,exc,match",
    [
        (dict(x=torch.zeros(0, 2, dtype=F64)), ValueError, "^x must be non-empty"),
        (dict(y=torch.zeros(3, 0, dtype=F64)), ValueError, "^y must be non-empty"),
        (dict(x=torch.zeros(4, dtype=F64)), ValueError, r"^x must have shape \(n, d\)"),
        (dict(x=[[0.0, 1.0]]), TypeError, "^x must be a torch.Tensor"),
        (dict(x=torch.zeros(3, 2, dtype=torch.int64)), TypeError, "^x must have a floating"),
        (dict(y=torch.zeros(3, 2, dtype=torch.float32)), TypeError, "x has dtype .* but y"),
        (dict(a=torch.zeros(6, dtype=F64)), ValueError, "^a sums to zero"),
        (dict(b=torch.ones(5, dtype=torch.float32)), TypeError, "^b has dtype"),
        (dict(b=[0.2] * 5), TypeError, "^b must be a torch.Tensor"),
        (dict(rho=-1.0), ValueError, "^rho"),
        (dict(rho=(1.0, 2.0, 3.0)), ValueError, "^rho"),
        (dict(cost="l1"), ValueError, "^cost"),
        (dict(update="jacobi"), ValueError, "^update"),
        (dict(max_iter=0), ValueError, "^max_iter"),
        (dict(max_iter=2.5), ValueError, "^max_iter"),
        (dict(tol=-1.0), ValueError, "^tol"),
        (dict(check_every=0), ValueError, "^check_every"),
        (dict(backend="keops"), ValueError, "^backend"),
        (dict(precision="fp8"), ValueError, "^precision"),
        (dict(eps_schedule="linear"), ValueError, "^eps_schedule"),
        (dict(eps_schedule=[1.0, -2.0]), ValueError, "^eps_schedule"),
        (dict(eps_schedule=[1.0] * 20, max_iter=5), ValueError, "^max_iter"),
        (dict(init=(torch.zeros(6, dtype=F64),)), TypeError, "^init"),
        (
            dict(init=(torch.zeros(6, dtype=F64), torch.zeros(4, dtype=F64))),
            ValueError,
            r"^init\[1\]",
        ),
        (dict(cost="cosine", x=torch.zeros(6, 2, dtype=F64)), ValueError, "^x has a zero vector"),
    ],
)
def test_named_errors(kwargs, exc, match):
    x, y = good()
    args = dict(x=x, y=y, a=None, b=None, eps=0.1)
    args.update(kwargs)
    x, y, a, b = args.pop("x"), args.pop("y"), args.pop("a"), args.pop("b")
    with pytest.raises(exc, match=match):
        flashot.sinkhorn(x, y, a, b, **args)


@pytest.mark.parametrize(
    "broken,match",
    [(("x", "a"), "^x contains NaN"), (("y", "b"), "^y contains NaN"), (("a", "b"), "^a has neg")],
)
def test_several_bad_values_name_the_first_argument(broken, match):
    """The value checks wait for the device once: the first broken argument is named."""
    x, y = good()
    args = dict(
        x=x, y=y, a=torch.full((6,), 1 / 6, dtype=F64), b=torch.full((5,), 1 / 5, dtype=F64)
    )
    for which in broken:
        if which in ("x", "y"):
            args[which][0, 0] = math.nan
        else:
            args[which][0] = -1.0
    with pytest.raises(ValueError, match=match):
        flashot.sinkhorn(args["x"], args["y"], args["a"], args["b"], eps=0.5)


def test_a_solve_inside_a_cuda_graph_capture_is_refused_clearly(monkeypatch):
    """Value checks wait for the host, which a capture forbids: a clear error, not a
    CUDA failure (checked with stand-ins: no GPU here)."""
    from flashot.problem import DeviceChecks

    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    checks = DeviceChecks()
    checks.add(torch.tensor(True), ValueError("never raised"))
    checks.verify()  # CPU verdicts: no capture concerns them
    verdict = type("CudaVerdict", (), {"is_cuda": True})()
    checks._items = [((verdict,), None)]
    with pytest.raises(RuntimeError, match="CUDA graph capture"):
        checks.verify()


def test_mixed_devices_are_named():
    if not torch.cuda.is_available():
        pytest.skip("needs a second device")
    x, y = good()
    with pytest.raises(ValueError, match="x is on"):
        flashot.sinkhorn(x, y.cuda(), eps=0.1)


def test_divergence_as_diverging_iterations_raise_not_nan():
    # a tiny eps in float32 far from converging must not return NaN silently
    x, y = good(50, 50, 3)
    res = flashot.sinkhorn(x.float() * 100, y.float() * 100, eps=1e-4, max_iter=20, tol=None)
    assert torch.isfinite(res.cost) and torch.isfinite(res.f).all()


@pytest.mark.parametrize("precision", ["fp32", "tf32", "bf16"])
def test_problem_allocates_only_the_two_feature_matrices(precision):
    """Without autograd, validation and the attention form allocate q and k and no other
    cloud-sized memory, inside ATen kernels included (a float64 reduction of a float32
    cloud copies it): a forward solve stays within inputs + O(n) memory."""
    from torch.profiler import ProfilerActivity, profile

    from flashot.problem import make_problem

    n, m, d = 300_000, 1000, 8  # n ≠ m: a float64 copy of x would outgrow q + k
    x, y = torch.randn(n, d), torch.randn(m, d) + 1
    with torch.no_grad(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        problem = make_problem(x, y, eps=0.1, backend="torch", precision=precision)
    events = sorted(
        (e for e in prof.events() if e.name == "[memory]"), key=lambda e: e.time_range.start
    )
    live = peak = 0
    for e in events:
        live += e.cpu_memory_usage
        peak = max(peak, live)
    assert problem.form.q.shape == (n, d)
    # q, k, their norms and the weights; block temporaries of at most 4 MB
    assert peak < (n + m) * d * 4 + 6 * (n + m) * 4 + (4 << 20), peak / (n * d * 4)


def test_numpy_inputs_are_cpu_tensors_and_results_tensors():
    import numpy as np

    rng = np.random.default_rng(0)
    x, y, b = rng.normal(size=(30, 2)), rng.normal(size=(20, 2)), rng.random(20)
    res = flashot.sinkhorn(x, y, None, b, eps=0.5)
    ref = flashot.sinkhorn(torch.from_numpy(x), torch.from_numpy(y), None, torch.from_numpy(b),
                           eps=0.5)  # fmt: skip
    assert isinstance(res.f, torch.Tensor) and res.f.dtype == torch.float64
    assert float(res.cost) == float(ref.cost)
    # float64 numpy weights follow a float32 cloud
    res32 = flashot.sinkhorn(x.astype(np.float32), y.astype(np.float32), None, b, eps=0.5)
    assert float(res32.cost) == pytest.approx(float(ref.cost), rel=1e-5)
    div = flashot.sinkhorn_divergence(x, y, eps=0.5)
    assert float(div) == pytest.approx(float(flashot.sinkhorn_divergence(
        torch.from_numpy(x), torch.from_numpy(y), eps=0.5)), rel=1e-12)  # fmt: skip
    with pytest.raises(TypeError, match="b must hold floats"):
        flashot.sinkhorn(x, y, None, np.ones(20, dtype=np.int64), eps=0.5)
    with pytest.raises(TypeError, match="x must have a floating dtype"):
        flashot.sinkhorn(np.ones((3, 2), dtype=np.int64), y, eps=0.5)


@settings(
    max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)  # the same patch for all
@given(
    sizes=st.lists(st.tuples(st.integers(1, 30), st.integers(1, 30)), min_size=1, max_size=4),
    seed=st.integers(0, 2**16),
)
def test_mean_costs_is_the_weighted_mean_of_the_dense_cost(monkeypatch, sizes, seed):
    """``mean_costs`` (closed form, float64 sums a block of rows at a time) against
    ``Σ a_i b_j C_ij / (Σa Σb)`` from the dense cost, per problem of a packed batch; blocks
    of a few rows, so every sum spans several blocks."""
    import flashot.geometry.costs
    from flashot.geometry.costs import get_cost
    from flashot.geometry.segments import Segments
    from flashot.packing import _packed_form
    from flashot.problem import mean_costs

    monkeypatch.setattr(flashot.geometry.costs, "_BLOCK", 8)
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randn(n, 3, dtype=torch.float64, generator=g) for n, _ in sizes]
    ys = [torch.randn(m, 3, dtype=torch.float64, generator=g) + 1 for _, m in sizes]
    ws_a = [torch.rand(n, dtype=torch.float64, generator=g) + 0.1 for n, _ in sizes]
    ws_b = [torch.rand(m, dtype=torch.float64, generator=g) + 0.1 for _, m in sizes]
    seg = Segments(
        tuple(np.cumsum([0] + [n for n, _ in sizes]).tolist()),
        tuple(np.cumsum([0] + [m for _, m in sizes]).tolist()),
    )
    form = _packed_form(get_cost("sqeuclidean"), torch.cat(xs), torch.cat(ys), seg, F64, None,
                        torch.ones(len(sizes), dtype=F64))[0]  # fmt: skip
    means = mean_costs(form, torch.cat(ws_a), torch.cat(ws_b))
    for s, (x, y, a, b) in enumerate(zip(xs, ys, ws_a, ws_b, strict=True)):
        dense = (a[:, None] * b[None] * torch.cdist(x, y).square()).sum() / (a.sum() * b.sum())
        assert float(means[s]) == pytest.approx(float(dense), rel=1e-10)


@pytest.mark.parametrize("call", [
    lambda e: flashot.sinkhorn(torch.randn(8, 2), torch.randn(6, 2), eps=e),
    lambda e: flashot.sinkhorn_divergence(torch.randn(8, 2), torch.randn(6, 2), eps=e),
    lambda e: flashot.SamplesLoss(blur=e),
])  # fmt: skip
def test_an_eps_that_requires_grad_is_refused_not_detached(call):
    """It was read with .item(): its gradient silently zero."""
    eps = torch.tensor(0.3, requires_grad=True)
    with pytest.raises(ValueError, match="requires grad"):
        call(eps)
    call(eps.detach())  # as a constant: fine


def _two(t):
    return torch.stack([t, t])


_DTYPE_CASES = {
    "sinkhorn.cost": lambda x, y: flashot.sinkhorn(x, y, eps=0.5).cost,
    "sinkhorn.f": lambda x, y: flashot.sinkhorn(x, y, eps=0.5).f,
    "relaxed.cost": lambda x, y: flashot.sinkhorn(x, y, eps=0.5, rho=1.0).cost,
    "fixed.cost": lambda x, y: flashot.sinkhorn(x, y, eps=0.5, tol=None, max_iter=20).cost,
    "transport_cost": lambda x, y: flashot.sinkhorn(x, y, eps=0.5).transport_cost,
    "batched.cost": lambda x, y: flashot.sinkhorn(_two(x), _two(y), eps=0.5).cost,
    "divergence": lambda x, y: flashot.sinkhorn_divergence(x, y, eps=0.5),
    "SamplesLoss": lambda x, y: flashot.SamplesLoss(blur=0.5)(x, y),
    "SamplesLoss.potentials": lambda x, y: flashot.SamplesLoss(blur=0.5, potentials=True)(x, y)[0],
    "SamplesLoss.batched": lambda x, y: flashot.SamplesLoss(blur=0.5)(_two(x), _two(y)),
    "ops.sinkhorn_cost": lambda x, y: flashot.ops.sinkhorn_cost(x, y, eps=0.5),
    "otdd": lambda x, y: (
        __import__("flashot.tasks.otdd")
        .tasks.otdd.dataset_distance(
            x, torch.arange(len(x)) % 2, y, torch.arange(len(y)) % 2, eps=0.5
        )
        .distance
    ),
}
_INPUT_SPACE = {  # tensors in the inputs' spaces follow the inputs
    "plan @ V": lambda x, y: flashot.sinkhorn(x, y, eps=0.5).plan @ torch.ones_like(y),
    "barycentric_map": lambda x, y: flashot.sinkhorn(x, y, eps=0.5).plan.barycentric_map(),
    "gradient": lambda x, y: torch.autograd.grad(
        flashot.sinkhorn_divergence(x.requires_grad_(), y, eps=0.5), x
    )[0],
    "hvp": lambda x, y: flashot.hvp(x, y, torch.ones_like(x), eps=0.5),
}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
@pytest.mark.parametrize("name", sorted(_DTYPE_CASES) + sorted(_INPUT_SPACE))
def test_one_dtype_rule_for_every_entry_point(name, dtype):
    """Values and potentials in the compute dtype (float32 for half inputs), input-space
    tensors in the inputs' dtype; half-input values are their float32 inputs' to 1e-2."""
    import warnings

    gen = torch.Generator().manual_seed(0)
    x32, y32 = torch.randn(20, 3, generator=gen), torch.randn(15, 3, generator=gen) + 0.5
    x, y = x32.to(dtype), y32.to(dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", flashot.ConvergenceWarning)
        if name in _DTYPE_CASES:
            out = _DTYPE_CASES[name](x, y)
            assert out.dtype == flashot.problem.compute_dtype(dtype)
            ref = _DTYPE_CASES[name](x.float(), y.float())  # (the same rounded points)
        else:
            out = _INPUT_SPACE[name](x, y)
            assert out.dtype == dtype
            ref = _INPUT_SPACE[name](x.float(), y.float())
    if name.endswith((".f", ".potentials")):  # (balanced potentials: up to a constant)
        out, ref = out - out.mean(), ref - ref.mean()
    assert torch.allclose(out.double(), ref.double(), rtol=2e-2, atol=2e-2)


_CHECK_DTYPES = (torch.bool, torch.float16, torch.bfloat16, torch.float32, torch.float64)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(_CHECK_DTYPES), st.integers(0, 5), st.integers(0, 3), st.booleans()
        ),
        min_size=1,
        max_size=8,
    ),
    st.integers(0, 2**31 - 1),
)
def test_device_checks_read_every_value_and_raise_the_first_failure_in_order(items, seed):
    """One read serves every queued tensor (any dtype and shape, grouped by dtype): each
    handle gives its own values exactly, and the first failing test in queue order
    raises, whatever the dtypes of the items around it."""
    from flashot.problem import DeviceChecks

    gen = torch.Generator().manual_seed(seed)
    queued = [
        tuple((torch.randn(size, generator=gen) * 100).to(dtype) for _ in range(max(1, parts)))
        for dtype, size, parts, _ in items
    ]
    reader = DeviceChecks()
    handles = [reader.read(tensors) for tensors in queued]
    reader.verify()
    for handle, tensors in zip(handles, queued, strict=True):
        expected = [float(v) for t in tensors for v in t.double().reshape(-1).tolist()]
        assert reader.host(handle).tolist() == expected
    checks, first = DeviceChecks(), None
    for i, (tensors, (*_, fails)) in enumerate(zip(queued, items, strict=True)):
        error = ValueError(f"item {i}")
        checks.read(tensors, lambda v, e=error, f=fails: e if f else None)
        first = first or (error if fails else None)
    if first is None:
        checks.verify()
        return
    with pytest.raises(ValueError) as raised:
        checks.verify()
    assert raised.value is first


def test_make_problem_reads_the_device_once_with_few_launches():
    """The inputs' checks and the cost bound take a handful of ops on the clouds' dtype
    (the verdicts are formed on the host, in float64, from read extremes): counted with
    a dispatch mode on float32 clouds, 53 before (v59) against 27 now, with one read."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from flashot.problem import make_problem

    views = ("aten::view", "aten::slice", "aten::select", "aten::detach", "aten::alias",
             "aten::_unsafe_view", "aten::expand", "aten::unsqueeze", "aten::t",
             "aten::as_strided")  # fmt: skip

    class Count(TorchDispatchMode):
        """Ops reading a float32 tensor: the device's share (the host's are float64)."""

        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            leaves = torch.utils._pytree.tree_leaves((args, kwargs))
            device = any(isinstance(t, torch.Tensor) and t.dtype == torch.float32 for t in leaves)
            if device and not func._schema.name.startswith(views):
                self.ops.append(func._schema.name)
            return func(*args, **(kwargs or {}))

    x, y = (t.float() for t in good(200, 150, 64))
    a, b = torch.rand(200) + 0.1, torch.rand(150) + 0.1
    with Count() as count:
        problem = make_problem(x, y, a, b, eps=0.1, backend="torch")
    assert len(count.ops) <= 30, count.ops
    hi, lo = torch.maximum(x.amax(0), y.amax(0)), torch.minimum(x.amin(0), y.amin(0))
    span = hi.double() - lo.double()  # (the box's float32 extremes, their span in float64)
    assert problem.form.cost_bound == pytest.approx(float((span**2).sum()), rel=1e-12)


@settings(max_examples=80, deadline=None)
@given(
    st.sampled_from([torch.float32, torch.float64]),
    st.integers(1, 40),
    st.integers(1, 40),
    st.lists(st.sampled_from([math.nan, math.inf, -math.inf, 3.0e38, -3.0e38]), max_size=3),
    st.booleans(),
    st.integers(0, 2**31 - 1),
)
def test_read_finite_raises_exactly_when_a_value_is_not_finite(dtype, n, m, specials, with_errors,
                                                                seed):  # fmt: skip
    """One read checks potentials and errors: FloatingPointError iff an entry is NaN or
    ±inf, never for large finite float32 values (their float64 sum cannot overflow),
    and the errors come back exactly."""
    from flashot.problem import read_finite

    gen = torch.Generator().manual_seed(seed)
    f, g = torch.randn(n, generator=gen, dtype=dtype), torch.randn(m, generator=gen, dtype=dtype)
    errors = torch.rand(3, generator=gen, dtype=dtype) if with_errors else None
    targets = [f, g] + ([errors] if with_errors else [])
    for i, value in enumerate(specials):
        t = targets[i % len(targets)]
        t[int(torch.randint(len(t), (1,), generator=gen))] = value
    bad = any(not bool(torch.isfinite(t).all()) for t in targets)
    if bad:
        with pytest.raises(FloatingPointError, match="non-finite potentials"):
            read_finite(f, g, errors)
        return
    read = read_finite(f, g, errors)
    assert read == (None if errors is None else errors.double().tolist())
