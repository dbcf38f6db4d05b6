"""A drop-in replacement for ``geomloss.SamplesLoss``.

Same conventions as GeomLoss 0.3: for ``"sinkhorn"`` (p = 2) the cost ``|x − y|²/2``,
``ε = blur²``, ``ρ = reach²``, the ε-scaling schedule from the bounding-box diameter
with ratio ``scaling`` per step, symmetric updates, one final extrapolation, and the
debiased cost; the solve streams through a flashot backend instead of materializing
cost matrices. The kernel norms (``"energy"``, ``"gaussian"``, ``"laplacian"``) and the
Hausdorff divergence (``"hausdorff"``, p = 1 or 2) stream PyTorch tiles
(:mod:`flashot.backends.kernel_sums`).
"""

from __future__ import annotations

import math
import sys
import warnings

import torch

from flashot.autodiff.functional import functional_transforms
from flashot.autodiff.functions import dual_term
from flashot.autodiff.second_order import check_hvp_tol, exact_second_order, packed_piece
from flashot.autodiff.unrolled import Trajectory
from flashot.backends import entry_point
from flashot.backends.kernel_sums import cost_of, kernel_matvec, pair_scope, softmin
from flashot.divergence import debiased_potentials
from flashot.geometry.costs import bounding_diameter, box_diameter, get_cost
from flashot.geometry.pair_costs import KERNEL_COSTS, PairCost
from flashot.ops import compiled_loss, encodable
from flashot.packing import pack_problems, pair_packing
from flashot.problem import (
    check_positive,
    cloud_tensor,
    compute_dtype,
    eps_range,
    make_problem,
    weights_tensor,
)
from flashot.solver.clusters import MAX_DIM, default_scale
from flashot.solver.loop import geomloss_schedule
from flashot.solver.multiscale import TooManyPairsError, multiscale_potentials
from flashot.solver.tiled_loop import geomloss_potentials

__all__ = ["LOSSES", "SamplesLoss"]

#: the losses :class:`SamplesLoss` computes (GeomLoss' names)
LOSSES = ("sinkhorn", "energy", "gaussian", "laplacian", "hausdorff")


