"""Parity with geomloss 0.3.1 (tensorized backend, float64)."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import flashot
from tests.conftest import clouds, rel, weights
from tests.references import geomloss_loop

geomloss = pytest.importorskip("geomloss")
F64 = torch.float64
OPTS = [
    dict(blur=0.1),
    dict(blur=0.05, scaling=0.7),
    dict(blur=0.2, reach=0.5),
    dict(blur=0.3, diameter=3.0),
]


def pair(opts, **kw):
    ref = geomloss.SamplesLoss("sinkhorn", p=2, backend="tensorized", **opts, **kw)
    ours = flashot.SamplesLoss("sinkhorn", p=2, backend="torch", **opts, **kw)
    return ref, ours


@pytest.mark.parametrize("opts", OPTS)
@pytest.mark.parametrize("debias", [True, False])
def test_values_and_gradients_match_geomloss(gen, opts, debias):
    x, y = clouds(gen, 40, 33, 3)
    a, b = weights(gen, 40), weights(gen, 33)
    ref, ours = pair(opts, debias=debias)
    ins = [t.clone().requires_grad_() for t in (a, x, b, y)]
    v_ref = ref(*ins)
    g_ref = torch.autograd.grad(v_ref, ins)
    v = ours(*ins)
    g = torch.autograd.grad(v, ins)
    assert rel(v, v_ref) < 1e-10
    if "reach" not in opts:
        for u, w in zip(g, g_ref, strict=True):
            assert rel(u, w) < 1e-9
    else:
        # GeomLoss 0.3.1 scales its relaxed x/y gradients by (rho + eps/2)/(rho + eps):
        # its UnbalancedWeight.backward is never called. Ours are the envelope gradients
        # (the same value code is gradchecked in test_divergence.py::test_gradcheck).
        rho, eps = opts["reach"] ** 2, opts["blur"] ** 2
        for u, w in zip(g[1::2], g_ref[1::2], strict=True):
            assert rel(u * (rho + eps / 2) / (rho + eps), w) < 1e-9


def test_two_argument_form_and_potentials(gen):
    x, y = clouds(gen, 30, 20, 2)
    ref, ours = pair(dict(blur=0.1), potentials=True)
    F_ref, G_ref = ref(x, y)
    F, G = ours(x, y)
    assert rel(F, F_ref) < 1e-10 and rel(G, G_ref) < 1e-10
    ref, ours = pair(dict(blur=0.1))
    assert rel(ours(x, y), ref(x, y)) < 1e-10


def test_batched_inputs(gen):
    x = torch.randn(3, 20, 2, generator=gen, dtype=F64)
    y = torch.randn(3, 25, 2, generator=gen, dtype=F64) + 0.5
    a = torch.rand(3, 20, generator=gen, dtype=F64)
    a = a / a.sum(1, keepdim=True)
    b = torch.full((3, 25), 1 / 25, dtype=F64)
    ref, ours = pair(dict(blur=0.1))
    assert ours(a, x, b, y).shape == (3,)
    assert rel(ours(a, x, b, y), ref(a, x, b, y)) < 1e-10
    ref, ours = pair(dict(blur=0.1), potentials=True)
    for u, w in zip(ours(a, x, b, y), ref(a, x, b, y), strict=True):
        assert u.shape == w.shape and rel(u, w) < 1e-10


def test_float32_matches_geomloss_float64(gen):
    x, y = clouds(gen, 200, 150, 3)
    ref, ours = pair(dict(blur=0.05))
    assert rel(ours(x.float(), y.float()), ref(x, y)) < 1e-5


def test_cosine_extension_matches_dense_loop(gen):
    x, y = clouds(gen, 30, 20, 4)
    from flashot.geometry.costs import bounding_diameter, get_cost
    from flashot.solver.schedule import geomloss_schedule

    loss = flashot.SamplesLoss(blur=0.2, cost="cosine", debias=False, backend="torch")
    schedule = geomloss_schedule(bounding_diameter(get_cost("cosine"), x, y), 0.04, 0.5)
    a, b = torch.full((30,), 1 / 30, dtype=F64), torch.full((20,), 1 / 20, dtype=F64)
    f, g = geomloss_loop(x, y, a, b, schedule, cost="cosine")
    assert rel(loss(x, y), (a * f).sum() + (b * g).sum()) < 1e-10


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(loss="wasserstein"), "loss"),
        (dict(p=3), "p must be 1 or 2"),
        (dict(blur=0), "blur"),
        (dict(reach=-1.0), "reach"),
        (dict(scaling=1.5), "scaling"),
        (dict(cost="l1"), "cost"),
        (dict(hvp_tol=0.0), "hvp_tol"),
        (dict(hvp_tol=True), "hvp_tol"),
    ],
)
def test_bad_options(kwargs, match):
    with pytest.raises(ValueError, match=match):
        flashot.SamplesLoss(**kwargs)


def test_bad_call_forms(gen):
    x, y = clouds(gen, 5, 5, 2)
    loss = flashot.SamplesLoss()
    with pytest.raises(ValueError, match="takes"):
        loss(x)
    with pytest.raises(ValueError, match="batched"):
        loss(x, y[None])


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(diameter=1e20), "diameter=1e\\+20 gives eps"),
        (dict(scaling=1 - 1e-9), "scaling=.* at most 10000"),
        (dict(blur=1e-30), "outside the range"),
    ],
)
def test_options_out_of_range_are_clear_errors(kw, match):
    x, y = torch.randn(20, 3), torch.randn(15, 3)
    with pytest.raises(ValueError, match=match):
        flashot.SamplesLoss(**kw)(x, y)


def test_huge_diameter_and_blur_stay_accurate_in_float32():
    # was: diameter=1e10 gave -0.248 (GeomLoss 0.658), blur=1e3 0.2731 against 0.3149
    torch.manual_seed(0)
    x, y = torch.randn(20, 3).double(), torch.randn(15, 3).double()
    for kw in (dict(diameter=1e10), dict(blur=1e3)):
        ref = float(flashot.SamplesLoss(**kw)(x, y))
        assert float(flashot.SamplesLoss(**kw)(x.float(), y.float())) == pytest.approx(
            ref, rel=1e-5
        )
    half_gap = 0.5 * float(((x.mean(0) - y.mean(0)) ** 2).sum())
    assert float(flashot.SamplesLoss(blur=1e4)(x, y)) == pytest.approx(half_gap, rel=1e-7)


def test_geomloss_positional_order_and_keywords():
    geomloss = pytest.importorskip("geomloss")
    import inspect

    ours = list(inspect.signature(flashot.SamplesLoss.__init__).parameters)[1:15]
    theirs = list(inspect.signature(geomloss.SamplesLoss.__init__).parameters)[1:]
    assert ours == theirs
    torch.manual_seed(0)
    x, y = torch.randn(30, 2, dtype=torch.float64), torch.randn(25, 2, dtype=torch.float64)
    # positional as GeomLoss: ("sinkhorn", 2, blur, reach, diameter, scaling, truncate, cost,
    # kernel, cluster_scale, debias) — debias=False is the 11th
    ref = geomloss.SamplesLoss("sinkhorn", 2, 0.3, None, None, 0.7, 5, None, None, None, False)(
        x, y
    )
    val = flashot.SamplesLoss("sinkhorn", 2, 0.3, None, None, 0.7, 5, None, None, None, False)(x, y)
    assert float(val) == pytest.approx(float(ref), rel=1e-6)
    base = float(flashot.SamplesLoss(blur=0.3)(x, y))
    for kw in (
        dict(truncate=None),
        dict(truncate=3),
        dict(backend="tensorized"),
        dict(backend="online"),
    ):
        assert float(flashot.SamplesLoss(blur=0.3, **kw)(x, y)) == pytest.approx(base, rel=1e-9)


@pytest.mark.parametrize("kw, match", [
    (dict(loss="energy", cluster_scale=0.1), "cluster_scale"),
    (dict(cost="cosine", cluster_scale=0.1), "cluster_scale"),
    (dict(cluster_scale=-0.1), "cluster_scale"),
    (dict(kernel=lambda x, y: x), "kernel must be None"),
    (dict(truncate=-1), "truncate"),
])  # fmt: skip
def test_geomloss_options_flashot_does_not_offer_are_refused(kw, match):
    with pytest.raises(ValueError, match=match):
        flashot.SamplesLoss(**kw)


def test_verbose_prints_one_line(capsys):
    x, y = torch.randn(20, 2), torch.randn(15, 2)
    flashot.SamplesLoss(blur=0.5, verbose=True)(x, y)
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "eps steps" in err and "(20, 2) vs (15, 2)" in err


def test_numpy_inputs_give_the_tensor_results():
    # numpy clouds are CPU tensors, numpy weights take their cloud's dtype (float32
    # here, where numpy defaults to float64); results are tensors
    import numpy as np

    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(30, 3)).astype(np.float32), rng.normal(size=(20, 3)).astype(np.float32)
    a, b = rng.random(30) + 0.1, rng.random(20) + 0.1
    loss = flashot.SamplesLoss(blur=0.3)
    want = loss(torch.from_numpy(a).float(), torch.from_numpy(x), torch.from_numpy(b).float(),
                torch.from_numpy(y))  # fmt: skip
    got = loss(a, x, b, y)
    assert isinstance(got, torch.Tensor) and got.dtype == torch.float32 and torch.equal(got, want)
    assert torch.equal(loss(x, y), loss(torch.from_numpy(x), torch.from_numpy(y)))
    batch = loss(np.stack([x, x]), np.stack([y, y]))
    # a packed solve: the same steps in another order of float32 operations
    assert batch.shape == (2,) and torch.equal(batch[0], batch[1])
    assert torch.allclose(batch[0], loss(x, y), rtol=1e-6, atol=0)
    with pytest.raises(TypeError, match="must hold floats"):
        loss(np.ones(30, dtype=np.int64), x, b, y)


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 30), m=st.integers(1, 30), d=st.integers(1, 5),
       scale=st.sampled_from([1e-3, 1.0, 50.0]), shift=st.sampled_from([0.0, -7.0, 1e3]),
       dtype=st.sampled_from([torch.float32, torch.float64]), seed=st.integers(0, 99))  # fmt: skip
def test_the_schedule_takes_the_diameter_from_the_problems_checks(n, m, d, scale, shift,
                                                                  dtype, seed):  # fmt: skip
    """The single call's ε schedule starts from the joint box's diagonal, read with the
    problem's input checks (one wait for the device, not two): GeomLoss' schedule from
    bounding_diameter, to rounding."""
    from flashot.geometry.costs import bounding_diameter
    from flashot.problem import make_problem
    from flashot.solver.loop import geomloss_schedule

    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=gen, dtype=dtype) * scale + shift
    y = torch.rand(m, d, generator=gen, dtype=dtype) * scale + shift
    loss = flashot.SamplesLoss(blur=0.05, scaling=0.6)
    problem = make_problem(x, y, eps=0.05**2, cost=loss.cost, normalize=False)
    ours = loss._schedule(x, y, problem)
    diameter = bounding_diameter(loss.cost, x, y)
    ref = geomloss_schedule(max(diameter, 0.05), 0.05**2, 0.6)
    assert len(ours) == len(ref)
    tol = 1e-6 if dtype == torch.float32 else 1e-12
    assert all(abs(o - r) <= tol * r for o, r in zip(ours, ref, strict=True))


def test_a_single_call_reads_no_second_diameter(gen, monkeypatch):
    """The single (N, D) call does not measure the boxes again (the batched one does)."""
    import flashot.samples_loss as module

    x, y = clouds(gen, 20, 15, 3)
    ref = flashot.SamplesLoss(blur=0.1, backend="torch")(x, y)

    def refuse(*args):
        raise AssertionError("bounding_diameter was called")

    monkeypatch.setattr(module, "bounding_diameter", refuse)
    assert rel(flashot.SamplesLoss(blur=0.1, backend="torch")(x, y), ref) < 1e-14
    with pytest.raises(AssertionError, match="bounding_diameter"):
        flashot.SamplesLoss(blur=0.1, backend="torch")(x[None], y[None])


def test_repr_names_the_loss_the_cost_and_the_mode():
    from flashot.geometry.pair_costs import PairCost

    plain = repr(flashot.SamplesLoss(blur=0.1))
    assert "'sinkhorn', p=2, blur=0.1" in plain and "cost='half_sqeuclidean'" in plain
    custom = repr(flashot.SamplesLoss(p=1, cost=PairCost(lambda s, t, a, b: s, name="mine")))
    assert "p=1" in custom and "PairCost mine" in custom
    assert "cluster_scale=0.2" in repr(flashot.SamplesLoss(cluster_scale=0.2))
    assert "cost='callable'" in repr(flashot.SamplesLoss(cost=lambda x, y: torch.cdist(x, y)))
