"""Tile tables (:mod:`flashot.backends.triton._tables`): lookup order, nearest keys, files."""

import json

import pytest

triton = pytest.importorskip("triton")
torch = pytest.importorskip("torch")

from flashot.backends.triton import _configs, _tables  # noqa: E402

ATTEND = ("attend", 64, 1, 13, 13, False, "tf32x3", torch.float32, True)
PLAN = ("plan_sums", 64, 13, 13, "tf32x3", torch.float32)


def tiles(cfg):
    return (cfg.kwargs["BLOCK_M"], cfg.kwargs["BLOCK_N"], cfg.num_warps, cfg.num_stages)


@pytest.fixture
def tables(tmp_path, monkeypatch):
    """An empty user cache and shipped folder, both under tmp_path."""
    monkeypatch.setenv("FLASHOT_CACHE_DIR", str(tmp_path / "user"))
    monkeypatch.setattr(_tables, "_SHIPPED", tmp_path / "shipped")
    _tables._tables.cache_clear()
    yield tmp_path
    _tables._tables.cache_clear()


def config(bm, bn, w, s):
    return triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=s)


def test_no_table_means_no_entry_and_the_heuristic_fits(tables):
    assert _tables.lookup(ATTEND, "sm_90") is None and _tables.lookup(ATTEND, None) is None
    for key in (ATTEND, PLAN, ("attend", 512, 512, 15, 15, True, "tf32", torch.bfloat16, False)):
        assert _configs.fits(_tables.heuristic(key), key[1])


def test_record_then_lookup_exact_and_nearest(tables):
    shipped = tables / "shipped" / "sm_90.json"
    _tables.record(ATTEND, config(128, 64, 8, 2), "sm_90", path=shipped)
    far = ("attend", 512, 1, 15, 15, False, "tf32x3", torch.float32, True)
    _tables.record(far, config(64, 64, 4, 3), "sm_90", path=shipped)
    assert tiles(_tables.lookup(ATTEND, "sm_90")) == (128, 64, 8, 2)
    near = ("attend", 32, 1, 14, 12, False, "tf32x3", torch.float32, True)  # closest: d = 64
    assert tiles(_tables.lookup(near, "sm_90")) == (128, 64, 8, 2)
    wide = ("attend", 256, 1, 13, 13, False, "tf32x3", torch.float32, True)  # d > 128 side
    assert tiles(_tables.lookup(wide, "sm_90")) == (64, 64, 4, 3)
    other = ("attend", 64, 1, 13, 13, False, "tf32", torch.float32, True)  # another dot
    assert tiles(_tables.lookup(other, "sm_90")) == (128, 64, 8, 2)  # before a farther d
    _tables.record(other, config(64, 32, 4, 2), "sm_90", path=shipped)
    assert tiles(_tables.lookup(other, "sm_90")) == (64, 32, 4, 2)
    assert _tables.lookup(PLAN, "sm_90") is None  # never another kernel
    assert _tables.lookup(ATTEND, "sm_80") is None  # tables are per architecture
    assert _tables.lookup(near, "sm_90", exact_only=True) is None  # shipped: never exact


def test_the_users_table_comes_first_and_replaces_its_own_entries(tables):
    shipped = tables / "shipped" / "sm_90.json"
    _tables.record(ATTEND, config(128, 64, 8, 2), "sm_90", path=shipped)
    path = _tables.record(ATTEND, config(64, 32, 4, 2), "sm_90")
    assert path == tables / "user" / "tiles_sm_90.json"
    assert tiles(_tables.lookup(ATTEND, "sm_90")) == (64, 32, 4, 2)
    assert tiles(_tables.lookup(ATTEND, "sm_90", exact_only=True)) == (64, 32, 4, 2)
    _tables.record(ATTEND, config(128, 128, 8, 3), "sm_90")
    entries = json.loads(path.read_text())["entries"]
    assert len(entries) == 1 and entries[0]["BLOCK_N"] == 128 and entries[0]["dtype"] == "float32"


def test_an_unreadable_table_is_a_clear_error(tables):
    path = tables / "user" / "tiles_sm_90.json"
    path.parent.mkdir(parents=True)
    path.write_text("{not json")
    with pytest.raises(RuntimeError, match=r"tiles_sm_90\.json.*flashot tune"):
        _tables.lookup(ATTEND, "sm_90")


def test_autotune_is_opt_in_through_the_environment(monkeypatch):
    from flashot.backends.triton import TritonBackend

    monkeypatch.delenv("FLASHOT_AUTOTUNE", raising=False)
    assert TritonBackend().autotune is False
    monkeypatch.setenv("FLASHOT_AUTOTUNE", "1")
    assert TritonBackend().autotune is True and TritonBackend(autotune=False).autotune is False


