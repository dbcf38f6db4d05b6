r"""The operands of a labeled cost's attention form, one allocation per cloud.

Row side (``factor = 2s``, ``extra = −λ_y T``) and column side (``factor = 1``,
``extra`` the identity) of :class:`flashot.geometry.labeled.LabeledCost`:

.. math::

    \mathrm{op}_i = \big(\mathrm{factor}\cdot w_i,\; \mathrm{extra}[c_i]\big),\qquad
    \mathrm{norm}_i = s\,\lVert w_i\rVert^2,\qquad w_i = \mathrm{round}(u_i - \mu).

Built in place, a block of rows at a time, into one (n, d + K) tensor: no centered,
scaled or concatenated copy of the cloud. The backward (rounding straight-through)

.. math::

    \bar u_i = \mathrm{factor}\cdot \bar{\mathrm{op}}_{i,:d}
        + 2 s\, w_i\, \overline{\mathrm{norm}}_i

recomputes ``w`` from ``u`` per block: it keeps ``u`` (the caller's cloud) and nothing
cloud-sized of its own. With ``create_graph=True`` it runs as differentiable PyTorch
code, so second derivatives through it are exact.
"""

from __future__ import annotations

import torch

from flashot.geometry.costs import _centered_into, _round_block, _row_ranges, round_operands

__all__ = ["augmented_rows"]


class _AugmentedRows(torch.autograd.Function):
    """``(op, norm)`` of the module, differentiable in ``u``."""

    @staticmethod
    def forward(u, center, extra, labels, rounding, factor, scale):
        n, d = u.shape
        out = torch.empty(n, d + extra.shape[1], dtype=u.dtype, device=u.device)
        norms = _centered_into(out[:, :d], u.detach(), center, rounding, factor)
        out[:, d:] = extra[labels]
        return out, norms.mul_(scale)

    @staticmethod
    def setup_context(ctx, inputs, output):
        u, center, _, _, rounding, factor, scale = inputs
        ctx.save_for_backward(u, center)
        ctx.rounding, ctx.factor, ctx.scale = rounding, factor, scale

    @staticmethod
    def backward(ctx, grad_out, grad_norms):
        if not ctx.needs_input_grad[0]:
            return (None,) * 7
        u, center = ctx.saved_tensors
        d = u.shape[1]
        factor, scale, rounding = ctx.factor, ctx.scale, ctx.rounding
        if torch.is_grad_enabled():  # create_graph=True: differentiable ops, exact 2nd order
            grad = 0.0
            if grad_out is not None:
                grad = factor * grad_out[:, :d]
            if grad_norms is not None:
                w = round_operands(u - center, rounding)
                grad = grad + 2.0 * scale * w * grad_norms[:, None]
            return grad if isinstance(grad, torch.Tensor) else None, *(None,) * 6
        grad = torch.zeros_like(u) if grad_out is None else torch.empty_like(u)
        for lo, hi in _row_ranges(u.shape[0], d):
            block = grad[lo:hi]
            if grad_out is not None:
                torch.mul(grad_out[lo:hi, :d], factor, out=block)
            if grad_norms is not None:
                w = u[lo:hi].detach() - center
                if rounding is not None:
                    _round_block(w, rounding)
                block.addcmul_(w, grad_norms[lo:hi, None], value=2.0 * scale)
        return grad, *(None,) * 6


def augmented_rows(u: torch.Tensor, center: torch.Tensor, extra: torch.Tensor,
                   labels: torch.Tensor, rounding, factor: float,
                   scale: float) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """``(op (n, d + K'), norm (n,))`` of the module.

    Args:
        u: (n, d) features (differentiable).  center: (d,) the joint center (a constant).
        extra: (K, K') the label part of a row, by class.  labels: (n,) indices into it.
        rounding: operand rounding of reduced-precision modes (``round_operands``).
        factor: 2s on the row side, 1 on the column side.  scale: the cost's s.
    """
    return _AugmentedRows.apply(u, center, extra.detach(), labels.to(u.device), rounding,
                                float(factor), float(scale))  # fmt: skip
