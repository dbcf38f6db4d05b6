"""Packed problems (flashot.geometry.segments): sampled rows, scaled bounds, and the device
tables shared between packings of the same offsets."""

import torch

import flashot


def test_sampled_rows_take_every_problems_first_row_and_each_step_after():
    from flashot.geometry.segments import Segments

    seg = Segments((0, 3, 3, 10, 11), (0, 2, 4, 6, 9), (1.0, 2.0, 3.0, 4.0))
    index, sub = seg.sample_rows(3, torch.device("cpu"))
    assert index.tolist() == [0, 3, 6, 9, 10]  # problem 1 is empty
    assert sub.rows == (0, 1, 1, 4, 5) and sub.cols == seg.cols and sub.bounds == seg.bounds
    assert seg.sample_rows(3, torch.device("cpu"))[1] is sub  # cached


def test_scaled_bounds_keep_the_packing_and_its_tables():
    from flashot.geometry.segments import Segments

    seg = Segments((0, 3, 7), (0, 2, 6), (1.0, 2.0))
    table = seg.blocks(2, torch.device("cpu"))
    warm = seg.scaled_bounds(4.0)
    assert (warm.rows, warm.cols, warm.bounds) == (seg.rows, seg.cols, (4.0, 8.0))
    assert warm.blocks(2, torch.device("cpu")) is table  # shared, not rebuilt
    assert warm.T.bounds == (4.0, 8.0) and warm.T.rows == seg.cols and warm.T.T is warm
    assert Segments((0, 1), (0, 1)).scaled_bounds(4.0).bounds is None


def test_packings_of_the_same_offsets_share_their_device_tables(gen, monkeypatch):
    """A new packing of the same offsets (each call of a training loop) takes the tables
    built before instead of copying them from the host again; other offsets, sizes or
    bounds get their own, the shared store keeps the latest SHARED_TABLES, and a packed
    loss reads the same with shared tables as with new ones."""
    from flashot.geometry import segments
    from flashot.geometry.segments import Segments

    monkeypatch.setattr(segments, "_SHARED", type(segments._SHARED)())
    cpu = torch.device("cpu")
    one, two = Segments((0, 3, 7), (0, 2, 6)), Segments((0, 3, 7), (0, 2, 6), (1.0, 2.0))
    assert two.blocks(2, cpu) is one.blocks(2, cpu) and two.row_ids(cpu) is one.row_ids(cpu)
    assert one.blocks(4, cpu) is not one.blocks(2, cpu)
    other = Segments((0, 4, 7), (0, 2, 6))
    assert other.blocks(2, cpu) is not one.blocks(2, cpu)
    assert other.blocks(2, cpu).tolist() == [[0, 2, 0, 2], [2, 4, 0, 2], [4, 6, 2, 6],
                                             [6, 7, 2, 6]]  # fmt: skip
    # sampled packings carry the bounds: shared only between equal bounds
    assert one.sample_rows(2, cpu)[1].bounds is None
    assert two.sample_rows(2, cpu)[1].bounds == (1.0, 2.0)
    monkeypatch.setattr(segments, "SHARED_TABLES", 2)
    for k in range(5):
        Segments((0, k + 1), (0, 1)).row_ids(cpu)
    assert len(segments._SHARED) == 2
    x, y = torch.rand(2, 5, 3, generator=gen), torch.rand(2, 6, 3, generator=gen)
    loss = flashot.SamplesLoss(p=2, blur=0.3, backend="torch")
    first, again = loss(x, y), loss(x, y)
    segments._SHARED.clear()
    assert torch.equal(first, again) and torch.equal(first, loss(x, y))


def test_shared_tables_hold_under_threads_and_evictions(monkeypatch):
    """Packings in several threads, with a store of two entries evicting all the time:
    every table is its own offsets' (built ones nest: uniform weights read row ids)."""
    import threading
    import time

    from flashot.geometry import segments
    from flashot.geometry.segments import Segments

    monkeypatch.setattr(segments, "_SHARED", type(segments._SHARED)())
    monkeypatch.setattr(segments, "SHARED_TABLES", 2)
    offsets = [(0, 3, 7), (0, 5, 6), (0, 1, 9), (0, 4, 8)]
    errors = []

    def work(seed):
        try:
            for i in range(200):
                rows = offsets[(seed + i) % len(offsets)]
                seg, cpu = Segments(rows, (0, 2, 4)), torch.device("cpu")
                want = [s for s in range(2) for _ in range(rows[s + 1] - rows[s])]
                # a build that builds (row ids) first: the store's lock is taken twice
                twice = seg.device_table(("twice",), lambda: 2 * seg.row_ids(cpu))  # noqa: B023
                assert twice.tolist() == [2 * s for s in want]
                assert seg.row_ids(cpu).tolist() == want
                assert seg.blocks(2, cpu)[0, :2].tolist() == [0, min(2, rows[1])]
        except Exception as err:  # (reported by the main thread)
            errors.append(err)

    threads = [threading.Thread(target=work, args=(k,), daemon=True) for k in range(6)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 30  # (a deadlock fails here, not by hanging the run)
    for t in threads:
        t.join(timeout=max(0.0, deadline - time.monotonic()))
    assert not errors and not any(t.is_alive() for t in threads)
