"""flashot: IO-aware entropic optimal transport (FlashSinkhorn) for large point clouds.

Log-domain Sinkhorn for the squared-Euclidean cost is a row-wise log-sum-exp of a
biased dot-product score matrix, the statistic attention computes; flashot
streams it tile by tile (PyTorch on any device, fused Triton kernels on GPUs)
without ever storing an n × m matrix.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings
from typing import TYPE_CHECKING

__version__ = "0.1.0"

#: public name → the module that defines it; imported on first use, so ``import flashot``
#: (and ``flashot --help``) loads no torch until something is solved
_SOURCES = {
    "COSTS": "flashot.geometry.costs",
    "BatchedSinkhornResult": "flashot.batched",
    "ConvergenceWarning": "flashot.solver.stopping",
    "DualSolveInfo": "flashot.autodiff.dual_log",
    "DualSolveLog": "flashot.autodiff.dual_log",
    "EpsilonScaling": "flashot.solver.loop",
    "HessianOperator": "flashot.hessian",
    "LabeledCost": "flashot.geometry.labeled",
    "PairCost": "flashot.geometry.pair_costs",
    "SamplesLoss": "flashot.samples_loss",
    "SinkhornResult": "flashot.result",
    "TransportPlan": "flashot.result",
    "available_backends": "flashot.backends",
    "free_support_barycenter": "flashot.tasks.barycenters",
    "gromov_wasserstein": "flashot.tasks.gromov",
    "hvp": "flashot.hessian",
    "labeled_cost": "flashot.geometry.labeled",
    "record_dual_solves": "flashot.autodiff.dual_log",
    "shuffled_regression": "flashot.tasks.shuffled",
    "sinkhorn": "flashot.ot",
    "sinkhorn_divergence": "flashot.divergence",
    "sinkhorn_varlen": "flashot.batched",
}
#: public submodules, as attributes of the package: name → module
_SUBMODULES = {"linalg": "flashot.numerics.linalg", "ops": "flashot.ops",
               "optim": "flashot.numerics.optim"}  # fmt: skip

#: modules that moved when the package was layered (before 0.1.0): old path → new path. Importing
#: an old path gives the new module, with a DeprecationWarning naming it.
MOVED = {
    "flashot.costs": "flashot.geometry.costs",
    "flashot.segments": "flashot.geometry.segments",
    "flashot.labeled": "flashot.geometry.labeled",
    "flashot.labeled_operands": "flashot.geometry.labeled_operands",
    "flashot.temperature": "flashot.backends.temperature",
    "flashot.dual": "flashot.backends.dual",
    "flashot.schedule": "flashot.solver.schedule",
    "flashot.stopping": "flashot.solver.stopping",
    "flashot.momentum": "flashot.solver.momentum",
    "flashot.graphs": "flashot.solver.graphs",
    "flashot.progress": "flashot.solver.progress",
    "flashot.linalg": "flashot.numerics.linalg",
    "flashot.optim": "flashot.numerics.optim",
    # (v38: the tasks)
    "flashot.otdd": "flashot.tasks.otdd",
    "flashot.flows": "flashot.tasks.flows",
    "flashot.shuffled": "flashot.tasks.shuffled",
    "flashot.datasets": "flashot.tasks.datasets",
    "flashot.demo": "flashot.tasks.demo",
}


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Resolves the old paths of :data:`MOVED` to the modules themselves."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in MOVED:
            return None
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec):
        new = MOVED[spec.name]
        # (warnings skips the import system's frames: level 2 is the importing line)
        warnings.warn(f"{spec.name} moved to {new}; import it from there",
                      DeprecationWarning, stacklevel=2)  # fmt: skip
        return importlib.import_module(new)

    def exec_module(self, module):
        pass


sys.meta_path.append(_MovedModules())

__all__ = [
    "COSTS",
    "BatchedSinkhornResult",
    "ConvergenceWarning",
    "DualSolveInfo",
    "DualSolveLog",
    "EpsilonScaling",
    "HessianOperator",
    "LabeledCost",
    "PairCost",
    "SamplesLoss",
    "SinkhornResult",
    "TransportPlan",
    "__version__",
    "available_backends",
    "free_support_barycenter",
    "gromov_wasserstein",
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
    from flashot import ops
    from flashot.autodiff.dual_log import DualSolveInfo, DualSolveLog, record_dual_solves
    from flashot.backends import available_backends
    from flashot.batched import BatchedSinkhornResult, sinkhorn_varlen
    from flashot.divergence import sinkhorn_divergence
    from flashot.geometry.costs import COSTS
    from flashot.geometry.labeled import LabeledCost, labeled_cost
    from flashot.geometry.pair_costs import PairCost
    from flashot.hessian import HessianOperator, hvp
    from flashot.numerics import linalg, optim
    from flashot.ot import sinkhorn
    from flashot.result import SinkhornResult, TransportPlan
    from flashot.samples_loss import SamplesLoss
    from flashot.solver.loop import EpsilonScaling
    from flashot.solver.stopping import ConvergenceWarning
    from flashot.tasks.barycenters import free_support_barycenter
    from flashot.tasks.gromov import gromov_wasserstein
    from flashot.tasks.shuffled import shuffled_regression


def __getattr__(name: str):
    """The public names, each imported on first access (PEP 562)."""
    if name in _SUBMODULES:
        value = importlib.import_module(_SUBMODULES[name])
    elif name in _SOURCES:
        value = getattr(importlib.import_module(_SOURCES[name]), name)
    else:
        raise AttributeError(f"module 'flashot' has no attribute {name!r}")
    globals()[name] = value  # (later accesses skip this function)
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
