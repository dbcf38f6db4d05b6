r"""The libraries compared, each optional: a provider says why it cannot run, or runs.

Every provider receives the same :class:`Problem` and returns a callable computing its
value (and the gradient in x for ``"gradient"``) of

.. math::

    \mathrm{OT}_\varepsilon = \min_P \langle P, C\rangle + \varepsilon\,
        \mathrm{KL}(P \,|\, a \otimes b), \qquad C_{ij} = |x_i - y_j|^2,

converted to this convention where the library's own differs (GeomLoss: ``|x−y|²/2``
with ``ε/2``, value doubled; POT: the plan's value computed here). Fixed-iteration
workloads run each library's own update: GeomLoss' and flashot's symmetric averaged
steps, POT's alternating ones (so its 10-iteration value differs by the algorithm,
not by accuracy: compare POT in ``converge``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch

import flashot
from flashot.bench.options import PROVIDERS

__all__ = ["HVP_TOL", "PROVIDERS", "Problem", "Provider", "direction", "make_problem", "providers"]


@dataclass
class Problem:
    """One benchmark problem (float32 on the device; ``eps`` for the cost ``|x − y|²``)."""

    x: torch.Tensor
    y: torch.Tensor
    a: torch.Tensor
    b: torch.Tensor
    eps: float
    iters: int
    tol: float

    @property
    def n(self) -> int:
        """Points per cloud."""
        return self.x.shape[0]

    @property
    def d(self) -> int:
        """Feature size."""
        return self.x.shape[1]


def make_problem(n: int, m: int, d: int, device, *, eps=0.1, iters=10, tol=1e-3,
                 seed=0, dtype=torch.float32) -> Problem:  # fmt: skip
    """x, y ~ N(0, I_d), weights uniform on [0.1, 1.1) normalized; seeded."""
    gen = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(n, d, device=device, generator=gen, dtype=dtype)
    y = torch.randn(m, d, device=device, generator=gen, dtype=dtype)
    a = torch.rand(n, device=device, generator=gen, dtype=dtype) + 0.1
    b = torch.rand(m, device=device, generator=gen, dtype=dtype) + 0.1
    return Problem(x, y, a / a.sum(), b / b.sum(), eps, iters, tol)


#: the solve's tolerance of the ``hvp`` workload (the Hessian of the converged value)
HVP_TOL = 1e-6
#: the peer's solve in the ``hvp`` workload (TF32 potentials stall above HVP_TOL)
PEER_HVP_TOL, PEER_HVP_ITERS = 1e-4, 2000
#: cost entries per block of POT's online solver (``pot-lazy``): 64 MB of float32
POT_LAZY_BLOCK = 1 << 24
#: classes of the ``otdd`` workload's datasets (labels i mod K on both sides)
OTDD_CLASSES = 10


def otdd_labels(pb: Problem) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``otdd`` workload's labels of x and y: ``i mod K`` (every class the same size)."""
    dev = pb.x.device
    return (torch.arange(pb.n, device=dev) % OTDD_CLASSES,
            torch.arange(pb.y.shape[0], device=dev) % OTDD_CLASSES)  # fmt: skip


def otdd_table(pb: Problem) -> torch.Tensor:
    """(2K, 2K) W² between the classes of both datasets (diagonal Gaussians).

    The label table the ``otdd`` workload's providers share (flashot's own, held fixed).
    """
    from flashot.tasks.otdd import class_table

    ya, yb = otdd_labels(pb)
    feats = [pb.x[ya == c] for c in range(OTDD_CLASSES)] + [
        pb.y[yb == c] for c in range(OTDD_CLASSES)]  # fmt: skip
    return class_table(feats, "gaussian", diagonal=True)


def direction(pb: Problem) -> torch.Tensor:
    """The ``hvp`` workload's direction: seeded, of x's shape and unit RMS."""
    gen = torch.Generator(device=pb.x.device).manual_seed(7)
    return torch.randn(pb.x.shape, device=pb.x.device, generator=gen, dtype=pb.x.dtype)


