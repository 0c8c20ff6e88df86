"""The regime map: where does EffOPD beat plain OPD at its best learning rate?

A grid of cells, each one regime: tokens per optimizer step (the short arithmetic task at 32
and at 512 prompts, the long worked-solution task at 128), the teacher (``sft``: the base
SFT'd far, the zoo's ``same-base``; ``rl``: the base plus Dr. GRPO, a short shift), and the
optimizer (AdamW; SGD with momentum on the ``rl`` teacher). In every cell, plain OPD and EffOPD
(−reverse-KL gate on 128 fixed rollouts, geometric c, as ``benchmarks/speedup.py``) are swept
over learning rates a factor 2 apart, up to where plain degrades; every run uses the full-
vocabulary reverse KL, evaluates greedy exact match on ≥1000 held-out problems (all of them
when the split holds fewer) and stops at 90% of the teacher's gain (cap 300 steps).

Staged, so the most informative runs come first and a budget cut leaves a usable map:

- stage 1: every lr of the cell, plain and EffOPD, seed 0 (extended by ×2 while plain's top lr
  has not degraded — final accuracy below its start, or a crash / NaN — and by ½ while plain's
  best is the lowest);
- ``noise``: the gradient-noise scale ``B_noise = tr(Σ)/|G|²`` at plain's best lr (see
  ``harness.NoiseProbe``), and every run records its secant cosine (``harness.SecantProbe``);
- stage 2: seeds 1 and 2 at each method's two best stage-1 lrs (SGD: the best; the retention
  cell: the three best, those within its budget first).

A cell counts when plain at its best lr reaches 75% of the gain on every seed and the gain is
at least 5 eval standard errors. Results are rewritten after every run and a rerun skips the
runs already in the json, so the study can be stopped and resumed at any point.

    python -m benchmarks.regimes                                 # the CPU grid (hours, one core)
    python -m benchmarks.regimes --cells short-512/sft/adamw     # some cells only
    python -m benchmarks.regimes --device cuda --budget_s 480    # the GPU study (69M, long task)
    python -m benchmarks.regimes --smoke --out /tmp/regimes      # the pipeline in under a minute
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
from pathlib import Path
from typing import Any

import torch

from benchmarks import harness
from benchmarks.common import markdown_table
from benchmarks.harness import (
    CELLS,
    EFFOPD,
    FRACTIONS,
    LEVELS,
    RETENTION,
    STOP_FRACTION,
    TASKS,
    degraded,
    fmt_range,
    gate_share,
    mean,
)

STEM = "regimes"
COUNT_FRACTION = 0.75  # plain at its best lr must reach this on every seed for the cell to count
MIN_GAIN_SE = 5.0  # ... and the gain must be this many eval standard errors
SPEEDUP_BAR = 1.2  # the question: is EffOPD at least this much faster on every paired seed?
STAGE2_SEEDS = (1, 2)
RETENTION_BUDGET = 0.02
STAGES = ("1", "noise", "2")


def options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cells", default="all", help="comma-separated cell names, or all")
    p.add_argument("--stages", default="1,noise,2", help="which stages to run (comma-separated)")
    p.add_argument("--effopd-lrs", type=int, default=99,
                   help="budget cut: stage 1 runs EffOPD only at plain's N best lrs")
    p.add_argument("--stage2-lrs", type=int, default=99,
                   help="budget cut: stage 2 at each method's N best lrs at most")
    p.add_argument("--max-steps", type=int, default=harness.REGIME_RUN["max_steps"])
    p.add_argument("--eval-every", type=int, default=harness.REGIME_RUN["eval_every"])
    p.add_argument("--warmup-steps", type=int, default=harness.REGIME_RUN["warmup_steps"],
                   help="linear lr warmup of every run")
    p.add_argument("--eval-size", type=int, default=harness.EVAL_SIZE)
    p.add_argument("--noise-steps", type=int, default=24, help="steps averaged for B_noise")
    p.add_argument("--noise-micro", type=int, default=8, help="micro-batches per step for B_noise")
    p.add_argument("--size", default=None, help="zoo model size (default: tiny; large for the "
                   "GPU grid)")
    p.add_argument("--grid", choices=("cpu", "gpu"), default=None,
                   help="the staged CPU grid, or the GPU study (default: gpu on a cuda device)")
    p.add_argument("--gpu-prompts", default="4096,1024", help="GPU grid: prompts per step levels")
    p.add_argument("--gpu-teacher", default="rl", choices=("sft", "rl"), help="GPU grid: teacher")
    p.add_argument("--long-task", default=TASKS["long"], help="task spec of the long task")
    p.add_argument("--cache-dir", default=None)
    p.add_argument("--note", default=None, help="a paragraph for the report, under its title "
                   "(kept in the json: later runs into the same --out keep it)")


def configure(a: argparse.Namespace, p: argparse.ArgumentParser) -> None:
    """The cells to run (the CPU grid, the GPU study, or the smoke cell) and their stages."""
    a.cell_specs, a.run_limit_s = dict(CELLS), None
    a.grid = a.grid or ("gpu" if a.device.startswith("cuda") else "cpu")
    if a.long_task != TASKS["long"]:
        a.cell_specs = {k: {**c, "task": a.long_task} if c["task"] == TASKS["long"] else c
                        for k, c in a.cell_specs.items()}
    if a.smoke:  # one short-task cell at 8 prompts, 2 lrs; stage 2 with one more seed
        a.cell_specs = {"smoke/sft/adamw": {**CELLS["short-32/sft/adamw"], "level": "smoke",
                                            "prompts": 8, "lrs": [1e-3, 4e-3]}}
        a.stage2_seeds, a.gate_size, a.extend = (1,), 16, False
    elif a.grid == "gpu":
        gpu_grid(a)
    else:
        a.stage2_seeds, a.gate_size, a.extend = STAGE2_SEEDS, EFFOPD["gate_size"], True
    a.size = a.size or "tiny"
    a.names = list(a.cell_specs) if a.cells == "all" else [s.strip() for s in a.cells.split(",")]
    unknown = [n for n in a.names if n not in a.cell_specs]
    if unknown:
        p.error(f"unknown cell(s) {unknown}; known: {', '.join(a.cell_specs)}")
    a.stage_list = [s.strip() for s in a.stages.split(",")]
    bad = [s for s in a.stage_list if s not in STAGES]
    if bad:
        p.error(f"unknown stage(s) {bad}; known: {', '.join(STAGES)}")


def gpu_grid(a: argparse.Namespace) -> None:
    """The GPU study: the 69M zoo model on the long task, rl teacher, 1024-4096 prompts per
    step, 2 lrs x 2 methods, 1 seed. Each run gets an equal share of --budget_s (a run past it
    keeps its partial curve), so the study fits the device time it is given."""
    a.cell_specs = {}
    for prompts in (int(x) for x in a.gpu_prompts.split(",")):
        a.cell_specs[f"long-{prompts}/{a.gpu_teacher}/adamw"] = {
            "level": f"long-{prompts}", "task": a.long_task, "prompts": prompts,
            "teacher": a.gpu_teacher, "optimizer": "adamw", "lrs": [2.5e-4, 1e-3],
            "kind": "main", "stage2": "none"}
    a.size = a.size or "large"
    a.stem, a.stage2_seeds, a.gate_size, a.extend = "regimes-gpu", (), 128, False
    a.stages = "1,noise"
    if a.budget_s is not None:
        a.run_limit_s = a.budget_s / (4 * len(a.cell_specs) + 1)


# --------------------------------------------------------------------------- runs


def config_for(a: argparse.Namespace, cell: dict[str, Any], method: str, lr: float, seed: int,
               target: float | None, **extra: Any) -> Any:
    eff = {**EFFOPD, "gate_size": a.gate_size} if method == "effopd" else {}
    return harness.cell_config(
        a.stem, f"{method}-{lr:g}-{seed}", cell, lr, seed, target, a.eval_size,
        max_steps=a.max_steps, warmup_steps=a.warmup_steps, eval_every=a.eval_every,
        device=a.device, **eff, **extra)


def run_key(cell: str, method: str, lr: float, seed: int) -> str:
    return f"{cell}|{method}|{lr:g}|{seed}"


def base_and_targets(a: argparse.Namespace, results: dict[str, Any], models: harness.Pairs,
                     cell_name: str, seed: int) -> dict[str, Any]:
    """The base's accuracy on this seed's eval set, the teacher's (all of test) and the targets."""
    return harness.base_and_targets(results, models, a.cell_specs[cell_name], seed, a.eval_size)


