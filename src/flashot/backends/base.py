r"""The streaming primitives every backend implements.

A backend evaluates reductions of the biased score matrix

.. math::

    S_{ij} = \frac{\langle q_i, k_j \rangle + h_j}{\varepsilon}

of an :class:`~flashot.geometry.costs.AttentionForm` without ever storing it. Two
primitives cover the whole library; everything else (column updates, plan
products, marginals, transport cost, gradients) is built on them in Python:

* ``row_attend(form, h, eps, v, log_w)``: the row log-sum-exp
  :math:`\ell_i = \varepsilon \log \sum_j w_j e^{S_{ij}}` and, when ``v`` is given,
  the softmax average :math:`o_i = \sum_j \mathrm{softmax}_j(S_{i\cdot} + \log w)\, v_j`.
* ``symmetric_lse(form, h_col, h_row, eps)``: the row LSE with column bias
  ``h_col`` and the column LSE (``form.T``) with row bias ``h_row``, the two
  halves of one Jacobi Sinkhorn step; a backend may fuse them.

Bias entries may be ``-inf`` (zero weights): they contribute nothing. Every row
must see at least one finite bias, which input validation guarantees.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import fields

import torch

from flashot.backends.dual import Potentials, marginal_error, row_mass
from flashot.backends.near import NEAR_FROM, is_near_uniform, near_attend
from flashot.backends.plan_vjp import ALL, PlanVJP, plan_vjp_tiles
from flashot.backends.temperature import device_damping, device_value
from flashot.geometry.costs import AttentionForm

__all__ = ["PRECISIONS", "Backend"]

#: Accepted values of ``precision=``. ``"auto"`` picks the backend's accurate default.
PRECISIONS = ("auto", "fp32", "tf32", "bf16", "fp16")
#: operand rounding of each mode: the clouds are rounded once, so that the matrix
#: units' products are exact and the cost stays a true squared distance
ROUNDING = {"fp32": None, "tf32": "tf32", "bf16": torch.bfloat16, "fp16": torch.float16}


class Backend:
    """Base class: the contract of the streaming primitives.

    Args:
        precision: how score tiles are computed, one of :data:`PRECISIONS`.
    """

    name = "base"
    #: a block of its primitives' launches can be captured as a CUDA graph (no host sync)
    capturable = False
    #: precisions this backend implements, besides ``"auto"``.
    precisions: tuple[str, ...] = ("fp32",)
    #: :meth:`_row_attend` streams packed forms (:mod:`flashot.geometry.segments`) in one pass;
    #: otherwise :meth:`row_attend` runs their problems one by one
    segmented = False

    def __init__(self, precision: str = "auto"):
        if precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
        if precision != "auto" and precision not in self.precisions:
            raise ValueError(
                f"precision={precision!r} is not available on backend={self.name!r} "
                f"(it offers {self.precisions})"
            )
        self.precision = "fp32" if precision == "auto" else precision

    @property
    def rounding(self):
        """How :func:`~flashot.geometry.costs.attention_form` rounds operands for this precision."""
        return ROUNDING[self.precision]

    def __repr__(self) -> str:
        return f"{type(self).__name__}(precision={self.precision!r})"

    def row_attend(
        self,
        form: AttentionForm,
        h: torch.Tensor,
        eps: float,
        v: torch.Tensor | None = None,
        log_w: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        r"""Row log-sum-exp and softmax average of the biased scores.

        .. math::

            \ell_i = \varepsilon \log \sum_j w_j
                \exp\Big(\frac{\langle q_i, k_j\rangle + h_j}{\varepsilon}\Big),
            \qquad
            o_i = \sum_j w_j \exp\Big(\frac{\langle q_i, k_j\rangle + h_j - \ell_i}
                {\varepsilon}\Big)\, v_j .

        At large ε (:func:`~flashot.backends.near.is_near_uniform`) every backend takes
        the near-uniform evaluation of :mod:`flashot.backends.near`, which keeps the
        weights apart from the bias; otherwise the backend's :meth:`_row_attend` streams
        the bias ``h + ε log w``.

        Args:
            form: attention form with q (n, d'), k (m, d').
            h: (m,) column bias (``g − β`` for a potential g), may hold ``-inf``.
            eps: temperature ε > 0.
            v: optional (m, p) values.
            log_w: optional (m,) log weights (``-inf`` for zero weights); None: w = 1.

        Returns:
            ``(lse, out)``: lse (n,) and out (n, p), or None when ``v`` is None.
        """
        seg = form.segments
        n, m = form.shape
        if n == 0 or m == 0:  # an empty block of a plan: nothing to stream, no mass
            lse = h.new_full((n,), -math.inf)
            return lse, None if v is None else v.new_zeros(n, v.shape[1])
        if seg is not None and (not self.segmented or seg.near(eps, NEAR_FROM)):
            return self._per_segment(form, h, eps, v, log_w)
        if seg is None and is_near_uniform(form, eps):
            return near_attend(form, h, eps, v, log_w, getattr(self, "budget", None))
        bias = h if log_w is None else h + device_value(eps) * log_w
        return self._row_attend(form, bias, eps, v)

    def _per_segment(self, form, h, eps, v, log_w):
        """:meth:`row_attend` of a packed form, one problem at a time (a launch each)."""
        seg = form.segments
        assert seg is not None
        parts = []
        for s in range(seg.count):
            cols = seg.col_slice(s)
            parts.append(self.row_attend(
                form.segment(s), h[cols], eps, None if v is None else v[cols],
                None if log_w is None else log_w[cols],
            ))  # fmt: skip
        lse = torch.cat([p[0] for p in parts])
        return lse, (None if v is None else torch.cat([_given(p[1]) for p in parts]))

    def _row_attend(
        self, form: AttentionForm, h: torch.Tensor, eps: float, v: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """:meth:`row_attend` with the weights folded into ``h`` (the backend's streaming pass)."""
        raise NotImplementedError

    def symmetric_lse(
        self, form: AttentionForm, h_col, h_row, eps: float, log_w_col=None, log_w_row=None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Jacobi step: ``row_attend(form, h_col)`` and ``row_attend(form.T, h_row)``.

        Args:
            form: attention form, q (n, d'), k (m, d').
            h_col: (m,) column bias for the row reduction.
            h_row: (n,) row bias for the column reduction.
            eps: temperature ε > 0.
            log_w_col: optional (m,) and log_w_row: optional (n,) log weights.

        Returns:
            ``(lse_rows (n,), lse_cols (m,))``.
        """
        return (
            self.row_attend(form, h_col, eps, log_w=log_w_col)[0],
            self.row_attend(form.T, h_row, eps, log_w=log_w_row)[0],
        )

    def potential_lse(
        self, pot: Potentials, stabilized: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`symmetric_lse` with the biases of potentials, ``h = g − β``, weights b.

        Args:
            pot: the problem at potentials (f, g).
            stabilized: the potentials are a solve's iterates, near the step's fixed point
                (a replayed schedule's steps; not a cold start): a backend may form the
                sums relative to them (one exponential a score, rows out of range
                recomputed exactly). The same LSEs either way.
        """
        form = pot.form
        return self.symmetric_lse(form, pot.g - form.beta, pot.f - form.alpha, pot.eps,
                                  pot.log_b, pot.log_a)  # fmt: skip

    def jacobi_step(
        self,
        pot: Potentials,
        lam: tuple[float, float],
        rho: tuple[float | None, float | None],
        *,
        check: bool = False,
        state=None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        r"""One averaged Jacobi (symmetric) Sinkhorn step, as in GeomLoss.

        .. math::

            f' = \tfrac12\big(f + \lambda_x T(g)\big), \qquad
            g' = \tfrac12\big(g + \lambda_y T(f)\big).

        Args:
            pot: the problem at the current potentials (f, g).
            lam: (λ_x, λ_y).  rho: (ρ_x, ρ_y) for the error's targets.
            check: also return the L1 marginal error of the plan at (f, g).
            state: the solve's :meth:`fast_state` (None: exact path). A backend's fast
                path must return the exact step's result (it may fall back per row).

        Returns:
            ``(f', g', err)``, err a 0-dim tensor or None.
        """
        form, f, g, log_a, log_b, eps = pot.parts()
        lse_r, lse_c = self.potential_lse(pot)
        err = None
        if check:
            r, c = (
                row_mass(f, lse_r, form.alpha, log_a, eps),
                row_mass(g, lse_c, form.beta, log_b, eps),
            )
            err = marginal_error(f, r, log_a, rho[0]) + marginal_error(g, c, log_b, rho[1])
            err = self.reduce(err)
        lam = device_damping(eps, lam)  # (a replayed schedule's row)
        f_new = 0.5 * (f + lam[0] * (form.alpha - lse_r))
        g_new = 0.5 * (g + lam[1] * (form.beta - lse_c))
        return f_new, g_new, err

    def reduce(self, t: torch.Tensor) -> torch.Tensor:
        """The sum of ``t`` over every part of the problem (the identity here).

        A solve sharded over ranks (:class:`~flashot.backends.sharded.ShardedBackend`)
        sums over them: the loop reduces its errors and floors with it.
        """
        return t

    def global_shape(self, form: AttentionForm) -> tuple[int, int]:
        """``(n, m)`` of the whole problem ``form`` is part of (its own shape here)."""
        return form.shape

    def fast_state(self, device: torch.device):
        """Per-solve state of the fast path of :meth:`jacobi_step`, or None (no fast path).

        Args:
            device: the solve's device.
        """
        return None

    def operand_scope(self, carry: list | None = None):
        """A block whose launches may share per-operand conversions (a solve, a dual solve).

        Backends that convert the clouds before their kernels read them (the Triton
        backend's split operands) keep the conversions within the block and drop them
        after, so that nothing of the clouds' size outlives the computation that uses it.

        Args:
            carry: a list the caller keeps (empty at first): the block's conversions are
                left in it at the exit and served again by the next block given it (a
                replayed schedule's passes, then each of its backward steps), so they
                live as long as the caller's list.
        """
        return contextlib.nullcontext()

    def take_score_memory(self) -> int:
        """The most bytes of n × m score matrices held at once since the last call.

        0 for backends that stream every score; the Triton backend may cache a solve's
        scores (its ``scores`` option). Reading resets the count.
        """
        return 0

    def replayed(self, form: AttentionForm) -> None:
        """A CUDA graph of a solve of ``form`` has replayed.

        :meth:`take_score_memory` then counts the score matrix its capture holds, if any.
        """

    def launch_key(self) -> tuple:
        """What, besides shapes and arguments, fixes this backend's launch sequence.

        For a :attr:`capturable` backend, two instances with equal keys launch the same
        kernels for the same calls, so CUDA graphs captured with one replay correctly
        for the other.
        """
        return (type(self).__qualname__, self.precision)

    def reads_temperatures(self, form: AttentionForm) -> bool:
        """Whether a solver step's launches on ``form`` read a temperature's device row.

        That is, every launch of a step given a :class:`~flashot.backends.temperature.Temperature`
        reads ε from its cell, none from its float value. Then a replayed solve
        (:mod:`flashot.solver.graphs`) keys its warm-up by structure, not by value, and serves
        every schedule of that structure (the data's diameter moves a GeomLoss
        schedule). Steps on the near-uniform path are still keyed by value. The
        default, False, keys every temperature by value.
        """
        return False

    def reads_vjp_temperatures(self, form: AttentionForm) -> bool:
        """Whether :meth:`row_attend` and :meth:`plan_vjp` on ``form`` read a device ε.

        That is, given a :class:`~flashot.backends.temperature.Temperature`, they read ε
        from its cell (with one value column, as a replayed transform's reverse product
        has), none from its float value. Then a replayed schedule's second derivatives
        (:mod:`flashot.autodiff.replay`) key their CUDA graphs by the schedule's
        structure, not its values, and serve points that move between calls.
        Near-uniform steps are still keyed by value.
        The default, False, keys by value.
        """
        return False

    def graph_key(self, form: AttentionForm):
        """A key if fixed-iteration solves on ``form`` should replay as CUDA graphs, or None.

        See :mod:`flashot.solver.graphs`. The key names what, besides shapes and the solver's
        options, fixes this backend's launch sequence. Only backends whose primitives
        never wait for the host may return one.
        """
        return None

    def extrapolate(
        self, pot: Potentials, lam: tuple[float, float]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One undamped Jacobi step, ``(λ_x T(g), λ_y T(f))``, without autograd.

        Args:
            pot: the problem at potentials (f, g).  lam: (λ_x, λ_y).
        """
        lse_r, lse_c = self.potential_lse(pot)
        return lam[0] * (pot.form.alpha - lse_r), lam[1] * (pot.form.beta - lse_c)

    def symmetric_vjp(self, form: AttentionForm, f, g, r_f, r_g, log_a, log_b, u_f, u_g, eps,
                      column_sums: bool = True):  # fmt: skip
        r"""The reverse of a symmetric step's two transforms in one pass, or None.

        With ``Π^x_ij = b_j e^{(r_f,i + g_j − β_j + s_ij)/ε}`` and ``Π^y_ji = a_i
        e^{(r_g,j + f_i − α_i + s_ij)/ε}`` (``r_f``, ``r_g`` the passes' negated LSEs):
        ``(u_f ⊙ Π^x k (n, d'), Π^xᵀ u_f (m,), Π^yᵀ(u_g ⊙ k) (n, d'), Π^yᵀ u_g (n,))``;
        without ``column_sums`` the second may be zeros (the transposed form's call, with
        the sides swapped, gives it as its fourth). The k-side terms ``Π^xᵀ(u_f ⊙ q)`` and
        ``u_g ⊙ Π^y q`` are that call's third and first.
        None here: the caller takes two :meth:`plan_vjp` (a backend that fuses them
        overrides this).
        """
        return None

    def mirror_vjp(self, form: AttentionForm, h, r, log_w, u, eps):
        r"""The reverse of a self problem's transform in one pass, or None.

        ``form``: a self problem's (n = m, ``s_ij = s_ji``: one cloud on both sides).
        With ``Π_ij = w_j e^{(r_i + h_j − β_j + s_ij)/ε}``: ``(u ⊙ Π k (n, d'),
        Πᵀ(u ⊙ q) (n, d'), Πᵀ u (n,))``, the column reductions read off the transposed
        plan's rows. None here: the caller takes :meth:`plan_vjp`'s two launches.
        """
        return None

    def plan_vjp(
        self,
        form: AttentionForm,
        f,
        g,
        a,
        b,
        eps: float,
        v,
        d,
        need: frozenset = ALL,
        d0=None,
    ) -> PlanVJP:
        r"""Reverse-mode product of the plan: reductions of ``S = P ⊙ (d⁰ 1ᵀ + D Vᵀ)``, ``Pᵀ D``.

        See :mod:`flashot.backends.plan_vjp` for the math; the default streams score
        tiles in PyTorch (any device), O((n + m)(d' + p)) memory.

        Args:
            form: attention form (detached).  f: (n,), g: (m,) potentials.
            a: (n,), b: (m,) weights.  eps: ε.
            v: (m, p) values.  d: (n, p) cotangent of ``P v``.
            need: the outputs to form (see :func:`~flashot.backends.plan_vjp.outputs_for`);
                the others may be None.
            d0: (n,) cotangent of the row sums ``P 1`` (a ones column of v), or None.

        Returns:
            A :class:`~flashot.backends.plan_vjp.PlanVJP`.
        """
        seg = form.segments
        if seg is not None:  # one problem at a time (a gradient's pass, not a step's)
            parts = []
            for s in range(seg.count):
                rows, cols = seg.row_slice(s), seg.col_slice(s)
                parts.append(self.plan_vjp(
                    form.segment(s), f[rows], g[cols], a[rows], b[cols], eps, v[cols],
                    d[rows], need, None if d0 is None else d0[rows],
                ))  # fmt: skip
            names = [fl.name for fl in fields(PlanVJP)]
            return PlanVJP(*(
                None if getattr(parts[0], k) is None else torch.cat([getattr(p, k) for p in parts])
                for k in names
            ))  # fmt: skip
        # GPUs want fewer, larger tiles (launches): 4M elements, 16 MB per float32 temporary
        budget = getattr(self, "budget", 1 << 22 if f.is_cuda else 1 << 20)
        return plan_vjp_tiles(form, f, g, a, b, eps, v, d, budget, need, d0)

    def plan_matvec(
        self, pot: Potentials, r, c, w=None, u=None
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        r"""``(P w, Pᵀ u)`` for the plan ``P = a b e^{(f⊕g−C)/ε}`` (a CG's matvec).

        Taken as weighted averages scaled by the plan's sums,
        ``(P w)_i = r_i Σ_j P_ij w_j / Σ_j P_ij``, so that ``P 1 = r`` and ``Pᵀ 1 = c``
        hold to rounding (a dual system's null vector stays one). Backends may fuse
        both products into one streaming pass (the Triton one does); the default takes
        one :meth:`row_attend` pass per product asked for.

        Args:
            pot: the problem at potentials (f, g) (detached).
            r: (n,), c: (m,) the plan's row and column sums (:meth:`marginals`).
            w: (m,) or None.  u: (n,) or None: the products not wanted are None.
        """
        form, f, g, log_a, log_b, eps = pot.parts()
        pw = ptu = None
        if w is not None:
            _, avg = self.row_attend(form, g - form.beta, eps, w[:, None], log_b)
            pw = r * _given(avg)[:, 0]
        if u is not None:
            _, avg = self.row_attend(form.T, f - form.alpha, eps, u[:, None], log_a)
            ptu = c * _given(avg)[:, 0]
        return pw, ptu

    def marginals(self, pot: Potentials) -> tuple[torch.Tensor, torch.Tensor]:
        """Row and column sums (n,), (m,) of the plan ``P = a b e^{(f⊕g−C)/ε}``.

        Args:
            pot: the problem at potentials (f, g).
        """
        lse_r, lse_c = self.potential_lse(pot)
        form, eps = pot.form, pot.eps
        return (row_mass(pot.f, lse_r, form.alpha, pot.log_a, eps),
                row_mass(pot.g, lse_c, form.beta, pot.log_b, eps))  # fmt: skip


def _given(t: torch.Tensor | None) -> torch.Tensor:
    """``t``, asked for and so present (a typing narrowing)."""
    assert t is not None
    return t
