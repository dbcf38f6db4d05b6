"""Numerics on Hessian-vector products.

CG and block Lanczos (:mod:`.linalg`); Newton-CG, trust-region and Adam–Newton optimizers
(:mod:`.optim`).
"""
