"""flashot: IO-aware entropic optimal transport (FlashSinkhorn) for large point clouds.

Log-domain Sinkhorn for the squared-Euclidean cost is a row-wise log-sum-exp of a
biased dot-product score matrix, the statistic attention computes; flashot
streams it tile by tile (PyTorch on any device, fused Triton kernels on GPUs)
without ever storing an n × m matrix.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__version__ = "0.1.0"

#: public name → the module that defines it; imported on first use, so ``import flashot``
#: (and ``flashot --help``) loads no torch until something is solved
_SOURCES = {
    "COSTS": "flashot.costs",
    "BatchedSinkhornResult": "flashot.batched",
    "ConvergenceWarning": "flashot.stopping",
    "DualSolveInfo": "flashot.autodiff.dual_log",
    "DualSolveLog": "flashot.autodiff.dual_log",
    "EpsilonScaling": "flashot.solver",
    "HessianOperator": "flashot.hessian",
    "LabeledCost": "flashot.labeled",
    "SamplesLoss": "flashot.samples_loss",
    "SinkhornResult": "flashot.result",
    "TransportPlan": "flashot.result",
    "available_backends": "flashot.backends",
    "hvp": "flashot.hessian",
    "labeled_cost": "flashot.labeled",
    "record_dual_solves": "flashot.autodiff.dual_log",
    "shuffled_regression": "flashot.tasks.shuffled",
    "sinkhorn": "flashot.ot",
    "sinkhorn_divergence": "flashot.divergence",
    "sinkhorn_varlen": "flashot.batched",
}
_SUBMODULES = ("linalg", "ops", "optim")

__all__ = [
    "COSTS",
    "BatchedSinkhornResult",
    "ConvergenceWarning",
    "DualSolveInfo",
    "DualSolveLog",
    "EpsilonScaling",
    "HessianOperator",
    "LabeledCost",
    "SamplesLoss",
    "SinkhornResult",
    "TransportPlan",
    "__version__",
    "available_backends",
    "hvp",
    "labeled_cost",
    "linalg",
    "ops",
    "optim",
    "record_dual_solves",
    "shuffled_regression",
    "sinkhorn",
    "sinkhorn_divergence",
    "sinkhorn_varlen",
]

if TYPE_CHECKING:  # (what type checkers and IDEs read; at run time, __getattr__)
    from flashot import linalg, ops, optim
    from flashot.autodiff.dual_log import DualSolveInfo, DualSolveLog, record_dual_solves
    from flashot.backends import available_backends
    from flashot.batched import BatchedSinkhornResult, sinkhorn_varlen
    from flashot.costs import COSTS
    from flashot.divergence import sinkhorn_divergence
    from flashot.hessian import HessianOperator, hvp
    from flashot.labeled import LabeledCost, labeled_cost
    from flashot.ot import sinkhorn
    from flashot.result import SinkhornResult, TransportPlan
    from flashot.samples_loss import SamplesLoss
    from flashot.solver import EpsilonScaling
    from flashot.stopping import ConvergenceWarning
    from flashot.tasks.shuffled import shuffled_regression


def __getattr__(name: str):
    """The public names, each imported on first access (PEP 562)."""
    if name in _SUBMODULES:
        value = importlib.import_module(f"flashot.{name}")
    elif name in _SOURCES:
        value = getattr(importlib.import_module(_SOURCES[name]), name)
    else:
        raise AttributeError(f"module 'flashot' has no attribute {name!r}")
    globals()[name] = value  # (later accesses skip this function)
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
