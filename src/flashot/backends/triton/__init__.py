"""The Triton backend: fused streaming kernels for CUDA GPUs (and Triton's interpreter).

Launch layer of the four (kernel → launch → autograd Function → public function):
allocation, grids, strides, precision and tiling choices. The kernels live in
``_kernels.py``, every tiling choice in ``_configs.py``.

Precision modes (``precision=``): ``"fp32"`` (default) computes score dots from
operands split once per solve into scaled float16 parts (:mod:`._split`, three half
MMAs) and value dots with 3xTF32 (both close to IEEE float32); ``"tf32"`` uses one TF32 pass;
``"bf16"``/``"fp16"`` round q and k to half precision (accumulation, potentials and
values stay float32).
"""

from __future__ import annotations

import math
import os

import torch
import triton

from flashot.backends.base import Backend
from flashot.backends.device import on_device, triton_interpreted
from flashot.backends.dual import Potentials, log_residual
from flashot.backends.near import NEAR_FROM, is_near_uniform
from flashot.backends.plan_vjp import ALL
from flashot.backends.temperature import LOG2E, Temperature, device_value, follows
from flashot.backends.triton import _configs
from flashot.backends.triton._combine import _combine_kernel
from flashot.backends.triton._gate import _HI, _LO_PER_TERM, Gate, sum_ranges
from flashot.backends.triton._kernels import _attend_kernel, _plan_sums_kernel, _update_kernel
from flashot.backends.triton._launch import _ATTEND, _PLAN_SUMS, TunedLaunches, temp_args
from flashot.backends.triton._one_pass import exact_lse
from flashot.backends.triton._operands import OperandCache, split_work
from flashot.backends.triton._vjp import FUSED_UP_TO, fused_plan_vjp

__all__ = ["TritonBackend"]

# tl.dot input precisions per mode (float32 operands); the interpreter knows only IEEE
_DOT = {"fp32": "tf32x3", "tf32": "tf32", "bf16": "tf32", "fp16": "tf32"}
#: the tile tables' name for the split score operands' dot (:mod:`._split`)
SPLIT_DOT = "split16"
#: floats of a value pass's per-split partial sums (64 MB): more splits than that fits
#: are not made (splits only balance the waves of programs: at most ~1.5× on one kernel)
VALUE_PARTIALS = 1 << 24
#: (rows, value columns) per program of the split merge: bounded, since its compile
#: time grows with the tile (Triton 3.6, sm_90: 0.7 s at 128 × 64, 72 s at 128 × 1024)
COMBINE_TILE = (64, 64)

#: relaxed problems skip the fused pass when the last step's largest |ln R| (nats)
#: exceeded this: the sums would mostly fall outside their window and need repair anyway
GATE_LIMIT = 100.0
#: the fused sums of a step carry a factor 2^SUM_SHIFT: their window of exact residuals
#: ln R is then about ±70 nats around 0 for n up to 10^6 (unshifted: −58…+83 at 50k)
SUM_SHIFT = 18.0
#: after the first (exact) step the span bound is loose (the initial residuals are all
#: large): the second step estimates its residual range from PROBE_ROWS strided rows and
#: as many columns, times PROBE_MARGIN, on clouds of at least PROBE_FROM points each
PROBE_ROWS, PROBE_MARGIN, PROBE_FROM = 256, 1.1, 4096
#: CUDA graphs pay off while launches cost as much as the work: n·m up to 2^28
GRAPHS_UP_TO_LOG2 = 28
#: from this feature width (None: never), in "fp32" with ``fused``, a Jacobi step streams
#: its score tiles once with two exps each and no window (:mod:`._one_pass`) instead of the
#: one-exp fused pass, whose gate sends a small-ε solve's first steps to two exact passes
#: (H200, 50k, ε = 0.1: d = 512 340 → 272 ms, d = 256 179 → 162, d = 128 69 → 116; NOTES.md)
ONE_PASS_FROM_D: int | None = 256


