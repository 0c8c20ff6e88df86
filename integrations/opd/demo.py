"""``lookahead-opd demo``: plain OPD vs EffOPD from the same student, measured side by side.

1. Build (or load from the cache) a tiny base model pretrained from scratch on generated
   arithmetic, and a teacher: the same base trained further (``--teacher_regime same-base``,
   the paper's setting) or an independently trained model (``independent``).
2. Distill the base toward the teacher twice with the same seed, prompts and rollout seeds:
   plain AdamW, then AdamW wrapped in ``ExtrapolatingOptimizer`` gated on a fixed gate set.
3. Report steps and wall-clock (rollouts, scoring, updates and gate evaluations; the
   measurement evals are excluded) to reach 90% of the teacher's accuracy, final accuracy and
   accepted jumps; write ``results.json`` and ``accuracy_vs_step.png`` under ``--output_dir``.

The demo reports what it measures: on tiny models a speed-up is not guaranteed (see
``docs/algorithm.md``), and the table says so when EffOPD does not help.
"""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from lookahead_opd.options import option

from ..cli_support import check_output_dir, quiet_loading_bars
from .config import OPDConfig, parse_dataclass, with_defaults
from .zoo import TEACHER_REGIMES, ZOO_SIZES

__all__ = ["DemoConfig", "run_demo", "main", "format_table"]


# The demo's defaults where they differ from a training run's. From
# benchmarks/results/speedup.md: at 64 prompts per step no run reached 0.9x the teacher in 600
# steps; at 256 both plain OPD and EffOPD did, in 330-360 steps. The loss is the full-vocabulary
# reverse_kl: the sampled-token reverse_kl_pg barely learns this task from a near one-hot teacher.
_DemoDefaults = with_defaults(OPDConfig, output_dir="runs/demo", max_steps=450, batch_size=256,
                              learning_rate=1e-3, warmup_steps=4, loss="reverse_kl")


@dataclass
class DemoConfig(_DemoDefaults):
    """Options of ``lookahead-opd demo`` (the CLI is generated from this dataclass): every
    ``OPDConfig`` option of both runs, plus how the models are built and the target. The demo
    sets ``student``, ``teacher`` (the built pair), ``extrapolate`` (one run each) and each
    run's ``output_dir`` (under this one) itself, so those get no flag; it runs in one process,
    so neither do the FSDP options."""

    CLI_HIDDEN: ClassVar[tuple[str, ...]] = ("student", "teacher", "extrapolate", "resume",
                                             "overwrite_output_dir", "fsdp", "fsdp_teacher",
                                             "fsdp_mixed_precision", "teacher_url", "teachers",
                                             "teacher_key", "default_teacher",
                                             "teacher_max_inflight", "teacher_timeout",
                                             "teacher_retries")

    cache_dir: str | None = option(None, "model cache (default $LOOKAHEAD_OPD_CACHE or "
                                   "~/.cache/lookahead-opd)")
    size: str = option("tiny", "model size in the zoo", choices=tuple(ZOO_SIZES))
    teacher_regime: str = option(TEACHER_REGIMES[0], "teacher", choices=TEACHER_REGIMES)
    target_fraction: float = option(0.9, "target = this × teacher accuracy")
    export_dir: str | None = option(None, "copy the student and teacher here, as student/ and "
                                    "teacher/, for `lookahead-opd train` (default: "
                                    "<output_dir>/models)")
    quick: bool = option(False, "a smaller configuration, for CI")

    def apply_quick(self) -> DemoConfig:
        """The CI configuration: fewer steps, smaller sets, same code path."""
        if not self.quick:
            return self
        return dataclasses.replace(self, max_steps=min(self.max_steps, 8), batch_size=min(self.batch_size, 16),
                                   gate_size=min(self.gate_size, 20), eval_size=min(self.eval_size, 50),
                                   eval_every=min(self.eval_every, 2))

    def validate(self, *, check_paths: bool = True) -> None:
        """Raise ``ValueError`` naming the first bad option; nothing is built or loaded (the
        models are the demo's own, so ``student`` and ``teacher`` are not checked)."""
        super().validate(check_paths=False)
        if not 0 < self.target_fraction <= 1:
            raise ValueError(f"target_fraction must be in (0, 1], got {self.target_fraction}")
        if check_paths:
            check_output_dir(self.output_dir)
            check_output_dir(str(self.models_dir()), "export_dir")

    def models_dir(self) -> Path:
        """Where the built student and teacher are copied."""
        return Path(self.export_dir) if self.export_dir else Path(self.output_dir) / "models"