def retention_gate(trainer_cls: type, held_out: Any, floor: float) -> type:
    """An ``OPDTrainer`` whose EffOPD gate scores −∞ (below every −reverse KL; the issue's −1
    for an accuracy gate) when the held-out operation's accuracy falls under ``floor``."""
    from lookahead_opd.integrations.opd.scoring import greedy_accuracy

    class RetentionGatedTrainer(trainer_cls):
        def gate_score(self) -> float:
            score = super().gate_score()
            kept = greedy_accuracy(self.synced_engine(), held_out["task"], held_out["problems"],
                                   held_out["task"].max_new_tokens)
            return score if kept >= floor else float("-inf")

    return RetentionGatedTrainer


def retention_hooks(a: argparse.Namespace, pair: dict[str, Any], bt: dict[str, Any],
                    method: str, seed: int) -> tuple[type, Any]:
    """A retention cell's trainer (EffOPD: gated on the held-out task) and what a run measures
    of the held-out task at its end."""
    from lookahead_opd.integrations.opd.trainer import OPDTrainer

    held = harness.load_task(RETENTION["held_out"])
    held_out = {"task": held, "problems": held.problems("gate", min(a.gate_size, len(
        held.problems("gate"))), seed=seed)}
    trainer_cls = OPDTrainer
    if method == "effopd":
        trainer_cls = retention_gate(OPDTrainer, held_out, bt["retention_base"] - RETENTION_BUDGET)

    def on_student(m: Any) -> float:
        return harness.accuracy(m, pair["tokenizer"], RETENTION["held_out"], a.eval_size, seed)
    return trainer_cls, on_student