class TritonBackend(TunedLaunches, OperandCache, Backend):
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
            where the split pays for its conversions; and up to 5 features every score
            launch, solve or not, reads TF32 triples (:mod:`._triples`:
            3xTF32's three terms in one TF32 MMA of 16 features) instead.
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
    ):
        super().__init__(precision)
        if autotune is None:
            opted = os.environ.get("FLASHOT_AUTOTUNE", "0").strip().lower()
            autotune = opted in ("1", "true", "yes")
        flags = (("fused", fused), ("autotune", autotune), ("graphs", graphs))
        if presplit is not None and not isinstance(presplit, bool):
            raise TypeError(f"presplit must be None, True or False, got {presplit!r}")
        for name, flag in flags:
            if not isinstance(flag, bool):
                raise TypeError(f"{name} must be True or False, got {flag!r}")
        if splits is not None and (isinstance(splits, bool) or not isinstance(splits, int)
                                   or splits < 1):  # fmt: skip
            raise ValueError(f"splits must be None or an integer ≥ 1, got {splits!r}")
        self.fused, self.autotune, self.splits, self.graphs = fused, autotune, splits, graphs
        self.presplit = presplit
        self._halves: list = []
        self._scopes = 0

    # ---- helpers -------------------------------------------------------------------
    def _dot(self, triples: bool = False) -> str:
        """The score MMAs' ``input_precision`` (``triples``: one TF32 product of triples)."""
        if triton_interpreted():
            return "ieee"
        return "tf32" if triples else _DOT[self.precision]

    def _kernel_dot(self, dot: str) -> str:
        """The kernels' ``PRECISION`` for a tile key's dot (split parts do not read it)."""
        return self._dot() if dot == SPLIT_DOT else dot

    def _attend(self, q, k, eps, bias, v=None, repair=None, keep_q=True, segments=None):
        """Row LSE and softmax average; ``bias`` is ``(h,)`` or ``(g, β, log b)``.

        ``repair=(sums, lo, hi)`` computes only the row blocks holding a sum outside
        ``(lo[0], hi)`` (``lo`` a 1-element tensor; other rows' outputs are then
        meaningless). ``keep_q``: cache q's half copy (False for a one-off sample).
        ``segments``: a packed batch (:mod:`flashot.geometry.segments`); the grid then runs over
        its table of row blocks, each streaming its own problem's columns, split as one
        problem's are (the widest problem's columns set the splits; a narrower problem's
        programs past its columns stream nothing).
        """
        elements = q.shape[0] * k.shape[0] if segments is None else segments.elements
        features = q.shape[1]  # (the tile key's: triples take a d = 3 TF32 launch's tiles)
        work = split_work(elements, features)
        q, k, split_args, presplit, triples = self.score_pair(q, k, keep_q, work)
        n, m, d = q.shape[0], k.shape[0], q.shape[1]
        dev = q.device
        potential = len(bias) == 3
        h, beta, log_w = bias if potential else (bias[0], bias[0], bias[0])
        bd, chunks = _configs.block_d(d, q.element_size())
        has_v = v is not None
        p = v.shape[1] if has_v else 1
        bp = _configs.block_p(p)
        vv = v.to(torch.float32) if has_v else h
        # values split like the score operands when those are (a solve's scope)
        v_split = presplit and has_v
        if v_split:
            vs = self._operand(vv.contiguous())
            vv, v_args = vs.parts[0], (vs.inv, vs.parts.stride(0))
        else:
            v_args = (h, 0)
        lse = torch.empty(n, device=dev, dtype=torch.float32)
        out = torch.empty(n, p, device=dev, dtype=torch.float32) if has_v else lse
        p_loop = _configs.value_loop(p) if has_v else 1
        p_chunks = triton.cdiv(p, bp * p_loop) if has_v else 1  # (programs on grid axis 2)
        nb, mb = _configs.bucket(n), _configs.bucket(m)
        block_m = 0  # (a packed batch's table: set once its tiles are known)
        if segments is not None:  # tiles for the batch's largest problem
            nb, mb = _configs.largest_bucket(segments.rows), _configs.largest_bucket(segments.cols)

        def build(splits, per, probe=False):
            """Grid, arguments and constexprs; partials allocated unless ``probe``."""
            split = splits > 1
            part_max = part_sum = part_acc = lse
            if split and not probe:
                part_max = torch.empty(splits, n, device=dev, dtype=torch.float32)
                part_sum = torch.empty_like(part_max)
                if has_v:
                    part_acc = torch.empty(splits, n, p, device=dev, dtype=torch.float32)

            def grid(meta):
                if segments is not None:
                    return (len(segments.blocks(meta["BLOCK_M"], dev)), splits, p_chunks)
                return (triton.cdiv(n, meta["BLOCK_M"]), splits, p_chunks)

            table = lse if segments is None else segments.blocks(block_m, dev)
            args = (q, k, h, beta, log_w, vv, lse, out, part_max, part_sum, part_acc, table,
                    h if repair is None else repair[0], n, m, d, p, LOG2E / eps, eps,
                    *temp_args(eps, lse), h if repair is None else repair[1],
                    0.0 if repair is None else repair[2],
                    per, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
                    vv.stride(0) if has_v else 0, vv.stride(1) if has_v else 0,
                    out.stride(0) if has_v else 0, out.stride(1) if has_v else 0,
                    nb, mb, *split_args, *v_args)  # fmt: skip
            consts = dict(BLOCK_D=bd, BLOCK_P=bp, D_CHUNKS=chunks, HAS_V=has_v, SPLIT=split,
                          POTENTIAL_BIAS=potential, REPAIR=repair is not None,
                          PRECISION=self._kernel_dot(dot), V_PRECISION=self._dot(),
                          PRESPLIT=presplit, V_SPLIT=v_split,
                          SEGMENTED=segments is not None, P_LOOP=p_loop)  # fmt: skip
            return grid, args, consts

        # tuned apart: forming the bias in the kernel adds loads (16 % slower in tf32 at 50k)
        dot = SPLIT_DOT if presplit else self._dot(triples)
        key = ("attend", features, p, nb, mb, has_v, dot, q.dtype, potential)
        # value partials hold splits·n·p floats: at most VALUE_PARTIALS of them, so that
        # wide values at large n take no split (a flow's 60k × 794 barycenters would
        # hold two more copies of the output); narrow ones (a CG's matvec) split freely
        most = max(1, VALUE_PARTIALS // (n * p)) if has_v else None

        def plan_for(tiles):
            return build(*self._split(_attend_kernel, key, tiles, build, n, m, dev, most))

        if segments is not None:  # one launch over the table of blocks

            def packed(tiles):  # the table of row blocks follows the tiles
                nonlocal block_m
                block_m = tiles.kwargs["BLOCK_M"]
                units = len(segments.blocks(block_m, dev)) * block_m
                return build(*self._split(_attend_kernel, key, tiles, build, units,
                                          segments.widest_cols, dev, most))  # fmt: skip

            cfg = self._table_tiles(key, nb, mb, dev)
            plan = self._run_fitting(_attend_kernel, key, cfg, packed, dev)
        else:
            cfg = self._tiles(key, nb + mb, dev)
            full = {"REPAIR": False}
            plan = self._launch(_ATTEND, _attend_kernel, key, cfg, plan_for, dev, full)
        if plan[2]["SPLIT"]:
            part_max, part_sum, part_acc = plan[1][8:11]
            splits = part_max.shape[0]
            blk, bpc = COMBINE_TILE if has_v else (128, 1)
            bpc = min(bpc, triton.next_power_of_2(p))
            with on_device(dev):
                _combine_kernel[(triton.cdiv(n, blk), triton.cdiv(p, bpc))](
                    part_max, part_sum, part_acc, lse, out, n, p, splits, eps,
                    *temp_args(eps, lse), out.stride(0) if has_v else 0,
                    out.stride(1) if has_v else 0,
                    BLOCK=blk, BLOCK_P=bpc, HAS_V=has_v,
                )  # fmt: skip
        return lse, (out if has_v else None)

    # ---- primitives ----------------------------------------------------------------
    def _row_attend(self, form, h, eps, v=None):
        """See :meth:`flashot.backends.base.Backend._row_attend`."""
        return self._attend(form.q, form.k, eps, (h.to(torch.float32).contiguous(),), v,
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
        form, f, g, log_a, log_b, eps = pot.parts()
        q, k, split_args, presplit, nb, mb, key = self._sums_operands(form)
        n, m, d = q.shape[0], k.shape[0], q.shape[1]
        dev = q.device
        bd, chunks = _configs.block_d(d, q.element_size())
        sums = torch.zeros((2 if mul is not None else 1) * (n + m), device=dev,
                           dtype=torch.float32)  # fmt: skip
        r, c, r_den, c_den = sums[:n], sums[n : n + m], sums[n + m : 2 * n + m], sums[2 * n + m :]
        gate_in, gate_out = gate if gate is not None else (sums, sums)
        seg = None if form.segments is None else form.segments.T  # column blocks' table
        block_n = 0  # (set once a packed batch's tiles are known)

        def build(splits, per, probe=False):
            """Grid, arguments and constexprs of a launch with ``splits`` row splits."""

            def grid(meta):
                if seg is not None:
                    return (len(seg.blocks(meta["BLOCK_N"], dev)), splits)
                return (triton.cdiv(m, meta["BLOCK_N"]), splits)

            table = sums if seg is None else seg.blocks(block_n, dev)
            args = (q, k, f, form.alpha, g, form.beta, log_a, log_b, r, c, gate_in, gate_out,
                    *(mul or (sums, sums)), r_den if mul else sums, c_den if mul else sums, table,
                    n, m, d, LOG2E / eps, shift, limit, int(span),
                    *temp_args(eps, sums, ratio), per,
                    q.stride(0), q.stride(1), k.stride(0), k.stride(1), nb, mb,
                    *split_args, sums, sums, sums)  # fmt: skip
            consts = dict(BLOCK_D=bd, D_CHUNKS=chunks, GATED=gate is not None,
                          MULTIPLY=mul is not None, PRECISION=self._kernel_dot(key[4]),
                          PRESPLIT=presplit, SEGMENTED=seg is not None)  # fmt: skip
            return grid, args, consts

        def plan_for(tiles):
            return build(*self._split(_plan_sums_kernel, key, tiles, build, m, n, dev))

        def reset():  # after tuning launches: they accumulated, ungated
            sums.zero_()
            if gate is not None:
                gate_out.zero_()

        if seg is not None:  # one launch over the table of blocks, rows split as above

            def packed(tiles):  # the table of column blocks follows the tiles
                nonlocal block_n
                block_n = tiles.kwargs["BLOCK_N"]
                units = len(seg.blocks(block_n, dev)) * block_n
                return build(*self._split(_plan_sums_kernel, key, tiles, build, units,
                                          seg.widest_cols, dev))  # fmt: skip

            cfg = self._table_tiles(key, nb, mb, dev)
            self._run_fitting(_plan_sums_kernel, key, cfg, packed, dev)
        else:
            cfg = self._tiles(key, nb + mb, dev)
            self._launch(_PLAN_SUMS, _plan_sums_kernel, key, cfg, plan_for, dev,
                         {"GATED": False}, reset)  # fmt: skip
        return (r, c) if mul is None else (r, c, r_den, c_den)

    def _sums_operands(self, form):
        """The score operands (:meth:`score_pair`), size buckets and tile key of plan sums."""
        seg = form.segments
        elements = form.q.shape[0] * form.k.shape[0] if seg is None else seg.elements
        work = split_work(elements, form.q.shape[1])
        q, k, split_args, presplit, triples = self.score_pair(form.q, form.k, work=work)
        if seg is None:
            nb, mb = _configs.bucket(q.shape[0]), _configs.bucket(k.shape[0])
        else:
            nb, mb = _configs.largest_bucket(seg.rows), _configs.largest_bucket(seg.cols)
        dot = SPLIT_DOT if presplit else self._dot(triples)
        key = ("plan_sums", form.q.shape[1], nb, mb, dot, q.dtype)
        return q, k, split_args, presplit, nb, mb, key

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
        return (*super().launch_key(), self.fused, self.autotune, self.splits, self._splits())

    def fast_state(self, device):
        """See :meth:`flashot.backends.base.Backend.fast_state`: the residual gate."""
        return Gate(device) if self.fused else None

    def _step(self, pot, w_old, w_new, *, rho=(None, None), check=False, state=None,
              log_sums=False, damped=False):  # fmt: skip
        """Fused sums (when allowed), exact repair where needed, then both updates.

        The gate: a balanced averaged step ``f' = f − ½ε ln R``, ``g' = g − ½ε ln C``
        gives ``ln R'_i = ½ ln R_i + ln Σ_j π_ij C_j^{−1/2}`` (``π`` the row-normalized
        plan), so every residual of the new potentials lies within half the span of the
        old ones: a bound with no lag, checked against the sums' window. After the
        initialization that bound is loose, so a solve's second step takes a sampled
        estimate instead (:meth:`_probe`, on clouds of :data:`PROBE_FROM` points or
        more). Relaxed steps compare the last residual itself with :data:`GATE_LIMIT`.
        In "fp32" from :data:`ONE_PASS_FROM_D` features a step is one exact pass instead
        (:mod:`._one_pass`), with no gate, when its partials fit their budget.
        """
        form, f, g, log_a, log_b, eps = pot.parts()
        n, m = f.shape[0], g.shape[0]
        dev = f.device
        bias_r, bias_c = (g, form.beta, log_b), (f, form.alpha, log_a)
        gate = None if state is None else state.swap()
        wide = self.fused and self.precision == "fp32" and ONE_PASS_FROM_D is not None
        wide = wide and form.q.shape[1] >= ONE_PASS_FROM_D
        both = exact_lse(self, pot) if wide else None
        if both is not None:
            if state is not None:  # the update records this step's residual range
                gate[1].zero_()
                state.eps, state.steps = eps, state.steps + 1
            return self._update(pot, w_old, w_new, rho, check, state, log_sums, gate, *both,
                                damped=damped)  # fmt: skip
        span = rho == (None, None) and w_old == w_new == (0.5, 0.5)
        ratio = False
        limit = _window(n, m) if span else GATE_LIMIT
        probe = span and self.fused and state is not None and state.steps == 1
        probe = probe and min(n, m) >= PROBE_FROM
        if probe:  # an estimate at this ε replaces the bound
            self._probe(pot, gate[0])
        elif state is not None:  # |ln R| scales as 1/ε: after an ε-scaling step, predict it
            ratio = follows(eps, state.eps)
            if not ratio:  # (else on the device: a replayed schedule's ratio)
                limit *= min(1.0, eps / (state.eps or eps))
        if state is not None:
            state.eps, state.steps = eps, state.steps + 1
        if self.fused:
            r, c = self.plan_sums(pot, gate, limit, span and not probe, SUM_SHIFT, ratio=ratio)
        else:
            r, c = torch.zeros(n, device=dev), torch.zeros(m, device=dev)
        lo, hi = sum_ranges(log_a, log_b, state)
        seg = form.segments
        lse_r = self._attend(form.q, form.k, eps, bias_r, repair=(r, lo[0:1], hi),
                             segments=seg)[0]  # fmt: skip
        lse_c = self._attend(form.k, form.q, eps, bias_c, repair=(c, lo[1:2], hi),
                             segments=None if seg is None else seg.T)[0]  # fmt: skip
        return self._update(pot, w_old, w_new, rho, check, state, log_sums, gate, lse_r, lse_c,
                            (r, c, lo, hi), damped)  # fmt: skip

    def _update(self, pot, w_old, w_new, rho, check, state, log_sums, gate, lse_r, lse_c,
                sums=None, damped=False):  # fmt: skip
        """The update launch of :meth:`_step`: fused sums where valid, else the LSEs.

        ``sums=(r, c, lo, hi)``; None: the LSEs hold every row and column. ``damped``:
        ``w_new`` is scaled by the damping of ``eps``'s device row.
        """
        form, f, g, log_a, log_b, eps = pot.parts()
        n, m, dev = f.shape[0], g.shape[0], f.device
        if sums is None:  # no sum is in range: every entry takes its LSE
            lo, hi = sum_ranges(log_a, log_b, state)
            r, c = torch.zeros(n, device=dev), torch.zeros(m, device=dev)
        else:
            r, c, lo, hi = sums
        f_out, g_out = torch.empty_like(f), torch.empty_like(g)
        err = torch.zeros(1, device=dev, dtype=torch.float32) if check else f_out
        blk = 1024
        with on_device(dev):
            _update_kernel[(triton.cdiv(n, blk) + triton.cdiv(m, blk),)](
                f, r, lse_r, form.alpha, log_a, f_out, g, c, lse_c, form.beta, log_b, g_out, err,
                f_out if gate is None else gate[1], n, m, eps,
                *temp_args(eps, f_out, damped=damped), SUM_SHIFT, lo, hi, w_old[0], w_new[0],
                w_old[1], w_new[1],
                0.0 if rho[0] is None else 1.0 / rho[0],
                0.0 if rho[1] is None else 1.0 / rho[1],
                BLOCK=blk,
                RELAXED_X=rho[0] is not None,
                RELAXED_Y=rho[1] is not None,
                CHECK=check,
                GATED=gate is not None,
                LOG_SUMS=log_sums,
            )  # fmt: skip
        return f_out, g_out, (err[0] if check else None)

    def _probe(self, pot, slot):
        """Write an estimate of this step's largest ``ln R`` and ``−ln R`` into ``slot``.

        The exact residuals of :data:`PROBE_ROWS` strided rows and as many columns
        (of a packed batch: every problem's first row and each step-th after it),
        times :data:`PROBE_MARGIN`: a sample, not a bound. Where it is wrong the fused
        pass's out-of-range sums are repaired exactly, at the cost of that pass.
        """
        form, f, g, log_a, log_b, eps = pot.parts()
        logs = []
        seg = form.segments
        for q, k, p, offset, bias, sides in (
            (form.q, form.k, f, form.alpha, (g, form.beta, log_b), seg),
            (form.k, form.q, g, form.beta, (f, form.alpha, log_a), None if seg is None else seg.T),
        ):
            step = max(1, len(p) // PROBE_ROWS)
            pick, sub = slice(None, None, step), None
            if sides is not None:  # a packed batch: each problem's rows, its own columns
                pick, sub = sides.sample_rows(step, p.device)
            lse = self._attend(q[pick], k, eps, bias, keep_q=False, segments=sub)[0]
            logs.append(log_residual(p[pick], lse, offset[pick], device_value(eps)))
        ln = torch.cat(logs)
        slot.copy_(torch.stack([ln.max(), -ln.min()]).clamp_min(0.0) * PROBE_MARGIN)

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
        return self._step(pot, (0.5, 0.5), w_new, rho=rho, check=check, state=state,
                          damped=damped)  # fmt: skip

    def extrapolate(self, pot, lam):
        """See :meth:`flashot.backends.base.Backend.extrapolate` (fused where valid)."""
        if _near(pot.form, pot.eps):
            return super().extrapolate(pot, lam)
        return self._step(pot, (0.0, 0.0), lam)[:2]

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

    def marginals(self, pot):
        """See :meth:`flashot.backends.base.Backend.marginals` (fused where valid)."""
        if _near(pot.form, pot.eps):
            return super().marginals(pot)
        ln_r, ln_c, _ = self._step(pot, (0.0, 0.0), (0.0, 0.0), log_sums=True)
        return torch.exp(pot.log_a + ln_r), torch.exp(pot.log_b + ln_c)


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


def _window(n: int, m: int) -> float:
    """Half-width (nats) of the residuals ``|ln R|`` that balanced fused sums hold exactly.

    :meth:`TritonBackend.valid_range` with weights ≤ 1 and the :data:`SUM_SHIFT`, less
    one nat of rounding slack.
    """
    shift = SUM_SHIFT * math.log(2.0)
    low = -math.log(_LO_PER_TERM * max(n, m)) + shift
    return min(low, math.log(_HI) - shift) - 1.0
