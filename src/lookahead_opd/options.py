"""``ExtrapolationOptions``: every option of the gated search, declared and validated here once.

``Extrapolator`` and ``ExtrapolatingOptimizer`` take these as keyword arguments and build one;
the integrations derive their configs and command lines from the same fields
(``config_fields``), so an option added here reaches ``OPDConfig``, ``lookahead-opd train`` and
the callbacks without another edit. Each field's ``metadata`` holds its ``help`` and, where the
values are a closed set, its ``choices``.
"""

# No ``from __future__ import annotations``: ``config_fields`` hands these types to
# ``dataclasses.make_dataclass`` and argument parsers, which need real types, not strings.
import dataclasses
import math
import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from . import distributed
from .schedule import (
    COEFFICIENT_SCHEMES,
    CoefficientSpec,
    Schedule,
    ScheduleSpec,
    make_schedule,
    resolve_coefficients,
)
from .snapshot import ReferenceSpec, SnapshotStore

__all__ = ["ExtrapolationOptions", "OPTION_NAMES", "PAPER_RULE", "option", "check_choice",
           "check_fields", "config_fields", "SNAPSHOTS"]

SNAPSHOTS = ("full", "lowrank")

PAPER_RULE: Mapping[str, Any] = MappingProxyType(
    {"linearity": 0.0, "on_jump": "keep", "patience": None, "back_off": 0, "margin": 0.0})
"""The search as "Learning to Foresee" published it, and as this library ran it by default
until issue 38: keep the best candidate of any ladder, leave the optimizer's state alone, search
at every scheduled step. ``ExtrapolatingOptimizer(opt, eval_fn, **PAPER_RULE)`` runs it. On
SmolLM2-135M it lost to plain OPD at plain's best lr (the kept jumps cost the end point,
``benchmarks/results/no_harm.md``); the defaults keep a jump only where the lr reads far too
small. The studies made before the change pin it (``benchmarks/harness.py``, ``AS_RUN``)."""


def option(default: Any, help: str, *, choices: Sequence[Any] | None = None,
           minimum: float | None = None, **metadata: Any) -> Any:
    """A dataclass field with a default and a ``help`` line (shown by generated CLIs). With
    ``choices`` the help names them; ``check_fields`` enforces them and ``minimum`` (a lower
    bound, inclusive; None passes). A list default is copied for every instance."""
    if choices is not None:
        help = f"{help}: {' | '.join(map(str, choices))}"
    metadata = {"help": help, "choices": choices, "minimum": minimum, **metadata}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=metadata)
    return field(default=default, metadata=metadata)


def check_choice(name: str, value: object, choices: Sequence[object]) -> None:
    """``ValueError`` naming ``value`` and the accepted ``choices`` unless it is one of them."""
    if value not in choices:
        raise ValueError(f"{name} must be one of {tuple(choices)}, got {value!r}")


def check_fields(config: Any, *, skip: Sequence[str] = ()) -> None:
    """Enforce the ``choices`` and ``minimum`` that the fields of the dataclass ``config``
    were declared with (by ``option``), naming the first bad value."""
    for f in dataclasses.fields(config):
        value, choices, minimum = getattr(config, f.name), f.metadata.get("choices"), f.metadata.get("minimum")
        if f.name in skip:
            continue
        if choices is not None:
            check_choice(f.name, value, choices)
        if minimum is not None and value is not None:
            if not isinstance(value, numbers.Real):  # bools: the field's own check
                raise TypeError(f"{f.name} must be a number >= {minimum}, got {value!r}")
            if value < minimum:
                raise ValueError(f"{f.name} must be >= {minimum}, got {value!r}")