def _run_one(cfg: DemoConfig, models: dict[str, Any], *, extrapolate: bool) -> dict[str, Any]:
    from .compare import run_variant
    from .tasks import load_task

    name = "effopd" if extrapolate else "opd"
    config = OPDConfig(**{**{f.name: getattr(cfg, f.name) for f in dataclasses.fields(OPDConfig)},
                          "student": models["student_path"], "teacher": models["teacher_path"],
                          "output_dir": str(Path(cfg.output_dir) / name),
                          "extrapolate": extrapolate, "resume": False,
                          "overwrite_output_dir": True})  # each demo remakes its runs
    return run_variant(config, models["student"], models["teacher"], load_task(cfg.task),
                       models["tokenizer"], engine_batch_size=256)


def export_models(student: Path, teacher: Path, export_dir: Path) -> tuple[Path, Path]:
    """Copy the two saved models to ``export_dir``/student and /teacher (replacing an earlier
    export): a stable place for ``lookahead-opd train``, where the cache's folder names change
    with the build's parameters."""
    out = []
    for src, name in ((student, "student"), (teacher, "teacher")):
        dst = export_dir / name
        if dst.exists():
            shutil.rmtree(dst)
        shutil.copytree(src, dst)
        out.append(dst)
    return out[0], out[1]


def run_demo(cfg: DemoConfig) -> dict[str, Any]:
    """Build or load the models, run plain OPD and EffOPD, write and return the results."""
    import torch

    from .zoo import build_pair

    cfg = cfg.apply_quick()
    cfg.validate()
    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    pair = build_pair(cfg.cache_dir, task_spec=cfg.task, size=cfg.size,
                      teacher_regime=cfg.teacher_regime, seed=cfg.seed, progress=cfg.progress)
    build_seconds = time.perf_counter() - t0
    student_dir, teacher_dir = export_models(pair.student_path, pair.teacher_path,
                                             cfg.models_dir())
    print(f"models: --student {student_dir} --teacher {teacher_dir} (for lookahead-opd train)",
          flush=True)
    teacher_acc = pair.accuracies["teacher"]
    target = cfg.target_fraction * teacher_acc
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .compare import steps_to_target

    models = {"student_path": str(pair.student_path), "teacher_path": str(pair.teacher_path),
              "tokenizer": AutoTokenizer.from_pretrained(pair.student_path),
              "student": AutoModelForCausalLM.from_pretrained(pair.student_path, dtype=torch.float32),
              "teacher": AutoModelForCausalLM.from_pretrained(pair.teacher_path, dtype=torch.float32)}
    runs = {"opd": _run_one(cfg, models, extrapolate=False),
            "effopd": _run_one(cfg, models, extrapolate=True)}
    for run in runs.values():
        step = steps_to_target(run["evals"], target)
        run["steps_to_target"] = step
        run["seconds_to_target"] = None if step is None else run["train_seconds"][step]
        run["accepted_jumps"] = sum(j["accepted"] is not None for j in run["jumps"])
        run["searches"] = len(run["jumps"])
    results = {
        "config": dataclasses.asdict(cfg),
        "models": {"student": str(student_dir), "teacher": str(teacher_dir),
                   "cache": {"student": str(pair.student_path), "teacher": str(pair.teacher_path)},
                   "accuracies": pair.accuracies, "build_seconds": build_seconds},
        "teacher_accuracy": teacher_acc,
        "target_accuracy": target,
        "runs": runs,
        "speedup_steps": _ratio(runs["opd"]["steps_to_target"], runs["effopd"]["steps_to_target"]),
        "speedup_seconds": _ratio(runs["opd"]["seconds_to_target"], runs["effopd"]["seconds_to_target"]),
    }
    (out / "results.json").write_text(json.dumps(results, indent=2))
    _plot(results, out / "accuracy_vs_step.png")
    return results


