"""The CPU row-block pool: every block once, errors surface, nothing global moves."""

from __future__ import annotations

import threading
from typing import ClassVar

import pytest
import torch

from flashot.backends import row_pool
from flashot.backends.row_pool import MIN_ELEMENTS, run_row_blocks
from flashot.backends.torch_backend import TorchBackend
from flashot.geometry.costs import AttentionForm


def threads_seen_by_a_new_thread() -> int:
    seen = []
    t = threading.Thread(target=lambda: seen.append(torch.get_num_threads()))
    t.start()
    t.join()
    return seen[0]


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def record_blocks(n, block, elements, *tensors):
    ran = []
    lock = threading.Lock()

    def body(i0, i1):
        with lock:
            ran.append((i0, i1, threading.current_thread().name))

    run_row_blocks(body, n, block, elements, *tensors)
    return ran


def test_every_block_runs_once_on_the_workers(two_threads):
    ran = record_blocks(103, 10, MIN_ELEMENTS, torch.zeros(3))
    want = [(i, min(103, i + 10)) for i in range(0, 103, 10)]
    assert sorted((i0, i1) for i0, i1, _ in ran) == want
    assert {name for _, _, name in ran} <= {"flashot-rows"}


@pytest.mark.parametrize("why", ["small", "one_block", "grad", "one_thread"])
def test_runs_in_order_on_the_caller_when_the_pool_does_not_apply(two_threads, why):
    x = torch.zeros(3, requires_grad=why == "grad")
    if why == "one_thread":
        torch.set_num_threads(1)
    n, block = (5, 10) if why == "one_block" else (50, 10)
    elements = MIN_ELEMENTS - 1 if why == "small" else MIN_ELEMENTS
    ran = record_blocks(n, block, elements, x)
    me = threading.current_thread().name
    assert ran == [(i, min(n, i + block), me) for i in range(0, n, block)]


def test_an_error_in_a_block_is_raised_to_the_caller(two_threads):
    def body(i0, i1):
        if i0 == 30:
            raise ValueError("block 30")

    with pytest.raises(ValueError, match="block 30"):
        run_row_blocks(body, 100, 10, MIN_ELEMENTS, torch.zeros(1))


def test_thread_counts_are_left_as_they_were(two_threads):
    row_pool._pool = None  # a fresh pool starts its workers here
    record_blocks(100, 10, MIN_ELEMENTS, torch.zeros(1))
    assert torch.get_num_threads() == 2
    assert threads_seen_by_a_new_thread() == 2


def test_inference_mode_outputs_are_writable_by_the_workers(two_threads):
    with torch.inference_mode():
        out = torch.empty(100)

        def body(i0, i1):
            out[i0:i1] = torch.arange(i0, i1, dtype=out.dtype)

        run_row_blocks(body, 100, 10, MIN_ELEMENTS, out)
    torch.testing.assert_close(out, torch.arange(100.0))


def lse_against_float64(attend, eps, seed):
    """Row LSE and softmax average of ``attend`` against float64 on a pooled size."""
    g = torch.Generator().manual_seed(seed)
    q, k = torch.randn(700, 3, generator=g), torch.randn(900, 3, generator=g)
    h, v = torch.randn(900, generator=g), torch.randn(900, 2, generator=g)
    lse, out = attend(AttentionForm(q, k, torch.zeros(700), torch.zeros(900)), h, eps, v)
    s = (q.double() @ k.double().T + h.double()) / eps
    torch.testing.assert_close(lse.double(), eps * torch.logsumexp(s, 1), rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(out.double(), torch.softmax(s, 1) @ v.double(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("threads", [1, 2])
def test_torch_backend_row_lse_matches_float64_with_and_without_the_pool(two_threads, threads):
    torch.set_num_threads(threads)
    lse_against_float64(TorchBackend(budget=900 * 64)._row_attend, 0.1, seed=0)


def test_idle_workers_keep_no_tensor_of_the_last_pass_alive(two_threads):
    import gc
    import weakref
    from functools import partial

    out = torch.empty(100)
    gone = weakref.ref(out)
    body = partial(fill_ones, out)  # (a closure's `del out` would clear its cell)
    run_row_blocks(body, 100, 10, MIN_ELEMENTS, out)
    del body, out
    gc.collect()
    assert gone() is None


def fill_ones(out, i0, i1):
    out[i0:i1] = 1.0


@pytest.mark.parametrize("threads", [1, 2])
def test_near_uniform_lse_matches_float64_with_and_without_the_pool(two_threads, threads):
    from flashot.backends.near import near_attend

    torch.set_num_threads(threads)
    lse_against_float64(lambda *args: near_attend(*args, budget=900 * 64), 50.0, seed=1)


def pool_threads() -> int:
    return sum(t.name == "flashot-rows" and t.is_alive() for t in threading.enumerate())


def _worker_stacks() -> str:
    """Where each live pool worker is (this test failed once on a loaded CI machine)."""
    import sys
    import traceback

    frames = sys._current_frames()
    live = [t for t in threading.enumerate() if t.name == "flashot-rows" and t.is_alive()]
    return "\n".join("".join(traceback.format_stack(frames[t.ident])) for t in live
                     if t.ident in frames)  # fmt: skip


def test_idle_workers_leave_and_a_later_pass_starts_new_ones(two_threads, monkeypatch):
    """Idle workers that had run torch ops slowed the caller's own small ops 2× for the
    rest of the process: they now leave after IDLE_S, and the next pass starts a pool."""
    import time

    monkeypatch.setattr(row_pool, "IDLE_S", 0.01)
    assert len(record_blocks(100, 10, MIN_ELEMENTS, torch.zeros(1))) == 10
    # they leave within milliseconds; a loaded 2-core CI machine once took over 5 s
    deadline = time.monotonic() + 30.0
    while pool_threads() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert pool_threads() == 0, f"workers still alive after 30 s, at:\n{_worker_stacks()}"
    ran = record_blocks(100, 10, MIN_ELEMENTS, torch.zeros(1))
    assert sorted(i0 for i0, _, _ in ran) == list(range(0, 100, 10))
    assert {name for _, _, name in ran} == {"flashot-rows"}


def test_a_worker_timing_out_as_a_pass_is_queued_still_serves_it(two_threads, monkeypatch):
    """Every worker's first wait times out just after the pass's blocks were queued: a
    worker leaves only when it sees nothing queued, so the pass completes (a worker that
    left on any timeout would leave it waiting forever: the watchdog fails the test)."""
    import queue
    import time

    class LateQueue(queue.SimpleQueue):
        timed_out: ClassVar[set] = set()

        def get(self, block=True, timeout=None):
            me = threading.get_ident()
            if me not in LateQueue.timed_out:
                LateQueue.timed_out.add(me)
                time.sleep(0.2)  # the pass is queued meanwhile
                raise queue.Empty
            return super().get(block, timeout)

    monkeypatch.setattr(row_pool.queue, "SimpleQueue", LateQueue)
    monkeypatch.setattr(row_pool, "_pool", None)
    result = []

    def one_pass():
        torch.set_num_threads(2)  # (this thread's own count)
        result.append(record_blocks(40, 10, MIN_ELEMENTS, torch.zeros(1)))

    caller = threading.Thread(target=one_pass, daemon=True)
    caller.start()
    caller.join(timeout=20)
    assert not caller.is_alive(), "the pass was queued to workers that had left"
    assert sorted(i0 for i0, _, _ in result[0]) == [0, 10, 20, 30]
    assert len(LateQueue.timed_out) == 2
