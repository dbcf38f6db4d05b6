"""Device helpers (flashot.backends.device): the interpreter switch and the current GPU."""

import pytest
import torch

from flashot.backends.device import on_device, triton_interpreted


def test_the_interpreter_is_the_environment_variable(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert triton_interpreted()
    for value in ("0", ""):
        monkeypatch.setenv("TRITON_INTERPRET", value)
        assert not triton_interpreted()
    monkeypatch.delenv("TRITON_INTERPRET")
    assert not triton_interpreted()


def test_off_cuda_the_device_block_changes_nothing():
    before = torch.cuda.current_device() if torch.cuda.is_available() else None
    with on_device(torch.device("cpu")):
        pass
    after = torch.cuda.current_device() if torch.cuda.is_available() else None
    assert before == after


def test_off_cuda_the_side_stream_runs_its_block_in_place():
    """Off CUDA a SideStream marks nothing, runs the block on the caller's thread and
    stream, and leaves the inputs as they were."""
    from flashot.backends.device import SideStream

    streams = SideStream(torch.device("cpu"))
    t = torch.arange(4.0)
    streams.ready(t, None)
    with streams.aside(t, None):
        out = t * 2
    streams.hand_over(out, None)
    assert torch.equal(out, torch.arange(4.0) * 2) and streams.side is None


@pytest.mark.gpu
def test_the_side_stream_waits_for_its_inputs_and_not_for_later_launches():
    """A block aside reads its input once the mark made it complete, while the caller's
    stream still runs the long work queued after the mark; the caller's stream then
    reads what the block made, complete."""
    from flashot.backends.device import SideStream

    dev = torch.device("cuda")
    streams = SideStream(dev)
    t = torch.full((1 << 20,), 3.0, device=dev)
    streams.ready(t)
    big = torch.randn(4096, 4096, device=dev)
    for _ in range(30):  # (~0.1 s of float32 products queued after the mark)
        big = torch.mm(big, big)
        big = big / big.norm()
    done = torch.cuda.Event()
    done.record()
    with streams.aside(t):
        total = float(t.sum())  # (the host waits for the side stream only)
        doubled = t * 2
    running = not done.query()
    streams.hand_over(doubled)
    assert total == 3.0 * (1 << 20)
    assert running  # the read did not wait for the products queued after the mark
    assert float((doubled - 6.0).abs().max()) == 0.0  # (read on the caller's stream)
