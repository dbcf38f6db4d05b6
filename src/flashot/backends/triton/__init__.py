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
    _jacobi_update_kernel,
    _plan_sums_kernel,
)

__all__ = ["TritonBackend"]

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
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


_ATTEND = _tuned(
    _attend_kernel,
    _configs.attend_configs(),
    ["d", "p", "n_bucket", "m_bucket", "HAS_V", "SPLIT", "PRECISION"],
)
_PLAN_SUMS = _tuned(
    _plan_sums_kernel,
    _configs.plan_sums_configs(),
    ["d", "n_bucket", "m_bucket", "COLUMNS", "SPLIT", "PRECISION"],
)


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
        self._cache_key, self._cache = None, None

    # ---- helpers -------------------------------------------------------------------
    def _dot(self) -> str:
        return "ieee" if triton_interpreted() else _DOT[self.precision]

    def _operands(self, form):
        """(q, k) as the kernels read them: float32, or half copies in bf16/fp16 mode."""
        q, k = form.q, form.k
        if q.dtype != torch.float32:
            raise TypeError(f"the triton backend computes in float32, got {q.dtype}")
        if self.precision not in _HALF:
            return q, k
        key = (q.data_ptr(), q._version, q.shape, k.data_ptr(), k._version, k.shape)
        if key != self._cache_key:  # one-entry cache: the solver reuses one form
            half = _HALF[self.precision]
            q, k = q.to(half), k.to(half)
            if triton_interpreted():  # numpy has no bfloat16: round, compute in float32
                q, k = q.float(), k.float()  # (exact: products of halves fit in float32)
            self._cache_key, self._cache = key, (q, k)
        return self._cache

    def _launch(self, tuned, raw, grid, args, consts):
        """Autotuned launch on a GPU; fixed tiles under the interpreter or without autotuning."""
        if triton_interpreted():
            tiles = _configs.INTERPRETER_TILES
            raw[grid(tiles)](*args, **consts, **tiles)
        elif self.autotune:
            tuned[grid](*args, **consts)
        else:
            cfg = tuned.configs[0]
            raw[grid(cfg.kwargs)](
                *args, **consts, **cfg.kwargs, num_warps=cfg.num_warps, num_stages=cfg.num_stages
            )

    def _splits(self, n: int, m: int, device) -> tuple[int, int]:
        """(splits, columns per split), the latter a multiple of every BLOCK_N."""
        splits = self.splits or _configs.column_splits(triton.cdiv(n, 128), m, 64, device)
        per = triton.cdiv(triton.cdiv(m, splits), 128) * 128
        return triton.cdiv(m, per), per

    # ---- primitives ----------------------------------------------------------------
    def row_attend(self, form, h, eps, v=None):
        """See :meth:`flashot.backends.base.Backend.row_attend`."""
        q, k = self._operands(form)
        n, m, d = q.shape[0], k.shape[0], q.shape[1]
        dev = q.device
        h = h.to(torch.float32).contiguous()
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

        args = (
            q,
            k,
            h,
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
            eps * LN2,
            per,
            q.stride(0),
            q.stride(1),
            k.stride(0),
            k.stride(1),
            vv.stride(0) if has_v else 0,
            vv.stride(1) if has_v else 0,
            out.stride(0) if has_v else 0,
            out.stride(1) if has_v else 0,
            _configs.bucket(n),
            _configs.bucket(m),
        )
        consts = dict(
            BLOCK_D=bd,
            BLOCK_P=bp,
            D_CHUNKS=chunks,
            HAS_V=has_v,
            SPLIT=split,
            PRECISION=self._dot(),
            V_PRECISION=self._dot(),
        )
        self._launch(_ATTEND, _attend_kernel, grid, args, consts)
        if not split:
            return lse, (out if has_v else None)
        top = part_max.max(0).values
        top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
        w = torch.exp2(part_max - top)
        total = (part_sum * w).sum(0)
        lse = eps * LN2 * (top + torch.log2(total))
        if not has_v:
            return lse, None
        return lse, (part_acc * w[..., None]).sum(0) / total[:, None]

    def plan_sums(self, form, u, v, a, b, eps, columns: bool = True):
        r"""Row and column sums of ``E_ij = exp((⟨q_i, k_j⟩ + u_i + v_j)/ε)``, weighted.

        .. math::

            R_i = \sum_j b_j E_{ij}, \qquad C_j = \sum_i a_i E_{ij},

        one exponential per element. With u = f − α and v = g − β, ``a_i b_j E_ij`` is the
        plan ``P_ij``. Valid only while E neither overflows nor underflows (callers check R, C).

        Args:
            form: attention form.  u: (n,), v: (m,) offsets.  a: (n,), b: (m,) weights.
            eps: ε.  columns: also compute C (else None).
        """
        q, k = self._operands(form)
        n, m, d = q.shape[0], k.shape[0], q.shape[1]
        dev = q.device
        scale = LOG2E / eps
        u2 = (u * scale).to(torch.float32).contiguous()
        v2 = (v * scale).to(torch.float32).contiguous()
        bd, chunks = _configs.block_d(d)
        splits, per = self._splits(n, m, dev)
        r = torch.zeros(n, device=dev, dtype=torch.float32)
        c = torch.zeros(m, device=dev, dtype=torch.float32) if columns else r

        def grid(meta):
            return (triton.cdiv(n, meta["BLOCK_M"]), splits)

        args = (
            q,
            k,
            u2,
            v2,
            a.to(torch.float32).contiguous(),
            b.to(torch.float32).contiguous(),
            r,
            c,
            n,
            m,
            d,
            scale,
            per,
            q.stride(0),
            q.stride(1),
            k.stride(0),
            k.stride(1),
            _configs.bucket(n),
            _configs.bucket(m),
        )
        consts = dict(
            BLOCK_D=bd, D_CHUNKS=chunks, COLUMNS=columns, SPLIT=splits > 1, PRECISION=self._dot()
        )
        self._launch(_PLAN_SUMS, _plan_sums_kernel, grid, args, consts)
        return r, (c if columns else None)

    def jacobi_step(
        self, form, f, g, log_a, log_b, eps, lam, rho, *, check=False, fast=False, status=None
    ):
        """See :meth:`flashot.backends.base.Backend.jacobi_step`.

        The fast path shares one score tile and one exponential per element between the
        row and column updates.
        """
        if not fast:
            return super().jacobi_step(
                form, f, g, log_a, log_b, eps, lam, rho, check=check, fast=False, status=status
            )
        a, b = torch.exp(log_a), torch.exp(log_b)
        r, c = self.plan_sums(form, f - form.alpha, g - form.beta, a, b, eps)
        err = torch.zeros(1, device=f.device, dtype=torch.float32) if check else r
        outs = []
        for pot, sums, w, lam_i, rho_i in ((f, r, a, lam[0], rho[0]), (g, c, b, lam[1], rho[1])):
            new = torch.empty_like(pot)
            size = pot.shape[0]
            inv_rho = 0.0 if rho_i is None else 1.0 / rho_i
            _jacobi_update_kernel[(triton.cdiv(size, 1024),)](
                pot,
                sums,
                w,
                new,
                err,
                status,
                size,
                eps,
                lam_i,
                inv_rho,
                BLOCK=1024,
                RELAXED=rho_i is not None,
                CHECK=check,
            )
            outs.append(new)
        return outs[0], outs[1], (err[0] if check else None)

    def _checked_sums(self, form, f, g, log_a, log_b, eps):
        """Fused (R, C, a, b) at (f, g) when no exponential over- or underflowed, else None."""
        if not self.speculative:
            return None
        a, b = torch.exp(log_a), torch.exp(log_b)
        r, c = self.plan_sums(form, f - form.alpha, g - form.beta, a, b, eps)
        lo, hi = 2.0**-60, 3.0e38
        safe = torch.stack([r.min(), c.min(), -r.max(), -c.max()])
        if bool((safe[:2] > lo).all()) and bool((safe[2:] > -hi).all()):
            return r, c, a, b
        return None

    def extrapolate(self, form, f, g, log_a, log_b, eps, lam):
        """See :meth:`flashot.backends.base.Backend.extrapolate` (one fused pass when safe)."""
        sums = self._checked_sums(form, f, g, log_a, log_b, eps)
        if sums is None:
            return super().extrapolate(form, f, g, log_a, log_b, eps, lam)
        r, c, _, _ = sums
        return lam[0] * (f - eps * torch.log(r)), lam[1] * (g - eps * torch.log(c))

    def marginals(self, form, f, g, log_a, log_b, eps):
        """See :meth:`flashot.backends.base.Backend.marginals` (one fused pass when safe)."""
        sums = self._checked_sums(form, f, g, log_a, log_b, eps)
        if sums is None:
            return super().marginals(form, f, g, log_a, log_b, eps)
        r, c, a, b = sums
        return a * r, b * c
