"""Geometry: costs compiled to attention forms, labeled costs, packed problems.

A cost becomes ``(q, k, α, β)`` with ``C_ij = α_i + β_j − ⟨q_i, k_j⟩``
(:mod:`.costs`); labeled costs append class features (:mod:`.labeled`); a batch of
problems packs into one form with a table of segments (:mod:`.segments`).
"""