def _ratio(plain: float | None, wrapped: float | None) -> float | None:
    if plain is None or wrapped is None or wrapped == 0:
        return None
    return plain / wrapped


def format_table(results: dict[str, Any]) -> str:
    """The demo's printed summary."""
    t = results["target_accuracy"]
    lines = [
        f"teacher accuracy {results['teacher_accuracy']:.1%}, student start "
        f"{results['runs']['opd']['evals'][0][1]:.1%}, target {t:.1%} "
        f"({results['config']['target_fraction']:g} x teacher)",
        "",
        f"{'run':<8} {'steps to target':>16} {'seconds to target':>18} {'final acc':>10} "
        f"{'jumps kept/searches':>20} {'gate evals':>11}",
    ]
    for name, r in results["runs"].items():
        steps = "not reached" if r["steps_to_target"] is None else str(r["steps_to_target"])
        secs = "—" if r["seconds_to_target"] is None else f"{r['seconds_to_target']:.1f}"
        jumps = "—" if name == "opd" else f"{r['accepted_jumps']}/{r['searches']}"
        gates = "—" if name == "opd" else str(r["gate_evals"])
        lines.append(f"{name:<8} {steps:>16} {secs:>18} {r['final_accuracy']:>10.1%} {jumps:>20} {gates:>11}")
    s, w = results["speedup_steps"], results["speedup_seconds"]
    lines.append("")
    if s is None:
        lines.append("speed-up: not measurable (a run did not reach the target)")
    else:
        every = results["config"]["eval_every"]
        if w is not None and s > 1.1 and w > 1.1:
            verdict = "EffOPD was faster on this seed"
        elif w is not None and (s < 0.9 or w < 0.9):
            verdict = "EffOPD was slower on this seed"
        else:
            verdict = (f"no clear difference (one seed, accuracy measured every {every} steps; "
                       "benchmarks/results/speedup.md has several)")
        lines.append(f"speed-up (OPD / EffOPD): {s:.2f}x in steps, {w:.2f}x in wall-clock: {verdict}")
    return "\n".join(lines)


def _plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, label in (("opd", "OPD"), ("effopd", "EffOPD")):
        steps, acc = zip(*results["runs"][name]["evals"], strict=True)
        ax.plot(steps, acc, marker=".", label=label)
    kept = [j["step"] for j in results["runs"]["effopd"]["jumps"] if j["accepted"] is not None]
    for k, s in enumerate(kept):
        ax.axvline(s, color="tab:orange", alpha=0.3, ls="--", label="accepted jump" if k == 0 else None)
    ax.axhline(results["target_accuracy"], color="gray", ls=":", label="target")
    ax.axhline(results["teacher_accuracy"], color="black", ls=":", lw=0.8, label="teacher")
    ax.set_xlabel("OPD step")
    ax.set_ylabel("greedy accuracy (held-out)")
    ax.set_ylim(0, 1.02)
    ax.legend(loc="lower right")
    ax.set_title("OPD vs EffOPD from the same student")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    import torch

    try:  # bad input: one clear line and status 2, before anything is built or loaded
        cfg = parse_dataclass(DemoConfig, list(argv or []), prog="lookahead-opd demo")
        cfg.validate()
    except ValueError as err:
        print(f"lookahead-opd demo: {err}", file=sys.stderr)
        return 2
    if cfg.threads is not None:  # the command's choice, for the whole process
        torch.set_num_threads(cfg.threads)
    if not cfg.progress:
        quiet_loading_bars()
    results = run_demo(cfg)
    print(format_table(results))
    print(f"\nwrote {Path(cfg.output_dir) / 'results.json'} and accuracy_vs_step.png")
    return 0 if not math.isnan(results["teacher_accuracy"]) else 1
