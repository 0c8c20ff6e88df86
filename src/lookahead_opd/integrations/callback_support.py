"""What the training-framework callbacks (HF ``Trainer``, Lightning) share: choosing the
parameters, checking the ``Extrapolator`` options a user passes, building the extrapolator, and
the scalars one search sends to the loggers.
Torch and the core only, so each adapter imports it without the other's framework."""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from typing import Any

from torch import nn

from lookahead_opd import ExtrapolationOptions, Extrapolator, JumpRecord, Summary
from lookahead_opd.extrapolator import ParamsSpec
from lookahead_opd.selection import PARAM_SELECTORS
from lookahead_opd.snapshot import SnapshotStore

__all__ = ["LOG_PREFIX", "PARAM_SELECTORS", "RESERVED_OPTIONS", "check_extrapolator_options",
           "param_selector", "build_extrapolator", "jump_scalars", "summary_scalars"]

LOG_PREFIX = "extrapolation/"
# Options a callback sets itself: the params, the gate and the framework's optimizer.
RESERVED_OPTIONS = ("params", "eval_fn", "optimizer")


def param_selector(params: str | Callable[[nn.Module], ParamsSpec]
                   ) -> Callable[[nn.Module], ParamsSpec]:
    """``params=`` as a function model -> params: a ``PARAM_SELECTORS`` name or a callable."""
    if isinstance(params, str):
        if params not in PARAM_SELECTORS:
            raise ValueError(f"params must be one of {tuple(PARAM_SELECTORS)} or a callable "
                             f"model -> params, got {params!r}")
        return PARAM_SELECTORS[params]
    if not callable(params):
        raise TypeError(f"params must be a str or a callable model -> params, got {params!r}")
    return params


def check_extrapolator_options(options: Mapping[str, Any]) -> None:
    """Reject unknown, reserved or invalid ``Extrapolator`` options at construction, not when
    training starts."""
    reserved = sorted(set(options) & set(RESERVED_OPTIONS))
    if reserved:
        raise TypeError(
            f"{reserved} are set by ExtrapolationCallback itself "
            "(the params come from params=, the optimizer from the trainer)"
        )
    if ExtrapolationOptions.from_kwargs(options).lr_follow is not None:
        raise ValueError("lr_follow scales the optimizer's steps inside ExtrapolatingOptimizer."
                         "step(); pass Trainer(optimizers=(ExtrapolatingOptimizer(...), None)) "
                         "to use it")


def build_extrapolator(params: ParamsSpec, eval_fn: Callable[[], float], optimizer: Any,
                       options: Mapping[str, Any]) -> Extrapolator:
    """The callback's ``Extrapolator`` for one training run. A ``SnapshotStore`` given as
    ``snapshot=`` is copied, so that each run starts from an empty anchor."""
    options = dict(options)
    store = options.get("snapshot")
    if isinstance(store, SnapshotStore):
        if len(store) > 0:
            raise ValueError(
                "the SnapshotStore passed as snapshot= already holds an anchor from an "
                "earlier run; pass snapshot='full' or 'lowrank' to get a fresh store per run"
            )
        options["snapshot"] = copy.deepcopy(store)
    return Extrapolator(params, eval_fn, optimizer=optimizer, **options)


def jump_scalars(record: JumpRecord, history: list[JumpRecord] | None = None) -> dict[str, float]:
    """The scalars one search adds to the logs, all floats (TensorBoard drops ``None``):
    ``accepted`` is 1.0 or 0.0, ``coefficient`` the kept ``c`` (0.0 when none was); with
    ``history`` also the running totals ``searches``, ``jumps`` and ``evals``; the geometry
    of the direction when it was logged. Keys carry ``LOG_PREFIX``."""
    logs = {
        "accepted": float(record.accepted is not None),
        "coefficient": float(record.accepted) if record.accepted is not None else 0.0,
        "score_before": float(record.score_before),
        "best_score": float(record.best_score),
        "n_evals": float(record.n_evals),
        "seconds": float(record.seconds),
        "direction_norm": float(record.direction_norm),
        "step": float(record.step),
    }
    for k in ("secant_cosine", "norm_ratio"):  # None at the first search
        if getattr(record, k) is not None:
            logs[k] = float(getattr(record, k))
    if history is not None:
        logs["searches"] = float(len(history))
        logs["jumps"] = float(sum(r.accepted is not None for r in history))
        logs["evals"] = float(sum(r.n_evals for r in history))
    for k, v in (record.geometry or {}).items():
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            logs[f"geometry/{k}"] = float(v)
    return {LOG_PREFIX + k: v for k, v in logs.items()}



def summary_scalars(summary: Summary) -> dict[str, float]:
    """``Extrapolator.summary()`` as logger scalars (``None`` dropped), keys under
    ``LOG_PREFIX + "summary/"``."""
    return {f"{LOG_PREFIX}summary/{k}": float(v) for k, v in summary.to_dict().items()
            if v is not None}
