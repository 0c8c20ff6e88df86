"""When to search, and which extrapolation coefficients to try.

A ``Schedule`` answers one question, ``is_search_step(step)``, for optimizer steps counted
from 1. The coefficient helpers turn the user's ``coefficients=`` option into the ordered
tuple of ``c`` values tried at each search (candidate ``W + c·Δ``).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Sequence
from typing import Union

__all__ = [
    "Schedule",
    "PowersOfTwo",
    "Every",
    "Steps",
    "make_schedule",
    "resolve_coefficients",
    "ScheduleSpec",
    "CoefficientSpec",
    "COEFFICIENT_SCHEMES",
]

# The named coefficient schemes, the default first.
COEFFICIENT_SCHEMES = ("geometric", "linear")


class Schedule:
    """Base class: decides whether optimizer step ``step`` (1-based) runs a search."""

    def is_search_step(self, step: int) -> bool:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class PowersOfTwo(Schedule):
    """Search after steps 1, 2, 4, 8, … (the EffOPD trigger ``t & (t - 1) == 0``)."""

    def is_search_step(self, step: int) -> bool:
        return step >= 1 and (step & (step - 1)) == 0


class Every(Schedule):
    """Search after every ``n``-th step: n, 2n, 3n, …"""

    def __init__(self, n: int) -> None:
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"every must be a positive int, got {n!r}")
        self.n = n

    def is_search_step(self, step: int) -> bool:
        return step >= 1 and step % self.n == 0

    def __repr__(self) -> str:
        return f"Every({self.n})"


class Steps(Schedule):
    """Search after an explicit set of steps (positive ints)."""

    def __init__(self, steps: Iterable[int]) -> None:
        values = list(steps)
        for s in values:
            if isinstance(s, bool) or not isinstance(s, int) or s < 1:
                raise ValueError(f"schedule steps must be positive ints, got {s!r} in {values!r}")
        if not values:
            raise ValueError("schedule steps must not be empty")
        self.steps = frozenset(values)

    def is_search_step(self, step: int) -> bool:
        return step in self.steps

    def __repr__(self) -> str:
        return f"Steps({sorted(self.steps)})"


ScheduleSpec = Union[str, Schedule, Iterable[int]]
CoefficientSpec = Union[str, Sequence[float]]


def make_schedule(schedule: ScheduleSpec = "powers_of_two", every: int | None = None) -> Schedule:
    """Build a ``Schedule`` from ``"powers_of_two"``, a ``Schedule``, an iterable of steps,
    or ``every=N`` (which requires ``schedule`` left at its default)."""
    if every is not None:
        if schedule != "powers_of_two":
            raise ValueError(f"give either schedule={schedule!r} or every={every!r}, not both")
        return Every(every)
    if isinstance(schedule, Schedule):
        return schedule
    if isinstance(schedule, str):
        if schedule == "powers_of_two":
            return PowersOfTwo()
        try:  # "1,2,8": the command-line form of a list of steps
            steps = [int(x) for x in schedule.split(",") if x.strip()]
        except ValueError:
            steps = []
        if not steps:
            raise ValueError(
                f"unknown schedule {schedule!r}; use 'powers_of_two', every=N, comma-separated "
                "steps, a Schedule, or an iterable of step numbers"
            )
        return Steps(steps)
    if isinstance(schedule, Iterable):
        return Steps(schedule)
    raise TypeError(f"schedule must be a str, a Schedule or an iterable of ints, got {schedule!r}")


def resolve_coefficients(
    coefficients: CoefficientSpec = "geometric",
    max_candidates: int | None = None,
    *,
    allow_zero: bool = False,
) -> tuple[float, ...]:
    """The ordered coefficients tried at each search.

    ``"geometric"``: 1, 2, 4, 8, 16 (2^k, the EffOPD summary's jumps); ``"linear"``: 2, 4, 6,
    8, 10 (2k, the paper's code). Named schemes give ``max_candidates`` values (default 5); an
    explicit increasing sequence is used whole unless ``max_candidates`` cuts it. With
    ``allow_zero`` (the averaged direction, where c = 0 is the window average) named schemes
    start with 0 and explicit sequences may contain 0.
    """
    if max_candidates is not None and (
        isinstance(max_candidates, bool) or not isinstance(max_candidates, int) or max_candidates < 1
    ):
        raise ValueError(f"max_candidates must be a positive int, got {max_candidates!r}")
    if isinstance(coefficients, str) and coefficients not in COEFFICIENT_SCHEMES:
        try:  # "0.5,1,2": the command-line form of a list of numbers
            coefficients = [float(c) for c in coefficients.split(",")]
        except ValueError:
            raise ValueError(
                f"coefficients must be one of {COEFFICIENT_SCHEMES} or increasing positive "
                f"numbers (a sequence or comma-separated), got {coefficients!r}"
            ) from None
    if isinstance(coefficients, str):
        n = 5 if max_candidates is None else max_candidates
        if coefficients == "geometric":
            values = [float(2**k) for k in range(n)]
        else:  # linear
            values = [float(2 * k) for k in range(1, n + 1)]
        if allow_zero:
            values = [0.0] + values[: n - 1] if n > 1 else [0.0]
        return tuple(values)
    try:
        values = [float(c) for c in coefficients]
    except (TypeError, ValueError):
        raise TypeError(
            f"coefficients must be one of {COEFFICIENT_SCHEMES} or a sequence of numbers, "
            f"got {coefficients!r}"
        ) from None
    if not values:
        raise ValueError("coefficients must not be empty")
    floor = "non-negative" if allow_zero else "positive"
    for c in values:
        if not math.isfinite(c) or c < 0 or (c == 0 and not allow_zero):
            raise ValueError(f"coefficients must be finite and {floor}, got {c!r} in {values!r}")
    if any(b <= a for a, b in itertools.pairwise(values)):
        raise ValueError(f"coefficients must be strictly increasing, got {values!r}")
    if max_candidates is not None:
        values = values[:max_candidates]
    return tuple(values)
