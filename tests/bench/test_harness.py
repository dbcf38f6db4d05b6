"""The timing harness (flashot.bench.harness): row budgets, --largest, GPU medians."""

import pytest
import torch

from flashot.bench.providers import Provider

CPU = torch.device("cpu")


class _Sleeper(Provider):
    """A fake provider whose call takes ``seconds_per_point2 × n²`` seconds."""

    name, computes, workloads = "sleeper", "sleeps", ("forward",)

    def __init__(self, seconds_per_point2):
        self.rate, self.calls = seconds_per_point2, []

    def unavailable(self, device):
        return None

    def prepare(self, workload, pb):
        import time

        def run():
            self.calls.append(pb.n)
            time.sleep(self.rate * pb.n**2)
            return torch.tensor(1.0)

        return run


def test_row_budget_skips_sizes_predicted_too_slow_and_slow_calls_run_twice(monkeypatch):
    """A provider whose n=40 call predicts over the row budget at n=160 (16× the work) is
    not called there; the skip row says the prediction. A call over SLOW_CALL_S is timed
    by two more calls, not by the usual medians."""
    from flashot.bench import harness

    monkeypatch.setattr(harness, "_reference", lambda pb, workload: 1.0)
    monkeypatch.setattr(harness, "SLOW_CALL_S", 0.01)
    prov = _Sleeper(2e-5)  # n=40: 32 ms; n=160 predicted 0.5 s
    rows = harness.run_suite(["forward"], [160, 40], [2], [prov], CPU, floors=False,
                             row_budget_s=0.2)  # fmt: skip
    by_n = {r.n: r for r in rows}
    assert by_n[40].ms == pytest.approx(32, rel=0.5) and by_n[40].skipped is None
    assert "predicted" in by_n[160].skipped and "row budget" in by_n[160].skipped
    assert 160 not in prov.calls
    # the accuracy check (n=40 is ACCURACY_N's min) + first call + two timed calls
    assert prov.calls.count(40) == 4


def test_largest_does_not_run_a_size_predicted_far_over_the_budget():
    """--largest stops doubling where 4× the last call passes PREDICTED_OVER × the budget:
    n=80 (~0.13 s) predicts 0.5 s at n=160 against a 0.3 s budget, so 160 is not called
    and the row says why; n=80 is the largest. A lower rate reaches the next size."""
    from flashot.bench import harness

    fast, slow = _Sleeper(2e-6), _Sleeper(2e-5)
    rows = harness.largest_sizes(["forward"], [2], [slow, fast], CPU, 0.3, start=20, cap=160)
    assert 160 not in slow.calls and rows[0].n == 80
    assert "n=160 not run: predicted" in rows[0].computes
    assert rows[1].n == 160 and "not run" not in rows[1].computes


class _Tuner(_Sleeper):
    """A sleeper whose first call at each n also sleeps ``tune`` seconds (autotuning)."""

    def __init__(self, seconds_per_point2, tune):
        super().__init__(seconds_per_point2)
        self.tune = tune

    def prepare(self, workload, pb):
        run = super().prepare(workload, pb)

        def first_slow():
            if self.calls.count(pb.n) == 0:
                import time

                time.sleep(self.tune)
            return run()

        return first_slow


def test_largest_repeats_a_first_call_over_the_budget():
    """A library that tunes at each new n (the peer) is judged on its repeated call: the
    first call at every size is over the budget, the repeat is not, so n reaches the cap."""
    from flashot.bench import harness

    tuner = _Tuner(1e-7, tune=0.25)
    (row,) = harness.largest_sizes(["forward"], [2], [tuner], CPU, 0.2, start=20, cap=80)
    assert row.n == 80 and row.ms < 200
    assert tuner.calls.count(80) == 2 and tuner.calls.count(40) == 2


@pytest.mark.parametrize("call_ms, window", [(0.5, 50), (4.0, 50), (22.0, 154), (300.0, 1000),
                                             (5000.0, 1000)])  # fmt: skip
def test_gpu_medians_take_enough_calls_within_a_second(call_ms, window, monkeypatch):
    """On a GPU do_bench's window holds at least MIN_SAMPLES calls of the measured call
    (a fixed 50 ms took the median of two 22 ms calls), at least 50 ms, at most 1 s."""
    import triton.testing

    from flashot.bench import harness

    clock = iter([0.0, call_ms / 1e3])
    monkeypatch.setattr(harness.time, "perf_counter", lambda: next(clock))
    monkeypatch.setattr(harness, "_sync", lambda device: None)
    seen = {}

    def fake_bench(fn, warmup, rep, return_mode):
        seen.update(rep=rep, mode=return_mode)
        return 1.25

    monkeypatch.setattr(triton.testing, "do_bench", fake_bench)
    calls = []
    assert harness.median_ms(lambda: calls.append(1), torch.device("cuda")) == 1.25
    assert calls == [1] and seen["mode"] == "median"
    assert seen["rep"] == pytest.approx(window)
    assert seen["rep"] >= harness.MIN_SAMPLES * call_ms or seen["rep"] == 1000.0
