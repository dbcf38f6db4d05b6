"""Row blocks of a CPU streaming pass, spread over single-threaded worker threads.

Why not PyTorch's intra-op threads: they open one OpenMP parallel region per tile op
(about nine per score tile, thousands per call), each closed by a barrier. On a small
shared machine that barrier waits for a vCPU another process holds. Measured on the
2-core VM (torch 2.13), a debiased ``SamplesLoss`` at n = 5 000, d = 3, value and
gradient, with a busy loop on the other core: 5.7–7.1 s with two intra-op threads,
1.4–1.6 s with one. Workers that run whole row blocks single-threaded meet once per
pass and take blocks from a shared counter, so a busy core just takes fewer blocks.

The pool has as many workers as the caller's ``torch.get_num_threads()`` and is used
only where it cannot change a result's meaning: CPU tensors, no autograd graph to
record, not under ``torch.compile``, at least two blocks. Starting a worker calls
``torch.set_num_threads(1)`` in it, which also sets PyTorch's default for threads
started later; the caller's count is set back right after, so nothing global moves.
Workers leave after :data:`IDLE_S` without a pass, so none outlive a solve.
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable

import torch

__all__ = ["run_row_blocks", "tile_sizes"]

#: below this many score elements per pass, handing blocks to threads costs more than it saves
MIN_ELEMENTS = 1 << 19
#: seconds a worker waits for the next pass before it leaves. Idle workers that have run
#: torch ops slow the caller's own small ops (2-core VM, torch 2.13: a 60 × 50 float64
#: solve 0.56 → 1.3 s while they lived, back once they left); a solve's passes come
#: closer together than this, so the workers live through a solve, not after it
IDLE_S = 0.05

_lock = threading.Lock()
_pool: _Pool | None = None
_local = threading.local()


class _Job:
    """One pass: ``body(i0, i1)`` for every block, blocks taken in order by any worker."""

    def __init__(self, body, starts, stop, workers, inference):
        self.body, self.stop, self.inference = body, stop, inference
        self.starts = iter(starts)
        self.lock = threading.Lock()
        self.left = workers
        self.error: BaseException | None = None
        self.done = threading.Event()

    def next_block(self):
        with self.lock:
            return None if self.error is not None else next(self.starts, None)

    def work(self, step):
        try:
            with torch.inference_mode() if self.inference else torch.no_grad():
                while (i0 := self.next_block()) is not None:
                    self.body(i0, min(self.stop, i0 + step))
        except BaseException as err:  # handed to the caller, raised there
            with self.lock:
                self.error = self.error or err
        finally:
            with self.lock:
                self.left -= 1
                if self.left == 0:
                    self.done.set()


class _Pool:
    """Workers serving the passes of one thread count; they leave once idle (see IDLE_S)."""

    def __init__(self, size: int):
        self.size, self.closed = size, False
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        ready = threading.Barrier(size + 1)
        for _ in range(size):
            threading.Thread(target=self._serve, args=(ready,), daemon=True,
                             name="flashot-rows").start()  # fmt: skip
        ready.wait()
        torch.set_num_threads(size)  # the workers' set_num_threads(1) also set the default

    def _serve(self, ready):
        torch.set_num_threads(1)
        _local.worker = True
        ready.wait()
        while True:
            try:
                task = self.jobs.get(timeout=IDLE_S)
            except queue.Empty:
                with _lock:  # jobs are queued under the lock: none can slip in unseen
                    if self.jobs.empty():
                        self.closed = True  # the next pass starts a new pool
                        return
                continue
            if task is None:
                return
            task[0].work(task[1])
            del task  # an idle worker must not keep the last pass's tensors alive

    def close(self):
        self.closed = True
        for _ in range(self.size):
            self.jobs.put(None)


def _forget_after_fork():
    global _pool
    _pool = None  # the child has none of the parent's threads


os.register_at_fork(after_in_child=_forget_after_fork)


def _queue(job: _Job, step: int, size: int) -> None:
    """Hand ``job`` to the workers of a pool of ``size`` (started if there is none)."""
    global _pool
    with _lock:
        if _pool is None or _pool.closed or _pool.size != size:
            if _pool is not None and not _pool.closed:
                _pool.close()
            _pool = _Pool(size)
        for _ in range(job.left):
            _pool.jobs.put((job, step))


def run_row_blocks(
    body: Callable[[int, int], None],
    n: int,
    block: int,
    elements: int,
    *tensors: torch.Tensor | None,
) -> None:
    """Call ``body(i0, i1)`` for the row blocks ``[i0, i1)`` of ``range(n)`` of size ``block``.

    The blocks run on the pool when that is safe and worth it (see module), else in
    order on the calling thread. ``body`` must only write rows ``i0:i1`` of its outputs.

    Args:
        body: the work of one block.
        n: number of rows.  block: rows per block.
        elements: score elements of the whole pass (the pool is used from
            :data:`MIN_ELEMENTS`).
        tensors: the pass's inputs, which decide device and autograd (None: absent).
    """
    starts = range(0, n, block)
    given = [t for t in tensors if t is not None]
    workers = torch.get_num_threads()
    if (
        len(starts) < 2
        or workers < 2
        or elements < MIN_ELEMENTS
        or getattr(_local, "worker", False)
        or torch.compiler.is_compiling()
        or any(t.device.type != "cpu" for t in given)
        or (torch.is_grad_enabled() and any(t.requires_grad for t in given))
    ):
        for i0 in starts:
            body(i0, min(n, i0 + block))
        return
    job = _Job(body, starts, n, min(workers, len(starts)), torch.is_inference_mode_enabled())
    _queue(job, block, workers)
    job.done.wait()
    if job.error is not None:
        raise job.error


def tile_sizes(n: int, m: int, budget: int) -> tuple[int, int]:
    """Pick (BLOCK_M, BLOCK_N) so that one score tile holds at most ``budget`` elements."""
    block_n = min(m, 8192)
    block_m = max(1, min(n, budget // block_n))
    return block_m, block_n
