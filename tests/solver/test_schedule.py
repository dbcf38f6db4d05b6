"""ε schedules (flashot.solver.schedule): GeomLoss' temperatures and their checks."""

import itertools
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

import flashot
from flashot.solver.schedule import geomloss_schedule, temperatures


@given(diameter=st.floats(1e-3, 1e3), eps=st.floats(1e-6, 1e2), scaling=st.floats(0.05, 0.95))
def test_geomloss_temperatures_fall_by_scaling_squared_down_to_eps(diameter, eps, scaling):
    """D² first (twice, as GeomLoss lists it), then blurs shrinking by ``scaling``
    (temperatures by its square) while above ε, then ε itself, once."""
    temps = temperatures(flashot.EpsilonScaling(scaling, diameter=diameter), eps, lambda: 0.0)
    assert temps[-1] == eps and all(t > eps for t in temps[:-1])
    if diameter**2 > eps:
        assert temps[0] == pytest.approx(diameter**2)
        assert len(temps) == 2 or temps[1] == pytest.approx(diameter**2)
    for hi, lo in itertools.pairwise(temps[1:-1]):
        assert lo == pytest.approx(hi * scaling**2, rel=1e-9)
    blur_steps = math.log(diameter / math.sqrt(eps)) / math.log(1 / scaling)
    assert len(temps) <= max(0, math.ceil(blur_steps)) + 2


def test_the_diameter_is_asked_for_only_when_needed():
    asked = []
    assert temperatures(None, 0.1, lambda: asked.append(1) or 1.0) == [0.1] and not asked
    assert temperatures([1.0, 0.5], 0.1, lambda: asked.append(1) or 1.0)[-1] == 0.1
    assert not asked
    temperatures("geomloss", 0.1, lambda: asked.append(1) or 2.0)
    assert asked == [1]
    assert temperatures("geomloss", 0.1, lambda: 0.0) == [0.1]  # coinciding points


@pytest.mark.parametrize("bad", ["geom", 0.5, [0.5, "x"], [True]])
def test_a_bad_schedule_names_the_argument(bad):
    with pytest.raises((ValueError, TypeError), match="eps_schedule"):
        temperatures(bad, 0.1, lambda: 1.0)


def test_a_schedule_too_long_is_refused():
    with pytest.raises(ValueError, match="scaling"):
        geomloss_schedule(1e6, 1e-12, 0.999)