def run_one(a: argparse.Namespace, results: dict[str, Any], models: harness.Pairs, cell_name: str,
            method: str, lr: float, seed: int, *, noise: bool = False) -> dict[str, Any]:
    cell = a.cell_specs[cell_name]
    pair = models.get(cell["task"], cell["teacher"])
    bt = base_and_targets(a, results, models, cell_name, seed)
    if noise:  # plain at this lr, micro-batched, a few steps, no evals on the way
        config = dataclasses.replace(
            config_for(a, cell, "plain", lr, seed, None), eval_every=0, max_steps=a.noise_steps,
            gradient_accumulation_steps=a.noise_micro)
    else:
        config = config_for(a, cell, method, lr, seed, bt["targets"][f"{STOP_FRACTION:g}"])
    trainer_cls = on_student = None
    if cell["kind"] == "retention":
        trainer_cls, on_student = retention_hooks(a, pair, bt, method, seed)
    probes: list[harness.NoiseProbe] = []

    def noise_probe(model: torch.nn.Module) -> list[harness.NoiseProbe]:
        probes.append(harness.NoiseProbe(model, a.noise_micro))
        return probes

    run = harness.run(config, pair, cell["task"], time_limit=a.run_limit_s, on_student=on_student,
                      trainer_class=trainer_cls, callbacks=noise_probe if noise else None)
    run["evals"] = run["evals"] or [[0, bt["base"]]]  # a crash before the first eval
    run.update(cell=cell_name, method=method, lr=lr, seed=seed)
    if noise and probes and probes[0].big:
        run["noise"] = probes[0].result(cell["prompts"] * config.num_samples)
    return run


# --------------------------------------------------------------------------- the plan


def _reached(run: dict[str, Any], bt: dict[str, Any]) -> dict[str, int | None]:
    """Steps and seconds to each fraction of the gain (None: not reached)."""
    return harness.reached(run, bt["targets"])


def rank_key(runs: list[dict[str, Any]], bt: dict[str, Any]) -> tuple[float, float, float]:
    """Smaller is better: the highest fraction reached on every seed, then mean steps to it,
    then minus the mean final accuracy."""
    return harness.rank_key(runs, bt["targets"])

def cell_runs(results: dict[str, Any], cell: str, method: str) -> dict[float, list[dict[str, Any]]]:
    by_lr: dict[float, list[dict[str, Any]]] = {}
    for r in results["runs"].values():
        if r["cell"] == cell and r["method"] == method:
            by_lr.setdefault(r["lr"], []).append(r)
    for rs in by_lr.values():
        rs.sort(key=lambda r: r["seed"])
    return dict(sorted(by_lr.items()))


def stage1_lrs(a: argparse.Namespace, results: dict[str, Any], cell_name: str) -> list[float]:
    """The cell's lrs, extended ×2 while plain's top lr has not degraded and ½ while plain's
    best is the lowest (two extensions each way at most)."""
    cell = a.cell_specs[cell_name]
    lrs = list(cell["lrs"])
    if not a.extend:
        return lrs
    plain = cell_runs(results, cell_name, "plain")
    for _ in range(2):
        top = plain.get(lrs[-1])
        if top is None or degraded(top[0]):
            break
        lrs.append(lrs[-1] * 2)
    bt = results["bases"].get(f"{cell['task']}|{cell['teacher']}|0")
    for _ in range(2):
        if bt is None or any(lr not in plain for lr in lrs):
            break
        # A retention cell compares runs within the budget: with none yet, go lower.
        kept = [lr for lr in lrs if within_budget(plain[lr][:1], bt)]
        if kept and min(kept, key=lambda lr: rank_key(plain[lr][:1], bt)) != lrs[0]:
            break
        lrs.insert(0, lrs[0] / 2)
    return lrs


def within_budget(runs: list[dict[str, Any]], bt: dict[str, Any]) -> bool:
    """Every run kept the held-out task within ``RETENTION_BUDGET`` of the base (always true
    outside retention cells, whose bases have no ``retention_base``)."""
    if "retention_base" not in bt:
        return True
    floor = bt["retention_base"] - RETENTION_BUDGET
    return all(r.get("extra") is not None and r["extra"] >= floor for r in runs)


def best_lrs(results: dict[str, Any], cell_name: str, method: str, bt: dict[str, Any],
             k: int, seeds: int | None = None) -> list[float]:
    """The ``k`` best lrs of ``method`` in the cell (by ``rank_key`` over the first ``seeds``;
    in a retention cell, the lrs within the budget first)."""
    runs = cell_runs(results, cell_name, method)
    return sorted(runs, key=lambda lr: (not within_budget(runs[lr][:seeds], bt),
                                        rank_key(runs[lr][:seeds], bt)))[:k]


