"""flashot inside ``torch.compile``: losses that return tensors are one
``flashot::loss`` node (``flashot.ops``, no graph break, ``fullgraph=True`` works);
``flashot.sinkhorn`` (a result object) runs eagerly outside the graph
(``flashot.backends.entry_point``, one break). Either way a compiled training step gives
the eager values and does not recompile step after step."""

import pytest
import torch

import flashot


def step(x, y, loss):
    """A training step as users write it: a loss on a transformed cloud, its gradient."""
    w = torch.nn.functional.softplus(x) * 1.5
    return loss(w, y) + (w**2).mean()


def inputs(seed):
    gen = torch.Generator().manual_seed(seed)
    return torch.rand(60, 3, generator=gen), torch.rand(50, 3, generator=gen)


def _node(fn):
    """A loss that is the flashot::loss node even eagerly (it refuses create_graph)."""
    fn.__name__ = "node"
    return fn


@pytest.mark.parametrize("make,breaks", [
    (lambda: flashot.SamplesLoss(blur=0.1, scaling=0.7, debias=True), 0),
    (lambda: (lambda w, y: flashot.sinkhorn_divergence(w, y, eps=0.05)), 0),
    (lambda: _node(lambda w, y: flashot.ops.sinkhorn_cost(w, y, eps=0.05)), 0),
    (lambda: (lambda w, y: flashot.sinkhorn(w, y, eps=0.05).cost), 1),
], ids=["SamplesLoss", "divergence", "sinkhorn_cost", "sinkhorn"])  # fmt: skip
def test_compiled_step_equals_eager_with_the_expected_graph_breaks(make, breaks):
    loss = make()
    explained = torch._dynamo.explain(step)(*inputs(0), loss)
    reasons = [str(r.reason) for r in explained.break_reasons]
    # losses are one node; sinkhorn's result object breaks once, at the call (the solve's
    # host logic and thread pool used to crash dynamo, or break at every check)
    assert explained.graph_break_count == breaks, reasons
    if breaks:
        assert "torch.compiler.disable" in reasons[0]
    torch._dynamo.reset()
    compiled = torch.compile(step, backend="aot_eager", fullgraph=breaks == 0)
    try:
        for seed in range(3):  # new data of the same shapes: no recompilation
            x, y = inputs(seed)
            xc, xe = x.clone().requires_grad_(), x.clone().requires_grad_()
            vc, ve = compiled(xc, y, loss), step(xe, y, loss)
            (gc,), (ge,) = torch.autograd.grad(vc, xc), torch.autograd.grad(ve, xe)
            assert torch.allclose(vc, ve, rtol=1e-6, atol=0) and torch.allclose(gc, ge, atol=1e-7)
            if seed == 0 and getattr(loss, "__name__", "") != "node":
                # one function: eager with create_graph=True returns the same gradient (to
                # an ulp: torch's own softplus backward differs under create_graph)
                xg = x.clone().requires_grad_()
                (gg,) = torch.autograd.grad(step(xg, y, loss), xg, create_graph=True)
                assert torch.allclose(gg, ge, rtol=1e-6, atol=1e-8)
                assert torch.allclose(gc, gg, atol=1e-7)
                torch.compiler.set_stance("fail_on_recompile")
    finally:
        torch.compiler.set_stance("default")


def test_fullgraph_refuses_a_call_returning_a_result_object():
    compiled = torch.compile(lambda x, y: flashot.sinkhorn(x, y, eps=0.1).cost,
                             backend="eager", fullgraph=True)  # fmt: skip
    with pytest.raises(Exception, match=r"torch\.compiler\.disable") as info:
        compiled(*inputs(1))
    # flashot's own reason (torch ≥ 2.8 shows it): what runs eagerly and what to use
    assert "flashot (sinkhorn) runs eagerly" in str(info.value)
    assert "flashot.ops.sinkhorn_cost" in str(info.value)


def test_batched_samples_loss_under_fullgraph_with_weights():
    gen = torch.Generator().manual_seed(5)
    x = torch.rand(3, 20, 2, generator=gen, dtype=torch.float64)
    y = torch.rand(3, 15, 2, generator=gen, dtype=torch.float64)
    a = torch.rand(3, 20, generator=gen, dtype=torch.float64) + 0.1
    a = a / a.sum(1, keepdim=True)
    loss = flashot.SamplesLoss(blur=0.2, scaling=0.6, backend="torch")
    xc, xe = x.clone().requires_grad_(), x.clone().requires_grad_()
    ac, ae = a.clone().requires_grad_(), a.clone().requires_grad_()
    vc = torch.compile(lambda *t: loss(*t), backend="aot_eager", fullgraph=True)(ac, xc, None, y)
    ve = loss(ae, xe, None, y)
    assert vc.shape == (3,) and torch.allclose(vc, ve, rtol=1e-12)
    w = torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64)  # per-problem weights of the loss
    gc = torch.autograd.grad((vc * w).sum(), (xc, ac))
    ge = torch.autograd.grad((ve * w).sum(), (xe, ae))
    assert all(torch.allclose(u, v, atol=1e-12) for u, v in zip(gc, ge, strict=True))


def test_the_node_refuses_second_derivatives_and_keeps_eager_options_eager():
    x, y = inputs(2)
    x = x.double().requires_grad_()
    value = flashot.ops.sinkhorn_cost(x, y.double(), eps=0.1, backend="torch")
    eager = flashot.sinkhorn(x, y.double(), eps=0.1, backend="torch").cost
    assert torch.allclose(value, eager, rtol=1e-12)
    with pytest.raises(RuntimeError, match="second derivatives"):
        torch.autograd.grad(value, x, create_graph=True)
    # a backend instance cannot travel in the node: the call stays eager (one break)
    from flashot.backends.torch_backend import TorchBackend

    loss = flashot.SamplesLoss(blur=0.1, backend=TorchBackend())
    assert loss._node_options is None


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
@pytest.mark.parametrize("kind", ["sinkhorn", "divergence", "samples_loss"])
def test_the_node_fake_kernel_matches_the_real_one(kind, dtype):
    """The fake kernel's value dtype is the dtype rule's (float32 for half inputs)."""
    from flashot import ops

    x = torch.randn(20, 3, dtype=dtype, requires_grad=True)
    y = torch.randn(15, 3, dtype=dtype)
    opts = {"blur": 0.5} if kind == "samples_loss" else {"eps": 0.5}
    args = (x, y, None, None, kind, ops._encode(opts), True)
    assert torch.library.opcheck(ops._loss_op, args, test_utils=("test_faketensor",)) == {
        "test_faketensor": "SUCCESS"
    }