class Provider:
    """A library's way of computing one workload (see the module)."""

    name = ""
    computes = ""
    workloads: tuple[str, ...] = ("forward", "gradient", "converge")
    #: its memory is PyTorch's (False: another allocator, e.g. JAX's, so no peak is reported)
    torch_memory = True

    def unavailable(self, device: torch.device) -> str | None:
        """Why this provider cannot run here (a one-line reason), or None."""
        return None

    def prepare(self, workload: str, pb: Problem) -> Callable[[], torch.Tensor]:
        """A callable returning the value (a 0-dim tensor) of ``workload`` on ``pb``."""
        raise NotImplementedError


def _timed(value_of: Callable[[torch.Tensor], torch.Tensor], workload: str, x: torch.Tensor):
    """The callable of a value workload: ``value_of(x)``, and its gradient for "gradient"."""
    if workload != "gradient":
        return lambda: value_of(x)

    def run():
        xs = x.detach().requires_grad_()
        value = value_of(xs)
        torch.autograd.grad(value, xs)
        return value.detach()

    return run


class Flashot(Provider):
    """flashot with a backend and precision mode.

    ``scores``: the Triton backend's option (``"auto"``, its default; ``"stream"`` and
    ``"cache"`` name the provider ``flashot-triton-stream`` and ``-cache``).
    """

    def __init__(self, backend: str, precision: str = "auto", scores: str = "auto"):
        self.backend, self.precision, self.scores = backend, precision, scores
        tag = ("" if precision == "auto" else f"-{precision}") + (
            "" if scores == "auto" else f"-{scores}")  # fmt: skip
        self.name = f"flashot-{backend}{tag}"
        self.computes = (
            "OT_eps; fixed iterations: symmetric averaged updates (GeomLoss') and a final "
            "extrapolation; converge: alternating updates, ε-scaling, tol; plan: (P y).sum() "
            "streamed after the solve; hvp: <v, H v> of the converged value (exact, CG)"
        )

    def unavailable(self, device):
        if self.backend not in flashot.available_backends(device):
            return f"backend {self.backend!r} is not available on {device.type}"
        if self.precision != "auto" and (self.backend != "triton" or device.type != "cuda"):
            return f"precision {self.precision!r} needs the triton backend on a GPU"
        return None

    workloads = ("forward", "gradient", "converge", "plan", "hvp", "otdd")

    def prepare(self, workload, pb):
        kw = dict(eps=pb.eps, backend=self.backend, precision=self.precision)
        if self.scores != "auto":  # (TritonBackend(scores=...): an instance, its precision)
            from flashot.backends.triton import TritonBackend

            kw.update(backend=TritonBackend(self.precision, scores=self.scores),
                      precision="auto")  # fmt: skip
        if workload == "otdd":  # debiased, diagonal Gaussian inner, fixed iterations
            from flashot.tasks.otdd import dataset_distance

            ya, yb = otdd_labels(pb)
            return lambda: dataset_distance(pb.x, ya, pb.y, yb, diagonal=True, tol=None,
                                            max_iter=pb.iters, update="symmetric",
                                            **kw).distance  # fmt: skip
        if workload == "plan":  # the product alone, after the solve
            plan = flashot.sinkhorn(pb.x, pb.y, pb.a, pb.b, tol=None, max_iter=pb.iters,
                                    update="symmetric", **kw).plan  # fmt: skip
            return lambda: (plan @ pb.y).sum()
        if workload == "hvp":
            v = direction(pb)
            return lambda: (v * flashot.hvp(pb.x, pb.y, v, pb.a, pb.b, tol=HVP_TOL,
                                            max_iter=100_000, warn=False, **kw)).sum()  # fmt: skip
        if workload == "converge":
            kw.update(tol=pb.tol, max_iter=100_000, eps_schedule="geomloss", warn=False)
        else:
            kw.update(tol=None, max_iter=pb.iters, update="symmetric")

        def value_of(x):
            return flashot.sinkhorn(x, pb.y, pb.a, pb.b, **kw).cost

        return _timed(value_of, workload, pb.x)


def _sq_dist(x, y):
    return (x * x).sum(1)[:, None] + (y * y).sum(1)[None, :] - 2.0 * x @ y.T


