"""``lookahead-opd demo``: what EffOPD is for, measured — a run from a conservative learning
rate, against plain OPD from the same lr and plain OPD at the best lr.

1. Load the pair: by default the one shipped with the package (``src/lookahead_opd/demo/pairs``: a
   tiny base on generated arithmetic and its Dr. GRPO teacher), the pair of
   ``benchmarks/results/lr_basin.md``'s ``short-512/rl/adamw`` cell; other ``--size`` /
   ``--teacher_regime`` / ``--seed`` values build one from scratch (minutes, then cached).
2. Distill the base toward the teacher from the same seed, prompts and rollout seeds, with no
   lr warm-up: plain AdamW at ``--learning_rate`` (the reference: 5e-4, AdamW's best on the
   shipped pair in ``lr_basin.md``), then from the conservative lr ``--learning_rate`` ×
   ``--conservative``: plain AdamW, AdamW wrapped in ``ExtrapolatingOptimizer`` (EffOPD) and,
   with ``--follow``, EffOPD with the experimental ``lr_follow``. Each run stops at
   ``--target_fraction`` of the teacher's gain over the base.
3. Report steps and training seconds (rollouts, scoring, updates and gate evaluations; the
   measurement evals excluded) to 75% of the gain and to the target, final accuracy, kept jumps,
   each EffOPD run's ``summary()`` and what it hints, and a conclusion drawn from these numbers;
   write ``results.json`` and ``accuracy_vs_step.png`` under ``--output_dir``.

The demo reports what it measures: one seed on a tiny model, stated as such; the lr basin
report has the other starting lrs (best/32 to best×2) and the lr-free Mechanic and Prodigy.
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

from lookahead_opd.integrations.cli_support import (
    check_output_dir,
    parse_dataclass,
    quiet_loading_bars,
)
from lookahead_opd.integrations.opd.config import OPDConfig, with_defaults
from lookahead_opd.options import PAPER_RULE, option

from .zoo import TEACHER_REGIMES, ZOO_SIZES

__all__ = ["DemoConfig", "check_demo", "run_demo", "main", "format_table", "conclusion", "reading", "FOLLOW_CAP"]


# The demo's defaults where they differ from a training run's: those of benchmarks/lr_basin.py
# (its short-512/rl/adamw cell, on the same shipped pair), so the demo reruns that report's
# seed-0 runs: 512 prompts per step, the full-vocabulary reverse KL (the sampled-token
# reverse_kl_pg barely learns this task), no lr warm-up (early kept jumps mostly made up for a
# warm-up, regimes-nowarmup), greedy accuracy every 4 steps on the whole test split (973
# problems; ``eval_size`` is capped at the split), EffOPD gated on −reverse KL over 128 fixed rollouts, a 300-step cap,
# and the search as that report ran it: ``PAPER_RULE``, the defaults before issue 38.
_DemoDefaults = with_defaults(OPDConfig, output_dir="runs/demo", max_steps=300, batch_size=512,
                              learning_rate=5e-4, warmup_steps=0, loss="reverse_kl",
                              eval_every=4, eval_size=1000, gate="neg_kl", gate_size=128,
                              **PAPER_RULE)
FOLLOW_CAP = 32.0  # lr_follow's cap in benchmarks/lr_basin.py: enough to climb from best/32
HEADLINE_FRACTION = 0.75  # of the gain: the lr basin report's headline target (or the stop's, if lower)


@dataclass
class DemoConfig(_DemoDefaults):
    """Options of ``lookahead-opd demo`` (the CLI is generated from this dataclass): every
    ``OPDConfig`` option of the runs, plus how the models are built, the conservative lr and
    the target. The demo sets ``student``, ``teacher`` (the pair), ``extrapolate``,
    ``lr_follow`` and ``stop_at_accuracy`` (per run) and each run's ``output_dir`` (under this
    one) itself, so those get no flag; it runs in one process, so neither do the FSDP
    options, and its shipped pair needs no preflight (``lookahead-opd check``)."""

    CLI_HIDDEN: ClassVar[tuple[str, ...]] = ("student", "teacher", "extrapolate", "resume",
                                             "overwrite_output_dir", "fsdp", "fsdp_teacher",
                                             "fsdp_mixed_precision", "teacher_url", "teachers",
                                             "teacher_key", "default_teacher",
                                             "teacher_max_inflight", "teacher_timeout",
                                             "teacher_retries", "lr_follow", "stop_at_accuracy",
                                             "allow_template_mismatch", "preflight_rollouts")

    cache_dir: str | None = option(None, "model cache (default $LOOKAHEAD_OPD_CACHE or "
                                   "~/.cache/lookahead-opd); the shipped pair needs none")
    size: str = option("tiny", "model size in the zoo", choices=tuple(ZOO_SIZES))
    teacher_regime: str = option("rl", "teacher", choices=TEACHER_REGIMES)
    conservative: float = option(1 / 16, "the conservative runs start at learning_rate × this "
                                 "(< 1)")
    follow: bool = option(True, "also run EffOPD with lr_follow (experimental) from the "
                          "conservative lr", negated_help="no EffOPD + lr_follow run")
    target_fraction: float = option(0.9, "runs stop at this fraction of the teacher's gain over "
                                    "the base (test-split accuracies)")
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

    def validate(self) -> None:
        """Raise ``ValueError`` naming the first bad option: the config's own values only
        (``check_demo`` adds the checks that read the rest of the package)."""
        super().validate()
        if not 0 < self.target_fraction <= 1:
            raise ValueError(f"target_fraction must be in (0, 1], got {self.target_fraction}")
        if not 0 < self.conservative < 1:
            raise ValueError(f"conservative must be in (0, 1): a factor below the reference "
                             f"learning_rate; got {self.conservative}")

    def models_dir(self) -> Path:
        """Where the built student and teacher are copied."""
        return Path(self.export_dir) if self.export_dir else Path(self.output_dir) / "models"

    def plan(self) -> list[dict[str, Any]]:
        """The runs, in order: name, what it is, lr, and its ``OPDConfig`` fields."""
        ref, low = self.learning_rate, self.learning_rate * self.conservative
        runs = [dict(name="reference", label="plain OPD at the reference lr", lr=ref, fields={}),
                dict(name="plain", label="plain OPD from the conservative lr", lr=low, fields={}),
                dict(name="effopd", label="EffOPD from the conservative lr", lr=low,
                     fields={"extrapolate": True})]
        if self.follow:
            runs.append(dict(name="effopd-follow", label="EffOPD + lr_follow (experimental)",
                             lr=low, fields={"extrapolate": True, "lr_follow": FOLLOW_CAP}))
        return runs


def _run_one(cfg: DemoConfig, models: dict[str, Any], run: dict[str, Any],
             stop_at: float) -> dict[str, Any]:
    from lookahead_opd.integrations.opd.tasks import load_task

    from .compare import run_variant

    task = load_task(cfg.task)
    config = OPDConfig(**{**{f.name: getattr(cfg, f.name) for f in dataclasses.fields(OPDConfig)},
                          "student": models["student_path"], "teacher": models["teacher_path"],
                          "output_dir": str(Path(cfg.output_dir) / run["name"]),
                          "learning_rate": run["lr"], "extrapolate": False, "lr_follow": None,
                          **run["fields"], "stop_at_accuracy": stop_at, "resume": False,
                          "overwrite_output_dir": True,  # each demo remakes its runs
                          # at most the whole test split (the default asks for all of it)
                          "eval_size": min(cfg.eval_size, len(task.problems("test")))})
    # The engine batch of benchmarks/harness.py's runs, so the demo reruns lr_basin's.
    return run_variant(config, models["student"], models["teacher"], task, models["tokenizer"],
                       engine_batch_size=1024)


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


def check_demo(cfg: DemoConfig) -> DemoConfig:
    """``cfg`` as it runs (``apply_quick``), after every check that can run before anything is
    built or loaded, once: those of a training run (``train.check_run``; the models are the
    demo's own, so ``student`` and ``teacher`` are not checked) and the output folders."""
    from lookahead_opd.integrations.opd.train import check_run

    cfg = cfg.apply_quick()
    check_run(cfg, check_paths=False)
    check_output_dir(cfg.output_dir)
    check_output_dir(str(cfg.models_dir()), "export_dir")
    return cfg


def run_demo(cfg: DemoConfig) -> dict[str, Any]:
    """Check ``cfg`` (``check_demo``), load (or build) the pair, run ``cfg.plan()``, write and
    return the results."""
    return _run_demo(check_demo(cfg))


def _run_demo(cfg: DemoConfig) -> dict[str, Any]:
    import torch

    from .zoo import build_pair

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
    base, teacher_acc = pair.accuracies["student"], pair.accuracies["teacher"]
    fractions = sorted({min(HEADLINE_FRACTION, cfg.target_fraction), cfg.target_fraction})
    targets = {f"{f:g}": base + f * (teacher_acc - base) for f in fractions}
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .compare import steps_to_target

    models = {"student_path": str(pair.student_path), "teacher_path": str(pair.teacher_path),
              "tokenizer": AutoTokenizer.from_pretrained(pair.student_path),
              "student": AutoModelForCausalLM.from_pretrained(pair.student_path, dtype=torch.float32),
              "teacher": AutoModelForCausalLM.from_pretrained(pair.teacher_path, dtype=torch.float32)}
    runs: dict[str, Any] = {}
    for spec in cfg.plan():
        print(f"run {len(runs) + 1}: {spec['label']}, lr {spec['lr']:g}", flush=True)
        run = _run_one(cfg, models, spec, targets[f"{cfg.target_fraction:g}"])
        run.update(label=spec["label"], lr=spec["lr"],
                   extrapolate=spec["fields"].get("extrapolate", False))
        for key, target in targets.items():
            step = steps_to_target(run["evals"], target)
            run[f"steps_{key}"] = step
            run[f"seconds_{key}"] = None if step is None else run["train_seconds"][step]
        run["train_clock"] = run["train_seconds"][max(run["train_seconds"])]
        run["accepted_jumps"] = sum(j["accepted"] is not None for j in run["jumps"])
        run["searches"] = len(run["jumps"])
        runs[spec["name"]] = run
    results = {
        "config": dataclasses.asdict(cfg),
        "models": {"student": str(student_dir), "teacher": str(teacher_dir),
                   "pair": Path(pair.student_path).parent.name,
                   "cache": {"student": str(pair.student_path), "teacher": str(pair.teacher_path)},
                   "accuracies": pair.accuracies, "build_seconds": build_seconds},
        "student_accuracy": base,
        "teacher_accuracy": teacher_acc,
        "targets": targets,
        "lrs": {"reference": cfg.learning_rate,
                "conservative": cfg.learning_rate * cfg.conservative},
        "runs": runs,
    }
    results["conclusion"] = conclusion(results)
    (out / "results.json").write_text(json.dumps(results, indent=2))
    _plot(results, out / "accuracy_vs_step.png")
    return results


def reading(summary: dict[str, Any]) -> str:
    """``ExtrapolatingOptimizer.summary()`` (as ``Summary.to_dict``) in one line, and what it
    hints: ``extra_distance`` ≥ 1 (the kept jumps moved the weights further than the optimizer
    did) hints that the learning rate is too small (``Summary``'s doc)."""
    from lookahead_opd.extrapolator import Summary

    s = Summary(**summary)
    if s.kept_jumps == 0:
        hint = "no jump kept: the run was plain OPD plus its gate"
    elif s.extra_distance >= 1:
        hint = (f"the kept jumps moved the weights {s.extra_distance:.1f}x as far as the "
                "optimizer did: a hint that the learning rate is too small")
    else:
        hint = ("the kept jumps added less than the optimizer's own distance: no strong hint "
                "that the learning rate is too small")
    return f"{s}. Reading: {hint}."


def _steps(run: dict[str, Any], key: str) -> str:
    s = run[f"steps_{key}"]
    return "not reached" if s is None else str(s)


def conclusion(results: dict[str, Any]) -> str:
    """One paragraph drawn from the run's own numbers: how far EffOPD from the conservative lr
    got toward 75% of the gain (the first of ``targets``), against plain OPD from the same lr
    and at the reference lr."""
    runs, lrs, cfg = results["runs"], results["lrs"], results["config"]
    key = next(iter(results["targets"]))
    ref, plain, eff = runs["reference"], runs["plain"], runs["effopd"]
    k, m, n = ref[f"steps_{key}"], plain[f"steps_{key}"], eff[f"steps_{key}"]
    text = (f"Steps to {float(key):.0%} of the gain from lr {lrs['conservative']:g} (the "
            f"reference {lrs['reference']:g} x {cfg['conservative']:g}): EffOPD {_steps(eff, key)}, "
            f"plain OPD {_steps(plain, key)}")
    if "effopd-follow" in runs:
        text += f", EffOPD + lr_follow (experimental) {_steps(runs['effopd-follow'], key)}"
    text += (f"; plain OPD at the reference lr {_steps(ref, key)} ('not reached': not within "
             f"{cfg['max_steps']} steps)")
    share = eff["gate_seconds"] / eff["train_clock"] if eff["train_clock"] else 0.0
    text += (f". EffOPD's gate cost {eff['gate_evals']} evaluations ({eff['gate_seconds']:.1f} s, "
             f"{share:.0%} of its training clock) and kept {eff['accepted_jumps']} of "
             f"{eff['searches']} jumps. ")
    if n is None:
        text += "EffOPD did not get there from the conservative lr on this run."
    elif k is None or n <= k:
        text += ("EffOPD from the conservative lr was at least as fast as plain OPD at the "
                 "reference lr: here the too-small lr cost nothing.")
    elif m is None or n < m:
        fewer = f"{m - n} steps fewer than plain" if m is not None else "plain did not get there"
        text += (f"EffOPD made up part of the too-small lr ({fewer}), not all of it: plain OPD "
                 f"at the reference lr was still {n / k:.1f}x faster.")
    else:
        text += "EffOPD was no faster than plain OPD from the conservative lr on this run."
    return (text + " One seed on a tiny model: benchmarks/results/lr_basin.md has the other "
            "starting lrs (best/32 to best x 2) and the lr-free Mechanic and Prodigy.")


def format_table(results: dict[str, Any]) -> str:
    """The demo's printed summary: the pair and targets, one row per run, each EffOPD run's
    ``summary()`` reading, and the conclusion."""
    cfg, lrs, targets = results["config"], results["lrs"], results["targets"]
    keys = list(targets)
    lines = [
        f"pair {results['models']['pair']}: student {results['student_accuracy']:.1%} -> teacher "
        f"{results['teacher_accuracy']:.1%} (test split); "
        + ", ".join(f"{float(k):.0%} of the gain = {t:.1%}" for k, t in targets.items()),
        f"reference lr {lrs['reference']:g} (--learning_rate), conservative lr "
        f"{lrs['conservative']:g} (x {cfg['conservative']:g}, --conservative); no warm-up",
        "",
        f"{'run':<14} {'lr':>9} " + " ".join(f"{'steps to ' + f'{float(k):.0%}':>13}" for k in keys)
        + f" {'seconds to ' + f'{float(keys[-1]):.0%}':>14} {'final acc':>10} "
        f"{'jumps kept/searches':>20} {'gate evals':>11}",
    ]
    for name, r in results["runs"].items():
        steps = " ".join(f"{'—' if r[f'steps_{k}'] is None else r[f'steps_{k}']:>13}" for k in keys)
        secs = r[f"seconds_{keys[-1]}"]
        jumps = f"{r['accepted_jumps']}/{r['searches']}" if r["extrapolate"] else "—"
        gates = str(r["gate_evals"]) if r["extrapolate"] else "—"
        lines.append(f"{name:<14} {r['lr']:>9.3g} {steps} {'—' if secs is None else f'{secs:.1f}':>14} "
                     f"{r['final_accuracy']:>10.1%} {jumps:>20} {gates:>11}")
    lines.append(f"('—': not reached in {cfg['max_steps']} steps)")
    lines.append("")
    for name, r in results["runs"].items():
        if r.get("summary"):
            lines.append(f"{name} summary(): {reading(r['summary'])}")
    lines += ["", results["conclusion"]]
    return "\n".join(lines)


def _plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    styles = {"reference": dict(color="black", ls="--"), "plain": dict(color="tab:blue"),
              "effopd": dict(color="tab:orange"), "effopd-follow": dict(color="tab:green")}
    for name, r in results["runs"].items():
        steps, acc = zip(*r["evals"], strict=True)
        ax.plot(steps, acc, marker=".", ms=3, label=f"{r['label']} ({r['lr']:.3g})",
                **styles.get(name, {}))
    kept = [j["step"] for j in results["runs"]["effopd"]["jumps"] if j["accepted"] is not None]
    for k, s in enumerate(kept):
        ax.axvline(s, color="tab:orange", alpha=0.25, ls=":",
                   label="EffOPD kept a jump" if k == 0 else None)
    for key, t in results["targets"].items():
        ax.axhline(t, color="gray", ls=":", lw=0.8)
        ax.annotate(f"{float(key):.0%} of the gain", (0, t), fontsize=7, color="gray",
                    xytext=(2, 2), textcoords="offset points")
    ax.axhline(results["teacher_accuracy"], color="black", ls=":", lw=0.8, label="teacher")
    ax.set_xlabel("OPD step")
    ax.set_ylabel("greedy accuracy (held-out)")
    ax.legend(loc="lower right", fontsize=7)
    ax.set_title("From a conservative lr: plain OPD vs EffOPD (dashed: plain OPD at the "
                 "reference lr)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    import torch

    try:  # bad input: one clear line and status 2, before anything is built or loaded
        cfg = check_demo(parse_dataclass(DemoConfig, list(argv or []), prog="lookahead-opd demo"))
    except ValueError as err:
        print(f"lookahead-opd demo: {err}", file=sys.stderr)
        return 2
    if cfg.threads is not None:  # the command's choice, for the whole process
        torch.set_num_threads(cfg.threads)
    if not cfg.progress:
        quiet_loading_bars()
    results = _run_demo(cfg)
    print(format_table(results))
    print(f"\nwrote {Path(cfg.output_dir) / 'results.json'} and accuracy_vs_step.png")
    return 0 if not math.isnan(results["teacher_accuracy"]) else 1
