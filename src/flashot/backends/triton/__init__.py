"""The Triton backend: fused streaming kernels for CUDA GPUs (and Triton's interpreter).

Launch layer of the four (kernel → launch → autograd Function → public function):
allocation, grids, strides, precision and tiling choices. The kernels live in
``_kernels.py``, every tiling choice in ``_configs.py``.

Precision modes (``precision=``): ``"fp32"`` (default) computes score and value dots
with 3xTF32 on tensor cores (close to IEEE float32); ``"tf32"`` uses one TF32 pass;
``"bf16"``/``"fp16"`` round q and k to half precision (accumulation, potentials and
values stay float32).
"""

from __future__ import annotations

import torch
import triton

from flashot.backends import triton_interpreted
from flashot.backends.base import Backend
from flashot.backends.triton import _configs
from flashot.backends.triton._kernels import (
    _attend_kernel,
    _combine_kernel,
    _plan_sums_kernel,
    _update_kernel,
)

__all__ = ["TritonBackend"]

LOG2E = 1.4426950408889634
_HALF = {"bf16": torch.bfloat16, "fp16": torch.float16}
# tl.dot input precisions per mode (float32 operands); the interpreter knows only IEEE
_DOT = {"fp32": "tf32x3", "tf32": "tf32", "bf16": "tf32", "fp16": "tf32"}


def _tuned(kernel, configs, key):
    return triton.autotune(
        configs=configs,
        key=key,
        prune_configs_by={"early_config_prune": _configs.prune},
        reset_to_zero=["R", "C"] if "R" in kernel.arg_names else None,
    )(kernel)


_ATTEND_KEY = ["d", "p", "n_bucket", "m_bucket", "HAS_V", "SPLIT", "PRECISION"]
_ATTEND = _tuned(_attend_kernel, _configs.attend_configs(), _ATTEND_KEY)
_PLAN_SUMS_KEY = ["d", "n_bucket", "m_bucket", "COLUMNS", "SPLIT", "PRECISION"]
_PLAN_SUMS = _tuned(_plan_sums_kernel, _configs.plan_sums_configs(), _PLAN_SUMS_KEY)
# best configuration per (kernel, key): after the first (tuning) call, launches skip the
# autotuner's per-call Python work and go straight to the compiled kernel
_BEST: dict = {}


