"""The Triton backend: fused streaming kernels for CUDA GPUs (and Triton's interpreter).

Each op is one file, kernel → launch → function: :mod:`._attend` (row LSEs and softmax
averages), :mod:`._plan_sums` (row and column plan sums, one exponential per score),
:mod:`._update` (both potentials' update), :mod:`._one_pass` (both LSEs in one exact
pass), :mod:`._vjp` (the reverse plan product), :mod:`._pairwise` (non-dot costs); the
fused step (:mod:`._step`) chains them. How they launch (tiles, splits, tuning) is
:mod:`._launch`, every tiling choice :mod:`._configs`, the operands' conversions
:mod:`._operands`. This class holds the options and maps the backend primitives
(:class:`~flashot.backends.base.Backend`) onto those functions.

Precision modes (``precision=``): ``"fp32"`` (default) computes score dots from
operands split once per solve into scaled float16 parts (:mod:`._split`, three half
MMAs) and value dots with 3xTF32 (both close to IEEE float32); ``"tf32"`` uses one TF32 pass;
``"bf16"``/``"fp16"`` round q and k to half precision (accumulation, potentials and
values stay float32).
"""

from __future__ import annotations

import contextlib
import math
import os

import torch

from flashot.backends.base import Backend
from flashot.backends.device import triton_interpreted
from flashot.backends.dual import Potentials
from flashot.backends.near import NEAR_FROM, is_near_uniform
from flashot.backends.plan_vjp import ALL
from flashot.backends.temperature import Temperature
from flashot.backends.triton import _configs
from flashot.backends.triton._attend import attend
from flashot.backends.triton._gate import _HI, _LO_PER_TERM, Gate
from flashot.backends.triton._one_pass import exact_lse
from flashot.backends.triton._operands import Operands
from flashot.backends.triton._plan_sums import plan_sums
from flashot.backends.triton._scores import SCORES
from flashot.backends.triton._step import GATE_LIMIT, fused_step
from flashot.backends.triton._sym_vjp import symmetric_vjp
from flashot.backends.triton._vjp import FUSED_UP_TO, fused_plan_vjp

__all__ = ["TritonBackend"]

#: CUDA graphs pay off while launches cost as much as the work: n·m up to 2^28
GRAPHS_UP_TO_LOG2 = 28


