"""Do no harm (issue 38): what a kept jump costs later, and a screen of fixes, on the real LM.

The every-block study (``real_lm --top-blocks 0``, ``real_lm-full``) found that EffOPD beats
plain OPD at the paper's lr 1e-6 and loses at plain's best lr 1e-5: the jumps it keeps early
buy the first steps and cost the end point. This study runs on the same harness, student,
teacher, task, held-out KL rollouts and seeds, and asks two things:

1. **Forks** (item 1). At each lr of ``FORK_LRS`` the jumps that the reference EffOPD run
   (``real_lm-full.json``, seed 0) kept up to step ``FORK_LAST`` are the fork points. Branch
   ``≤ s`` searches on the reference schedule up to step ``s`` and not after; branch ``none``
   never searches. Every branch runs to the last fork point + ``FORK_AFTER`` steps, with the
   held-out KL every ``FORK_KL_EVERY`` steps. Runs are a fixed function of the seed (prompts
   and rollout seeds are functions of the step), so the branches through ``s`` and through the
   previous kept jump differ by the jump at ``s`` alone: with it and without it, the same
   steps after it. The report sets the gate's decision (its score before and after) beside
   what it bought ``FORK_AFTER`` steps later. Branch ``none`` is plain OPD: its KL must equal
   ``real_lm-full``'s plain run at the same steps (a determinism check the report shows).
2. **The screen** (item 2). Each variant of ``VARIANTS`` on seed 0 at each lr of
   ``SCREEN_LRS`` (the harm, the gain), 40 steps, accuracy only at the end; compared with the
   plain and EffOPD runs of ``real_lm-full`` at the same lr and seed (same config).

    OMP_NUM_THREADS=1 python -m benchmarks.no_harm --workers 2 &    # twice: two workers
    python -m benchmarks.no_harm --report-only
    python -m benchmarks.no_harm --smoke --out /tmp/no_harm         # the pipeline, a zoo pair

Every run is appended to ``no_harm.json`` when it ends; a rerun skips the runs there.
"""

from __future__ import annotations

import argparse
import math
from typing import Any

import torch

from benchmarks import harness, real_lm
from benchmarks.common import markdown_table, previous_results
from benchmarks.harness import EFFOPD

STEM = "no_harm"
FORK_LRS = (1e-5, 1e-6)  # plain's best (the harm), the paper's (the gain)
SCREEN_LRS = (1e-5, 1e-6)
FORK_LAST = 8  # fork at kept jumps up to this step (1e-6 keeps jumps to 32: budget)
FORK_AFTER = 10  # steps each branch runs past the last fork point
FORK_KL_EVERY = 2
NEVER = "1000000"  # a search schedule whose one step is never reached: no search
# The screen's candidates, each EffOPD's options on top of ``harness.EFFOPD`` (the reference
# EffOPD and plain runs are real_lm-full's). Ordered by the mechanism they test, cheapest
# guess first: the runs go in this order, both lrs of one variant before the next.
VARIANTS: dict[str, dict[str, Any]] = {
    # Adam's first updates are close to sign(g): a one-step secant is mostly noise, and c
    # multiplies it. Searching only once the secant spans 8 steps averages the noise down.
    "late": dict(schedule="8,16,32"),
    # Adam's moments describe the point before the jump: start them again after one.
    "reset": dict(on_jump="reset"),
    "late+reset": dict(schedule="8,16,32", on_jump="reset"),
    # the difference of window averages: less noise than the secant's end points
    "averaged": dict(direction="averaged"),
    # overshoot: at a tuned lr the best c is ~1 (Luner & Grimmer); cap it
    "c<=2": dict(coefficients="1,2"),
    "lr_follow": dict(lr_follow=32),
}


def options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--teacher", default=None, help="the teacher's model folder (real_lm's)")
    p.add_argument("--variants", default=",".join(VARIANTS),
                   help=f"the screen's variants, in order (of {', '.join(VARIANTS)})")
    p.add_argument("--no-forks", dest="forks", action="store_false", help="the screen only")
    p.add_argument("--max-steps", type=int, default=40)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--kl-every", type=int, default=5)
    p.add_argument("--kl-size", type=int, default=32)
    p.add_argument("--eval-size", type=int, default=200)
    p.add_argument("--gate-size", type=int, default=16)


