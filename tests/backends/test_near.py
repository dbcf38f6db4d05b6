"""The near-uniform LSE against a 60-digit reference, and its use by every backend at large ε."""

import math

import mpmath
import pytest
import torch

from flashot.backends import available_backends
from flashot.backends.near import is_near_uniform, log_mass, near_attend
from flashot.backends.torch_backend import TorchBackend
from flashot.geometry.costs import attention_form, get_cost
from tests.conftest import clouds

mpmath.mp.dps = 60


def _dot(u, v):
    return mpmath.fsum(mpmath.mpf(a) * b for a, b in zip(u, v, strict=True))


def mp_lse(form, h, eps, log_w):
    """ε log Σ_j π_j exp((<q_i,k_j> + h_j)/ε) in 60 digits, π = w/Σw (weights within rounding
    of a probability vector are one: the contract of near_attend)."""
    q, k = form.q.double().tolist(), form.k.double().tolist()
    hs = h.double().tolist()
    total = mpmath.fsum(mpmath.exp(mpmath.mpf(w)) for w in log_w.double().tolist())
    lw = [mpmath.mpf(w) - mpmath.log(total) for w in log_w.double().tolist()]
    e = mpmath.mpf(eps)
    out = []
    for qi in q:
        terms = [
            mpmath.exp(mpmath.mpf(w) + (_dot(qi, kj) + hj) / e)
            for kj, hj, w in zip(k, hs, lw, strict=False)
        ]
        out.append(float(e * mpmath.log(mpmath.fsum(terms))))
    return torch.tensor(out, dtype=torch.float64)


@pytest.mark.parametrize("dtype,rtol", [(torch.float64, 1e-13), (torch.float32, 2e-6)])
@pytest.mark.parametrize("eps", [0.05, 3.0, 1e3, 1e8, 1e30])
def test_near_attend_is_accurate_at_any_eps(gen, dtype, rtol, eps):
    x, y = clouds(gen, 7, 9, 3)
    form = attention_form(get_cost("sqeuclidean"), x.to(dtype), y.to(dtype))
    h = torch.randn(9, generator=gen, dtype=torch.float64).to(dtype)
    w = torch.rand(9, generator=gen, dtype=torch.float64) + 0.1
    log_w = (w / w.sum()).log().to(dtype)
    lse, _ = near_attend(form, h, eps, log_w=log_w)
    ref = mp_lse(form, h, eps, log_w)
    # error relative to the scores' size: |<q,k>| + |h| is what a float can resolve
    scale = float((form.q.abs().sum(1).max() * form.k.abs().max() + h.abs().max()).double())
    assert (lse.double() - ref).abs().max() <= rtol * scale


def test_near_attend_values_and_zero_weights(gen):
    x, y = clouds(gen, 6, 8, 2)
    form = attention_form(get_cost("sqeuclidean"), x, y)
    h = torch.randn(8, generator=gen, dtype=torch.float64)
    log_w = torch.log(torch.tensor([0.2, 0, 0.1, 0.1, 0, 0.3, 0.2, 0.1], dtype=torch.float64))
    v = torch.randn(8, 3, generator=gen, dtype=torch.float64)
    lse, out = near_attend(form, h, 0.7, v, log_w)
    s = (form.q @ form.k.T + h) / 0.7 + log_w
    assert torch.allclose(lse, 0.7 * torch.logsumexp(s, 1), rtol=1e-13, atol=1e-13)
    assert torch.allclose(out, torch.softmax(s, 1) @ v, rtol=1e-12, atol=1e-13)


def test_total_weight_within_rounding_of_one_is_one():
    w = torch.rand(1000, dtype=torch.float64)
    w32 = (w / w.sum()).float()
    assert float(log_mass(w32.log())[1]) == 0.0
    assert float(log_mass((2 * w32).log())[1]) == pytest.approx(math.log(2), rel=1e-6)


def test_every_backend_takes_the_near_path_from_the_cost_bound(gen):
    backends = [TorchBackend()]
    if "triton" in available_backends("cpu"):
        from flashot.backends.triton import TritonBackend

        backends.append(TritonBackend())
    x, y = clouds(gen, 5, 4, 2)
    form = attention_form(get_cost("sqeuclidean"), x.float(), y.float())
    bound = form.cost_bound
    assert bound >= float((x[:, None] - y[None]).pow(2).sum(-1).max())
    assert not is_near_uniform(form, 0.5 * bound) and is_near_uniform(form, bound)
    h = torch.zeros(4)
    for backend in backends:
        lse, _ = backend.row_attend(form, h, 1e7, log_w=torch.full((4,), -math.log(4)))
        ref = (form.q @ form.k.T).double().mean(1)  # ε log mean exp(t/ε) → mean t
        assert torch.allclose(lse.double(), ref, atol=1e-5)