class SamplesLoss(torch.nn.Module):
    """Losses between sampled measures, GeomLoss-compatible.

    Args:
        loss: ``"sinkhorn"`` (the debiased Sinkhorn divergence or OT_ε), the kernel
            norms ``"energy"`` (``k = −|x − y|``), ``"gaussian"``
            (``exp(−|x − y|²/2 blur²)``), ``"laplacian"`` (``exp(−|x − y|/blur)``), or
            ``"hausdorff"``: ``½⟨a, s_b(x) − s_a(x)⟩ + ½⟨b, s_a(y) − s_b(y)⟩`` with the soft
            distance ``s_μ(z) = −ε log Σ_k μ_k exp(−C(z, z_k)/ε)``, ``C = |x − y|^p/p``,
            ε = blur^p (Feydy et al. 2019; GeomLoss 0.3.1's own fails with ``KeyError``).
            A kernel norm is ``½⟨a, K_xx a⟩ + ½⟨b, K_yy b⟩ − ⟨a, K_xy b⟩``; GeomLoss
            clamps distances at 1e-4 (so its self terms see k(1e-4) on their diagonals,
            −1e-4 instead of 0 for the energy); flashot uses the exact 0, with the
            same gradients. Kernel sums and Hausdorff's soft distances run as p = 1's
            (below: fused on CUDA float32, else checkpointed tiles; exact derivatives,
            twice); their weights are used as given (GeomLoss'), uniform 1/N when
            omitted; the Sinkhorn options (``reach``, ``scaling``, ``diameter``,
            ``debias``, ``precision``) do not apply to them.
        p: 1 or 2: the cost ``|x − y|^p/p``, ε = blur^p, ρ = reach^p, for ``"sinkhorn"``
            and ``"hausdorff"``; ignored by the kernel norms (as GeomLoss). With p = 1
            the Sinkhorn loss runs GeomLoss' loop over streamed soft-minima
            (:mod:`flashot.solver.tiled_loop`: no ``"cosine"``, no second
            derivatives beyond the final extrapolation's; a fused Triton kernel on
            CUDA float32 clouds, PyTorch tiles otherwise or with ``backend="torch"``);
            p = 2 streams the attention form through the backends.
        blur: ε = blur^p (> 0); the kernels' σ.
        reach: None (balanced) or the KL relaxation scale, ρ = reach^p.
        diameter: the data diameter for the ε schedule, or None to measure it (the
            joint bounding box's diagonal, read with the input checks). On CUDA the
            solves of a repeated call (a training loop) replay as CUDA graphs while the
            schedule keeps its length: a measured diameter moves its warm-up
            temperatures, which the kernels read from the device
            (:mod:`flashot.backends.temperature`); a fixed one also keeps the length.
        scaling: ratio of successive blurs in the ε schedule, in (0, 1).
        truncate: the multiscale mode's truncation (None or > 0): cluster pairs whose
            plan entries are bounded by ``exp(−truncate²/2)`` times their weights are
            skipped (:mod:`flashot.solver.multiscale`; None: none skipped). Without
            ``cluster_scale`` it has no effect (the full problem is solved).
        cost: None (``|x − y|^p/p``), ``"cosine"`` (1 − cos(x, y); p = 2 Sinkhorn), or a
            callable ``cost(x_block, y_block)`` → the (r, c) cost tile of (r, D) and (c, D)
            blocks, for ``"sinkhorn"`` and ``"hausdorff"`` (GeomLoss' tensorized ``cost``,
            but on 2-D blocks): it runs in checkpointed PyTorch tiles like p = 1, with
            ε = blur^p and the schedule from the point cloud's diameter^p, and must be
            differentiable by autograd (twice for second derivatives). A
            :class:`flashot.PairCost` with a Triton function runs fused on CUDA, as p = 1.
        kernel: only None (a custom kernel callable is not supported).
        cluster_scale: None (the full problem), or the cell side of the multiscale mode
            for ``"sinkhorn"`` with the cost ``|x − y|^p/p`` and D ≤ 8 (GeomLoss'
            ``backend="multiscale"``): coarse steps on grid clusters while ε >
            cluster_scale^p, then block-sparse soft-minima over the cluster pairs the
            truncation keeps (:mod:`flashot.solver.multiscale`). An approximation: its
            value and gradient are within the truncation of the dense ones only as far
            as the coarse steps converge alike (measured in benchmarks/NOTES.md). It
            pays for 2-D and 3-D shapes; where a mask would keep more than
            :data:`~flashot.solver.multiscale.MAX_PAIRS` cluster pairs it warns and
            solves the dense problem.
        debias: return the debiased Sinkhorn divergence (else OT_ε).
        potentials: return the potentials (F, G) instead of the value.
        verbose: print one line per call on stderr (sizes, ε schedule, backend).
        backend: ``"auto"``, ``"torch"``, ``"triton"`` or a backend instance; GeomLoss'
            ``"tensorized"`` and ``"online"`` name the same exact solve here (``"torch"``
            and ``"auto"``), its ``"multiscale"`` is the multiscale mode (with a default
            ``cluster_scale``: about 2 000 cells across the bounding box).
        precision: precision mode of the backend (see :func:`flashot.sinkhorn`),
            keyword only.
        hvp_tol: the relative error asked of second derivatives (a double backward),
            keyword only; None: 1e-3 in float32, 1e-8 in float64. The schedule's
            iterations are differentiated exactly, up to two approximations held to it:
            the iterates the solve kept are read where the step LSEs they imply hold to
            ``hvp_tol / 10``, and an eager reverse sweep (large problems on a GPU, any on
            the CPU) stops where the schedule's first steps could add at most
            ``hvp_tol / 100`` of the largest gradient (:mod:`flashot.autodiff.replay`).

    The positional order is GeomLoss': ``SamplesLoss("sinkhorn", 2, blur, reach,
    diameter, scaling, truncate, cost, kernel, cluster_scale, debias, potentials,
    verbose, backend)``.

    Gradients are GeomLoss' (the envelope gradient of the final extrapolation), with or
    without ``create_graph``. The schedule stops before the potentials converge, so that
    gradient is not the derivative of the value, nor of any function: a double backward
    ``∇⟨g, v⟩`` gives ``Jᵀ v`` for the Jacobian J of the returned gradient, exactly
    (:mod:`flashot.autodiff.unrolled`), and J is symmetric only as far as the schedule
    converged. Newton-type methods want :func:`flashot.sinkhorn_divergence` (a solve to a
    tolerance, whose Hessian is symmetric) instead.

    Call forms: ``loss(x, y)`` or ``loss(a, x, b, y)``, with x (N, D) or (B, N, D)
    and weights (N,) or (B, N). Returns a scalar, (B,) values, or (F, G) shaped
    like the weights. Numpy arrays are taken as CPU tensors (numpy weights take their
    cloud's dtype); the results are tensors.
    """

    def __init__(
        self,
        loss: str = "sinkhorn",
        p: int = 2,
        blur: float = 0.05,
        reach: float | None = None,
        diameter: float | None = None,
        scaling: float = 0.5,
        truncate: float | None = 5,
        cost: str | None = None,
        kernel=None,
        cluster_scale: float | None = None,
        debias: bool = True,
        potentials: bool = False,
        verbose: bool = False,
        backend="auto",
        *,
        precision: str = "auto",
        hvp_tol: float | None = None,
    ):
        super().__init__()
        if loss not in LOSSES:
            raise ValueError(f"loss must be one of {LOSSES}, got {loss!r}")
        if isinstance(p, bool) or p not in (1, 2):
            raise ValueError(f"p must be 1 or 2, got {p!r}")
        custom = callable(cost)
        if custom and loss not in ("sinkhorn", "hausdorff"):
            raise ValueError(f"a cost callable applies to 'sinkhorn' and 'hausdorff', not to "
                             f"{loss!r}")  # fmt: skip
        # (the attention form's losses; the others run tiles, flashot.solver.tiled_loop)
        fused = loss == "sinkhorn" and p == 2 and not custom
        if not custom and (cost not in (None, "cosine") or (cost is not None and not fused)):
            raise ValueError(f"cost must be None{' or cosine' if fused else ''} or a callable "
                             f"for loss={loss!r}, p={p!r}, got {cost!r}")  # fmt: skip
        if loss != "sinkhorn" and reach is not None:
            raise ValueError(f"reach applies to loss='sinkhorn' only, not to {loss!r}")
        if loss == "hausdorff" and potentials:
            raise ValueError("potentials=True is not available for loss='hausdorff'")
        if truncate is not None and not (isinstance(truncate, (int, float)) and truncate > 0):
            raise ValueError(f"truncate must be None or a number > 0, got {truncate!r}")
        if kernel is not None:
            raise ValueError("kernel must be None: a custom kernel callable is not supported "
                             "(loss='energy', 'gaussian' or 'laplacian' names one)")  # fmt: skip
        multiscale = cluster_scale is not None or backend == "multiscale"
        if multiscale and (loss != "sinkhorn" or cost is not None):
            raise ValueError("cluster_scale (the multiscale mode) applies to loss='sinkhorn' "
                             "with the cost |x − y|^p/p (cost=None) only")  # fmt: skip
        self.cluster_scale = (None if cluster_scale is None
                              else check_positive(cluster_scale, "cluster_scale"))  # fmt: skip
        self._multiscale = multiscale
        if backend == "multiscale":
            backend = "auto"
        fused = fused and not multiscale
        if isinstance(backend, str):
            backend = {"tensorized": "torch", "online": "auto"}.get(backend, backend)
        if not isinstance(verbose, bool):
            raise TypeError(f"verbose must be True or False, got {verbose!r}")
        self.truncate, self.verbose = truncate, verbose
        self.blur = check_positive(blur, "blur")
        self.reach = None if reach is None else check_positive(reach, "reach")
        self.diameter = None if diameter is None else check_positive(diameter, "diameter")
        if not (isinstance(scaling, (int, float)) and 0 < scaling < 1):
            raise ValueError(f"scaling must be in (0, 1), got {scaling!r}")
        self.scaling, self.debias, self.potentials = float(scaling), bool(debias), bool(potentials)
        self.loss, self.p = loss, int(p)
        self.backend, self.precision = backend, precision
        self.hvp_tol = check_hvp_tol(hvp_tol)
        self.cost = get_cost("half_sqeuclidean" if cost is None or custom else cost)
        self._tile_cost = _checked_cost(cost) if custom else cost_of(int(p))
        self._custom_cost = custom
        self._fused = fused
        # what a flashot::loss node needs to rebuild this loss (None: no node, eager call)
        node = dict(blur=self.blur, reach=self.reach, diameter=self.diameter,
                    scaling=self.scaling, cost=cost, debias=self.debias,
                    backend=self.backend, precision=precision,
                    hvp_tol=self.hvp_tol)  # fmt: skip
        self._node_options = (None if potentials or verbose or not fused
                              or not encodable(node) else node)  # fmt: skip

    def extra_repr(self) -> str:
        """Options shown by ``repr``."""
        if not self._custom_cost:
            cost = self.cost.name
        elif isinstance(self._tile_cost, PairCost):
            cost = f"PairCost {self._tile_cost.name}"
        else:
            cost = "callable"
        multiscale = f", cluster_scale={self.cluster_scale}" if self._multiscale else ""
        return (
            f"{self.loss!r}, p={self.p}, blur={self.blur}, reach={self.reach}, "
            f"scaling={self.scaling}, debias={self.debias}, cost={cost!r}, "
            f"backend={self.backend!r}{multiscale}"
        )

    def forward(self, *args):
        """``(x, y)`` or ``(a, x, b, y)``; see the class docstring.

        Under ``torch.compile`` a value (not ``potentials=True``, a backend given by name)
        is one ``flashot::loss`` graph node (:mod:`flashot.ops`): no graph break.
        """
        if torch.compiler.is_compiling() and self._node_options is not None:
            if len(args) == 2:
                return compiled_loss("samples_loss", args[0], args[1], **self._node_options)
            if len(args) == 4:
                return compiled_loss("samples_loss", args[1], args[3], args[0], args[2],
                                     **self._node_options)  # fmt: skip
        return self._forward(*args)

    @entry_point
    @functional_transforms
    def _forward(self, *args):
        """The eager call behind :meth:`forward`."""
        if len(args) == 2:
            (x, y), a, b = args, None, None
        elif len(args) == 4:
            a, x, b, y = args
        else:
            raise ValueError(f"SamplesLoss takes (x, y) or (a, x, b, y), got {len(args)} arguments")
        x, y = cloud_tensor(x), cloud_tensor(y)  # numpy in, tensors out
        if isinstance(x, torch.Tensor):
            a, b = weights_tensor(a, x, "a"), weights_tensor(b, x, "b")
        for t, name in ((x, "x"), (y, "y")):
            if not isinstance(t, torch.Tensor) or t.dim() not in (2, 3):
                raise ValueError(f"{name} must be a (N, D) or (B, N, D) tensor")
        if x.dim() != y.dim():
            raise ValueError(
                "x and y must both be batched or both not, "
                f"got shapes {tuple(x.shape)}, {tuple(y.shape)}"
            )
        if x.dim() == 3 and x.shape[0] != y.shape[0]:
            raise ValueError(
                f"x and y must have the same batch size, got {x.shape[0]} and {y.shape[0]}"
            )
        if not self._fused:  # (kernel norms, Hausdorff, p = 1 or a cost callable: tiles)
            if x.dim() == 2:
                return self._kernel_loss(a, x, b, y)
            items = [self._kernel_loss(None if a is None else _batch_item(a, i, "a"), x[i],
                                       None if b is None else _batch_item(b, i, "b"), y[i])
                     for i in range(x.shape[0])]  # fmt: skip
            if self.potentials:
                return torch.stack([f for f, _ in items]), torch.stack([g for _, g in items])
            return torch.stack(items)
        if x.dim() == 2:
            return self._single(a, x, b, y)
        temps = self._schedule(x, y)  # one diameter for the whole batch, as GeomLoss
        return self._batched(a, x, b, y, temps)  # one packed solve (flashot.batched)

    def _say(self, x, y, temps) -> None:
        if self.verbose:
            print(f"flashot SamplesLoss: {tuple(x.shape)} vs {tuple(y.shape)}, {len(temps)} "
                  f"eps steps from {temps[0]:.3g} to {temps[-1]:.3g}, backend "
                  f"{self.backend!r}, precision {self.precision!r}", file=sys.stderr)  # fmt: skip

    def _schedule(self, x, y, problem=None) -> list[float]:
        # (the problem's checked cost bound is its boxes': no second read of them)
        bound = None if problem is None else problem.form.cost_bound
        diameter = (self.diameter or box_diameter(self.cost, bound)
                    or bounding_diameter(self.cost, x, y))  # fmt: skip
        dtype = compute_dtype(x.dtype) if isinstance(x, torch.Tensor) else torch.float32
        hi = eps_range(0.0, dtype)[1]
        for value, name in ((self.blur, "blur"), (diameter, "diameter")):
            if value**2 > hi:  # the schedule starts at ε = diameter², ends at blur²
                raise ValueError(
                    f"{name}={value:g} gives eps = {name}² = {value**2:.3g}, beyond what {dtype} "
                    f"supports ({hi:.3g}); rescale the data or use float64"
                )
        temps = geomloss_schedule(max(diameter, self.blur), self.blur**2, self.scaling)
        self._say(x, y, temps)
        return temps

    def _kernel_loss(self, a, x, b, y):
        r"""GeomLoss' kernel norms and the Hausdorff divergence of one (N, D) pair.

        Kernel norms (``"energy"``: ``k = −|x − y|``, ``"gaussian"``:
        ``exp(−|x − y|²/2σ²)``, ``"laplacian"``: ``exp(−|x − y|/σ)``, σ = blur):
        ``½⟨a, K_xx a⟩ + ½⟨b, K_yy b⟩ − ⟨a, K_xy b⟩``; potentials
        ``(K_xx a − K_xy b, K_yy b − K_yx a)``. Hausdorff, with the soft distance
        ``s_μ(z) = −ε log Σ_k μ_k exp(−C(z, z_k)/ε)``, ``C = |x − y|^p/p``, ε = blur^p:
        ``½⟨a, s_b(x) − s_a(x)⟩ + ½⟨b, s_a(y) − s_b(y)⟩``.
        """
        x, y, a, b = check_kernel_inputs(a, x, b, y)
        if self.loss == "sinkhorn":  # p = 1: GeomLoss' loop on tiles
            return self._tiled_sinkhorn(a, x, b, y)
        if self.loss == "hausdorff":
            eps, cost = self.blur**self.p, self._tile_cost
            la, lb = torch.log(a), torch.log(b)
            engine = self._tile_backend()
            on_x = (softmin(x, y, lb, eps, cost, backend=engine)
                    - softmin(x, x, la, eps, cost, backend=engine))  # fmt: skip
            on_y = (softmin(y, x, la, eps, cost, backend=engine)
                    - softmin(y, y, lb, eps, cost, backend=engine))  # fmt: skip
            return 0.5 * ((a * on_x).sum() + (b * on_y).sum())
        kernel, scaled = KERNEL_COSTS[self.loss]
        if scaled:  # (k(x, y) = φ(|x/σ − y/σ|²))
            x, y = x / self.blur, y / self.blur

        def k_times(rows, cols, w):
            return kernel_matvec(rows, cols, w, kernel, backend=self._tile_backend())

        a_x, b_x, b_y = k_times(x, x, a), k_times(x, y, b), k_times(y, y, b)
        if self.potentials:  # (the value needs no K_yx a: ⟨a, K_xy b⟩ holds the cross term)
            return a_x - b_x, b_y - k_times(y, x, a)
        return 0.5 * ((a * a_x).sum() + (b * b_y).sum()) - (a * b_x).sum()

    def _tiled_sinkhorn(self, a, x, b, y):
        """``SamplesLoss("sinkhorn", p=1)`` by :mod:`flashot.solver.tiled_loop`."""
        diameter = self.diameter or bounding_diameter(get_cost("sqeuclidean"), x, y)
        temps = geomloss_schedule(max(diameter, self.blur), self.blur**self.p, self.scaling,
                                  self.p)  # fmt: skip
        self._say(x, y, temps)
        eps = self.blur**self.p
        rho = None if self.reach is None else self.reach**self.p
        if self._multiscale and x.shape[1] > MAX_DIM:
            raise ValueError(f"cluster_scale (the multiscale mode) takes clouds of at most "
                             f"{MAX_DIM} dimensions, got {x.shape[1]}")  # fmt: skip
        with pair_scope(x, y, self._tile_cost, self._tile_backend()):  # (operands made once)
            pots = None
            if self._multiscale:
                scale = self.cluster_scale or default_scale(diameter, x.shape[1])
                trunc = math.inf if self.truncate is None else float(self.truncate)
                try:
                    pots = multiscale_potentials(a, x, b, y, self._tile_cost, temps,
                                                 self.debias, scale, trunc, self.p, rho,
                                                 self._tile_backend())  # fmt: skip
                except TooManyPairsError as err:  # (the dense problem below: exact, O((n + m) d))
                    warnings.warn(f"SamplesLoss(cluster_scale={scale:.3g}) on {x.shape[1]}-D "
                                  f"clouds: {err}; solved without clusters instead",
                                  stacklevel=3)  # fmt: skip
            if pots is None:
                pots = geomloss_potentials(a, x, b, y, self._tile_cost, temps, self.debias,
                                           rho, self._tile_backend())  # fmt: skip
        if self.potentials:
            if pots.f_aa is None or pots.g_bb is None:
                return pots.f_ba, pots.g_ab
            return pots.f_ba - pots.f_aa, pots.g_ab - pots.g_bb
        value = dual_term(pots.f_ba, a, eps, rho) + dual_term(pots.g_ab, b, eps, rho)
        if pots.f_aa is not None and pots.g_bb is not None:
            value = value - dual_term(pots.f_aa, a, eps, rho) - dual_term(pots.g_bb, b, eps, rho)
        return value

    def _tile_backend(self) -> str:
        """The soft-minima's engine: the backend's name (an instance: its own)."""
        name = self.backend if isinstance(self.backend, str) else getattr(self.backend, "name",
                                                                           "auto")  # fmt: skip
        return name if name in ("triton", "torch") else "auto"

    def _single(self, a, x, b, y, temps=None):
        """One (N, D) problem; ``temps``: its ε schedule, or None for this call's own."""
        shape_a, shape_b = (None if a is None else a.shape), (None if b is None else b.shape)
        rho = None if self.reach is None else self.reach**2
        problem = make_problem(
            x,
            y,
            a,
            b,
            eps=self.blur**2,
            cost=self.cost,
            rho=rho,
            normalize=False,
            backend=self.backend,
            precision=self.precision,
        )
        if temps is None:
            temps = self._schedule(x, y, problem)
        pots = debiased_potentials(
            problem, temps, debias=self.debias, max_iter=len(temps), tol=None
        )
        if self.potentials:
            f, g = pots.f, pots.g
            if self.debias:
                f, g = f - pots.p, g - pots.q
            f = f.reshape(shape_a) if shape_a is not None else f
            g = g.reshape(shape_b) if shape_b is not None else g
            return f, g  # (in the compute dtype: the dtype rule, flashot.problem.compute_dtype)
        return pots.value(problem, self.hvp_tol)

    def _batched(self, a, x, b, y, temps):
        """A batch as one packed solve (balanced or with ``reach``).

        The B problems (x_i, y_i) and, debiased, the 2B self problems (x_i, x_i),
        (y_i, y_i), which symmetric steps keep symmetric. Each problem's value is
        :func:`~flashot.autodiff.functions.dual_term` summed over its own points.
        """
        bsz, n, m = x.shape[0], x.shape[1], y.shape[1]
        weights = []
        for w, size, name in ((a, n, "a"), (b, m, "b")):
            if w is not None:
                w = torch.stack([_batch_item(w, i, name) for i in range(bsz)])
                if w.shape != (bsz, size):
                    raise ValueError(f"{name} must be a ({bsz}, {size}) tensor")
                w = w.reshape(-1)
            weights.append(w)
        packed_x, packed_y, rows, cols, wa, wb = pair_packing(x, y, *weights, self.debias)
        rho = None if self.reach is None else self.reach**2
        pp = pack_problems(packed_x, packed_y, rows, cols, wa, wb, eps=self.blur**2,
                           cost=self.cost, backend=self.backend, precision=self.precision,
                           normalize=False, rho=rho)  # fmt: skip
        f, g, out = pp.potentials(temps, max_iter=len(temps), tol=None, update="symmetric")
        seg = pp.segments
        if self.potentials:
            fs = f[: bsz * n].reshape(bsz, n)
            gs = g[: bsz * m].reshape(bsz, m)
            if self.debias:  # a self problem's two potentials agree up to rounding: average
                p = f[bsz * n : 2 * bsz * n] + g[bsz * m : bsz * (m + n)]
                fs = fs - 0.5 * p.reshape(bsz, n)
                gs = gs - 0.5 * (f[2 * bsz * n :] + g[bsz * (m + n) :]).reshape(bsz, m)
            return fs, gs
        eps = self.blur**2
        value = dual_term(f, pp.a, eps, rho, seg.sum) + dual_term(g, pp.b, eps, rho, seg.T.sum)
        if torch.is_grad_enabled() and value.requires_grad:  # differentiable twice
            trajectory = Trajectory(tuple(float(t) for t in temps), len(temps),
                                    iterates=out.iterates)  # fmt: skip
            value = exact_second_order(value, [packed_piece(pp, f, g, self.hvp_tol, trajectory,
                                                            geomloss=True)])  # fmt: skip
        value = value.reshape(-1, bsz)
        value = value[0] - 0.5 * (value[1] + value[2]) if self.debias else value[0]
        return value