def configure(a: argparse.Namespace, p: argparse.ArgumentParser) -> None:
    if isinstance(a.variants, str):
        a.variants = [v for v in a.variants.split(",") if v]
    unknown = [v for v in a.variants if v not in VARIANTS]
    if unknown:
        p.error(f"--variants: unknown {unknown}; known: {', '.join(VARIANTS)}")
    a.task, a.top_blocks = real_lm.TASK, 0
    a.fork_lrs, a.screen_lrs, a.fork_last, a.fork_after = FORK_LRS, SCREEN_LRS, FORK_LAST, FORK_AFTER
    if a.smoke:  # the committed tiny zoo pair: every kind of run in a minute
        a.task, a.top_blocks = "arithmetic", 1
        a.fork_lrs = a.screen_lrs = (1e-3,)
        a.fork_last, a.fork_after, a.variants = 2, 2, a.variants[:1]


# --------------------------------------------------------------------------- the plan


def reference(a: argparse.Namespace, method: str, lr: float) -> dict[str, Any] | None:
    """``real_lm-full``'s seed-0 run of ``method`` at ``lr`` (the same config), if any."""
    full = None if a.smoke else previous_results(a.out, real_lm.FULL_STEM)
    return (full or {}).get("runs", {}).get(real_lm.run_key("full", method, lr, 0))


def fork_points(a: argparse.Namespace, lr: float) -> list[int]:
    """The steps ≤ ``fork_last`` where the reference EffOPD run kept a jump (without one, as in
    the smoke run, every search step: a refused search makes a branch equal to the one
    before it, which costs a run and shows nothing wrong)."""
    ref = reference(a, "effopd", lr)
    steps = [s for s in (2 ** i for i in range(8)) if s <= a.fork_last]
    if ref is None:
        return steps
    return [j["step"] for j in ref["jumps"] if j["accepted"] is not None and j["step"] in steps]


def jobs(a: argparse.Namespace) -> list[tuple[str, tuple[str, str, float]]]:
    """(key, (kind, name, lr)): the fork branches of every lr, then the screen, both lrs of
    one variant before the next."""
    out = []
    if a.forks:
        for lr in a.fork_lrs:
            points = fork_points(a, lr)
            out += [("fork", "none", lr)] + [("fork", f"<={s}", lr) for s in points]
    out += [("screen", v, lr) for v in a.variants for lr in a.screen_lrs]
    return [(f"{kind}|{name}|{lr:g}|0", (kind, name, lr)) for kind, name, lr in out]


def run_one(a: argparse.Namespace, pair: dict[str, Any], kl: harness.HeldOutKL, kind: str,
            name: str, lr: float) -> dict[str, Any]:
    fields = dict(EFFOPD, gate_size=a.gate_size)
    if kind == "fork":
        points = fork_points(a, lr)
        last = name.removeprefix("<=")
        searches = [] if name == "none" else [s for s in (2 ** i for i in range(8))
                                              if s <= int(last)]
        fields.update(schedule=",".join(map(str, searches)) or NEVER)
        steps, every = max(points, default=0) + a.fork_after, FORK_KL_EVERY
        eval_size = 8  # the accuracy at the ends is not read: the KL is the measure
    else:
        fields.update(VARIANTS[name])
        steps, every, eval_size = a.max_steps, a.kl_every, a.eval_size
    config = harness.opd_config(
        a.stem, f"{kind}-{name}-{lr:g}", task=a.task, loss=real_lm.LOSS, max_steps=steps,
        batch_size=a.batch_size, learning_rate=lr, warmup_steps=0, eval_every=0,
        eval_size=eval_size, seed=0, train_top_blocks=a.top_blocks, progress=not a.smoke,
        **fields)
    probes: list[harness.HeldOutKL] = []

    def watch(model: torch.nn.Module) -> list[Any]:
        probe = kl.for_model(model)
        probe.every = every
        probes.append(probe)
        return probes

    run = harness.run(config, pair, a.task, callbacks=watch, engine_batch_size=64)
    run.update(kind=kind, name=name, lr=lr, seed=0, options=fields,
               kl=probes[0].curve if probes else [])
    return run


# --------------------------------------------------------------------------- summary


def kl_at(run: dict[str, Any] | None, step: int) -> float | None:
    return None if run is None else next((k for s, k in run["kl"] if s == step), None)