def pending(a: argparse.Namespace, results: dict[str, Any], cell_name: str,
            stage: str) -> list[tuple[str, float, int, bool]]:
    """(method, lr, seed, noise) runs of ``stage`` not in the results yet, as far as the runs
    so far determine them (stage 1's extensions appear once the runs they depend on exist)."""
    cell = a.cell_specs[cell_name]
    done = results["runs"]
    todo: list[tuple[str, float, int, bool]] = []
    if stage == "1":
        # Plain at every lr first; then EffOPD from plain's best lr down, so that a budget cut
        # drops the EffOPD runs least likely to be its best (where plain itself was slowest).
        lrs = stage1_lrs(a, results, cell_name)
        todo = [("plain", lr, 0, False) for lr in lrs
                if run_key(cell_name, "plain", lr, 0) not in done]
        if todo:
            return todo
        plain = cell_runs(results, cell_name, "plain")
        bt = results["bases"][f"{cell['task']}|{cell['teacher']}|0"]
        for lr in sorted(lrs, key=lambda lr: rank_key(plain[lr][:1], bt))[:a.effopd_lrs]:
            if run_key(cell_name, "effopd", lr, 0) not in done:
                todo.append(("effopd", lr, 0, False))
        return todo
    if any(pending(a, results, cell_name, "1")):
        return []
    bt = results["bases"][f"{cell['task']}|{cell['teacher']}|0"]
    if stage == "noise":
        lr = best_lrs(results, cell_name, "plain", bt, 1, seeds=1)[0]
        if run_key(cell_name, "noise", lr, 0) not in done:
            todo.append(("noise", lr, 0, True))
        return todo
    k = min({"three-best": 3, "two-best": 2, "best": 1, "none": 0}[cell["stage2"]], a.stage2_lrs)
    for method in ("plain", "effopd"):
        for lr in best_lrs(results, cell_name, method, bt, k, seeds=1):
            for seed in a.stage2_seeds:
                if run_key(cell_name, method, lr, seed) not in done:
                    todo.append((method, lr, seed, False))
    return todo


# --------------------------------------------------------------------------- summary


def lr_row(runs: list[dict[str, Any]], bt: dict[str, Any]) -> dict[str, Any]:
    """One lr of a method in a cell: per seed, its steps and seconds to each fraction, final
    accuracy, whether it degraded, what it kept of a held-out task, whether a limit cut it."""
    return {"seeds": [r["seed"] for r in runs], "final": [r["final_accuracy"] for r in runs],
            "degraded": [degraded(r) for r in runs],
            **{k: [_reached(r, bt)[k] for r in runs] for k in _reached(runs[0], bt)},
            "retention": [r.get("extra") for r in runs],
            "stopped": [bool(r.get("stopped")) for r in runs]}


def best_of(runs: dict[float, list[dict[str, Any]]], bt: dict[str, Any]) -> dict[str, Any] | None:
    """A method at its best lr among those run on the most seeds (in a retention cell, among
    the lrs whose every seed kept the budget); None when no lr qualifies."""
    runs = {lr: rs for lr, rs in runs.items() if within_budget(rs, bt)}
    if not runs:
        return None
    n_max = max(len(rs) for rs in runs.values())
    full = {lr: rs for lr, rs in runs.items() if len(rs) == n_max}
    best = min(full, key=lambda lr: rank_key(full[lr], bt))
    rs = full[best]
    cos = [c for r in rs for s, c in r.get("secant_cosines", []) if s >= 8]
    return {
        "best_lr": best, "seeds": [r["seed"] for r in rs],
        **{k: [_reached(r, bt)[k] for r in rs] for k in _reached(rs[0], bt)},
        "final": [r["final_accuracy"] for r in rs],
        "searches": [len(r["jumps"]) for r in rs],
        "accepted_jumps": [[(j["step"], j["accepted"]) for j in r["jumps"] if j["accepted"]]
                           for r in rs],
        "secant_cosine": statistics.fmean(cos) if cos else None,
        "tokens_per_step": mean([r.get("tokens_per_step") for r in rs]),
        "gate_share": [gate_share(r) for r in rs],
    }


def paired_ratios(p: dict[str, Any], e: dict[str, Any]) -> tuple[list[int], dict[str, Any]]:
    """The seeds both methods ran at their best lr, and plain ÷ EffOPD per seed of the steps and
    seconds to each fraction (None: one of them did not reach it)."""
    paired = [s for s in e["seeds"] if s in p["seeds"]]
    ratios: dict[str, list[float | None]] = {}
    for f in FRACTIONS:
        for what in ("steps", "seconds"):
            k = f"{what}_{f:g}"
            vals = []
            for s in paired:
                ps, es = p[k][p["seeds"].index(s)], e[k][e["seeds"].index(s)]
                vals.append(None if ps is None or es is None or es == 0 else ps / es)
            ratios[k] = vals
    return paired, ratios