def _checked_cost(cost):
    """A user's ``cost(x_block, y_block)``, each (r, c) tile checked once it is computed.

    A :class:`PairCost` checks its own, and keeps its Triton function.
    """
    if isinstance(cost, PairCost):
        return cost

    def tile(x, y):
        c = cost(x, y)
        if not isinstance(c, torch.Tensor) or c.shape != (x.shape[0], y.shape[0]):
            got = tuple(c.shape) if isinstance(c, torch.Tensor) else type(c).__name__
            raise ValueError(f"cost(x, y) must return an ({x.shape[0]}, {y.shape[0]}) tensor "
                             f"for (r, D) and (c, D) blocks, got {got}")  # fmt: skip
        return c

    return tile


def check_kernel_inputs(a, x, b, y):
    """``(x, y, a, b)`` checked for a kernel loss.

    Finite clouds of one dtype, device and dimension; weights of their shapes (uniform
    ``1/N`` when None, as GeomLoss).
    """
    for t, name in ((x, "x"), (y, "y")):
        if not t.dtype.is_floating_point or t.shape[0] == 0 or t.shape[1] == 0:
            raise ValueError(f"{name} must be a non-empty floating-point (N, D) tensor")
        if not bool(torch.isfinite(t.detach()).all()):
            raise ValueError(f"{name} holds non-finite coordinates")
    if x.shape[1] != y.shape[1] or (x.dtype, x.device) != (y.dtype, y.device):
        raise ValueError(f"x and y must share dimension, dtype and device, got "
                         f"{tuple(x.shape)} {x.dtype} {x.device} and {tuple(y.shape)} "
                         f"{y.dtype} {y.device}")  # fmt: skip
    out = []
    for w, pts, name in ((a, x, "a"), (b, y, "b")):
        if w is None:
            w = torch.full((len(pts),), 1.0 / len(pts), dtype=pts.dtype, device=pts.device)
        if not isinstance(w, torch.Tensor) or w.reshape(-1).shape != (len(pts),):
            raise ValueError(f"{name} must hold {len(pts)} weights, one per point")
        w = w.reshape(-1).to(pts.dtype)
        wd = w.detach()
        if not bool(torch.isfinite(wd).all()) or bool((wd < 0).any()):
            raise ValueError(f"{name} must be finite, non-negative weights")
        out.append(w)
    return x, y, out[0], out[1]


def _batch_item(w, i: int, name: str) -> torch.Tensor:
    if not isinstance(w, torch.Tensor) or w.dim() not in (2, 3):
        raise ValueError(f"with batched points, {name} must be a (B, N) tensor")
    return w[i].reshape(-1)
