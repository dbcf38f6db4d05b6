r"""Dataset flows: dataset A's features move down the gradient of OTDD(A, B).

Each step is an explicit Euler step of the Wasserstein gradient flow of
``F(x) = OTDD((x, y_a), B)``: with uniform weights each point moves by
``−τ n ∇_{x_i} F`` (the first variation's gradient; n undoes the 1/n of the weights).
The class table ``W(c, c')`` is computed from the starting features and held, or
recomputed from the moved features every step (``recompute_stats=True``, the
label term then follows the moving classes). Snapshots are PNG grids of the first
points of every class of A.
"""

from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

import flashot
from flashot.backends import entry_point
from flashot.backends.base import _given
from flashot.tasks.otdd import _label_cost, _outer, _prepare, _streaming

__all__ = ["FlowResult", "dataset_flow", "save_grid"]

#: the gradient's plan products run in this many blocks of rows (memory: one block's output)
GRADIENT_BLOCKS = 8


@dataclass
class FlowResult:
    """The outcome of :func:`dataset_flow`.

    Attributes:
        x: (n, d) the moved features of A.
        distances: OTDD before each step and after the last (steps + 1 values).
        snapshots: paths of the PNG files written.
    """

    x: torch.Tensor
    distances: list[float] = field(default_factory=list)
    snapshots: list[Path] = field(default_factory=list)