def summarize_cell(a: argparse.Namespace, results: dict[str, Any], cell_name: str) -> dict[str, Any]:
    cell = a.cell_specs[cell_name]
    bt = results["bases"].get(f"{cell['task']}|{cell['teacher']}|0")
    out: dict[str, Any] = {"cell": cell_name, **{k: cell[k] for k in ("level", "prompts", "teacher",
                                                                         "optimizer", "kind")}}
    if bt is None or not any(r["cell"] == cell_name for r in results["runs"].values()):
        return {**out, "status": "not run"}
    out.update(base=bt["base"], teacher_accuracy=bt["teacher"], gain=bt["gain"],
               gain_se=bt["gain_se"], eval_n=bt["eval_n"], retention_base=bt.get("retention_base"))
    runs = {m: cell_runs(results, cell_name, m) for m in ("plain", "effopd")}
    out["per_lr"] = {m: {f"{lr:g}": lr_row(v, bt) for lr, v in by_lr.items()}
                     for m, by_lr in runs.items()}
    out["methods"] = methods = {m: best for m, by_lr in runs.items()
                                if (best := best_of(by_lr, bt)) is not None}
    noise = [r for r in results["runs"].values() if r["cell"] == cell_name and r["method"] == "noise"]
    out["noise"] = noise[0].get("noise") if noise else None
    if "plain" not in methods or "effopd" not in methods:
        if cell["kind"] == "retention":
            out["count_reason"] = (f"no run of {' or '.join(m for m in ('plain', 'effopd') if m not in methods)}"
                                   f" kept {RETENTION['held_out']} within {100 * RETENTION_BUDGET:g} points of the base")
        return {**out, "status": "partial"}
    p = methods["plain"]
    out["paired_seeds"], out["ratios"] = paired, ratios = paired_ratios(p, methods["effopd"])
    reach = p[f"steps_{COUNT_FRACTION:g}"]
    out["counts"] = bool(all(x is not None for x in reach) and bt["gain"] >= MIN_GAIN_SE * bt["gain_se"])
    out["count_reason"] = ("counts" if out["counts"] else
                           "plain at its best lr misses 75% of the gain on some seed"
                           if any(x is None for x in reach) else "gain under 5 eval SEs")
    # The verdict's fraction: 0.9 when both reach it on every paired seed, else 0.75.
    out["verdict_fraction"] = next((f for f in (0.9, 0.75, 0.5)
                                    if all(x is not None for x in ratios[f"steps_{f:g}"])), None)
    out["status"] = "stage 2 done" if len(paired) >= 1 + len(a.stage2_seeds) else "stage 1 only"
    return out


def summarize(a: argparse.Namespace, results: dict[str, Any]) -> dict[str, Any]:
    """Every cell asked for (``--cells``) or with runs in the json."""
    ran = {r["cell"] for r in results["runs"].values()}
    return {name: summarize_cell(a, results, name) for name in a.cell_specs
            if name in a.names or name in ran}


# --------------------------------------------------------------------------- report



def _ratios(xs: list[float | None]) -> str:
    return ", ".join("—" if x is None else f"{x:.2f}" for x in xs) or "—"


def verdict(summary: dict[str, Any]) -> str:
    """The one sentence the study exists for."""
    wins, largest = [], None
    for name, c in summary.items():
        if c.get("ratios") is None:
            continue
        for k, vals in c["ratios"].items():
            if k.startswith("steps_"):
                for s, v in zip(c["paired_seeds"], vals, strict=True):
                    if v is not None and (largest is None or v > largest[0]):
                        largest = (v, name, k.split("_")[1], s)
        f = c["verdict_fraction"]
        vals = c["ratios"][f"steps_{f:g}"] if f is not None else []
        if c["counts"] and len(vals) >= 3 and all(v is not None and v >= SPEEDUP_BAR for v in vals):
            wins.append(f"{name} ({_ratios(vals)} to {f:.0%} of the gain)")
    counted = sum(bool(c.get("counts")) for c in summary.values())
    # Cells where the bar is cleared on every paired seed at a lower fraction of the gain only.
    early = []
    for name, c in summary.items():
        if not c.get("counts") or c.get("verdict_fraction") is None:
            continue
        for f in FRACTIONS:
            vals = c["ratios"].get(f"steps_{f:g}", [])
            if f < c["verdict_fraction"] and len(vals) >= 3 and all(
                    v is not None and v >= SPEEDUP_BAR for v in vals):
                vf = c["verdict_fraction"]
                early.append(f"{name} to {f:.0%} of the gain ({_ratios(vals)}), not at "
                             f"{vf:.0%} ({_ratios(c['ratios'][f'steps_{vf:g}'])})")
    note = f" Ahead early only: {'; '.join(early)}." if early else ""
    if wins:
        return (f"EffOPD was ≥{SPEEDUP_BAR}× faster in steps than plain OPD at its best lr on every "
                f"paired seed (3 seeds) in: {'; '.join(wins)}.{note}")
    big = ("no ratio was measured" if largest is None else
           f"the largest paired-seed ratio measured anywhere was {largest[0]:.2f}× "
           f"({largest[1]}, to {float(largest[2]):.0%} of the gain, seed {largest[3]})")
    return (f"No counted cell ({counted} counted) showed EffOPD ≥{SPEEDUP_BAR}× faster than plain "
            f"OPD at its best lr on every paired seed at the target (90% of the gain; 75% where "
            f"90% was not reached by both); {big}.{note}")