class DenseTorch(Provider):
    """A plain PyTorch log-domain loop on the full n × m cost matrix."""

    name = "dense-torch"
    computes = ("OT_eps, the same symmetric updates as flashot on a stored n×m cost matrix; "
                "plan: the n×m plan formed, times y; otdd: the dense formula, the augmented "
                "n×m cost |x−y|² + W²[c, c'] (flashot's class table) and the same debiased "
                "symmetric solves")  # fmt: skip
    workloads = ("forward", "gradient", "plan", "otdd")

    def unavailable(self, device):
        return None

    def prepare(self, workload, pb):
        la, lb = pb.a.log(), pb.b.log()

        def t(h, log_w, cost):  # soft c-transform ε LSE over the other side
            return -pb.eps * torch.logsumexp((h[None, :] - cost) / pb.eps + log_w[None, :], 1)

        def value_of(x):
            c = _sq_dist(x, pb.y)
            cd = c.detach()
            with torch.no_grad():
                f = t(torch.zeros_like(lb), lb, cd)
                g = t(torch.zeros_like(la), la, cd.T)
                for _ in range(pb.iters):
                    f, g = 0.5 * (f + t(g, lb, cd)), 0.5 * (g + t(f, la, cd.T))
            f_new, g_new = t(g, lb, c), t(f, la, c.T)  # the differentiated extrapolation
            return (pb.a * f_new).sum() + (pb.b * g_new).sum()

        if workload == "otdd":
            ya, yb = otdd_labels(pb)
            table = otdd_table(pb).to(pb.x.dtype)
            k = OTDD_CLASSES
            uni_a = torch.full_like(la, -math.log(len(la)))
            uni_b = torch.full_like(lb, -math.log(len(lb)))

            def ot(u, v, cu, cv, wu, wv):  # symmetric solve, GeomLoss' start and final step
                c = _sq_dist(u, v) + table[cu[:, None], cv[None, :]]
                f, g = t(torch.zeros_like(wv), wv, c), t(torch.zeros_like(wu), wu, c.T)
                for _ in range(pb.iters):
                    f, g = 0.5 * (f + t(g, wv, c)), 0.5 * (g + t(f, wu, c.T))
                f, g = t(g, wv, c), t(f, wu, c.T)
                return (wu.exp() * f).sum() + (wv.exp() * g).sum()

            def distance():
                with torch.no_grad():
                    xy = ot(pb.x, pb.y, ya, yb + k, uni_a, uni_b)
                    xx = ot(pb.x, pb.x, ya, ya, uni_a, uni_a)
                    yy = ot(pb.y, pb.y, yb + k, yb + k, uni_b, uni_b)
                    return xy - 0.5 * (xx + yy)

            return distance
        if workload == "plan":
            with torch.no_grad():
                c = _sq_dist(pb.x, pb.y)
                f, g = t(torch.zeros_like(lb), lb, c), t(torch.zeros_like(la), la, c.T)
                for _ in range(pb.iters):
                    f, g = 0.5 * (f + t(g, lb, c)), 0.5 * (g + t(f, la, c.T))
                f, g = t(g, lb, c), t(f, la, c.T)

            def product():  # the stored plan's product (the plan is formed each call)
                logp = (f[:, None] + g[None, :] - c) / pb.eps + la[:, None] + lb[None, :]
                return (torch.exp(logp) @ pb.y).sum()

            return product
        return _timed(value_of, workload, pb.x)