def save_grid(x: torch.Tensor, labels: torch.Tensor, path, per_class: int = 8,
              image_shape: tuple[int, int] | None = None, title: str = "") -> Path:  # fmt: skip
    """A PNG of ``per_class`` images of every class (rows: classes), gray scale."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as err:
        raise ImportError("snapshots need matplotlib: pip install 'flashot[demo]'") from err
    if image_shape is None:
        side = math.isqrt(x.shape[1])
        if side * side != x.shape[1]:
            raise ValueError(f"features ({x.shape[1]}) are not square images: give image_shape")
        image_shape = (side, side)
    classes = torch.unique(labels).tolist()
    fig, axes = plt.subplots(len(classes), per_class, figsize=(per_class, len(classes)),
                             squeeze=False)  # fmt: skip
    pixels = x.detach().float().cpu()
    for r, c in enumerate(classes):
        rows = pixels[labels.cpu() == c][:per_class]
        for col in range(per_class):
            ax = axes[r][col]
            ax.axis("off")
            if col < len(rows):
                ax.imshow(rows[col].reshape(image_shape).numpy(), cmap="gray", vmin=0, vmax=1)
    if title:
        fig.suptitle(title)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path


def _value_and_grad(x, index_a, xb, labels_b, cost, eps, self_b, warm, **sinkhorn_options):
    r"""``(OTDD, its gradient in x, OT(B, B))`` from the plans of OT(A, A) and OT(A, B).

    With the class table held, ``C = s‖x − y‖² + λ_y W²`` and the envelope theorem give
    OT_ε(A, Y)'s gradient in a row point as ``Σ_j P_ij ∇_x C(x_i, y_j) = 2s (r_i x_i −
    (P Y)_i)`` (``r = P 1``); OT(A, A) moves both of its sides (rows, and columns through
    ``Pᵀ``), so for ``OTDD = OT(A, B) − ½ OT(A, A) − ½ OT(B, B)``

    .. math::

        \nabla_{x_i} = 2s\Big[\big(r^{ab}_i x_i - (P^{ab} Y_b)_i\big)
            - \tfrac12 \big(r^{aa}_i x_i - (P^{aa} X)_i\big)
            - \tfrac12 \big(c^{aa}_i x_i - (P^{aa\top} X)_i\big)\Big],

    the two halves equal when ``P^{aa}`` is symmetric (ρ_x = ρ_y). The products run a
    block of rows at a time into one gradient array (``plan[lo:hi] @ V``): the peak is
    one problem's two operands and the gradient, no barycenters of A's size and no
    autograd graph. ``warm``: the previous step's potentials per problem (``"aa"``,
    ``"ab"``), updated in place (see :func:`_solve`).
    """
    with torch.no_grad():
        if self_b is None:
            self_b = flashot.sinkhorn(xb, xb, eps=eps, cost=cost.with_labels(labels_b, labels_b),
                                      **sinkhorn_options).cost  # fmt: skip
        rho = sinkhorn_options.get("rho")
        symmetric = not (isinstance(rho, (tuple, list)) and rho[0] != rho[1])
        grad = torch.zeros_like(x)
        value = -0.5 * self_b
        for name, other, labels, weight in (("aa", x, index_a, -0.5), ("ab", xb, labels_b, 1.0)):
            res = _solve(x, other, cost.with_labels(index_a, labels), eps, warm, name,
                         sinkhorn_options)  # fmt: skip
            value = value + weight * res.cost
            if name == "ab":
                terms = [(res.plan, 1.0)]
            else:  # both sides of OT(A, A): its rows, and its columns as Pᵀ's rows
                terms = [(res.plan, 2.0)] if symmetric else [(res.plan, 1.0), (res.plan.T, 1.0)]
            for plan, sides in terms:
                _add_envelope_term(grad, plan, other, x, 2.0 * cost.scale * weight * sides)
            del res, terms, plan  # this problem's operands go before the next is built
    return value, grad, self_b


def _add_envelope_term(grad, plan, values, x, weight):
    """``grad += weight · (r ⊙ x − P V)``, in :data:`GRADIENT_BLOCKS` blocks of rows.

    ``P V = r ⊙ T`` with ``T`` the softmax averages of V: one streaming pass per block
    gives both r and T. Each block's output is 1/GRADIENT_BLOCKS of A's size; a block
    still fills the GPU.
    """
    n = x.shape[0]
    rows = max(1, -(-n // GRADIENT_BLOCKS))
    for lo in range(0, n, rows):
        hi = min(n, lo + rows)
        block = plan[lo:hi]
        r, avg = block._attend(block._values(values, "V"))
        avg = _given(avg).sub_(x[lo:hi]).mul_(r[:, None])  # r ⊙ (T − x), in place
        grad[lo:hi].add_(avg, alpha=-weight)
        del block, r, avg  # not alive while the next block's product runs


def _solve(x, y, cost, eps, warm, name, options):
    """``flashot.sinkhorn`` of one of the flow's problems, from its previous solution.

    A step moves the points a little, so the previous step's potentials (same rows,
    same columns) are close to this step's: the solve starts from them at the final ε,
    with no ε-scaling (which would start over from the diameter). The flow concentrates
    A's points, which slows Sinkhorn down step after step; on 1 000 MNIST images against
    rotated copies (ε = 5, step 0.1) the third step's cross problem took 465 iterations
    from scratch and 270 from the previous potentials. ``warm`` is None when disabled.
    """
    start = None if warm is None else warm.get(name)
    if start is not None:
        options = {**options, "init": start, "eps_schedule": None}
    res = flashot.sinkhorn(x, y, eps=eps, cost=cost, **options)
    if warm is not None:
        warm[name] = (res.f.detach(), res.g.detach())
    return res


@entry_point
def dataset_flow(
    xa: torch.Tensor,
    ya,
    xb: torch.Tensor,
    yb,
    *,
    eps: float,
    steps: int = 10,
    step_size: float = 0.1,
    lambda_x: float = 1.0,
    lambda_y: float = 1.0,
    inner: str = "gaussian",
    diagonal: bool = False,
    recompute_stats: bool = False,
    snapshot_every: int = 0,
    snapshot_dir=None,
    image_shape: tuple[int, int] | None = None,
    progress: bool = True,
    warm_start: bool = True,
    **sinkhorn_options,
) -> FlowResult:
    """Move A's features along the gradient flow of OTDD(A, B) (see module).

    Args:
        xa: (n, d) features of A (not modified).  ya: (n,) labels of A.
        xb: (m, d) features of B.  yb: (m,) labels of B.
        eps: ε of the outer problems.
        steps: Euler steps.  step_size: τ.
        lambda_x, lambda_y, inner, diagonal: as in :func:`flashot.tasks.otdd.dataset_distance`.
        recompute_stats: recompute the class table from the moved features each step.
        snapshot_every: write a PNG grid every this many steps (0: none); needs
            ``snapshot_dir`` and matplotlib.
        snapshot_dir: folder of the snapshots (``step_0000.png``, ...).
        image_shape: (h, w) of an image, when the features are not square images.
        progress: one line per step on stderr (distance, time per step, time left).
        warm_start: start each step's problems from the previous step's potentials (at
            the final ε, without the ε schedule of ``sinkhorn_options``, which the first
            step follows).
        **sinkhorn_options: passed to :func:`flashot.sinkhorn` (not ``init``: the
            flow's problems start from their own potentials).

    Returns:
        A :class:`FlowResult`.

    Memory: a step holds about 4.4 arrays of A's size beyond the inputs: the state, one
    problem's two operands ((d + K)/d wide, K the classes of both), the gradient, and one
    block of a plan product (a CPU-measured count, ``tests/test_flows.py``). The
    gradient is the plans' envelope formula (:func:`_value_and_grad`), accumulated a
    block of rows at a time. On the Triton backend the default ``precision="auto"`` also
    keeps split copies of both operands at large sizes (two more); ``precision="tf32"``
    or ``"bf16"`` keeps none.
    """
    xa, classes_a, index_a, xb, classes_b, index_b = _prepare(xa, ya, xb, yb)
    for value, name in ((steps, "steps"), (snapshot_every, "snapshot_every")):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{name} must be an integer ≥ 0, got {value!r}")
    if not (isinstance(step_size, (int, float)) and math.isfinite(step_size) and step_size > 0):
        raise ValueError(f"step_size must be a finite number > 0, got {step_size!r}")
    if snapshot_every and snapshot_dir is None:
        raise ValueError("snapshot_every needs snapshot_dir")
    if "init" in sinkhorn_options:
        raise ValueError("init is not a dataset_flow option: each step starts from the "
                         "previous step's potentials (warm_start)")  # fmt: skip
    if not isinstance(warm_start, bool):
        raise ValueError(f"warm_start must be True or False, got {warm_start!r}")
    warm: dict | None = {} if warm_start else None
    sinkhorn_options = _streaming(sinkhorn_options, xa)  # (OTDD's memory bound)
    ka, kb = len(classes_a), len(classes_b)
    first = xa.detach()
    out = FlowResult(first)  # the input is the first state (never written to)
    xb, labels_b = xb.detach(), index_b + ka  # B's labels after A's in the class table
    cost = self_b = None
    start = time.perf_counter()
    for step in range(steps + 1):
        if cost is None or recompute_stats:
            cost = _label_cost(out.x, index_a, ka, xb, index_b, kb, inner, diagonal, eps,
                               lambda_x, lambda_y)  # fmt: skip
            self_b = None  # OT(B, B) depends on the table
        x = out.x
        if step < steps:
            value, grad, self_b = _value_and_grad(x, index_a, xb, labels_b, cost, eps, self_b,
                                                  warm, **sinkhorn_options)  # fmt: skip
        else:
            with torch.no_grad():
                value, _, self_b = _outer(x, index_a, xb, labels_b, cost, eps, True, self_b,
                                          solve=lambda x, y, c, name: _solve(
                                              x, y, c, eps, warm, name, sinkhorn_options),
                                          **sinkhorn_options)  # fmt: skip
        out.distances.append(float(value))
        if snapshot_every and (step % snapshot_every == 0 or step == steps):
            path = Path(snapshot_dir) / f"step_{step:04d}.png"
            title = f"step {step}, OTDD {out.distances[-1]:.4g}"
            out.snapshots.append(save_grid(out.x, index_a, path, image_shape=image_shape,
                                           title=title))  # fmt: skip
        if step == steps:
            break
        out.x = torch.add(x, grad, alpha=-step_size * x.shape[0])  # one allocation
        del x, grad  # not into the next step's peak
        if progress:
            per = (time.perf_counter() - start) / (step + 1)
            print(f"flow step {step + 1}/{steps}  OTDD {out.distances[-1]:.6g}  "
                  f"{per:.2f} s/step  {per * (steps - step - 1):.0f} s left", file=sys.stderr,
                  flush=True)  # fmt: skip
    out.x = out.x.clone() if out.x is first else out.x.detach()
    return out
