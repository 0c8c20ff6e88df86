import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from lookahead_opd.schedule import (
    Every,
    PowersOfTwo,
    Steps,
    make_schedule,
    resolve_coefficients,
)


@given(st.integers(min_value=-4, max_value=1 << 20))
def test_powers_of_two_fires_exactly_on_powers(step):
    expected = step >= 1 and 2 ** round(math.log2(step)) == step
    assert PowersOfTwo().is_search_step(step) == expected


def test_powers_of_two_first_steps():
    fired = [t for t in range(1, 70) if PowersOfTwo().is_search_step(t)]
    assert fired == [1, 2, 4, 8, 16, 32, 64]


@given(st.integers(1, 50), st.integers(1, 500))
def test_every_fires_on_multiples(n, step):
    assert Every(n).is_search_step(step) == (step % n == 0)


@given(st.sets(st.integers(1, 1000), min_size=1))
def test_steps_fires_on_given_steps_only(steps):
    s = Steps(steps)
    assert {t for t in range(1, 1001) if s.is_search_step(t)} == steps


def test_make_schedule_forms():
    assert isinstance(make_schedule(), PowersOfTwo)
    assert make_schedule(every=3).n == 3
    assert make_schedule([5, 7]).steps == {5, 7}
    custom = Every(2)
    assert make_schedule(custom) is custom


@pytest.mark.parametrize(
    "kwargs, error",
    [
        ({"schedule": "fibonacci"}, ValueError),
        ({"schedule": [0, 1]}, ValueError),
        ({"schedule": []}, ValueError),
        ({"every": 0}, ValueError),
        ({"schedule": [3], "every": 2}, ValueError),
        ({"schedule": 3.5}, TypeError),
    ],
)
def test_make_schedule_rejects(kwargs, error):
    with pytest.raises(error):
        make_schedule(**kwargs)


def test_named_coefficients():
    assert resolve_coefficients("geometric") == (1, 2, 4, 8, 16)
    assert resolve_coefficients("linear") == (2, 4, 6, 8, 10)
    assert resolve_coefficients("geometric", 3) == (1, 2, 4)
    assert resolve_coefficients("geometric", allow_zero=True) == (0, 1, 2, 4, 8)
    assert resolve_coefficients([0.25, 0.5, 1, 2]) == (0.25, 0.5, 1.0, 2.0)
    assert resolve_coefficients([0.25, 0.5, 1, 2], 2) == (0.25, 0.5)
    assert resolve_coefficients([0, 1], allow_zero=True) == (0.0, 1.0)


@given(st.sampled_from(["geometric", "linear"]), st.integers(1, 12), st.booleans())
def test_named_coefficients_are_increasing_and_sized(name, n, zero):
    cs = resolve_coefficients(name, n, allow_zero=zero)
    assert len(cs) == n
    assert all(b > a for a, b in zip(cs, cs[1:], strict=False))
    assert (cs[0] == 0) == zero


@pytest.mark.parametrize(
    "coefficients, error",
    [
        ([], ValueError),
        ([0, 1], ValueError),
        ([-1, 2], ValueError),
        ([2, 1], ValueError),
        ([1, 1], ValueError),
        ([1, float("nan")], ValueError),
        ("quadratic", ValueError),
        (["a"], TypeError),
    ],
)
def test_bad_coefficients(coefficients, error):
    with pytest.raises(error):
        resolve_coefficients(coefficients)


def test_bad_max_candidates():
    with pytest.raises(ValueError, match="max_candidates"):
        resolve_coefficients("geometric", 0)