class GeomLoss(Provider):
    """GeomLoss 0.3.1's own loop (``sinkhorn_loop``), tensorized or online (KeOps)."""

    workloads = ("forward", "gradient")

    def __init__(self, mode: str):
        self.mode = mode
        self.name = f"geomloss-{mode}"
        self.computes = ("OT_eps via GeomLoss' symmetric loop at a fixed ε: cost |x−y|²/2 with "
                         "ε/2, value doubled")  # fmt: skip

    def unavailable(self, device):
        try:
            import geomloss  # noqa: F401
        except ImportError:
            return "geomloss is not installed"
        if self.mode == "online":
            try:
                import pykeops  # noqa: F401
            except ImportError:
                return "pykeops is not installed"
        return None

    def prepare(self, workload, pb):
        from geomloss._legacy import sinkhorn_divergence as sd
        from geomloss._legacy import sinkhorn_samples as ss

        eps = pb.eps / 2.0  # GeomLoss' p = 2 cost is |x − y|²/2
        eps_list = [eps] * pb.iters
        a, b, y = pb.a[None], pb.b[None], pb.y[None]

        if self.mode == "online":  # GeomLoss' own online route: a KeOps reduction, 2-D clouds
            softmin = partial(ss.softmin_online,
                              log_conv=ss.lse_genred(ss.cost_formulas[2], pb.d))  # fmt: skip

        def value_of(x):
            if self.mode == "tensorized":
                softmin_ = ss.softmin_tensorized
                c_xy = _sq_dist(x, y[0].detach())[None] / 2.0
                c_yx = _sq_dist(y[0], x.detach())[None] / 2.0
            else:
                softmin_ = softmin
                c_xy, c_yx = (x, y[0].detach()), (y[0], x.detach())
            _, _, g_ab, f_ba = sd.sinkhorn_loop(softmin_, sd.log_weights(a), sd.log_weights(b),
                                                None, None, c_xy, c_yx, eps_list, None,
                                                debias=False)  # fmt: skip
            value = sd.sinkhorn_cost(eps, None, a, b, None, None, g_ab, f_ba, batch=True,
                                     debias=False)  # fmt: skip
            return 2.0 * value[0]

        return _timed(value_of, workload, pb.x)


def _plan_terms(plan, log_p, c, a, b, eps):
    """``⟨P, C⟩ + ε (Σ P log(P / a⊗b) − Σ P)`` of a block of a fixed plan (rows of a).

    ``OT_ε`` of the plan is the sum over blocks plus ε. Differentiable through ``c``
    only: the plan's envelope gradient.
    """
    with torch.no_grad():
        log_ab = torch.log(a)[:, None] + torch.log(b)[None, :]
        kl = (plan * (log_p - log_ab)).sum() - plan.sum()
    return (plan * c).sum() + eps * kl


class POT(Provider):
    """POT's log-domain Sinkhorn (``ot.sinkhorn_log``) on the full cost matrix."""

    name = "pot"
    computes = ("OT_eps = <P, C> + ε KL(P | a⊗b) of the plan of ot.sinkhorn_log (alternating "
                "updates; numItermax, stopThr = tol on its marginal error)")  # fmt: skip
    workloads = ("forward", "gradient", "converge")

    def unavailable(self, device):
        try:
            import ot  # noqa: F401
        except ImportError:
            return "POT is not installed"
        return None

    def prepare(self, workload, pb):
        import ot

        iters, stop = (100_000, pb.tol) if workload == "converge" else (pb.iters, 0.0)

        def value_of(x):
            c = _sq_dist(x, pb.y)
            with torch.no_grad():
                plan = ot.bregman.sinkhorn_log(pb.a, pb.b, c.detach(), pb.eps, numItermax=iters,
                                               stopThr=stop, warn=False)  # fmt: skip
            log_p = torch.log(plan.clamp_min(1e-38))
            return pb.eps + _plan_terms(plan, log_p, c, pb.a, pb.b, pb.eps)

        return _timed(value_of, workload, pb.x)


