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


@pytest.mark.parametrize(
    "p,expected", [(1, 16), (3, 16), (40, 64), (64, 64), (100, 128), (512, 128)]
)
def test_value_chunks_on_gpus(monkeypatch, p, expected):
    """Value chunks: at least 16 columns (tensor cores), at most VALUE_TILE_CAP."""
    from flashot.backends.triton import _configs

    monkeypatch.setattr(_configs, "triton_interpreted", lambda: False)
    assert _configs.block_p(p) == expected


def _cdiv(a, b):
    return -(-a // b)


def _waves_cost(units, moving, slots, splits, per):
    from flashot.backends.triton import _configs

    return _cdiv(units * splits, slots) * (per + _configs.PROGRAM_OVERHEAD)


@pytest.mark.parametrize(
    "units,moving,slots,most",
    [(782, 50_000, 528, 50_000), (157, 10_000, 528, 10_000), (528, 50_000, 528, 50_000),
     (391, 50_000, 264, 2), (5, 300, 528, 300), (15_625, 1_000_000, 528, 10**6)],
)  # fmt: skip
def test_balanced_splits_cover_the_items_and_beat_every_other_count(units, moving, slots, most):
    """Splits of a multiple of 128 items cover the moving side exactly once, and no
    allowed count has fewer, fuller waves under the model."""
    from flashot.backends.triton import _configs

    splits, per = _configs.balanced_splits(units, moving, slots, most)
    assert per % 128 == 0 and (splits - 1) * per < moving <= splits * per
    assert 1 <= splits <= max(1, most)
    cost = _waves_cost(units, moving, slots, splits, per)
    for want in range(1, most + 1):
        p = _cdiv(_cdiv(moving, want), 128) * 128
        s = _cdiv(moving, p)
        if s > 1 and p < 512:
            break
        assert cost <= _waves_cost(units, moving, slots, s, p)


def test_balanced_splits_fill_the_partial_wave_at_50k():
    """782 blocks on 528 slots run 1.48 waves as 2; two splits make 2.96 waves of 3."""
    from flashot.backends.triton import _configs

    assert _configs.balanced_splits(782, 50_000, 528, 50_000) == (2, 25_088)
    assert _configs.balanced_splits(528, 50_000, 528, 50_000)[0] == 1  # one full wave
    assert _configs.balanced_splits(782, 50_000, 528, 1)[0] == 1  # capped


@pytest.mark.parametrize(
    "regs,warps,smem,expected",
    [(126, 4, 33_000, 4), (168, 8, 66_000, 1), (32, 4, 0, 16), (64, 4, 100_000, 2),
     (255, 4, 0, 2)],
)  # fmt: skip
def test_resident_programs_from_registers_shared_memory_and_warps(regs, warps, smem, expected):
    """The H200's limits: 64k registers, 228 KB shared memory, 2048 threads per SM."""
    from types import SimpleNamespace

    from flashot.backends.triton import _configs

    props = SimpleNamespace(regs_per_multiprocessor=65536, shared_memory_per_multiprocessor=233472,
                            max_threads_per_multi_processor=2048)  # fmt: skip
    kernel = SimpleNamespace(n_regs=regs, metadata=SimpleNamespace(num_warps=warps, shared=smem))
    assert _configs.resident_programs(kernel, props) == expected
    assert _configs.resident_programs(SimpleNamespace(), props) is None  # not loaded: unknown


@pytest.mark.parametrize("bm", [16, 32, 64, 128, 256])
@pytest.mark.parametrize("bn", [16, 32, 64, 128, 256])
@pytest.mark.parametrize("stages", [1, 2, 3, 4])
def test_smaller_tiles_shrink_at_every_step_and_end(bm, bn, stages):
    """Each step holds fewer stages or a smaller tile (never more warps), and the chain
    ends (None) once the tile is at most 32 × 32 with one stage."""
    import triton

    from flashot.backends.triton import _configs

    cfg = triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=4, num_stages=stages)
    steps = 0
    while (nxt := _configs.smaller(cfg)) is not None:
        before = (cfg.num_stages, cfg.kwargs["BLOCK_M"] * cfg.kwargs["BLOCK_N"])
        after = (nxt.num_stages, nxt.kwargs["BLOCK_M"] * nxt.kwargs["BLOCK_N"])
        assert after != before and all(a <= b for a, b in zip(after, before, strict=True))
        assert nxt.num_warps == cfg.num_warps
        cfg, steps = nxt, steps + 1
        assert steps < 20
    assert max(cfg.kwargs["BLOCK_M"], cfg.kwargs["BLOCK_N"]) <= 32 and cfg.num_stages == 1


@pytest.mark.parametrize("bm", [32, 64, 128, 256])
@pytest.mark.parametrize("bn", [32, 64, 128])
@pytest.mark.parametrize("stages", [1, 2, 3, 4])
@pytest.mark.parametrize("ratio", [1.1, 1.7, 3.0, 10.0])
def test_smaller_tiles_skip_only_steps_that_cannot_fit(bm, bn, stages, ratio):
    """Told that a launch needed ``ratio`` times the GPU's shared memory, the step down
    lands on the first tiles of the plain chain that fit by the footprint estimate (or
    on the chain's last), skipping only tiles estimated not to fit."""
    import triton

    from flashot.backends.triton import _configs

    cfg = triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=4, num_stages=stages)
    have = 1000
    need = int(ratio * have)
    chain, step = [], _configs.smaller(cfg)
    while step is not None:
        chain.append(step)
        step = _configs.smaller(step)
    got = _configs.smaller(cfg, need, have)
    if not chain:
        assert got is None
        return
    tiles = lambda c: (c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_stages)  # noqa: E731
    fits = [need * _configs._footprint(c) <= have * _configs._footprint(cfg) for c in chain]
    want = chain[fits.index(True)] if any(fits) else chain[-1]
    assert tiles(got) == tiles(want)
