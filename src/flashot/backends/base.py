r"""The streaming primitives every backend implements.

A backend evaluates reductions of the biased score matrix

.. math::

    S_{ij} = \frac{\langle q_i, k_j \rangle + h_j}{\varepsilon}

of an :class:`~flashot.costs.AttentionForm` without ever storing it. Two
primitives cover the whole library; everything else (column updates, plan
products, marginals, transport cost, gradients) is built on them in Python:

* ``row_attend(form, h, eps, v)``: the row log-sum-exp
  :math:`\ell_i = \varepsilon \log \sum_j e^{S_{ij}}` and, when ``v`` is given,
  the softmax average :math:`o_i = \sum_j \mathrm{softmax}_j(S_{i\cdot})\, v_j`.
* ``symmetric_lse(form, h_col, h_row, eps)``: the row LSE with column bias
  ``h_col`` and the column LSE (``form.T``) with row bias ``h_row``, the two
  halves of one Jacobi Sinkhorn step; a backend may fuse them.

Bias entries may be ``-inf`` (zero weights): they contribute nothing. Every row
must see at least one finite bias, which input validation guarantees.
"""

from __future__ import annotations

import torch

from flashot.costs import AttentionForm

__all__ = ["PRECISIONS", "Backend"]

#: Accepted values of ``precision=``. ``"auto"`` picks the backend's accurate default.
PRECISIONS = ("auto", "fp32", "tf32", "bf16", "fp16")


class Backend:
    """Base class: the contract of the streaming primitives.

    Args:
        precision: how score tiles are computed, one of :data:`PRECISIONS`.
    """

    name = "base"
    #: precisions this backend implements, besides ``"auto"``.
    precisions: tuple[str, ...] = ("fp32",)

    def __init__(self, precision: str = "auto"):
        if precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
        if precision != "auto" and precision not in self.precisions:
            raise ValueError(
                f"precision={precision!r} is not available on backend={self.name!r} "
                f"(it offers {self.precisions})"
            )
        self.precision = "fp32" if precision == "auto" else precision

    def __repr__(self) -> str:
        return f"{type(self).__name__}(precision={self.precision!r})"

    def row_attend(
        self,
        form: AttentionForm,
        h: torch.Tensor,
        eps: float,
        v: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        r"""Row log-sum-exp and softmax average of the biased scores.

        .. math::

            \ell_i = \varepsilon \log \sum_j
                \exp\Big(\frac{\langle q_i, k_j\rangle + h_j}{\varepsilon}\Big),
            \qquad
            o_i = \sum_j \exp\Big(\frac{\langle q_i, k_j\rangle + h_j - \ell_i}
                {\varepsilon}\Big)\, v_j .

        Args:
            form: attention form with q (n, d'), k (m, d').
            h: (m,) column bias, may hold ``-inf``.
            eps: temperature ε > 0.
            v: optional (m, p) values.

        Returns:
            ``(lse, out)``: lse (n,) and out (n, p), or None when ``v`` is None.
        """
        raise NotImplementedError

    def symmetric_lse(
        self, form: AttentionForm, h_col: torch.Tensor, h_row: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Jacobi step: ``row_attend(form, h_col)`` and ``row_attend(form.T, h_row)``.

        Args:
            form: attention form, q (n, d'), k (m, d').
            h_col: (m,) column bias for the row reduction.
            h_row: (n,) row bias for the column reduction.
            eps: temperature ε > 0.

        Returns:
            ``(lse_rows (n,), lse_cols (m,))``.
        """
        return self.row_attend(form, h_col, eps)[0], self.row_attend(form.T, h_row, eps)[0]