def gate_line(summary: dict[str, Any]) -> str:
    """What the gate cost where it bought nothing: its share of EffOPD's clock at its best lr."""
    per_cell = {name: [x for x in c["methods"]["effopd"]["gate_share"] if x is not None]
                for name, c in summary.items()
                if c.get("counts") and "effopd" in c.get("methods", {})}
    per_cell = {k: v for k, v in per_cell.items() if v}
    if not per_cell:
        return ""
    every = [x for v in per_cell.values() for x in v]
    cells = "; ".join(f"{k} {fmt_range([100 * x for x in v], '{:.1f}')}%" for k, v in per_cell.items())
    return (f"**What the gate cost.** At EffOPD's best lr in the counted cells its gate took "
            f"{100 * min(every):.1f}–{100 * max(every):.1f}% of its training clock: {cells}. A "
            f"search scores the same {EFFOPD['gate_size']} fixed rollouts once for the current weights and "
            "once per candidate (two evaluations when the first is refused) whatever the batch, "
            "and searches come at steps 1, 2, 4, 8, …, so the share is largest where a step is "
            "cheap (few prompts per step) or a run stops after a few dozen steps.\n")


def retention_line(name: str, c: dict[str, Any]) -> str:
    """A retention cell's result in one paragraph: how much of the held-out task the runs kept."""
    if c.get("kind") != "retention" or c["status"] == "not run":
        return ""
    kept = [(float(lr), x) for per_lr in c["per_lr"].values() for lr, d in per_lr.items()
            for x in d["retention"] if x is not None]
    if not kept:
        return ""
    lo, hi = min(x for _, x in kept), max(x for _, x in kept)
    lrs = sorted({lr for lr, _ in kept})
    within = "No run of either method" if c["status"] == "partial" else "Some runs"
    return (f"**Retention ({name}).** {within} at lrs {lrs[0]:g}–{lrs[-1]:g} kept "
            f"{RETENTION['held_out']} within {100 * RETENTION_BUDGET:g} points of the base's "
            f"{c['retention_base']:.1%}: after the runs it was at {lo:.1%}–{hi:.1%}. The gate "
            "refuses jumps that cost the held-out task; the optimizer's own steps cost it anyway.\n")


def header(results: dict[str, Any]) -> list[str]:
    """The title, the note, what made the runs and how to read the tables."""
    m, cfg = results["machine"], results["config"]
    return [
        "# The regime map: EffOPD vs plain OPD at its best learning rate",
        "",
        *([results["note"], ""] if results.get("note") else []),
        "Made by " + ", then ".join(f"`{c}`" for c in results.get("commands", [m.get("command")]))
        + f" (runs written with `--out` elsewhere were merged in), last at {m.get('git_commit')}, on "
        + " and ".join(results.get("machines") or [m.get("cpu_model")])
        + f" ({m.get('device')}, torch {m.get('torch')}, {m.get('torch_threads')} thread). Full-vocabulary "
        f"reverse KL; zoo size `{cfg['size']}`; lr warmup {cfg.get('warmup_steps', 4)} steps; "
        f"eval every {cfg['eval_every']} steps on "
        f"min({cfg['eval_size']}, the test split) held-out problems; runs stop at "
        f"{STOP_FRACTION:.0%} of the teacher's gain over the base (cap {cfg['max_steps']} steps). "
        "EffOPD: −reverse-KL gate on fixed rollouts, geometric c, searches at steps 1, 2, 4, 8, …; "
        "its seconds include every gate evaluation. Mean [min–max] over seeds; ratios are plain ÷ "
        "EffOPD per paired seed (>1: EffOPD faster), at the highest fraction of the gain both "
        "reach on every paired seed. The verdict is on steps: the seconds are each run's own "
        "training clock, and the CPU runs shared 2 cores with other jobs (load up to 10–15), so "
        "a seconds ratio far from 1 where the steps are equal is the clock's noise, not the method.",
        "",
    ]


MAP_HEADERS = ["cell", "tokens/step", "B_noise (prompts / tokens)", "base → teacher", "counts",
               "plain best lr", "EffOPD best lr", "steps to 50/75/90% plain", "EffOPD",
               "seconds to that fraction, plain", "EffOPD", "paired ratio (steps) at",
               "seconds ratio", "EffOPD gate share of its clock", "EffOPD jumps kept / searches",
               "secant cos (plain, s≥8)", "status"]


def map_row(name: str, c: dict[str, Any]) -> list[Any]:
    """A cell's row of the map: each method at its best lr, the paired ratios, the gate."""
    p, e = c["methods"].get("plain"), c["methods"].get("effopd")
    noise = c.get("noise")
    nz = "—" if not noise else f"{noise['b_noise_rows']:.0f} / {noise['b_noise_tokens']:.0f}"
    tps = p and p.get("tokens_per_step")
    f = c.get("verdict_fraction")

    def steps(x: dict[str, Any] | None) -> str:
        return "—" if x is None else " / ".join(fmt_range(x[f"steps_{fr:g}"]) for fr in FRACTIONS)

    return [
        name, "—" if not tps else f"{tps:.0f}", nz,
        f"{c['base']:.1%} → {c['teacher_accuracy']:.1%} (SE {c['gain_se']:.1%})",
        "yes" if c.get("counts") else f"no: {c.get('count_reason', c['status'])}",
        "—" if p is None else f"{p['best_lr']:g}", "—" if e is None else f"{e['best_lr']:g}",
        steps(p), steps(e),
        "—" if p is None or f is None else fmt_range(p[f"seconds_{f:g}"], "{:.1f}"),
        "—" if e is None or f is None else fmt_range(e[f"seconds_{f:g}"], "{:.1f}"),
        "—" if f is None else f"{f:.0%}: {_ratios(c['ratios'][f'steps_{f:g}'])}",
        "—" if f is None else _ratios(c["ratios"][f"seconds_{f:g}"]),
        "—" if e is None or None in e["gate_share"] else fmt_range([100 * x for x in e["gate_share"]], "{:.1f}%"),
        "—" if e is None else ", ".join(f"{len(k)}/{n}" for k, n in zip(
            e["accepted_jumps"], e["searches"], strict=True)),
        "—" if p is None or p["secant_cosine"] is None else f"{p['secant_cosine']:.2f}",
        c["status"]]


