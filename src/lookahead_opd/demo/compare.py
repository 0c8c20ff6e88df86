"""Run OPD variants from one student and compare them: the demo's and the benchmarks' engine.

``run_variant`` trains a fresh copy of the student with one ``OPDConfig`` through the real
``OPDTrainer`` (``HFEngine`` over the copy) and returns what a comparison needs: the eval
curve, the wall-clock at every step (gate evals included, measurement evals excluded), the
reverse-KL curve and every ``JumpRecord``. ``steps_to_target`` and ``jump_survival`` read those.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from lookahead_opd.integrations.opd.config import OPDConfig
from lookahead_opd.integrations.opd.tasks import Task

__all__ = ["run_variant", "steps_to_target", "jump_survival"]


def run_variant(config: OPDConfig, student: nn.Module, teacher: nn.Module, task: Task,
                tokenizer: Any, *,
                callbacks: Callable[[nn.Module], Sequence[Callable[[dict[str, Any]], None]]] | None = None,
                on_student: Callable[[nn.Module], Any] | None = None,
                engine_batch_size: int = 1024,
                trainer_class: type | None = None) -> dict[str, Any]:
    """Train a deep copy of ``student`` with ``config``; ``student`` itself is not touched.

    ``callbacks(copy)`` returns the ``OPDTrainer`` callbacks for the copy being trained (to
    watch its weights); ``on_student(copy)`` is called with the trained copy before it is
    dropped, and its return value is stored under ``"extra"``. ``trainer_class`` replaces
    ``OPDTrainer`` with a subclass (e.g. one whose ``gate_score`` adds a constraint).
    """
    from lookahead_opd.integrations.opd.engines import HFEngine
    from lookahead_opd.integrations.opd.trainer import OPDTrainer

    config.validate()  # its own values: a variant's fields are the caller's
    torch.manual_seed(config.seed)
    model = copy.deepcopy(student)
    engine = HFEngine(model, tokenizer, batch_size=engine_batch_size)
    trainer = (trainer_class or OPDTrainer)(
        config, model, teacher, task, engine, tokenizer=tokenizer,
        callbacks=list(callbacks(model)) if callbacks else None)
    t0 = time.perf_counter()
    result = trainer.train()
    wall = time.perf_counter() - t0
    return {
        "evals": [list(e) for e in result.evals],
        "train_seconds": {m["step"]: m["train_seconds"] for m in result.metrics},
        "reverse_kl": [(m["step"], m["reverse_kl"]) for m in result.metrics if "reverse_kl" in m],
        "jumps": result.jumps,
        "summary": None if result.summary is None else result.summary.to_dict(),
        "gate_evals": trainer.gate_evals,
        "gate_seconds": trainer.gate_seconds,
        "wall_seconds": wall,
        "final_accuracy": result.evals[-1][1] if result.evals else None,
        "extra": None if on_student is None else on_student(model),
    }


def steps_to_target(evals: Sequence[Sequence[float]], target: float) -> int | None:
    """First evaluated step whose accuracy reaches ``target`` (``None`` if never)."""
    return next((int(s) for s, a in evals if a >= target), None)


def jump_survival(run: dict[str, Any], plain: dict[str, Any], horizon: int) -> list[dict[str, Any]]:
    """For each accepted jump at step s: is the run still ahead of ``plain`` (same seed) at the
    first eval at or after ``s + horizon``? A jump that wins the gate by one problem and is
    gone a few steps later was noise."""
    def at(evals: Sequence[Sequence[float]], step: int) -> float | None:
        return next((a for s, a in evals if s >= step), None)

    out = []
    for j in run["jumps"]:
        if j["accepted"] is None:
            continue
        mine, theirs = at(run["evals"], j["step"] + horizon), at(plain["evals"], j["step"] + horizon)
        out.append({"step": j["step"], "coefficient": j["accepted"],
                    "ahead_after": None if mine is None or theirs is None else mine > theirs,
                    "margin": None if mine is None or theirs is None else mine - theirs})
    return out
