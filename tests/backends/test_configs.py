"""Tiling rules of the Triton backend (``_configs``)."""

import pytest

from flashot.backends import available_backends

pytestmark = pytest.mark.skipif("triton" not in available_backends("cpu")
                                and "triton" not in available_backends("cuda"),
                                reason="no triton")  # fmt: skip


@pytest.mark.parametrize(
    "d,itemsize,expected",
    [(1, 4, (16, 1)), (64, 4, (64, 1)), (128, 2, (128, 1)), (130, 4, (32, 5)),
     (512, 4, (32, 16)), (512, 2, (64, 8)), (4096, 2, (64, 64))],
)  # fmt: skip
def test_feature_chunks_on_gpus(monkeypatch, d, itemsize, expected):
    """One hoisted chunk up to 128 features; beyond, 128-byte chunks that pipeline."""
    from flashot.backends.triton import _configs

    monkeypatch.setattr(_configs, "triton_interpreted", lambda: False)
    assert _configs.block_d(d, itemsize) == expected


def test_autotuning_buckets_are_capped():
    from flashot.backends.triton import _configs

    assert _configs.bucket(50_000) == 15
    assert _configs.bucket(1_000_000) == _configs.bucket(2**16) == _configs.BUCKET_CAP


@pytest.mark.parametrize("p,expected", [(1, 16), (3, 16), (40, 64), (64, 64), (512, 64)])
def test_value_chunks_on_gpus(monkeypatch, p, expected):
    """Value chunks: at least 16 columns (tensor cores), at most VALUE_TILE_CAP."""
    from flashot.backends.triton import _configs

    monkeypatch.setattr(_configs, "triton_interpreted", lambda: False)
    assert _configs.block_p(p) == expected
