"""The one dense float64 reference of the tests: full cost matrices, textbook formulas.

Nothing here shares code with flashot's solver: costs are formed from their
definitions, Sinkhorn runs on the full matrix with ``torch.logsumexp``.
"""

from __future__ import annotations

import math

import torch

F64 = torch.float64


def dense_cost(x, y, cost="sqeuclidean"):
    """C_ij from the definition, float64."""
    x, y = x.detach().to(F64), y.detach().to(F64)
    if cost == "cosine":
        xn = x / x.norm(dim=1, keepdim=True)
        yn = y / y.norm(dim=1, keepdim=True)
        return 1.0 - xn @ yn.T
    sq = ((x[:, None, :] - y[None, :, :]) ** 2).sum(-1)
    return sq if cost == "sqeuclidean" else sq / 2


def softmin(C, h, eps):
    """-eps log sum_j exp(h_j - C_ij / eps), row-wise."""
    return -eps * torch.logsumexp(h[None, :] - C / eps, dim=1)


def sinkhorn_dense(C, a, b, eps, rho=(None, None), tol=1e-13, max_iter=100_000, init_g=None):
    """Alternating log-domain Sinkhorn on the full matrix, to convergence.

    Returns (f, g) with P = a b exp((f + g - C)/eps); g is the last update. ``init_g``
    only shortens the run: the fixed point does not depend on it.
    """
    C, a, b = C.to(F64), a.to(F64), b.to(F64)
    la, lb = a.log(), b.log()
    lam = [1.0 if r is None else r / (r + eps) for r in rho]
    f = torch.zeros_like(a)
    g = torch.zeros_like(b) if init_g is None else init_g.detach().to(F64)
    for _ in range(max_iter):
        f = lam[0] * softmin(C, lb + g / eps, eps)
        g = lam[1] * softmin(C.T, la + f / eps, eps)
        P = plan_dense(C, a, b, f, g, eps)
        target = a if rho[0] is None else a * torch.exp(-f / rho[0])
        if (P.sum(1) - target).abs().sum() < tol:
            break
    return f, g


def plan_dense(C, a, b, f, g, eps):
    """P_ij = a_i b_j exp((f_i + g_j - C_ij)/eps)."""
    return a[:, None] * b[None, :] * torch.exp((f[:, None] + g[None, :] - C) / eps)


def kl(p, q):
    """Generalized KL divergence sum p log(p/q) - p + q."""
    p, q = p.reshape(-1), q.reshape(-1)
    pos = p > 0
    return (p[pos] * torch.log(p[pos] / q[pos])).sum() - p.sum() + q.sum()


def primal(C, a, b, P, eps, rho=(None, None)):
    """<P, C> + eps KL(P | a x b) + rho KL(P1 | a) + rho KL(P^T 1 | b)."""
    val = (P * C).sum() + eps * kl(P, a[:, None] * b[None, :])
    if rho[0] is not None:
        val = val + rho[0] * kl(P.sum(1), a)
    if rho[1] is not None:
        val = val + rho[1] * kl(P.sum(0), b)
    return val


def entropic_ot(
    x, y, a, b, eps, cost="sqeuclidean", rho=(None, None), init_g=None, max_iter=100_000
):
    """OT_eps by the dense reference, as the primal value of the converged plan."""
    C = dense_cost(x, y, cost)
    f, g = sinkhorn_dense(C, a, b, eps, rho, init_g=init_g, max_iter=max_iter)
    return primal(C, a.to(F64), b.to(F64), plan_dense(C, a.to(F64), b.to(F64), f, g, eps), eps, rho)