def test_the_shipped_tables_fit_their_keys():
    for path in _tables._SHIPPED.glob("sm_*.json"):
        for entry in json.loads(path.read_text())["entries"]:
            assert entry["kernel"] in _tables.FIELDS
            assert _configs.fits(_tables._config(entry), entry["d"]), entry


def test_tuning_says_so_and_keeps_its_tiles(tables, monkeypatch, capsys):
    monkeypatch.setattr(_tables, "arch", lambda index: "sm_90")
    gpu = torch.device("cuda", 0)  # (never touched: the arch is patched)
    tuned = type("Tuned", (), {"configs": [config(64, 32, 4, 2)] * 24})()
    _tables.announce(tuned, ATTEND, gpu)
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "tuning attend tiles for d=64" in err and "24 candidates" in err
    assert "FLASHOT_AUTOTUNE=0" in err and str(tables / "user") in err
    _tables.keep(ATTEND, config(128, 32, 8, 3), gpu)
    assert tiles(_tables.lookup(ATTEND, "sm_90", exact_only=True)) == (128, 32, 8, 3)
    monkeypatch.setenv("FLASHOT_CACHE_DIR", "/proc/no/such/dir")
    with pytest.warns(RuntimeWarning, match="not saved"):
        _tables.keep(ATTEND, config(128, 32, 8, 3), gpu)


def test_launches_take_table_tiles_unless_tuning_is_opted_in(tables, monkeypatch):
    from flashot.backends.triton import _launch

    monkeypatch.setattr(_launch, "triton_interpreted", lambda: False)
    monkeypatch.setattr(_launch, "_BEST", {})
    monkeypatch.setattr(_tables, "_CHOSEN", {})
    monkeypatch.setattr(_tables, "arch", lambda index: "sm_90")
    gpu = torch.device("cuda", 0)  # (only its arch is asked for, patched)
    big = _configs.TUNE_FROM_LOG2
    assert tiles(_launch.tiles_for(ATTEND, big, gpu, False)) == tiles(_tables.heuristic(ATTEND))
    shipped = tables / "shipped" / "sm_90.json"
    _tables.record(ATTEND, config(64, 32, 4, 2), "sm_90", path=shipped)
    assert tiles(_launch.tiles_for(ATTEND, big, gpu, False)) == tiles(
        _tables.heuristic(ATTEND)
    )  # cached
    _tables._CHOSEN.clear()
    assert tiles(_launch.tiles_for(ATTEND, big, gpu, False)) == (64, 32, 4, 2)
    assert _launch.tiles_for(ATTEND, big, gpu, True) is None  # tune: the shipped table is no answer
    assert tiles(_launch.tiles_for(ATTEND, big - 1, gpu, True)) == (
        64,
        32,
        4,
        2,
    )  # too small to tune
    _tables.record(ATTEND, config(128, 128, 8, 3), "sm_90")  # an earlier run's tuning
    assert tiles(_launch.tiles_for(ATTEND, big, gpu, True)) == (128, 128, 8, 3)


def test_provenance_names_each_chosen_keys_source(tables, monkeypatch):
    """Exact shipped entries, nearest stand-ins (with the fields that differ), entries that
    do not fit and missing ones (the heuristic) are told apart."""
    monkeypatch.setattr(_tables, "_CHOSEN", {})
    monkeypatch.setattr(_tables, "_SOURCE", {})
    monkeypatch.setattr(_tables, "arch", lambda index: "sm_90")
    gpu = torch.device("cuda", 0)
    _tables.record(ATTEND, config(128, 64, 8, 2), "sm_90", path=tables / "shipped" / "sm_90.json")
    near = ("attend", 32, 1, 14, 13, False, "tf32x3", torch.float32, True)
    for key in (ATTEND, near, PLAN):
        _tables.choose(key, gpu, _configs.fits)
    _tables.choose(ATTEND, torch.device("cuda", 1), lambda cfg, d: False)
    got = _tables.provenance()
    assert got[("cuda", 0, ATTEND)] == "the shipped sm_90 table"
    assert got[("cuda", 0, near)] == "nearest entry (d=64, nb=13)"
    assert got[("cuda", 0, PLAN)].startswith("heuristic: no sm_90 entry")
    assert got[("cuda", 1, ATTEND)] == "heuristic: the shipped sm_90 table does not fit d=64"
    _tables.record(PLAN, config(64, 64, 4, 3), "sm_90")  # the user's: first, exact only
    monkeypatch.setattr(_tables, "_CHOSEN", {})
    _tables._tables.cache_clear()
    _tables.choose(PLAN, gpu, _configs.fits)
    assert _tables.provenance()[("cuda", 0, PLAN)] == "the user's table"
