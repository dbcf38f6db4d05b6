"""Other libraries' calling conventions on flashot's streamed solver.

:mod:`flashot.compat.pot`: POT's point-cloud calls (``empirical_sinkhorn2``,
``empirical_sinkhorn_divergence``, ``solve_sample``) with POT's argument names and
returned quantities.
"""