def every_lr(name: str, c: dict[str, Any]) -> list[str]:
    """A cell's table of every lr of both methods, per seed."""
    rows = []
    for method, per_lr in c["per_lr"].items():
        for lr, d in per_lr.items():
            cells = [" / ".join("—" if d[f"steps_{fr:g}"][i] is None else str(d[f"steps_{fr:g}"][i])
                                for fr in FRACTIONS) for i in range(len(d["seeds"]))]
            ret = "" if all(x is None for x in d["retention"]) else (
                "; kept " + ", ".join(f"{x:.1%}" for x in d["retention"]))
            cut = "" if not any(d["stopped"]) else " (time limit)"
            rows.append([method, lr, "; ".join(cells) + cut, fmt_range(d["final"], "{:.1%}") + ret,
                         "yes" if any(d["degraded"]) else "no", len(d["seeds"])])
    return [f"### {name}", "", markdown_table(
        ["method", "lr", "steps to 50/75/90% per seed", "final acc", "degraded", "seeds"], rows), ""]


def pair_lines(results: dict[str, Any]) -> list[str]:
    """The zoo pair each task and teacher ran on."""
    lines = ["## Pairs", "", "The zoo pair each task and teacher ran on (zoo builds are seeded but "
             "differ across machines and thread counts; a rerun on a pair that differs skips "
             "the cell rather than mix two pairs in one map):", ""]
    pairs = results.get("pairs", {})
    for key in dict.fromkeys(k.rsplit("|", 1)[0] for k in results["bases"]):
        rec = pairs.get(key)
        acc = rec["accuracies"] if rec else {}
        lines.append(f"- {key}: " + (f"`{rec['build']}`, " + ", ".join(
            f"{k} {v:.1%}" for k, v in acc.items() if isinstance(v, float)) if rec else
            "built in the first session, not recorded (its teacher's accuracy is in the map)"))
    return [*lines, ""]


def report(a: argparse.Namespace, results: dict[str, Any]) -> str:
    s = results["summary"]
    counted = [n for n, c in s.items() if c.get("counts")]
    ran = {n: c for n, c in s.items() if c["status"] != "not run"}
    lines = [
        *header(results),
        f"**Verdict.** {verdict(s)}",
        "",
        f"**Cells counted: {len(counted)} of {len(ran)} run** "
        f"(a cell counts when plain at its best lr reaches {COUNT_FRACTION:.0%} of the gain on "
        f"every seed and the gain is ≥{MIN_GAIN_SE:g} eval standard errors): "
        f"{', '.join(counted) or 'none'}.",
        "",
        *[line for line in [gate_line(s)] if line],
        *[line for name, c in s.items() if (line := retention_line(name, c))],
        "## The map",
        "",
        markdown_table(MAP_HEADERS, [map_row(name, c) for name, c in ran.items()]),
        "",
        *(["![heat map](regimes_map.png)", ""] if a.stem == STEM else []),
        "## Every learning rate", "",
        "Steps to 50 / 75 / 90% of the gain per seed ('—': not reached in the cap); "
        "'degraded': final accuracy below the start, or a crash.", "",
        *[line for name, c in ran.items() for line in every_lr(name, c)],
        *pair_lines(results),
        "## Not run", "", "What the full staged protocol asks for and is not in the json "
        "(stopped for the CPU budget unless a reason is given):", "",
        *(not_run(a, results) or ["- every run of the grid ran."]),
    ]
    return "\n".join(lines) + "\n"


def not_run(a: argparse.Namespace, results: dict[str, Any]) -> list[str]:
    """Per cell, the runs of the full protocol (no budget cuts) that are missing."""
    full = argparse.Namespace(**{**vars(a), "effopd_lrs": 99, "stage2_lrs": 99})
    reasons = results.get("unavailable", {})
    out = []
    for name, c in results["summary"].items():
        if c["status"] == "not run":
            out.append(f"- **{name}**: the whole cell — "
                       + (reasons.get(name) or "not run within the CPU budget"))
            continue
        for stage in ("1", "noise", "2"):
            todo = pending(full, results, name, stage)
            if todo:
                runs = ", ".join(f"{m} lr {lr:g} seed {sd}" for m, lr, sd, _ in todo)
                later = " (and the stages after it)" if stage != "2" else ""
                why = f" — {reasons[name]}" if name in reasons else ""
                out.append(f"- {name}, stage {stage}{later}: {runs}{why}")
                break
    return out


