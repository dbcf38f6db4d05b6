"""Device helpers (flashot.backends.device): the interpreter switch and the current GPU."""

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
