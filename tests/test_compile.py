"""flashot inside ``torch.compile`` (``flashot.backends.entry_point``): each call runs
eagerly outside the traced graph, so a compiled training step gives the eager values,
breaks its graph only at the flashot calls, and does not recompile step after step."""

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


@pytest.mark.parametrize("make", [
    lambda: flashot.SamplesLoss(blur=0.1, scaling=0.7, debias=True),
    lambda: (lambda w, y: flashot.sinkhorn(w, y, eps=0.05).cost),
    lambda: (lambda w, y: flashot.sinkhorn_divergence(w, y, eps=0.05)),
], ids=["SamplesLoss", "sinkhorn", "divergence"])  # fmt: skip
def test_compiled_step_equals_eager_and_breaks_only_at_the_flashot_call(make):
    loss = make()
    explained = torch._dynamo.explain(step)(*inputs(0), loss)
    reasons = [str(r.reason) for r in explained.break_reasons]
    # one break, at the call; nothing of flashot is traced (the solve's host logic and
    # thread pool used to crash dynamo, or break the graph at every check)
    assert explained.graph_break_count == 1 and "torch.compiler.disable" in reasons[0]
    torch._dynamo.reset()
    compiled = torch.compile(step, backend="aot_eager")
    try:
        for seed in range(3):  # new data of the same shapes: no recompilation
            x, y = inputs(seed)
            xc, xe = x.clone().requires_grad_(), x.clone().requires_grad_()
            vc, ve = compiled(xc, y, loss), step(xe, y, loss)
            (gc,), (ge,) = torch.autograd.grad(vc, xc), torch.autograd.grad(ve, xe)
            assert torch.equal(vc, ve) and torch.equal(gc, ge)
            if seed == 0:
                torch.compiler.set_stance("fail_on_recompile")
    finally:
        torch.compiler.set_stance("default")


def test_fullgraph_refuses_a_flashot_call():
    loss = flashot.SamplesLoss(blur=0.1)
    compiled = torch.compile(step, backend="eager", fullgraph=True)
    with pytest.raises(Exception, match=r"torch\.compiler\.disable"):
        compiled(*inputs(1), loss)