def forks(a: argparse.Namespace, results: dict[str, Any]) -> list[dict[str, Any]]:
    """Per lr and fork point: the jump's c, the gate's score before and after it, and the
    held-out KL of the branches with and without it, right after and ``fork_after`` later."""
    runs, out = results["runs"], []
    for lr in a.fork_lrs:
        previous = runs.get(f"fork|none|{lr:g}|0")
        for s in fork_points(a, lr):
            run = runs.get(f"fork|<={s}|{lr:g}|0")
            if run is None or previous is None:
                break
            jump = next((j for j in run["jumps"] if j["step"] == s), None)
            kept = jump and jump.get("accepted")
            gate = (jump["score_before"], jump["scores"][jump["coefficients"].index(kept)]
                    ) if kept else (None, None)
            after = [step for step, _ in run["kl"] if step > s]
            out.append({"lr": lr, "step": s, "c": kept, "gate": gate,
                        "curve": [(t, kl_at(previous, t), kl_at(run, t)) for t in after]})
            previous = run
    return out


def describe(a: argparse.Namespace, results: dict[str, Any], r: dict[str, Any] | None
             ) -> dict[str, Any] | None:
    if r is None:
        return None
    b = argparse.Namespace(max_steps=a.max_steps)
    return real_lm.describe_run(b, results, r)


def screen(a: argparse.Namespace, results: dict[str, Any]) -> list[dict[str, Any]]:
    """Per lr: plain and EffOPD (real_lm-full's) and every variant run, described, with its
    ratios to plain: steps to 90% of the KL drop (plain / variant: ≥ 0.95 is no harm) and the
    KL at the cap (variant / plain: ≤ 1.05 is no harm)."""
    cap = a.max_steps + a.kl_every
    out = []
    for lr in a.screen_lrs:
        plain = describe(a, results, reference(a, "plain", lr))
        rows = [("plain (real_lm-full)", plain),
                ("EffOPD (real_lm-full)", describe(a, results, reference(a, "effopd", lr)))]
        rows += [(v, describe(a, results, results["runs"].get(f"screen|{v}|{lr:g}|0")))
                 for v in VARIANTS]
        for name, d in rows:
            if d is None:
                continue
            steps = end = None
            if plain is not None:
                steps = real_lm.ratio(plain["kl_steps_0.9"], d["kl_steps_0.9"], cap)
                end = (d["final_kl"] / plain["final_kl"]
                       if d["final_kl"] is not None and plain["final_kl"] else None)
            out.append({"lr": lr, "name": name, **d, "steps_ratio_0.9": steps, "kl_ratio": end})
    return out


def replayed(a: argparse.Namespace, results: dict[str, Any]) -> list[dict[str, Any]]:
    """Branch ``none`` is plain OPD: per fork lr, its held-out KL beside ``real_lm-full``'s
    plain run at the steps both measured (equal when runs are a fixed function of the seed)."""
    out = []
    for lr in a.fork_lrs:
        mine, theirs = results["runs"].get(f"fork|none|{lr:g}|0"), reference(a, "plain", lr)
        if mine and theirs:
            both = sorted({s for s, _ in mine["kl"]} & {s for s, _ in theirs["kl"]} - {0})
            out.append({"lr": lr, "steps": both, "max_difference": max(
                (abs(kl_at(mine, t) - kl_at(theirs, t)) for t in both), default=None)})
    return out


def summarize(a: argparse.Namespace, results: dict[str, Any]) -> dict[str, Any]:
    return {"forks": forks(a, results), "screen": screen(a, results),
            "replayed": replayed(a, results)}


# --------------------------------------------------------------------------- report


def _n(x: Any, fmt: str = "{:.3f}") -> str:
    return "—" if x is None or (isinstance(x, float) and math.isnan(x)) else fmt.format(x)


def fork_table(a: argparse.Namespace, s: dict[str, Any]) -> list[str]:
    if not s["forks"]:
        return ["Not run yet.", ""]
    rows = []
    for f in s["forks"]:
        right = f["curve"][0] if f["curve"] else (None, None, None)
        later = next((t for t in f["curve"] if t[0] >= f["step"] + a.fork_after), None)
        end = f["curve"][-1] if f["curve"] else (None, None, None)
        rows.append([f"{f['lr']:g}", f["step"], _n(f["c"], "{:g}"),
                     f"{_n(f['gate'][0], '{:.4f}')} → {_n(f['gate'][1], '{:.4f}')}",
                     *[f"{_n(t[1], '{:.4f}')} → {_n(t[2], '{:.4f}')} (step {t[0]})"
                       if t and t[0] is not None else "—" for t in (right, later, end)]])
    return [markdown_table(["lr", "fork step", "c kept", "gate −KL before → with the jump",
                            "held-out KL without → with, next", f"≥{a.fork_after} steps on",
                            "at the branches' end"], rows), ""]


