"""What the training-framework callbacks (HF ``Trainer``, Lightning) share: checking the
``Extrapolator`` options a user passes, and the scalars one search sends to the loggers.
Torch and the core only, so each adapter imports it without the other's framework."""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

import torch

from lookahead_opd import Extrapolator, JumpRecord, Summary

__all__ = [
    "LOG_PREFIX",
    "RESERVED_OPTIONS",
    "check_extrapolator_options",
    "jump_scalars",
    "summary_scalars",
]

LOG_PREFIX = "extrapolation/"
# Options a callback sets itself: the params, the gate and the framework's optimizer.
RESERVED_OPTIONS = ("params", "eval_fn", "optimizer")


def check_extrapolator_options(options: Mapping[str, Any]) -> None:
    """Reject unknown, reserved or invalid ``Extrapolator`` options at construction, not when
    training starts. Snapshot settings are checked when the real extrapolator is built (a
    low-rank reference names the model's own parameters)."""
    accepted = set(inspect.signature(Extrapolator.__init__).parameters) - {"self", *RESERVED_OPTIONS}
    reserved = sorted(set(options) & set(RESERVED_OPTIONS))
    if reserved:
        raise TypeError(
            f"{reserved} are set by ExtrapolationCallback itself "
            "(the params come from params=, the optimizer from the trainer)"
        )
    unknown = sorted(set(options) - accepted)
    if unknown:
        raise TypeError(f"unknown Extrapolator options {unknown}; accepted: {sorted(accepted)}")
    probe = {k: v for k, v in options.items() if k not in ("snapshot", "rank", "reference")}
    dummy = torch.zeros(1)
    Extrapolator([dummy], lambda: 0.0, optimizer=torch.optim.SGD([dummy], lr=0.0), **probe)


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