def gaussian_entropic_ot(m1, A, m2, B, eps):
    """Closed form of OT_eps between N(m1, A) and N(m2, B) for |x - y|^2 (Janati et al., 2020).

    With sigma^2 = eps/2 and D = (4 A^½ B A^½ + sigma^4 I)^½:
    |m1 - m2|^2 + tr A + tr B - tr D + d sigma^2 (1 - log 2 sigma^2)
    + sigma^2 log det(D + sigma^2 I).
    """
    s2, d = eps / 2, A.shape[0]

    def sqrtm(M):
        w, V = torch.linalg.eigh(M)
        return V @ torch.diag(w.clamp_min(0).sqrt()) @ V.T

    As = sqrtm(A)
    D = sqrtm(4 * As @ B @ As + s2**2 * torch.eye(d, dtype=F64))
    return (
        ((m1 - m2) ** 2).sum()
        + A.trace()
        + B.trace()
        - D.trace()
        + d * s2 * (1 - math.log(2 * s2))
        + s2 * torch.logdet(D + s2 * torch.eye(d, dtype=F64))
    )


def gaussian_quadrature(mean, cov, n_per_dim, half_width=6.0):
    """A weighted tensor grid whose weights follow N(mean, cov): a quadrature of the Gaussian."""
    d = cov.shape[0]
    t = torch.linspace(-half_width, half_width, n_per_dim, dtype=F64)
    pts = torch.cartesian_prod(*([t] * d)).reshape(-1, d)
    w = torch.exp(-0.5 * (pts**2).sum(1))
    evals, V = torch.linalg.eigh(cov)
    root = V @ torch.diag(evals.sqrt()) @ V.T
    return pts @ root.T + mean, w / w.sum()


def geomloss_loop(x, y, a, b, eps_list, rho=None, cost="half_sqeuclidean"):
    """GeomLoss' symmetric loop and final extrapolation, dense (values only)."""
    Cxy = dense_cost(x, y, cost)
    la, lb = a.to(F64).log(), b.to(F64).log()
    lam = (lambda e: 1.0) if rho is None else (lambda e: 1 / (1 + e / rho))
    e = eps_list[0]
    f = lam(e) * softmin(Cxy, lb, e)
    g = lam(e) * softmin(Cxy.T, la, e)
    for e in eps_list:
        ft = lam(e) * softmin(Cxy, lb + g / e, e)
        gt = lam(e) * softmin(Cxy.T, la + f / e, e)
        f, g = 0.5 * (f + ft), 0.5 * (g + gt)
    e = eps_list[-1]
    return lam(e) * softmin(Cxy, lb + g / e, e), lam(e) * softmin(Cxy.T, la + f / e, e)


def dense_gradient(x, y, a, b, eps, cost="sqeuclidean", rho=(None, None)):
    """(∇_x, ∇_y) of OT_eps by the envelope theorem on the dense plan: Σ_j P_ij ∇C_ij."""
    x = x.detach().to(F64).requires_grad_()
    y = y.detach().to(F64).requires_grad_()
    a, b = a.to(F64), b.to(F64)
    C = _cost_with_grad(x, y, cost)
    f, g = sinkhorn_dense(C.detach(), a, b, eps, rho)
    P = plan_dense(C.detach(), a, b, f, g, eps)
    return torch.autograd.grad((P * C).sum(), (x, y))


def _cost_with_grad(x, y, cost):
    if cost == "cosine":
        return 1.0 - (x / x.norm(dim=1, keepdim=True)) @ (y / y.norm(dim=1, keepdim=True)).T
    sq = ((x[:, None, :] - y[None, :, :]) ** 2).sum(-1)
    return sq if cost == "sqeuclidean" else sq / 2


def dense_hvp_fd(x, y, a, b, eps, vx, vy, h=1e-5, **kw):
    """Central differences of :func:`dense_gradient` along (vx, vy): the joint HVP."""
    plus = dense_gradient(x + h * vx, y + h * vy, a, b, eps, **kw)
    minus = dense_gradient(x - h * vx, y - h * vy, a, b, eps, **kw)
    return tuple((p - m) / (2 * h) for p, m in zip(plus, minus, strict=True))