class TritonBackend(Backend):
    """Fused Triton kernels (float32 compute; float16/bfloat16/float32 inputs).

    Args:
        precision: ``"auto"``/``"fp32"``, ``"tf32"``, ``"bf16"`` or ``"fp16"``.
        fused: use the one-exp fused kernel (verified, with fallback) for symmetric
            steps, extrapolation and marginals; False runs two exact passes instead.
        autotune: autotune tile shapes (else the first configuration of each space).
        splits: force the number of column splits (tests); None chooses from the GPU.
    """

    name = "triton"
    precisions = ("fp32", "tf32", "bf16", "fp16")

    def __init__(
        self,
        precision: str = "auto",
        fused: bool = True,
        autotune: bool = True,
        splits: int | None = None,
    ):
        super().__init__(precision)
        self.speculative, self.autotune, self.splits = fused, autotune, splits
        self._halves: dict = {}

    # ---- helpers -------------------------------------------------------------------
    def _dot(self) -> str:
        return "ieee" if triton_interpreted() else _DOT[self.precision]

    def _operand(self, t: torch.Tensor) -> torch.Tensor:
        """A feature matrix as the kernels read it: float32, or a cached half copy."""
        if t.dtype != torch.float32:
            raise TypeError(f"the triton backend computes in float32, got {t.dtype}")
        if self.precision not in _HALF:
            return t
        key = (t.data_ptr(), t._version, tuple(t.shape), tuple(t.stride()))
        if key not in self._halves:  # the solver reuses q and k: convert them once
            half = t.to(_HALF[self.precision])
            if triton_interpreted():  # numpy has no bfloat16: round, compute in float32
                half = half.float()  # (exact: products of halves fit in float32)
            if len(self._halves) >= 4:
                self._halves.pop(next(iter(self._halves)))
            self._halves[key] = half
        return self._halves[key]

    def _launch(self, tuned, raw, key, grid, args, consts):
        """Launch with the tuned tiles (tuning on first use), fixed tiles when interpreted."""
        if triton_interpreted():
            tiles = _configs.INTERPRETER_TILES
            raw[grid(tiles)](*args, **consts, **tiles)
            return
        cfg = _BEST.get(key) if self.autotune else tuned.configs[0]
        if cfg is None:
            tuned[grid](*args, **consts)
            _BEST[key] = tuned.best_config
            return
        raw[grid(cfg.kwargs)](
            *args, **consts, **cfg.kwargs, num_warps=cfg.num_warps, num_stages=cfg.num_stages
        )

    def _splits(self, n: int, m: int, device) -> tuple[int, int]:
        """(splits, columns per split), the latter a multiple of every BLOCK_N."""
        splits = self.splits or _configs.column_splits(triton.cdiv(n, 128), m, 64, device)
        per = triton.cdiv(triton.cdiv(m, splits), 128) * 128
        return triton.cdiv(m, per), per

    def _attend(self, q, k, eps, bias, v=None):
        """Row LSE and softmax average; ``bias`` is ``(h,)`` or ``(g, β, log b)``."""
        q, k = self._operand(q), self._operand(k)
        n, m, d = q.shape[0], k.shape[0], q.shape[1]
        dev = q.device
        potential = len(bias) == 3
        h, beta, log_w = bias if potential else (bias[0], bias[0], bias[0])
        bd, chunks = _configs.block_d(d)
        has_v = v is not None
        p = v.shape[1] if has_v else 1
        bp = _configs.block_p(p)
        vv = v.to(torch.float32) if has_v else h
        splits, per = self._splits(n, m, dev)
        split = splits > 1
        lse = torch.empty(n, device=dev, dtype=torch.float32)
        out = torch.empty(n, p, device=dev, dtype=torch.float32) if has_v else lse
        if split:
            part_max = torch.empty(splits, n, device=dev, dtype=torch.float32)
            part_sum = torch.empty_like(part_max)
            part_acc = torch.empty(splits, n, p, device=dev, dtype=torch.float32) if has_v else lse
        else:
            part_max = part_sum = part_acc = lse
        p_chunks = triton.cdiv(p, bp) if has_v else 1

        def grid(meta):
            return (triton.cdiv(n, meta["BLOCK_M"]), splits, p_chunks)

        nb, mb = _configs.bucket(n), _configs.bucket(m)
        args = (
            q,
            k,
            h,
            beta,
            log_w,
            vv,
            lse,
            out,
            part_max,
            part_sum,
            part_acc,
            n,
            m,
            d,
            p,
            LOG2E / eps,
            eps,
            per,
            q.stride(0),
            q.stride(1),
            k.stride(0),
            k.stride(1),
            vv.stride(0) if has_v else 0,
            vv.stride(1) if has_v else 0,
            out.stride(0) if has_v else 0,
            out.stride(1) if has_v else 0,
            nb,
            mb,
        )
        consts = dict(
            BLOCK_D=bd,
            BLOCK_P=bp,
            D_CHUNKS=chunks,
            HAS_V=has_v,
            SPLIT=split,
            POTENTIAL_BIAS=potential,
            PRECISION=self._dot(),
            V_PRECISION=self._dot(),
        )
        key = ("attend", d, p, nb, mb, has_v, split, potential, self._dot(), q.dtype)
        self._launch(_ATTEND, _attend_kernel, key, grid, args, consts)
        if split:
            blk = 128
            _combine_kernel[(triton.cdiv(n, blk),)](
                part_max,
                part_sum,
                part_acc,
                lse,
                out,
                n,
                p,
                splits,
                eps,
                out.stride(0) if has_v else 0,
                out.stride(1) if has_v else 0,
                BLOCK=blk,
                BLOCK_P=triton.next_power_of_2(p) if has_v else 1,
                HAS_V=has_v,
            )
        return lse, (out if has_v else None)

    # ---- primitives ----------------------------------------------------------------
    def row_attend(self, form, h, eps, v=None):
        """See :meth:`flashot.backends.base.Backend.row_attend`."""
        return self._attend(form.q, form.k, eps, (h.to(torch.float32).contiguous(),), v)

    def plan_sums(self, form, f, g, log_a, log_b, eps, columns: bool = True):
        r"""Weighted row and column sums of ``E_ij = exp((f_i + g_j − C_ij)/ε)``.

        .. math::

            R_i = \sum_j b_j E_{ij}, \qquad C_j = \sum_i a_i E_{ij},

        one exponential per element (``a_i b_j E_ij`` is the plan ``P_ij``). Valid only
        while E neither overflows nor underflows: callers check R and C.

        Args:
            form: attention form.  f: (n,), g: (m,) potentials.
            log_a: (n,), log_b: (m,) log weights.  eps: ε.  columns: also compute C.

        Returns:
            ``(R (n,), C (m,) or None)``.
        """
        q, k = self._operand(form.q), self._operand(form.k)
        n, m, d = q.shape[0], k.shape[0], q.shape[1]
        dev = q.device
        bd, chunks = _configs.block_d(d)
        splits, per = self._splits(n, m, dev)
        sums = torch.zeros(n + m, device=dev, dtype=torch.float32)
        r, c = sums[:n], sums[n:]

        def grid(meta):
            return (triton.cdiv(n, meta["BLOCK_M"]), splits)

        nb, mb = _configs.bucket(n), _configs.bucket(m)
        args = (
            q,
            k,
            f,
            form.alpha,
            g,
            form.beta,
            log_a,
            log_b,
            r,
            c,
            n,
            m,
            d,
            LOG2E / eps,
            per,
            q.stride(0),
            q.stride(1),
            k.stride(0),
            k.stride(1),
            nb,
            mb,
        )
        consts = dict(
            BLOCK_D=bd, D_CHUNKS=chunks, COLUMNS=columns, SPLIT=splits > 1, PRECISION=self._dot()
        )
        key = ("plan_sums", d, nb, mb, columns, splits > 1, self._dot(), q.dtype)
        self._launch(_PLAN_SUMS, _plan_sums_kernel, key, grid, args, consts)
        return r, (c if columns else None)

    def jacobi_step(
        self, form, f, g, log_a, log_b, eps, lam, rho, *, check=False, fast=False, status=None
    ):
        """See :meth:`flashot.backends.base.Backend.jacobi_step`.

        The fast path shares one score tile and one exponential per element between the
        row and column updates; the exact path runs two online-max passes. Either way
        the update and the marginal error are one more small launch.
        """
        if fast:
            r, c = self.plan_sums(form, f, g, log_a, log_b, eps)
        else:
            r = self._attend(form.q, form.k, eps, (g, form.beta, log_b))[0]
            c = self._attend(form.k, form.q, eps, (f, form.alpha, log_a))[0]
        n, m = f.shape[0], g.shape[0]
        f_new, g_new = torch.empty_like(f), torch.empty_like(g)
        err = torch.zeros(1, device=f.device, dtype=torch.float32) if check else f_new
        if status is None:
            status = torch.zeros(1, device=f.device, dtype=torch.int32)
        blk = 1024
        _update_kernel[(triton.cdiv(n, blk) + triton.cdiv(m, blk),)](
            f,
            r,
            form.alpha,
            log_a,
            f_new,
            g,
            c,
            form.beta,
            log_b,
            g_new,
            err,
            status,
            n,
            m,
            eps,
            lam[0],
            lam[1],
            0.0 if rho[0] is None else 1.0 / rho[0],
            0.0 if rho[1] is None else 1.0 / rho[1],
            BLOCK=blk,
            RELAXED_X=rho[0] is not None,
            RELAXED_Y=rho[1] is not None,
            CHECK=check,
            FROM_LSE=not fast,
        )
        return f_new, g_new, (err[0] if check else None)

    def _checked_sums(self, form, f, g, log_a, log_b, eps):
        """Fused (R, C) at (f, g) when no exponential over- or underflowed, else None."""
        if not self.speculative:
            return None
        r, c = self.plan_sums(form, f, g, log_a, log_b, eps)
        lo = torch.stack([r.min(), c.min()])
        hi = torch.stack([r.max(), c.max()])
        if bool((lo > 2.0**-60).all() & (hi < 3.0e38).all()):
            return r, c
        return None

    def extrapolate(self, form, f, g, log_a, log_b, eps, lam):
        """See :meth:`flashot.backends.base.Backend.extrapolate` (one fused pass when safe)."""
        sums = self._checked_sums(form, f, g, log_a, log_b, eps)
        if sums is None:
            return super().extrapolate(form, f, g, log_a, log_b, eps, lam)
        r, c = sums
        return lam[0] * (f - eps * torch.log(r)), lam[1] * (g - eps * torch.log(c))

    def marginals(self, form, f, g, log_a, log_b, eps):
        """See :meth:`flashot.backends.base.Backend.marginals` (one fused pass when safe)."""
        sums = self._checked_sums(form, f, g, log_a, log_b, eps)
        if sums is None:
            return super().marginals(form, f, g, log_a, log_b, eps)
        r, c = sums
        return torch.exp(log_a) * r, torch.exp(log_b) * c
