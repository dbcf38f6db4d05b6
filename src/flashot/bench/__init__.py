r"""``flashot bench``: flashot beside the libraries users already run, on this machine.

One problem per row, the same for every provider: x, y ~ N(0, I) in d dimensions,
random positive weights, squared Euclidean cost :math:`C_{ij} = |x_i - y_j|^2`, a
fixed ε (``--eps``, 0.1) and float32 inputs. Workloads:

* ``forward``: the OT value after a fixed number of iterations (``--iters``, 10);
* ``gradient``: the value and its gradient in x;
* ``converge``: solve to a marginal error (``--tol``) with ε-scaling, what users run,
  at ε × d (a fixed fraction of the cost's scale, 2d for these clouds);
* ``plan``: the product ``P y`` of the solved plan with the target points (timed alone);
* ``hvp``: ``⟨v, H v⟩`` of the converged value's Hessian in x (flashot's exact HVP);
* ``otdd``: the debiased dataset distance between x and y labeled ``i mod 10``
  (diagonal Gaussian class distances, fixed iterations, uniform weights), flashot's
  streamed label table against the dense formula (the augmented n×m cost matrix).

Each provider computes the same quantity in its own convention and the row says how
(:attr:`~flashot.bench.providers.Provider.computes`). Times are medians: CUDA events
through ``triton.testing.do_bench`` on a GPU, wall-clock on a CPU; first calls
(compilation, tuning) are excluded and reported apart. On a GPU every flashot row
also gets the floor of its operation count at ceilings measured in the same run
(:mod:`flashot.bench.floor`).

    flashot bench                       # a quick suite on whatever device is present
    flashot bench --full --out results  # the suite behind BENCHMARKS.md
    flashot bench --merge part1 part2 --out results  # one suite from runs of parts of it
"""

from __future__ import annotations

__all__ = ["Row", "run_suite"]


def __getattr__(name: str):
    if name in __all__:  # (the harness imports torch: loaded on use)
        from flashot.bench import harness

        return getattr(harness, name)
    raise AttributeError(f"module 'flashot.bench' has no attribute {name!r}")
