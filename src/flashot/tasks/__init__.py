"""Tasks built on the public API, as a user would build them.

:mod:`~flashot.tasks.otdd` (dataset distances), :mod:`~flashot.tasks.flows` (gradient
flows of datasets), :mod:`~flashot.tasks.shuffled` (regression without pairings),
:mod:`~flashot.tasks.gromov` (entropic Gromov–Wasserstein between clouds in different
spaces), :mod:`~flashot.tasks.barycenters` (free-support barycenters),
:mod:`~flashot.tasks.datasets` (bundled data), :mod:`~flashot.tasks.demo` (color
transfer). Nothing below this layer imports it (tests/test_layers.py).
"""
