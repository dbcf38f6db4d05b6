"""Compiling ahead (flashot.backends.triton._ahead): the manifest's successors and the gate.

The gate runs on fake kernels that act as Triton's ``JITFunction`` does where it matters:
a launch compiles (adds its key to the device cache) unless the key is cached, and
``preload`` compiles from specialization data. A real compile ahead needs a GPU (the
cold-start benchmark measures it there).
"""

import contextlib
import json
import threading
from unittest import mock

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("triton")
from flashot.backends.triton import _ahead


class FakeKernel:
    """A kernel whose launches compile ``key`` unless cached (on device 0)."""

    def __init__(self, name, fail=False, delay=None):
        self.name, self.fail, self.delay = name, fail, delay
        self.device_caches = {0: ({}, None)}
        self.launch_compiles, self.preloads, self.launches = [], [], []

    def __getitem__(self, grid):
        def launch(key):
            cache = self.device_caches[0][0]
            if key not in cache:
                self.launch_compiles.append(key)
                cache[key] = object()
            self.launches.append(key)

        return launch

    def warmup(self, *, grid, key):  # (compiles, never launches)
        cache = self.device_caches[0][0]
        if key not in cache:
            self.launch_compiles.append(key)
            cache[key] = object()

    def preload(self, data):
        if self.delay is not None:
            self.delay.wait(5)
        spec = json.loads(data)
        if self.fail:
            raise RuntimeError("compile failed")
        self.preloads.append(spec)
        self.device_caches[0][0][spec["key"]] = object()
        return None  # (no launcher to build)


def entry(kernel, key):
    data = json.dumps({"key": key, "options": {"num_warps": 4, "extern_libs": [["x", "/a"]]}})
    return {"kernel": f"flashot.fake:{kernel}", "key": key, "data": data}


@contextlib.contextmanager
def gate(runs, kernels, enabled=True):
    """The module's state fresh, ``runs`` as the manifest, ``kernels`` by name."""
    table = _ahead.successors(runs)
    with (
        mock.patch.object(_ahead, "_STATE", {"enabled": None}),
        mock.patch.object(_ahead, "_SUBMITTED", set()),
        mock.patch.object(_ahead, "_PENDING", {}),
        mock.patch.object(_ahead, "_POOL", None),
        mock.patch.object(_ahead, "triton_interpreted", lambda: False),
        mock.patch.object(_ahead, "_manifest", lambda device: table),
        mock.patch.object(_ahead, "_resolve", lambda name: kernels.get(name.split(":")[1])),
        mock.patch.object(_ahead.torch.cuda, "device", lambda d: contextlib.nullcontext()),
        mock.patch.dict("os.environ", {_ahead.ENV: "1" if enabled else "0"}),
    ):
        yield
        if _ahead._POOL is not None:
            _ahead._POOL.shutdown(wait=True)


keys = st.lists(st.sampled_from("abcdefgh"), min_size=1, max_size=8, unique=True)


@settings(max_examples=200, deadline=None)
@given(runs=st.lists(keys, min_size=1, max_size=4))
def test_successors_follow_the_key_in_every_run_that_holds_it(runs):
    """What a key hands on follows it in each run holding it (in the first one's order),
    and is all that follows it where one run holds it."""
    named = {f"run{i}": [entry("k", key) for key in run] for i, run in enumerate(runs)}
    table = _ahead.successors(named)
    assert set(table) == {key for run in runs for key in run}
    for key, out in table.items():
        got = [e["key"] for e in out]
        tails = [run[run.index(key) + 1 :] for run in runs if key in run]
        assert key not in got and len(set(got)) == len(got)
        for tail in tails:
            assert set(got) <= set(tail)
        assert got == [k for k in tails[0] if all(k in t for t in tails)]
        if len(tails) == 1:
            assert got == tails[0]


def test_a_launch_that_compiles_hands_its_successors_to_workers_and_none_compiles_twice():
    a, b = FakeKernel("a"), FakeKernel("b")
    runs = {"w": [entry("a", "a1"), entry("b", "b1"), entry("a", "a2")]}
    with gate(runs, {"a": a, "b": b}):
        _ahead.fire(a, (1,), "a1")  # compiles a1: b1 and a2 go to the workers
        _ahead.fire(b, (1,), "b1")  # waits for b1's compile, then launches it
        _ahead.fire(a, (1,), "a2")
    assert a.launch_compiles == ["a1"] and b.launch_compiles == []
    assert [p["key"] for p in b.preloads] == ["b1"] and [p["key"] for p in a.preloads] == ["a2"]
    assert a.launches == ["a1", "a2"] and b.launches == ["b1"]
    assert all("extern_libs" not in p["options"] for p in a.preloads + b.preloads)


