"""The real teacher's reference distance (benchmarks/builders/real_teacher.py): the SFT teacher of equal
accuracy is read between the probes that bracket the RL teacher's accuracy, not at the first
probe past it, which would overstate it in the RL teacher's favour."""

import pytest

from benchmarks.builders.real_teacher import equal_accuracy_distance

PROBES = [(0, 0.2, 0.0), (10, 0.3, 0.001), (20, 0.5, 0.002), (30, 0.7, 0.003)]


def test_interpolates_between_the_bracketing_probes():
    assert equal_accuracy_distance(PROBES, 0.4) == pytest.approx(0.0015)
    assert equal_accuracy_distance(PROBES, 0.5) == pytest.approx(0.002)
    assert equal_accuracy_distance(PROBES, 0.25) == pytest.approx(0.0005)


def test_takes_the_first_crossing_when_accuracy_is_not_monotone():
    noisy = [(0, 0.2, 0.0), (10, 0.45, 0.001), (20, 0.35, 0.002), (30, 0.6, 0.003)]
    assert equal_accuracy_distance(noisy, 0.4) == pytest.approx(0.0008)


def test_never_reached_gives_the_last_probe():
    assert equal_accuracy_distance(PROBES, 0.9) == 0.003


def test_a_base_already_at_the_accuracy_is_distance_zero():
    assert equal_accuracy_distance(PROBES, 0.1) == 0.0
