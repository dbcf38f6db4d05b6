"""The bench command's choices (flashot.bench.options): parsing with the standard library."""

import argparse

import pytest

from flashot.bench.options import PROVIDERS, WORKLOADS, add_arguments


def parser():
    p = argparse.ArgumentParser(exit_on_error=False)
    add_arguments(p)
    return p


def test_lists_parse_to_tuples_and_bad_numbers_are_named():
    args = parser().parse_args(["--sizes", "1000,4000", "--dims", "3", "--workloads",
                                "forward,hvp", "--providers", "flashot-torch,pot"])  # fmt: skip
    assert list(args.sizes) == [1000, 4000] and list(args.dims) == [3]
    assert set(args.workloads) <= set(WORKLOADS) and set(args.providers) <= set(PROVIDERS)
    with pytest.raises(argparse.ArgumentError, match="--sizes: expected comma-separated"):
        parser().parse_args(["--sizes", "10,x"])
    assert parser().parse_args(["--dims", ""]).dims == ()  # (empty: the device's defaults)
