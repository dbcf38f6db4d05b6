"""Tile tuning (flashot.backends.triton.tune, ``flashot tune``): its arguments, its help
and its refusal without a GPU."""

import re

import pytest
import torch

from flashot.cli import main


@pytest.mark.parametrize("argv, match", [
    (["tune", "--precision", "fp64"], "expected fp32, tf32, bf16 or fp16"),
    (["tune", "--d", "0"], "expected positive integers"),
    (["tune", "--n", "ten"], "expected positive integers"),
])  # fmt: skip
def test_tune_rejects_bad_lists(argv, match, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2 and re.search(match, capsys.readouterr().err)


def test_tune_help_names_the_tuners_own_defaults(capsys):
    """Options left out take tune()'s defaults; the help, written out (the tuner's
    module needs triton, the parser must not), must say the same."""
    from flashot.backends.triton import tune

    with pytest.raises(SystemExit):
        main(["tune", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for values in (tune.DEFAULT_PRECISIONS, tune.DEFAULT_DIMS, tune.DEFAULT_SIZES):
        assert f"default: {', '.join(map(str, values))}" in text


@pytest.mark.skipif(torch.cuda.is_available(), reason="the message of a machine without a GPU")
def test_tune_without_a_gpu_is_one_line(capsys):
    assert main(["tune", "--d", "3"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "needs a CUDA GPU" in err