def test_a_compile_without_launch_hands_on_its_successors_too():
    """The occupancy probe compiles a launch's kernel before the launch itself: that
    compile is the workload's first own key and must not go unseen."""
    a, b = FakeKernel("a"), FakeKernel("b")
    with gate({"w": [entry("a", "a1"), entry("b", "b1")]}, {"a": a, "b": b}):
        _ahead.warmup(a, (1,), key="a1")
        _ahead.fire(a, (1,), "a1")
        _ahead.fire(b, (1,), "b1")
    assert a.launch_compiles == ["a1"] and a.launches == ["a1"]
    assert [p["key"] for p in b.preloads] == ["b1"] and b.launch_compiles == []


def test_a_launch_waits_for_its_kernels_compiles_in_flight():
    a, b, release = FakeKernel("a"), None, threading.Event()
    b = FakeKernel("b", delay=release)
    runs = {"w": [entry("a", "a1"), entry("b", "b1")]}
    with gate(runs, {"a": a, "b": b}):
        _ahead.fire(a, (1,), "a1")
        timer = threading.Timer(0.2, release.set)
        timer.start()
        _ahead.fire(b, (1,), "b1")  # (blocks until the worker's compile ends)
        timer.join()
    assert b.launch_compiles == [] and [p["key"] for p in b.preloads] == ["b1"]


def test_a_failed_compile_ahead_leaves_the_launch_to_compile_it():
    a, b = FakeKernel("a"), FakeKernel("b", fail=True)
    with gate({"w": [entry("a", "a1"), entry("b", "b1")]}, {"a": a, "b": b}):
        _ahead.fire(a, (1,), "a1")
        _ahead.fire(b, (1,), "b1")
    assert b.preloads == [] and b.launch_compiles == ["b1"] and b.launches == ["b1"]


def test_nothing_is_compiled_ahead_when_turned_off_or_unknown():
    a, b = FakeKernel("a"), FakeKernel("b")
    runs = {"w": [entry("a", "a1"), entry("b", "b1")]}
    with gate(runs, {"a": a, "b": b}, enabled=False):
        _ahead.fire(a, (1,), "a1")
        _ahead.fire(b, (1,), "b1")
    assert b.preloads == [] and b.launch_compiles == ["b1"]
    a, b = FakeKernel("a"), FakeKernel("b")
    with gate(runs, {"a": a, "b": b}):
        _ahead.fire(a, (1,), "zz")  # a key the manifest does not hold
        _ahead.fire(b, (1,), "b1")
    assert b.preloads == [] and b.launch_compiles == ["b1"]


def test_a_key_shared_by_workloads_waits_for_one_of_its_own():
    """A kernel every workload launches first hands on only what all of them share."""
    s, a, b = FakeKernel("s"), FakeKernel("a"), FakeKernel("b")
    runs = {
        "one": [entry("s", "s1"), entry("a", "a1"), entry("b", "b1")],
        "two": [entry("s", "s1"), entry("a", "a9"), entry("b", "b9")],
    }
    with gate(runs, {"s": s, "a": a, "b": b}):
        _ahead.fire(s, (1,), "s1")  # shared: nothing yet
        assert not _ahead._PENDING
        _ahead.fire(a, (1,), "a9")  # workload two's own: b9 ahead
        _ahead.fire(b, (1,), "b9")
    assert [p["key"] for p in b.preloads] == ["b9"] and b.launch_compiles == []
    assert a.launch_compiles == ["a9"]


def test_the_interpreter_never_compiles_ahead():
    with (
        mock.patch.object(_ahead, "_STATE", {"enabled": None}),
        mock.patch.dict("os.environ", {"TRITON_INTERPRET": "1", _ahead.ENV: "1"}),
    ):
        assert _ahead._enabled() is False


def test_manifests_are_named_by_capability_and_triton_version():
    path = _ahead.manifest_path((9, 0), "3.6.0")
    assert path.name == "ahead_sm90_triton3.6.0.json" and path.parent.name == "tiles"


def test_triton_is_hashed_in_a_thread_that_the_first_launch_joins():
    calls, release = [], threading.Event()

    def slow_key():
        release.wait(5)
        calls.append(threading.current_thread().name)

    a = FakeKernel("a")
    with (
        gate({}, {"a": a}),
        mock.patch.object(_ahead, "_HASHING", []),
        mock.patch.object(_ahead.torch.cuda, "is_initialized", lambda: True),
        mock.patch("triton.runtime.cache.triton_key", slow_key),
    ):
        _ahead.hash_triton_early()
        _ahead.hash_triton_early()  # (once a process)
        assert len(_ahead._HASHING) == 1 and not calls
        threading.Timer(0.2, release.set).start()
        _ahead.fire(a, (1,), "a1")  # joins the hashing thread before compiling
        assert calls == ["flashot-triton-key"] and not _ahead._HASHING


def test_triton_is_not_hashed_early_where_cuda_is_not_initialized():
    """Starting the thread must not be what initializes CUDA (a later fork would break)."""
    with (
        mock.patch.object(_ahead, "_HASHING", []),
        mock.patch.object(_ahead, "_STATE", {"enabled": True}),
        mock.patch.object(_ahead.torch.cuda, "is_initialized", lambda: False),
    ):
        _ahead.hash_triton_early()
        assert _ahead._HASHING == []