@dataclass(frozen=True)
class ExtrapolationOptions:
    """The options of the gated search (see ``Extrapolator``). Validated on construction."""

    mode: str = option("max", "the gate score is maximised or minimised", choices=("max", "min"))
    min_improvement: float = option(0.0, "a candidate must beat the best score by more than this")
    margin: float = option(
        0.0, "a candidate must also beat the best by more than this many standard errors of "
        "the per-example differences (eval_fn returns one score per example, the same examples "
        "at every call; 0: off)", minimum=0.0)
    back_off: int = option(
        0, "when a candidate's score turns worse, keep the candidate this many before the best "
        "(W_t when there are not that many): the best lies near where the score turns, and an "
        "overshoot of the gate's best costs the run later at a well-tuned lr; nothing changes "
        "when every candidate improved (0: off)", minimum=0)
    linearity: float = option(
        0.5, "keep a jump only from a ladder on which every candidate beat the best and whose "
        "last rung gained, per unit of c, at least this fraction of what the rung before it "
        "gained (the rungs join W_t's score at c = 0 and the candidates'): at a too-small lr "
        "the gate's gain is still near linear in c, at a tuned lr it bends before the score "
        "turns; fewer than two rungs keep nothing (0: off, the paper's rule)", minimum=0.0)
    schedule: ScheduleSpec = option(
        "powers_of_two", "search steps: powers_of_two, comma-separated steps, a Schedule or an "
        "iterable of steps", cli_type=str)
    every: int | None = option(None, "search every N steps instead (schedule left at default)")
    coefficients: CoefficientSpec = option(
        COEFFICIENT_SCHEMES[0], f"coefficients c tried in order: {' | '.join(COEFFICIENT_SCHEMES)} "
        "| increasing numbers (comma-separated)", cli_type=str)
    max_candidates: int | None = option(
        None, "candidates tried per search at most (named coefficients: 5 by default)")
    patience: int | None = option(
        3, "stop searching for good once this many searches in a row kept no jump, and free "
        "the anchor (None: search at every scheduled step; 3 lost no kept jump in any recorded "
        "run with the -KL gate)")
    lr_follow: float | None = option(
        None, "experimental, ExtrapolatingOptimizer only: after a kept jump of c, scale the base "
        "optimizer's steps (1 + c) times more, up to this factor; halve the scale (not below 1) "
        "when a search refuses its first candidate (None: off)")
    snapshot: Any = option(SNAPSHOTS[0], "the anchor's store (also a SnapshotStore object)", choices=SNAPSHOTS,
                           cli_type=str)
    rank: int | None = option(None, "rank of the lowrank snapshot")
    reference: ReferenceSpec = option(None, "lowrank snapshot's reference weights (default: the "
                                      "initial ones)", cli_type=None)
    offload: str | None = option(None, "keep the anchor and restore buffer on this device "
                                    "instead of the parameters'", choices=(None, "cpu"))
    direction: str = option("secant", "the jump's direction, W_t − anchor (the paper's) or the "
                            "difference of window averages", choices=("secant", "averaged"))
    direction_rank: int | None = option(
        None, "extrapolate each 2-D weight along the top-r singular subspace of its update only "
        "(None: the raw direction)")
    on_jump: str = option("reset", "the optimizer state after an accepted jump: reset clears it "
                          "(Adam's moments describe the point before the jump; it needs the "
                          "optimizer), keep is the paper's", choices=("keep", "reset"))
    reduce: str = option("mean", "how gate scores combine across torch.distributed ranks",
                         choices=distributed.REDUCTIONS)
    process_group: Any = option(None, "torch.distributed group of the reduction", cli_type=None)
    log_geometry: bool = option(False, "record the geometry of each search's direction")

    @classmethod
    def from_kwargs(cls, options: Mapping[str, Any]) -> "ExtrapolationOptions":
        """Build from keyword options, with a ``TypeError`` naming any unknown one."""
        unknown = sorted(set(options) - set(OPTION_NAMES))
        if unknown:
            raise TypeError(f"unknown Extrapolator options {unknown}; accepted: {list(OPTION_NAMES)}")
        return cls(**options)

    def __post_init__(self) -> None:
        check_fields(self, skip=("snapshot",) if isinstance(self.snapshot, SnapshotStore) else ())
        m = self.min_improvement
        if isinstance(m, bool) or not isinstance(m, numbers.Real):
            raise TypeError(f"min_improvement must be a number, got {m!r}")
        if not math.isfinite(m) or m < 0:
            raise ValueError(f"min_improvement must be finite and >= 0, got {m!r}")
        z = self.margin
        if isinstance(z, bool) or not isinstance(z, numbers.Real) or not math.isfinite(z):
            raise ValueError(f"margin must be a finite number >= 0, got {z!r}")
        q = self.linearity
        if isinstance(q, bool) or not isinstance(q, numbers.Real) or not math.isfinite(q):
            raise ValueError(f"linearity must be a finite number >= 0, got {q!r}")
        b = self.back_off
        if isinstance(b, bool) or not isinstance(b, int):
            raise ValueError(f"back_off must be an int >= 0 (candidates to step back), got {b!r}")
        for name in ("direction_rank", "rank", "patience"):
            r = getattr(self, name)
            if r is not None and (isinstance(r, bool) or not isinstance(r, int) or r < 1):
                raise ValueError(f"{name} must be None or an int >= 1, got {r!r}")
        f = self.lr_follow
        if f is not None and (isinstance(f, bool) or not isinstance(f, numbers.Real)
                              or not math.isfinite(f) or f <= 1):
            raise ValueError(f"lr_follow must be None or a finite number > 1 (the largest "
                             f"factor on the base optimizer's lr), got {f!r}")
        if isinstance(self.snapshot, SnapshotStore):
            if self.rank is not None or self.reference is not None:
                raise ValueError("rank= and reference= configure a snapshot by name; set them on "
                                 "the store")
        elif self.snapshot == "lowrank" and self.rank is None:
            raise ValueError("snapshot='lowrank' needs rank=r (a positive int)")
        elif self.snapshot == "full" and (self.rank is not None or self.reference is not None):
            raise ValueError("rank= and reference= apply to snapshot='lowrank' only")
        self.make_schedule()
        self.coefficient_values()

    def make_schedule(self) -> Schedule:
        """The search schedule these options name."""
        return make_schedule(self.schedule, self.every)

    def coefficient_values(self) -> tuple[float, ...]:
        """The ordered coefficients tried at each search (0 first for the averaged direction)."""
        return resolve_coefficients(self.coefficients, self.max_candidates,
                                    allow_zero=self.direction == "averaged")


OPTION_NAMES = tuple(f.name for f in dataclasses.fields(ExtrapolationOptions))


def config_fields(*, exclude: Sequence[str] = (), defaults: dict[str, Any] | None = None
                  ) -> list[tuple[str, Any, Any]]:
    """The options a config file or a command line can set, as ``dataclasses.make_dataclass``
    field specs: plain types (``str`` for options that also take objects), the defaults
    (``defaults`` overrides some), and a ``help`` that names the accepted values. Options that
    only take objects (``reference``, ``process_group``) and ``exclude`` are left out."""
    defaults = dict(defaults or {})
    specs = []
    for f in dataclasses.fields(ExtrapolationOptions):
        cli_type = f.metadata.get("cli_type", f.type)
        if f.name in exclude or cli_type is None:
            continue
        default = defaults.pop(f.name, f.default)
        specs.append((f.name, cli_type, field(default=default, metadata=f.metadata)))
    if defaults:
        raise ValueError(f"defaults for unknown or excluded options: {sorted(defaults)}")
    return specs
