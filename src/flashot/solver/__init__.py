"""The one Sinkhorn loop (:mod:`.loop`) and what drives it.

ε schedules (:mod:`.schedule`), when to measure the error and when to stop
(:mod:`.stopping`), momentum (:mod:`.momentum`), CUDA graphs of whole blocks of
iterations (:mod:`.graphs`) and progress bars (:mod:`.progress`).
"""
