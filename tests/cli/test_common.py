"""What the commands share (flashot.cli.common): the device argument, exit codes."""

import pytest
import torch

from flashot.cli.common import EXIT_ERROR, EXIT_NOT_CONVERGED, CliError, parse_device


def test_a_missing_cuda_index_is_one_line_on_a_gpu_machine(monkeypatch):
    """On a one-GPU machine ``--device cuda:7`` named the device in torch's multi-line
    CUDA error; now one line, with the devices there are."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(CliError, match=r"--device cuda:7: this machine has 1 CUDA device\(s\)"):
        parse_device("cuda:7")
    assert parse_device("cuda:0") == torch.device("cuda:0")


def test_a_cpu_or_a_bad_name_and_the_exit_codes():
    assert parse_device("cpu") == torch.device("cpu")
    with pytest.raises(CliError, match="--device 'gpu0'"):
        parse_device("gpu0")
    assert (EXIT_ERROR, EXIT_NOT_CONVERGED) == (1, 3)