def dense_hvp_implicit(x, y, f, g, v, eps, a=None, b=None, tikhonov=1e-10):
    """The x-block HVP of OT_ε for |x − y|²/2 at given potentials, dense, balanced.

    With ``P = a b e^{(f ⊕ g − C)/ε}`` (r, c its marginals) and ``s_ij = ⟨x_i − y_j, v_i⟩``,
    the potentials move by (df, dg) solving ``[[D_r, P], [Pᵀ, D_c]] (df, dg) = ((P∘s)1,
    (P∘s)ᵀ1)`` (the plan keeps its marginals), solved by a Cholesky factorization of the
    Schur complement ``D_c − Pᵀ D_r⁻¹ P + c cᵀ/Σc + tikhonov·D_c``; then
    ``H v = r ⊙ v + Σ_j dP_ij (x_i − y_j)`` with ``dP = P ⊙ (df ⊕ dg − s)/ε``. Independent
    of the finite differences and of flashot; at the solution it is the exact HVP. The
    Tikhonov term (relative to D_c) only touches directions of near-zero plan coupling,
    on which the HVP does not depend (check by varying it). Memory: a few n × m.
    """
    n, m = x.shape[0], y.shape[0]
    a = torch.full((n,), 1.0 / n, dtype=x.dtype, device=x.device) if a is None else a
    b = torch.full((m,), 1.0 / m, dtype=x.dtype, device=x.device) if b is None else b
    C = 0.5 * ((x * x).sum(1)[:, None] + (y * y).sum(1)[None] - 2 * x @ y.T)
    P = a[:, None] * b[None] * torch.exp((f[:, None] + g[None] - C) / eps)
    del C
    r, c = P.sum(1), P.sum(0)
    s = (x * v).sum(1)[:, None] - v @ y.T
    ps = P * s
    rhs_f, rhs_g = ps.sum(1), ps.sum(0)
    del ps
    S = -(P.T @ (P / r[:, None]))
    S.diagonal().add_((1 + tikhonov) * c)
    S += torch.outer(c, c) / c.sum()
    rhs = rhs_g - P.T @ (rhs_f / r)
    rhs = rhs - c * rhs.sum() / c.sum()
    dg = torch.cholesky_solve(rhs[:, None], torch.linalg.cholesky(S))[:, 0]
    del S
    df = (rhs_f - P @ dg) / r
    dP = P * (df[:, None] + dg[None] - s) / eps
    return r[:, None] * v + x * dP.sum(1)[:, None] - dP @ y


def entropic_ot_matrix(C, a, b, eps, self_problem=False):
    """OT_eps for a dense cost matrix: the primal value of the converged plan (float64).

    A self problem (a cloud with itself: C symmetrized, a = b) takes the averaged
    symmetric fixed point ``f ← ½ (f + softmin(C, log a + f/ε))``, where alternating
    updates crawl.
    """
    C, a, b = C.to(F64), a.to(F64), b.to(F64)
    if self_problem:
        C = 0.5 * (C + C.T)
        f = torch.zeros_like(a)
        for _ in range(100_000):
            f = 0.5 * (f + softmin(C, a.log() + f / eps, eps))
            if (plan_dense(C, a, a, f, f, eps).sum(1) - a).abs().sum() < 1e-13:
                break
        g = f
    else:
        f, g = sinkhorn_dense(C, a, b, eps)
    return primal(C, a, b, plan_dense(C, a, b, f, g, eps), eps)