class TritonBackend(Backend):
    """Fused Triton kernels (float32 compute; float16/bfloat16/float32 inputs).

    Args:
        precision: ``"auto"``/``"fp32"``, ``"tf32"``, ``"bf16"`` or ``"fp16"``.
        fused: use the one-exp fused kernel (verified, with fallback) for symmetric
            steps, extrapolation and marginals; False runs two exact passes instead.
        autotune: tune tile shapes on first use of each launch key (a minute or so per
            key; kept in the user's tile table, :mod:`._tables`); False takes the
            shipped tables' tiles, so a first call only compiles. None (default): True
            when the environment variable ``FLASHOT_AUTOTUNE`` is ``1``.
        splits: force the number of column splits (tests); None chooses from the GPU.
        graphs: replay repeated solves of launch-bound size (n·m ≤ 2^28) as CUDA
            graphs (:mod:`flashot.solver.graphs`; to a tolerance, in blocks between checks);
            each capture keeps a copy of its inputs and its memory pool. The process
            keeps the 8 most recent; ``flashot.solver.graphs.GRAPHS.clear()`` frees them
            (a replayed schedule's second derivatives: ``flashot.autodiff.replay.
            REPLAY_GRAPHS.clear()``).
        presplit: in ``"fp32"``, split the score operands once per solve
            (:mod:`._split`; a copy of each cloud's size in half precision while a
            solve runs) instead of per tile by 3xTF32. Passes outside a solve
            (gradients, plan products, dual solves) keep 3xTF32. None (default):
            for launches with n·m·max(4d, 64) ≥ 2^34 (:data:`._operands.PRESPLIT_FROM`),
            where the split pays for its conversions, while the copies of both
            operands take at most 256 MB (:data:`._operands.PRESPLIT_MAX_BYTES`;
            beyond, 3xTF32 per tile keeps the memory at the clouds'); and up to 5
            features every score launch, solve or not, reads TF32 triples (:mod:`._triples`:
            3xTF32's three terms in one TF32 MMA of 16 features) instead.
        scores: ``"auto"`` (default), ``"stream"`` or ``"cache"``. ``"stream"``
            recomputes every score in every pass, memory O((n + m) d); ``"cache"`` forms
            each solve's n × m score matrix once, in this precision mode, and its passes
            read it (:mod:`._scores`): 4·n·m bytes while the solve runs (10 GB at n = m =
            50 000), each pass bandwidth-bound instead of recomputing d-wide dot products.
            ``"auto"`` caches from :data:`._scores.AUTO_FROM_D` features (256 in "fp32"
            and "tf32", 512 in the half modes). Either way
            a matrix is formed only while all a solve holds takes at most half the GPU's
            free memory (:data:`._scores.FREE_SHARE`; otherwise the solve streams), lives
            while the solve and its final passes run, and is freed after; a result's
            ``score_memory`` says how many bytes its solve held (0: streamed). Only solves
            use it (not packed batches, not the plan's later products, which stream); the
            p = 1 and pair costs stream. A CUDA graph of a small solve (n·m ≤ 2^28; a
            solve to a tolerance replays a graph per block between checks) forms its
            matrix inside the graph, whose memory pool keeps it while the graph is cached
            (``flashot.solver.graphs.GRAPHS.clear()`` frees them). Measured (v56, H100, 10
            symmetric iterations at ε = 0.1, d = 512, forward / with ∇x in ms, OTT-JAX
            dense in the same process): the default precision 10k 12.9 / 18.2 → 8.7 /
            13.8 (OTT 11.6 / 12.1), 50k 258 / 367 → 112 / 209 (OTT 250 / 268), cost and
            gradient as accurate as streamed (1.4e-7 and 3.1e-5 from float64 at 10k).
            Tasks bounded in memory (``flashot.tasks.otdd``, its flows) stream.
    """

    name = "triton"
    precisions = ("fp32", "tf32", "bf16", "fp16")
    capturable = True
    segmented = True

    def __init__(
        self,
        precision: str = "auto",
        fused: bool = True,
        autotune: bool | None = None,
        splits: int | None = None,
        graphs: bool = True,
        presplit: bool | None = None,
        scores: str = "auto",
    ):
        super().__init__(precision)
        if scores not in SCORES:
            raise ValueError(f"scores must be one of {SCORES}, got {scores!r}")
        if autotune is None:
            opted = os.environ.get("FLASHOT_AUTOTUNE", "0").strip().lower()
            autotune = opted in ("1", "true", "yes")
        flags = (("fused", fused), ("autotune", autotune), ("graphs", graphs))
        for name, flag in flags:
            if not isinstance(flag, bool):
                raise TypeError(f"{name} must be True or False, got {flag!r}")
        if splits is not None and (isinstance(splits, bool) or not isinstance(splits, int)
                                   or splits < 1):  # fmt: skip
            raise ValueError(f"splits must be None or an integer ≥ 1, got {splits!r}")
        self.fused, self.autotune, self.splits, self.graphs = fused, autotune, splits, graphs
        #: the score operands' conversions and MMA precisions (:mod:`._operands`)
        self.operands = Operands(self.precision, None, scores)
        self.presplit = presplit  # (checked by the setter)

    @property
    def presplit(self) -> bool | None:
        """The ``presplit`` option (see the class)."""
        return self.operands.presplit

    @presplit.setter
    def presplit(self, value: bool | None) -> None:
        if value is not None and not isinstance(value, bool):
            raise TypeError(f"presplit must be None, True or False, got {value!r}")
        self.operands.presplit = value
        self.operands.cache = []  # (copies made under the old rule)

    def __setattr__(self, name: str, value) -> None:
        # the operands read the precision mode: one value for both, whenever it is set
        if name == "precision" and value not in self.precisions:
            raise ValueError(f"precision must be one of {self.precisions}, got {value!r}")
        super().__setattr__(name, value)
        if name == "precision" and "operands" in self.__dict__:
            self.operands.precision = value
            self.operands.cache = []

    def operand_scope(self, carry: list | None = None) -> contextlib.AbstractContextManager:
        """See :meth:`flashot.backends.base.Backend.operand_scope`.

        Split operands are made and shared within (:meth:`._operands.Operands.scope`).
        """
        return self.operands.scope(carry)

    def take_score_memory(self) -> int:
        """See :meth:`flashot.backends.base.Backend.take_score_memory`."""
        return self.operands.take_held()

    def replayed(self, form) -> None:
        """See :meth:`flashot.backends.base.Backend.replayed`."""
        self.operands.replayed(form.q, form.k)

    # ---- primitives ----------------------------------------------------------------
    def _row_attend(self, form, h, eps, v=None):
        """See :meth:`flashot.backends.base.Backend._row_attend`."""
        return attend(self, form.q, form.k, eps, (h.to(torch.float32).contiguous(),), v,
                      segments=form.segments)  # fmt: skip

    def plan_sums(self, pot, gate=None, limit=GATE_LIMIT, span=False, shift=0.0, mul=None,
                  ratio=False):  # fmt: skip
        r"""Weighted row and column sums of ``E_ij = exp((f_i + g_j − C_ij)/ε)``.

        .. math::

            R_i = 2^s \sum_j b_j E_{ij}, \qquad C_j = 2^s \sum_i a_i E_{ij},

        one exponential per element (``a_i b_j E_ij`` is the plan ``P_ij``; ``s`` the
        ``shift``). A sum is exact when it lies in :meth:`valid_range`; outside it,
        terms may have over- or underflowed.

        Args:
            pot: the problem at potentials (f, g) (:class:`~flashot.backends.dual.Potentials`).
            gate: optional ``(gate_in, gate_out)`` 2-element float32 tensors: skip the
                pass (sums stay 0) when the bound ``gate_in`` gives exceeds ``limit``,
                and zero ``gate_out``. ``gate_in`` holds the largest ``ln R`` and
                ``−ln R`` (rows and columns, from 0) of the last step.
            limit: the gate's threshold, in nats.
            span: the bound is half the sum of ``gate_in`` (else its larger entry).
            shift: ``s``, in base 2.
            mul: optional ``(u (n,), w (m,))``: weights ``a ⊙ u`` and ``b ⊙ w`` instead
                (then ``a ⊙ R = P w`` and ``b ⊙ C = Pᵀ u``).
            ratio: ``limit`` is scaled on the device by ``eps``'s ratio to the schedule's
                previous temperature (a :class:`~flashot.backends.temperature.Temperature`).

        Returns:
            ``(R (n,), C (m,))``; with ``mul``, ``(R, C, R₀, C₀)`` with ``R₀``, ``C₀`` the
            sums without it.
        """
        return plan_sums(self, pot, gate, limit, span, shift, mul, ratio)

    @staticmethod
    def valid_range(size: int, max_weight: float = 1.0) -> tuple[float, float]:
        """``(lo, hi)`` within which a plan sum ``Σ_j w_j E_ij`` of ``size`` terms is exact.

        Its largest term is at least ``sum/size``; with ``sum > size·max(1, w)·2^-100``
        (``w`` the largest weight) every term that matters (within 2^-24 of it) is a
        normal float, and terms lost to underflow (``E < 2^-126``) add less than
        ``sum·2^-26``; ``hi`` leaves room below overflow. With a shift ``s`` the sums
        are exact for ``ln R`` in ``(ln lo − s ln 2, ln hi − s ln 2)``.
        """
        return size * max(1.0, max_weight) * _LO_PER_TERM, _HI

    def reads_temperatures(self, form):
        """:meth:`~flashot.backends.base.Backend.reads_temperatures`: one problem, no capture.

        (Inside a caller's CUDA graph capture the table's copy could not run.)
        """
        capturing = form.q.is_cuda and torch.cuda.is_current_stream_capturing()
        return form.segments is None and not capturing

    def reads_vjp_temperatures(self, form):
        """See :meth:`~flashot.backends.base.Backend.reads_vjp_temperatures`.

        Within the fused reverse product's features (its tiled fallback takes ε as a
        Python scalar).
        """
        return self.reads_temperatures(form) and form.q.shape[1] <= FUSED_UP_TO

    def graph_key(self, form):
        """See :meth:`flashot.backends.base.Backend.graph_key`: small problems on CUDA."""
        n, m = form.shape
        small = n * m <= 2**GRAPHS_UP_TO_LOG2 and (n + m) * form.q.shape[1] <= 2**24
        if not (self.graphs and small and form.q.is_cuda and not triton_interpreted()):
            return None
        if form.segments is not None or torch.cuda.is_current_stream_capturing():
            return None  # (a packed batch; inside the caller's own graph)
        return self.launch_key()

    def launch_key(self):
        """See :meth:`flashot.backends.base.Backend.launch_key`."""
        splits = self.operands.splits()
        return (*super().launch_key(), self.fused, self.autotune, self.splits, splits,
                self.operands.scores)  # fmt: skip

    def fast_state(self, device):
        """See :meth:`flashot.backends.base.Backend.fast_state`: the residual gate."""
        return Gate(device) if self.fused else None

    def jacobi_step(self, pot, lam, rho, *, check=False, state=None):
        """See :meth:`flashot.backends.base.Backend.jacobi_step`.

        The fast path shares one score tile and one exponential per element between the
        row and column updates, and rows or columns where it is out of range are redone
        exactly (online max) in the same step; without ``state`` (or ``fused=False``)
        every row takes the exact path. Either way the update and the marginal error are
        one more small launch, and nothing waits for the host.
        """
        if _near(pot.form, pot.eps):  # ε above the cost's range: the exact near path
            return super().jacobi_step(pot, lam, rho, check=check)
        # a replayed schedule's damping is read from its row (the update scales ½ by it)
        damped = isinstance(pot.eps, Temperature) and rho != (None, None)
        w_new = (0.5, 0.5) if damped else (0.5 * lam[0], 0.5 * lam[1])
        return fused_step(self, pot, (0.5, 0.5), w_new, rho=rho, check=check, state=state,
                          damped=damped)  # fmt: skip

    def potential_lse(self, pot, stabilized=False):
        """See :meth:`flashot.backends.base.Backend.potential_lse`.

        ``stabilized`` from :data:`._configs.STABILIZED_LSE_FROM` score elements: the
        undamped :meth:`extrapolate` (a fused step's sums, one exponential a score for
        both sides, rows outside the sums' exact window recomputed), ``LSE = α − T``.
        Otherwise in "fp32" both LSEs come from one pass over the score tiles (two exps a
        score, :func:`._one_pass.exact_lse`) where its partials fit their budget
        (:data:`._configs.ONE_PASS_LSE`); else, and for near-uniform forms, two row passes.
        """
        form, start = pot.form, _configs.STABILIZED_LSE_FROM
        big = start is not None and form.q.shape[0] * form.k.shape[0] >= start
        if stabilized and big and self.fused and not _near(form, pot.eps):
            t_x, t_y = self.extrapolate(pot, (1.0, 1.0))
            return form.alpha - t_x, form.beta - t_y
        if _configs.ONE_PASS_LSE and self.precision == "fp32" and not _near(pot.form, pot.eps):
            both = exact_lse(self, pot)
            if both is not None:
                return both
        return super().potential_lse(pot)

    def extrapolate(self, pot, lam):
        """See :meth:`flashot.backends.base.Backend.extrapolate` (fused where valid)."""
        if _near(pot.form, pot.eps):
            return super().extrapolate(pot, lam)
        return fused_step(self, pot, (0.0, 0.0), lam)[:2]

    def plan_matvec(self, pot, r, c, w=None, u=None):
        """See :meth:`flashot.backends.base.Backend.plan_matvec`: one fused pass.

        The rows are first moved to their fixed point, ``f̃ = f − ε ln(r/a)`` with row
        weights r (the plan is unchanged), so that every term lies well inside float32's
        range (``E_ij ≤ 1/b_j``) and no max needs tracking; the pass also sums the plain
        weights, whose ratios give the averages.
        """
        if _generic(pot.form, pot.eps):
            return super().plan_matvec(pot, r, c, w, u)
        f, eps = pot.f, pot.eps
        # row weights r with f̃ keep r_i E'_ij = a_i E_ij for the columns; rows without
        # mass add nothing (and must not overflow into 0 · inf)
        log_r = torch.log(r)
        f_fixed = torch.where(r > 0, f - eps * (log_r - pot.log_a), -math.inf)
        mul_a = torch.zeros_like(r) if u is None else u.to(torch.float32)
        mul_b = torch.zeros_like(c) if w is None else w.to(torch.float32)
        fixed = Potentials(pot.form, f_fixed, pot.g, log_r, pot.log_b, eps)
        rows, cols, rows_den, cols_den = self.plan_sums(fixed, mul=(mul_a, mul_b))
        pw = None if w is None else torch.where(r > 0, r * rows / rows_den, 0.0)
        ptu = None if u is None else torch.where(c > 0, c * cols / cols_den, 0.0)
        return pw, ptu

    def plan_vjp(self, form, f, g, a, b, eps, v, d, need=ALL, d0=None):
        """:meth:`~flashot.backends.base.Backend.plan_vjp`, fused (:mod:`._vjp`) for d, p ≤ 128."""
        if _generic(form, eps) or max(form.q.shape[1], v.shape[1]) > FUSED_UP_TO:
            return super().plan_vjp(form, f, g, a, b, eps, v, d, need, d0)
        return fused_plan_vjp(self, form, f, g, a, b, eps, v, d, need, d0)

    def symmetric_vjp(self, form, f, g, r_f, r_g, log_a, log_b, u_f, u_g, eps,
                      column_sums=True):  # fmt: skip
        """See :meth:`~flashot.backends.base.Backend.symmetric_vjp`.

        One launch (:mod:`._sym_vjp`) with :data:`._configs.SYM_VJP` on, up to
        :data:`._configs.SYM_VJP_UP_TO` features, not packed, not near-uniform; else None.
        """
        if not _fuses_vjp(form, eps):
            return None
        return symmetric_vjp(self, form, f, g, r_f, r_g, log_a, log_b, u_f, u_g, eps,
                             column_sums=column_sums)  # fmt: skip

    def mirror_vjp(self, form, h, r, log_w, u, eps):
        """See :meth:`~flashot.backends.base.Backend.mirror_vjp`.

        :mod:`._sym_vjp`'s launch where :meth:`symmetric_vjp` takes the form: side 0 the
        transform, side 1 its transposed rows (values q, no column atomics); else None.
        """
        if form.q.shape != form.k.shape or not _fuses_vjp(form, eps):
            return None
        own = h - form.beta + form.alpha  # (side 1's bias (own − α) is the transform's h − β)
        row_k, _, col_q, col = symmetric_vjp(self, form, own, h, r, r, log_w, log_w, u, u, eps,
                                             values=form.q, column_sums=False)  # fmt: skip
        return row_k, col_q, col

    def marginals(self, pot):
        """See :meth:`flashot.backends.base.Backend.marginals` (fused where valid)."""
        if _near(pot.form, pot.eps):
            return super().marginals(pot)
        ln_r, ln_c, _ = fused_step(self, pot, (0.0, 0.0), (0.0, 0.0), log_sums=True)
        return torch.exp(pot.log_a + ln_r), torch.exp(pot.log_b + ln_c)


def _fuses_vjp(form, eps: float) -> bool:
    """Whether :mod:`._sym_vjp` takes a form's reverse products (on, narrow, not generic)."""
    narrow = form.q.shape[1] <= _configs.SYM_VJP_UP_TO
    return _configs.SYM_VJP and narrow and not _generic(form, eps)


def _near(form, eps: float) -> bool:
    """Whether the near-uniform LSE serves ``form`` (for a packed form: any of its problems)."""
    if form.segments is not None:
        return form.segments.near(eps, NEAR_FROM)
    return is_near_uniform(form, eps)


def _generic(form, eps: float) -> bool:
    """Whether a plan product takes the base class's path.

    That is near-uniform forms, and packed ones (:mod:`flashot.geometry.segments`), whose
    products run one problem at a time.
    """
    return form.segments is not None or is_near_uniform(form, eps)