def plot(a: argparse.Namespace, results: dict[str, Any], out: Path) -> None:
    """Heat map: rows teacher/optimizer, columns tokens-per-step level; colour the smallest
    paired-seed step ratio (plain ÷ EffOPD) at the verdict's fraction; text the ratios and
    B_noise; gray: not run."""
    import numpy as np

    s = results["summary"]
    levels = sorted(dict.fromkeys(c["level"] for c in s.values()),
                    key=lambda lv: list(LEVELS).index(lv) if lv in LEVELS else len(LEVELS))
    rows = list(dict.fromkeys(f"{c['teacher']}/{c['optimizer']}" for c in s.values()))
    grid = np.full((len(rows), len(levels)), np.nan)
    size = (2.6 * len(levels) + 2, 1.1 * len(rows) + 1.5)
    with harness.figure(out / f"{a.stem}_map.png", panel=size) as (fig, axes):
        ax = axes[0][0]
        for c in s.values():
            i, j = rows.index(f"{c['teacher']}/{c['optimizer']}"), levels.index(c["level"])
            f = c.get("verdict_fraction")
            text = c["status"] if c["status"] in ("not run", "partial") else (
                "no ratio: 50% of the gain\nnot reached by both")
            if c["kind"] == "retention" and c["status"] == "partial":
                text = f"no run kept the held-out\ntask within {100 * RETENTION_BUDGET:g} points"
            if f is not None:
                vals = [v for v in c["ratios"][f"steps_{f:g}"] if v is not None]
                grid[i, j] = min(vals)
                text = (f"{'/'.join(f'{v:.2f}' for v in vals)}× @{f:.0%}\n"
                        f"{'counts' if c['counts'] else 'not counted'}")
            if c.get("noise"):
                text += f"\nB_noise {c['noise']['b_noise_rows']:.0f} prompts"
            ax.text(j, i, text, ha="center", va="center", fontsize=7)
        cmap = harness.pyplot().get_cmap("RdBu").with_extremes(bad="lightgray")
        im = ax.imshow(np.ma.masked_invalid(grid), cmap=cmap, vmin=0.5, vmax=1.5, aspect="auto")
        ax.set_xticks(range(len(levels)), levels)
        ax.set_yticks(range(len(rows)), rows)
        ax.set_xlabel("task / prompts per step")
        ax.set_title("EffOPD speed-up in steps over plain OPD, each at its best lr\n"
                     "(colour: worst paired seed; >1 EffOPD faster; gray: not run)", fontsize=9)
        fig.colorbar(im, ax=ax, label="plain ÷ EffOPD steps (worst seed)")


# --------------------------------------------------------------------------- the study


def prepare(a: argparse.Namespace, store: harness.Store) -> tuple[harness.Pairs, list[str]]:
    """The pairs (built, minutes, or loaded) and the cells whose pair is the json's."""
    from tqdm.auto import tqdm

    results = store.data
    if a.note is not None:
        results["note"] = a.note
    results["cells"] = a.cell_specs
    models = harness.Pairs(a.cache_dir, size=a.size, device=a.device)
    ready = []
    for name in a.names:
        cell = a.cell_specs[name]
        pair = models.get(cell["task"], cell["teacher"])
        why = (f"pair not available: {pair['error']}" if "error" in pair
               else harness.check_pair(results, cell, pair))
        if why is not None:
            results["unavailable"][name] = why
            tqdm.write(f"regimes: skipping {name}: {why}")
            continue
        results["unavailable"].pop(name, None)
        ready.append(name)
    return models, ready


def jobs(a: argparse.Namespace, store: harness.Store, ctx: Any) -> list[tuple[str, Any]]:
    """Stage by stage: the first cell with a pending run of the earliest stage that has one."""
    for stage in a.stage_list:
        for name in ctx[1]:
            if todo := pending(a, store.data, name, stage):
                return [(run_key(name, m, lr, seed), (store.data, name, m, lr, seed, noise))
                        for m, lr, seed, noise in todo]
    return []


def run(a: argparse.Namespace, ctx: Any, job: tuple[Any, ...]) -> dict[str, Any]:
    results, name, method, lr, seed, noise = job
    return run_one(a, results, ctx[0], name, method, lr, seed, noise=noise)


STUDY = harness.Study(
    STEM, __doc__, report, options=options, uses=("threads", "budget"), devices=("cpu", "cuda"),
    smoke=dict(cells="all", max_steps=6, eval_every=2, eval_size=40, noise_steps=3, noise_micro=2),
    configure=configure, fields=dict(bases=dict, unavailable=dict, pairs=dict),
    report_options=("cells", "stages", "effopd_lrs", "stage2_lrs", "max_steps", "eval_every",
                    "warmup_steps", "eval_size", "noise_steps", "noise_micro", "size", "device",
                    "grid", "gpu_prompts", "gpu_teacher", "long_task", "smoke"),
    private=("cell_specs", "names"), prepare=prepare, jobs=jobs, run=run, summarize=summarize,
    plot=lambda a, results: plot(a, results, Path(a.out)))
main = STUDY.main

if __name__ == "__main__":
    raise SystemExit(main())