def bures_wasserstein_sq(x1, x2, diagonal=False, unbiased=False):
    """W² between Gaussian fits of two clouds, by scipy's sqrtm (float64).

    ML covariances (1/n), or with ``unbiased`` microsoft/otdd's (1/(n − 1), its ``cov``).
    """
    import numpy as np
    from scipy.linalg import sqrtm

    x1, x2 = x1.double().numpy(), x2.double().numpy()
    m1, m2 = x1.mean(0), x2.mean(0)
    if diagonal:
        ddof = 1 if unbiased else 0
        return float(((m1 - m2) ** 2).sum()
                     + ((x1.std(0, ddof=ddof) - x2.std(0, ddof=ddof)) ** 2).sum())  # fmt: skip
    s1 = np.cov(x1, rowvar=False, bias=not unbiased).reshape(x1.shape[1], x1.shape[1])
    s2 = np.cov(x2, rowvar=False, bias=not unbiased).reshape(x2.shape[1], x2.shape[1])
    r1 = sqrtm(s1).real
    cross = sqrtm(r1 @ s2 @ r1).real
    return float(((m1 - m2) ** 2).sum() + np.trace(s1 + s2 - 2 * cross))


def geomloss_gradient(x, y, a, b, eps_list, rho=None, cost="half_sqeuclidean", debias=True):
    """∇_x of GeomLoss' Sinkhorn loss as GeomLoss computes it, dense, float64.

    The symmetric loop runs without autograd; the final extrapolation is differentiated on
    its own side only (``C(x, y.detach())`` for the x-potential, ``C(x, x.detach())`` for
    the debiasing one), the potentials it reads held fixed: the envelope gradient that
    GeomLoss returns, which is not the derivative of the loss it returns unless the loop
    converged. Its finite differences are the reference of second derivatives through a
    fixed schedule.
    """
    x = x.detach().to(F64).requires_grad_()
    y, a, b = y.detach().to(F64), a.to(F64), b.to(F64)
    e = eps_list[-1]
    lam = 1.0 if rho is None else 1 / (1 + e / rho)
    with torch.no_grad():
        _, g = _symmetric_loop(x, y, a, b, eps_list, rho, cost)
        p = _symmetric_loop(x, x, a, a, eps_list, rho, cost)[0] if debias else None
    f_star = lam * softmin(_cost_with_grad(x, y, cost), b.log() + g / e, e)
    value = _dual_side(f_star, a, e, rho)
    if debias:
        p_star = lam * softmin(_cost_with_grad(x, x.detach(), cost), a.log() + p / e, e)
        value = value - _dual_side(p_star, a, e, rho)
    return torch.autograd.grad(value, x)[0]


def _symmetric_loop(x, y, a, b, eps_list, rho, cost):
    C = dense_cost(x, y, cost)
    la, lb = a.log(), b.log()
    lam = (lambda e: 1.0) if rho is None else (lambda e: 1 / (1 + e / rho))
    e = eps_list[0]
    f, g = lam(e) * softmin(C, lb, e), lam(e) * softmin(C.T, la, e)
    for e in eps_list:
        ft, gt = lam(e) * softmin(C, lb + g / e, e), lam(e) * softmin(C.T, la + f / e, e)
        f, g = 0.5 * (f + ft), 0.5 * (g + gt)
    return f, g


def _dual_side(f, w, eps, rho):
    """A term whose f-derivative is one measure's envelope gradient: ⟨w, f⟩, or relaxed
    (ρ + ε) ⟨w, 1 − e^{−f/ρ}⟩ (the derivative of the dual value at the fixed point, which
    flashot takes; GeomLoss 0.3.1 scales it by (ρ + ε/2)/(ρ + ε))."""
    if rho is None:
        return (w * f).sum()
    return (rho + eps) * (w * (1 - torch.exp(-f / rho))).sum()


def jacobian_fd(fn, x, h=1e-6):
    """The Jacobian (x.numel(), x.numel()) of ``fn`` (x ↦ tensor shaped like x), columns by
    central differences in float64."""
    x = x.detach().to(F64)
    cols = []
    for i in range(x.numel()):
        e = torch.zeros(x.numel(), dtype=F64)
        e[i] = h
        e = e.reshape(x.shape)
        cols.append(((fn(x + e) - fn(x - e)) / (2 * h)).reshape(-1))
    return torch.stack(cols, 1)