class POTLazy(POT):
    """POT's online Sinkhorn (``ot.bregman.empirical_sinkhorn2``, ``isLazy=True``).

    The cost in blocks of rows, never n × m at once.
    """

    name = "pot-lazy"
    computes = ("OT_eps = <P, C> + ε KL(P | a⊗b) of the plan of its log-scalings "
                "(ot.bregman.empirical_sinkhorn2, isLazy=True, alternating updates, blocks of "
                "POT_LAZY_BLOCK / m rows; POT computes its cost blocks with NumPy on the "
                "host)")  # fmt: skip

    def prepare(self, workload, pb):
        import ot

        iters, stop = (100_000, pb.tol) if workload == "converge" else (pb.iters, 0.0)
        rows = max(1, POT_LAZY_BLOCK // pb.y.shape[0])

        def value_of(x):
            with torch.no_grad():
                _, log = ot.bregman.empirical_sinkhorn2(
                    x.detach(),
                    pb.y,
                    pb.eps,
                    pb.a,
                    pb.b,
                    metric="sqeuclidean",
                    numIterMax=iters,
                    stopThr=stop,
                    isLazy=True,
                    batchSize=(rows, rows),
                    log=True,
                    warn=False,
                )
            f, g = log["u"], log["v"]  # log-scalings: P = exp(f_i + g_j − C_ij / ε)
            value = x.new_tensor(pb.eps)
            for lo in range(0, x.shape[0], rows):  # the plan's value, a block of rows at a time
                c = _sq_dist(x[lo : lo + rows], pb.y)
                with torch.no_grad():
                    log_p = f[lo : lo + rows, None] + g[None, :] - c / pb.eps
                value = value + _plan_terms(log_p.exp(), log_p, c, pb.a[lo : lo + rows], pb.b,
                                            pb.eps)  # fmt: skip
            return value

        return _timed(value_of, workload, pb.x)


class FlashSinkhorn(Provider):
    """The FlashSinkhorn paper's package (``flash-sinkhorn`` 0.4.1), its TF32 default."""

    name = "flash-sinkhorn"
    computes = ("OT_eps with its symmetric updates, TF32, cost |x−y|² (its p = 2 "
                "convention); hvp: <v, H v> from its streaming HVP "
                "(hvp_x_sqeuclid_from_potentials: CG on the dual system, tau2 = 1e-5, "
                "its defaults) at its pre-extrapolation potentials solved at the fixed ε "
                "to its threshold = 1e-4 (its own marginal criterion; at most 2000 "
                "iterations)")  # fmt: skip
    workloads = ("forward", "gradient", "hvp")

    def unavailable(self, device):
        try:
            import flash_sinkhorn  # noqa: F401
        except ImportError:
            return "flash-sinkhorn is not installed"
        return None if device.type == "cuda" else "flash-sinkhorn needs a CUDA GPU"

    def prepare(self, workload, pb):
        from flash_sinkhorn import SamplesLoss

        if workload == "hvp":
            return self._hvp(pb, direction(pb))
        loss = SamplesLoss("sinkhorn", backend="symmetric", use_epsilon_scaling=False,
                           eps=pb.eps, debias=False, potentials=False, normalize=False,
                           last_extrapolation=True, allow_tf32=True,
                           n_iters=pb.iters)  # fmt: skip

        def value_of(x):
            return loss(pb.a, x, pb.b, pb.y)

        return _timed(value_of, workload, pb.x)

    @staticmethod
    def _hvp(pb, v):
        """``<v, H v>`` through the package's own streaming HVP.

        That is the route its tests and paper use; v19–v21 timed double backward through
        its loss instead, whose first call at 10k did not finish in 200 s. Its TF32
        potentials stall above HVP_TOL, so the solve stops at PEER_HVP_TOL.
        """
        from flash_sinkhorn import geomloss_to_ott_potentials, hvp_x_sqeuclid_from_potentials
        from flash_sinkhorn.sinkhorn_solvers import sinkhorn_flashstyle_symmetric

        def hvp():
            _, _, f, g = sinkhorn_flashstyle_symmetric(
                pb.x, pb.y, pb.a, pb.b, use_epsilon_scaling=False, eps=pb.eps,
                n_iters=PEER_HVP_ITERS, threshold=PEER_HVP_TOL, allow_tf32=True,
                return_prelast=True)  # fmt: skip
            f, g = geomloss_to_ott_potentials(f, g, pb.a, pb.b, eps=pb.eps)
            hv, _ = hvp_x_sqeuclid_from_potentials(pb.x, pb.y, f, g, v, eps=pb.eps,
                                                   allow_tf32=True)  # fmt: skip
            return (v * hv).sum()

        return hvp


class OTT(Provider):
    """OTT-JAX 0.6's Sinkhorn on a ``PointCloud``: dense, or online (``batch_size``)."""

    workloads = ("forward", "gradient", "converge")
    torch_memory = False

    def __init__(self, mode: str, batch_size: int = 2048):
        self.mode, self.batch_size = mode, batch_size
        self.name = f"ott-{mode}"
        self.computes = ("OT_eps = reg_ot_cost of OTT's Sinkhorn (alternating updates from "
                         "zero, cost |x−y|², absolute ε, no final extrapolation: its "
                         "fixed-iteration value differs from flashot's by the algorithm); "
                         "fixed iterations: min = max = iters; gradient by Danskin (the "
                         "envelope); converge: threshold = tol (L1); on JAX > 0.5 the "
                         "online mode runs with a one-line shim (_ott_jax_compat)")  # fmt: skip

    def unavailable(self, device):
        try:
            import jax
            import ott  # noqa: F401
        except ImportError:
            return "ott-jax (and jax) are not installed"
        platforms = {d.platform for d in jax.devices()}
        want = "gpu" if device.type == "cuda" else "cpu"
        if want not in platforms:
            return f"jax has no {want} device here (it has {sorted(platforms)})"
        return None

    def prepare(self, workload, pb):
        import jax
        import jax.numpy as jnp
        from ott.geometry import pointcloud
        from ott.problems.linear import linear_problem
        from ott.solvers.linear import sinkhorn

        _ott_jax_compat()

        def as_jax(t):  # zero-copy where the device allows it
            try:
                return jax.dlpack.from_dlpack(t.detach().contiguous())
            except Exception:  # (another device or an old jax)
                return jnp.asarray(t.detach().cpu().numpy())

        fixed = workload != "converge"
        solver = sinkhorn.Sinkhorn(
            threshold=-1.0 if fixed else pb.tol,
            max_iterations=pb.iters if fixed else 100_000,
            min_iterations=pb.iters if fixed else 0,
            inner_iterations=1 if fixed else 10,
            implicit_diff=None, use_danskin=True,
        )  # fmt: skip
        batch = None if self.mode == "dense" else self.batch_size
        y, a, b = as_jax(pb.y), as_jax(pb.a), as_jax(pb.b)

        def cost(x):
            geom = pointcloud.PointCloud(x, y, epsilon=pb.eps, batch_size=batch)
            return solver(linear_problem.LinearProblem(geom, a, b)).reg_ot_cost

        fn = jax.jit(jax.value_and_grad(cost) if workload == "gradient" else cost)
        x = as_jax(pb.x)

        def run():
            out = fn(x)
            value = out[0] if workload == "gradient" else out
            jax.block_until_ready(out)
            return torch.tensor(float(value))

        return run


def _ott_jax_compat():
    """Give JAX back ``batching.is_vmappable`` when it lacks it (JAX > 0.5).

    OTT 0.6's batched map (its online mode) reads it. It was true only for JAX's custom
    vmappable types, never for the arrays passed here, so a constant false answer is
    what the old JAX would give.
    """
    from jax.interpreters import batching

    if not hasattr(batching, "is_vmappable"):
        batching.is_vmappable = lambda leaf: False


#: providers that A/B an option's value (the Triton backend's ``scores``): run when named
OPT_IN = ("flashot-triton-stream", "flashot-triton-cache")


def providers(device: torch.device, names=None) -> list[Provider]:
    """The providers to run; those unavailable say why when run.

    ``names``: these (of :data:`PROVIDERS`), in their order; None: every one in the
    table's order, the Triton rows on a GPU only, :data:`OPT_IN` only when named.
    """
    out: list[Provider] = [Flashot("torch"), Flashot("triton"), Flashot("triton", "tf32"),
                           Flashot("triton", "bf16"), Flashot("triton", scores="stream"),
                           Flashot("triton", scores="cache"),
                           DenseTorch(), GeomLoss("tensorized"),
                           GeomLoss("online"), POT(), POTLazy(), FlashSinkhorn(), OTT("dense"),
                           OTT("online")]  # fmt: skip
    if names is not None:
        by_name = {p.name: p for p in out}
        return [by_name[name] for name in dict.fromkeys(names)]
    return [p for p in out if p.name not in OPT_IN
            and (device.type == "cuda" or not p.name.startswith("flashot-triton"))]  # fmt: skip
