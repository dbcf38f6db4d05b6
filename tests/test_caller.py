"""Warnings at the user's line (flashot.caller), past flashot's and torch's wrappers."""

import pytest

import flashot
from flashot import ConvergenceWarning
from tests.conftest import clouds


def test_warnings_point_at_the_caller(gen):
    # entry points are wrapped (autocast, compile, torch.func): warnings must skip those frames
    x, y = clouds(gen, 20, 15, 2)
    with pytest.warns(ConvergenceWarning) as caught:
        flashot.sinkhorn(x, y, eps=0.01, tol=1e-12, max_iter=3)
        flashot.sinkhorn_divergence(x, y, eps=0.01, tol=1e-12, max_iter=3)
    assert {w.filename for w in caught} == {__file__}
