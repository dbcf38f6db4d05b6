"""flashot: IO-aware entropic optimal transport (FlashSinkhorn) for large point clouds.

Log-domain Sinkhorn for the squared-Euclidean cost is a row-wise log-sum-exp of a
biased dot-product score matrix, the statistic attention computes; flashot
streams it tile by tile (PyTorch on any device, fused Triton kernels on GPUs)
without ever storing an n × m matrix.
"""

from flashot import linalg, ops, optim
from flashot.autodiff.implicit import DualSolveInfo, DualSolveLog, record_dual_solves
from flashot.backends import available_backends
from flashot.batched import BatchedSinkhornResult, sinkhorn_varlen
from flashot.costs import COSTS
from flashot.divergence import sinkhorn_divergence
from flashot.hessian import hvp
from flashot.labeled import LabeledCost, labeled_cost
from flashot.ot import ConvergenceWarning, sinkhorn
from flashot.result import SinkhornResult, TransportPlan
from flashot.samples_loss import SamplesLoss
from flashot.solver import EpsilonScaling

# isort: split
from flashot.shuffled import shuffled_regression  # (uses the names above)

__version__ = "0.1.0"

__all__ = [
    "COSTS",
    "BatchedSinkhornResult",
    "ConvergenceWarning",
    "DualSolveInfo",
    "DualSolveLog",
    "EpsilonScaling",
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