def screen_table(s: dict[str, Any]) -> list[str]:
    if not s["screen"]:
        return ["Not run yet.", ""]
    rows = [[f"{r['lr']:g}", r["name"], real_lm._steps(r, "kl"),
             f"{_n(r['kl0'])} → {_n(r['final_kl'])}",
             _n(r["steps_ratio_0.9"], "{:.2f}"), _n(r["kl_ratio"], "{:.2f}"),
             ", ".join(f"{c:g}" for c in r["kept_coefficients"]) or "none",
             _n(r["final_accuracy"], "{:.1%}"), _n(r["gate_share"], "{:.0%}"),
             _n(r["clock"], "{:.0f}")] for r in s["screen"]]
    return [markdown_table(["lr", "run", "KL steps 50/75/90%", "KL start → at cap",
                            "steps to 90%: plain / run", "KL at cap: run / plain", "c kept",
                            "accuracy at cap", "gate share", "clock (s)"], rows), ""]


def report(a: argparse.Namespace, results: dict[str, Any]) -> str:
    s = results["summary"]
    return "\n".join([
        "# Do no harm: what a kept jump costs later, and a screen of fixes (real LM)", "",
        harness.made_by(results) + ". The `real_lm-full` setting: student "
        f"`{real_lm.STUDENT}` training every block, its RL-near teacher, task `{a.task}`, loss "
        f"`{real_lm.LOSS}`, {a.batch_size} prompts per step, no warm-up, seed 0; EffOPD's gate "
        f"−reverse KL on {a.gate_size} fixed rollouts; held-out reverse KL on {a.kl_size} fixed "
        "rollouts.", "",
        "## What a kept jump costs later (forks)", "",
        f"Branches that differ by one kept jump, run the same steps after it (held-out KL every "
        f"{FORK_KL_EVERY} steps; '→': without the jump → with it).", "",
        *fork_table(a, s),
        *[f"Branch `none` against `real_lm-full`'s plain run at lr {r['lr']:g}, steps "
          f"{', '.join(map(str, r['steps']))}: largest difference in held-out KL "
          f"{_n(r['max_difference'], '{:.1e}')} (the fork's runs replay the study's)."
          for r in s.get("replayed", [])], "",
        "## The screen (seed 0)", "",
        f"{a.max_steps} steps; plain and EffOPD are `real_lm-full`'s runs at the same lr and "
        "seed. No harm: steps to 90% of the KL drop ≥ 0.95× plain's (or both unreached) and "
        "the KL at the cap ≤ 1.05× plain's.", "",
        *screen_table(s),
    ])


def prepare(a: argparse.Namespace, store: harness.Store) -> tuple[dict[str, Any], Any]:
    """real_lm's pair, the teacher's accuracy (real_lm-full's when known), the held-out KL."""
    pair = real_lm.load_pair(a)
    results = store.data
    results["teacher"] = pair["teacher_name"]
    task = harness.load_task(a.task, pair["tokenizer"])
    known = store.old or (None if a.smoke else previous_results(a.out, real_lm.FULL_STEM)) or {}
    results["teacher_accuracy"] = known.get("teacher_accuracy") or harness.accuracy(
        pair["teacher"], pair["tokenizer"], a.task, a.eval_size, 0)  # seed 0's eval set
    kl = harness.HeldOutKL(pair["student"], pair["teacher"], pair["tokenizer"], task,
                           task.problems("test", a.kl_size, seed=real_lm.KL_PROBLEM_SEED),
                           every=a.kl_every, max_new_tokens=task.max_new_tokens,
                           seed=real_lm.KL_SEED)
    return pair, kl


STUDY = harness.Study(
    STEM, __doc__, report, options=options, uses=("threads", "budget", "workers"),
    smoke=dict(max_steps=4, batch_size=8, kl_every=2, kl_size=8, eval_size=40, gate_size=8),
    configure=configure,
    report_options=("max_steps", "batch_size", "kl_every", "kl_size", "eval_size", "gate_size"),
    prepare=prepare, jobs=lambda a, store, ctx: jobs(a),
    run=lambda a, ctx, job: run_one(a, *ctx, *job), summarize=summarize)
main = STUDY.main

if __name__ == "__main__":
    raise SystemExit(main())
