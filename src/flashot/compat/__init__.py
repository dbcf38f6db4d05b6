"""Other libraries' calling conventions on flashot's streamed solver.

:mod:`flashot.compat.pot`: POT's point-cloud calls (``empirical_sinkhorn2``,
``empirical_sinkhorn_divergence``, ``solve_sample``) with POT's argument names and
returned quantities, and POT's matrix calls (``sinkhorn``, ``sinkhorn2``) for a cost
matrix already in memory (:mod:`flashot.compat.pot_matrix`).
"""
