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

3. **Prodigy's fine-tuning advice** (``--stages advice``, item 4). Its authors advise a smaller
   ``d_coef`` and ``safeguard_warmup`` with a short lr warm-up for fine-tuning (the Prodigy
   README; konstmish/prodigy #27, #39). Each setting of ``ADVICE`` runs on seed 0 from 1e-6;
   the one with the lowest held-out KL at the cap is "Prodigy, advised" below.
4. **The rivals** (``--stages rivals``, item 4): each of ``RIVALS`` from 1e-6 and at 1e-5
   (``RIVAL_LRS``; Prodigy's ``d0`` is that lr), seeds ``SEEDS``.
5. **The confirmation** (``--stages confirm --default NAME``, item 3): the chosen variant (a
   name of ``VARIANTS``, or ``effopd``) beside plain at ``CONFIRM_LRS`` × ``SEEDS``; the runs
   ``real_lm-full`` holds are read from it, the others run here.

    OMP_NUM_THREADS=1 python -m benchmarks.no_harm --workers 2 &    # twice: two workers
    OMP_NUM_THREADS=1 python -m benchmarks.no_harm --stages confirm --default late \\
        --only-lrs 3e-6 --only-seeds 0,1                              # a slice of a stage
    python -m benchmarks.no_harm --report-only
    python -m benchmarks.no_harm --smoke --out /tmp/no_harm         # the pipeline, a zoo pair

Every run is appended to ``no_harm.json`` when it ends; a rerun skips the runs there.
"""

from __future__ import annotations

import argparse
import json
import math
from typing import Any

import torch

from benchmarks import harness, real_lm, searches
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
    # late missed the bar at 3e-6 by the least (KL at the cap 1.06x, 1.07x plain's after one
    # c = 1 jump at step 8), and the reset took untuned_only's seed 0 there from 1.31x to 1.03x
    "late+reset": dict(schedule="8,16,32", on_jump="reset"),
    # the difference of window averages: less noise than the secant's end points
    "averaged": dict(direction="averaged"),
    # overshoot: at a tuned lr the best c is ~1 (Luner & Grimmer); cap it
    "c<=2": dict(coefficients="1,2"),
    "lr_follow": dict(lr_follow=32),
    # selection on a small gate: the forks' c = 2 at step 2 (1e-5) won on the gate and lost on
    # the held-out rollouts two steps later; ask for 2 paired standard errors of the gate set
    "margin": dict(margin=2.0),
    # the gate's best at a tuned lr sits at the edge where the score turns (real_lm-full,
    # 1e-5, step 1: c = 4 at −0.077, c = 8 at −0.194), while at 1e-6 every c up to 16
    # improved: step back one candidate from the edge, and only where there is one
    "back_off": dict(back_off=1),
    # late kept 1e-5 whole and 1e-6's gain (KL at the cap 0.32× plain) but slower than the
    # early jumps; back_off 1 still kept c = 2 at 1e-5's step 1: keep a jump only from a
    # ladder that never turned (every c up to 16 better: only a too-small lr gives that)
    "untuned_only": dict(back_off=8),
    # reset alone ended 1e-5 below plain (KL at the cap 0.80×) after the same c = 4 jump: the
    # optimizer's state, not the jump alone, carried the cost; with the smaller jump too
    "reset+back_off": dict(on_jump="reset", back_off=1),
    # untuned_only at 3e-6 (confirmation, seed 0) kept one jump, c = 16 at step 1 from a ladder
    # that never turned, led plain until step 25 and ended 1.31x its KL: is it Adam's moments
    # from before the jump? Where nothing is kept (1e-5, 3e-5) this run is untuned_only's.
    "reset+untuned_only": dict(on_jump="reset", back_off=8),
    # The step-1 ladders never turned at 1e-6 or at 3e-6, but they bend differently: the last
    # rung's gain per unit of c is 0.7-0.9x the rung's before at 1e-6, under 0.2x at 3e-6 (see
    # "How the gate's ladder bends", made from these ladders: the threshold 0.5 was read off
    # them, so the seeds and lrs not yet seen are the test). Keep a jump only from a ladder
    # that has not bent: a too-small lr's.
    "linear": dict(linearity=0.5),
    "reset+linear": dict(linearity=0.5, on_jump="reset"),
}
BEND = VARIANTS["linear"]["linearity"]
# A variant that adds on_jump="reset" to another: where the other kept no jump, the reset never
# acted and the runs are the same run (runs are a fixed function of the seed), made once.
RESET_TWINS = {"reset": "effopd", "late+reset": "late", "reset+back_off": "back_off",
               "reset+untuned_only": "untuned_only", "reset+linear": "linear"}
# More generally, a variant that keeps a jump only from ladders its twin keeps from (and acts
# on nothing else): where the twin kept no jump, it kept none on the same ladders either.
TWINS = {**RESET_TWINS, "linear": "untuned_only"}  # linearity > 0 needs a ladder that never turned
STAGES = ("forks", "screen", "advice", "rivals", "confirm")
# summary()'s reading: kept jumps that added more distance than the optimizer moved hint that
# the lr is too small (real_lm-full, seed 0: 5.17 at 1e-6, 0.59 at 1e-5)
TOO_SMALL = 1.0
SEEDS = (0, 1, 2)
RIVAL_LRS = (1e-6, 1e-5)  # from the paper's lr, and at plain's best (Prodigy: its d0)
CONFIRM_LRS = (1e-6, 3e-6, 1e-5, 3e-5)
ADVICE_WARMUP = 4  # steps of linear lr warm-up (10% of the 40): "a short warm-up"
ADVICE = {f"d_coef={d:g}": d for d in (0.5, 0.1)}  # the README's "0.5 or even 0.1"
PRODIGY = {"optimizer": "prodigy"}  # lr 1 (build_optimizer), d0 = the run's lr
# The rivals, each EffOPD's or Prodigy's options; "Prodigy, advised" takes the advice's pick.
RIVAL_NAMES = {"effopd+lr_follow": "lr_follow"}  # a rival that is a screen variant: one run
RIVALS: dict[str, dict[str, Any]] = {
    "prodigy": PRODIGY,
    "prodigy, advised": PRODIGY,
    "effopd+lr_follow": {**EFFOPD, **VARIANTS["lr_follow"]},
    "effopd(prodigy)": {**EFFOPD, **PRODIGY},
}


def options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--teacher", default=None, help="the teacher's model folder (real_lm's)")
    p.add_argument("--variants", default=",".join(VARIANTS),
                   help=f"the screen's variants, in order (of {', '.join(VARIANTS)})")
    p.add_argument("--stages", default="forks,screen",
                   help=f"comma-separated, in order (of {', '.join(STAGES)})")
    p.add_argument("--default", default=None,
                   help="confirm: the chosen variant (a screen variant's name, or effopd)")
    p.add_argument("--only-lrs", default=None, help="run only the plan's runs at these lrs "
                   "(comma-separated; the plan and the report stay whole)")
    p.add_argument("--only-seeds", default=None, help="run only the plan's runs of these seeds "
                   "(comma-separated; the plan and the report stay whole)")
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
    if isinstance(a.stages, str):
        a.stages = [x for x in a.stages.split(",") if x]
    if set(a.stages) - set(STAGES):
        p.error(f"--stages: unknown {sorted(set(a.stages) - set(STAGES))}; known: "
                f"{', '.join(STAGES)}")
    if "confirm" in a.stages and a.default not in (*VARIANTS, "effopd"):
        p.error(f"--stages confirm needs --default, one of effopd, {', '.join(VARIANTS)}")
    for name, kind in (("only_lrs", float), ("only_seeds", int)):
        value = getattr(a, name)
        if isinstance(value, str):
            try:
                setattr(a, name, tuple(kind(x) for x in value.split(",") if x))
            except ValueError:
                p.error(f"--{name.replace('_', '-')}: {value!r} is not a comma-separated list "
                        f"of {kind.__name__}s")
    a.seeds, a.rival_lrs, a.confirm_lrs = SEEDS, RIVAL_LRS, CONFIRM_LRS
    a.task, a.top_blocks = real_lm.TASK, 0
    a.fork_lrs, a.screen_lrs, a.fork_last, a.fork_after = FORK_LRS, SCREEN_LRS, FORK_LAST, FORK_AFTER
    if a.smoke:  # the committed tiny zoo pair: every kind of run in a minute
        a.task, a.top_blocks = "arithmetic", 1
        a.fork_lrs = a.screen_lrs = (1e-3,)
        a.fork_last, a.fork_after, a.variants = 2, 2, a.variants[:1]
        a.seeds, a.rival_lrs, a.confirm_lrs = (0, 1), (1e-3,), (1e-3,)


# --------------------------------------------------------------------------- the plan


def reference(a: argparse.Namespace, method: str, lr: float, seed: int = 0
              ) -> dict[str, Any] | None:
    """``real_lm-full``'s run of ``method`` (plain or effopd) at ``lr`` and ``seed`` (the same
    config), if any."""
    full = None if a.smoke else previous_results(a.out, real_lm.FULL_STEM)
    return (full or {}).get("runs", {}).get(real_lm.run_key("full", method, lr, seed))


def find_run(a: argparse.Namespace, results: dict[str, Any], name: str, lr: float, seed: int
             ) -> dict[str, Any] | None:
    """The run of method ``name`` (plain, effopd, a variant or a rival) at ``lr`` and ``seed``
    wherever it was made: ``real_lm-full``, the screen, the rivals or the confirmation (the
    same config in each, so no run is made twice)."""
    name = RIVAL_NAMES.get(name, name)
    if name in ("plain", "effopd") and (ref := reference(a, name, lr, seed)) is not None:
        return ref
    run = next((r for kind in ("screen", "rival", "confirm")
                if (r := results["runs"].get(f"{kind}|{name}|{lr:g}|{seed}")) is not None), None)
    if run is None and name in TWINS:  # the same decisions on the same ladders: one run
        twin = find_run(a, results, TWINS[name], lr, seed)
        if twin is not None and all(j["accepted"] is None for j in twin["jumps"]):
            return twin
    return run


def advice_pick(a: argparse.Namespace, results: dict[str, Any]) -> str | None:
    """The setting of ``ADVICE`` whose seed-0 run from the first rival lr ends at the lowest
    held-out KL (all of them run), else None."""
    runs = {n: results["runs"].get(f"advice|{n}|{a.rival_lrs[0]:g}|0") for n in ADVICE}
    if None in runs.values():
        return None
    final = {n: describe(a, results, r)["final_kl"] for n, r in runs.items()}
    return min(final, key=lambda n: math.inf if final[n] is None else final[n])


def fork_points(a: argparse.Namespace, lr: float) -> list[int]:
    """The steps ≤ ``fork_last`` where the reference EffOPD run kept a jump (without one, as in
    the smoke run, every search step: a refused search makes a branch equal to the one
    before it, which costs a run and shows nothing wrong)."""
    ref = reference(a, "effopd", lr)
    steps = [s for s in (2 ** i for i in range(8)) if s <= a.fork_last]
    if ref is None:
        return steps
    return [j["step"] for j in ref["jumps"] if j["accepted"] is not None and j["step"] in steps]


def wanted(a: argparse.Namespace, results: dict[str, Any], stage: str
           ) -> list[tuple[str, float, int]]:
    """(method, lr, seed) of ``stage``, in the order they run."""
    if stage == "forks":
        return [(n, lr, 0) for lr in a.fork_lrs
                for n in ("none", *(f"<={s}" for s in fork_points(a, lr)))]
    if stage == "screen":
        return [(v, lr, 0) for v in a.variants for lr in a.screen_lrs]
    if stage == "advice":
        return [(n, a.rival_lrs[0], 0) for n in ADVICE]
    if stage == "rivals":
        names = [n for n in RIVALS if n != "prodigy, advised" or advice_pick(a, results)]
        return [(RIVAL_NAMES.get(n, n), lr, s) for s in a.seeds for lr in a.rival_lrs
                for n in names]
    return [(n, lr, s) for s in a.seeds for lr in a.confirm_lrs for n in ("plain", a.default)]


def jobs(a: argparse.Namespace, results: dict[str, Any]
         ) -> list[tuple[str, tuple[str, str, float, int]]]:
    """(key, (kind, name, lr, seed)) of every stage of ``--stages``, skipping the rivals' and
    the confirmation's runs already made elsewhere (``find_run``), and those outside
    ``--only-lrs``/``--only-seeds``."""
    kind = {"forks": "fork", "rivals": "rival"}
    out = []
    for stage in a.stages:
        k = kind.get(stage, stage)
        out += [(f"{k}|{n}|{lr:g}|{seed}", (k, n, lr, seed))
                for n, lr, seed in wanted(a, results, stage)
                if (k not in ("rival", "confirm") or find_run(a, results, n, lr, seed) is None)
                and (not a.only_lrs or any(math.isclose(lr, x) for x in a.only_lrs))
                and (not a.only_seeds or seed in a.only_seeds)]
    return out


def fields_of(a: argparse.Namespace, results: dict[str, Any], kind: str, name: str, lr: float
              ) -> dict[str, Any]:
    """The OPDConfig fields of a run (its method's options; Prodigy's ``d0`` is ``lr``)."""
    if kind == "fork":
        last = name.removeprefix("<=")
        searches = [] if name == "none" else [s for s in (2 ** i for i in range(8))
                                              if s <= int(last)]
        fields = {**EFFOPD, "schedule": ",".join(map(str, searches)) or NEVER}
    elif kind == "advice" or name == "prodigy, advised":
        pick = name if kind == "advice" else advice_pick(a, results)
        fields = {**PRODIGY, "warmup_steps": ADVICE_WARMUP, "d_coef": ADVICE[pick]}
    else:
        fields = dict(RIVALS.get(name) or ({} if name == "plain" else EFFOPD))
        fields.update(VARIANTS.get(name, {}))
    if "gate" in fields:
        fields["gate_size"] = a.gate_size
    if fields.get("optimizer") == "prodigy":
        kwargs = {"d0": lr, **({"d_coef": fields.pop("d_coef")} if "d_coef" in fields else {})}
        fields["optimizer_kwargs"] = json.dumps(kwargs)
    return fields


def run_one(a: argparse.Namespace, pair: dict[str, Any], kl: harness.HeldOutKL,
            store: harness.Store, kind: str, name: str, lr: float, seed: int
            ) -> dict[str, Any]:
    fields = fields_of(a, store.data, kind, name, lr)
    if kind == "fork":
        steps = max(fork_points(a, lr), default=0) + a.fork_after
        every, eval_size = FORK_KL_EVERY, 8  # the accuracy at the ends is not read
    else:
        steps, every, eval_size = a.max_steps, a.kl_every, a.eval_size
    config = harness.opd_config(
        a.stem, f"{kind}-{name}-{lr:g}-{seed}", task=a.task, loss=real_lm.LOSS,
        max_steps=steps, batch_size=a.batch_size, learning_rate=lr, eval_every=0,
        eval_size=eval_size, seed=seed, train_top_blocks=a.top_blocks, progress=not a.smoke,
        **{"warmup_steps": 0, **fields})
    probes: list[harness.HeldOutKL] = []

    def watch(model: torch.nn.Module) -> list[Any]:
        probe = kl.for_model(model)
        probe.every = every
        probes.append(probe)
        return probes

    run = harness.run(config, pair, a.task, callbacks=watch, engine_batch_size=64)
    run.update(kind=kind, name=name, lr=lr, seed=seed, options=fields,
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


def compared(a: argparse.Namespace, results: dict[str, Any], name: str, lr: float, seed: int,
             plain_lr: float, run: dict[str, Any] | None = None) -> dict[str, Any] | None:
    """The run of ``name`` at ``lr`` and ``seed``, described, with its ratios to plain's at
    ``plain_lr`` and the same seed: steps to 90% of the KL drop (plain / run: ≥ 0.95 is no
    harm) and the KL at the cap (run / plain: ≤ 1.05 is no harm); and its summary's
    ``extra_distance``. None when the run is not made yet. ``run``: this one instead of
    ``find_run``'s."""
    run = run or find_run(a, results, name, lr, seed)
    d = describe(a, results, run)
    if d is None:
        return None
    plain = describe(a, results, find_run(a, results, "plain", plain_lr, seed))
    steps = end = None
    if plain is not None:
        steps = real_lm.ratio(plain["kl_steps_0.9"], d["kl_steps_0.9"],
                              a.max_steps + a.kl_every)
        end = (d["final_kl"] / plain["final_kl"]
               if d["final_kl"] is not None and plain["final_kl"] else None)
    share = gate_share_until(run, d["kl_steps_0.9"] or a.max_steps)
    return {"lr": lr, "seed": seed, "name": name, **d, "paired": plain is not None,
            "steps_ratio_0.9": steps,
            "seconds_ratio_0.9": None if steps is None or share is None else steps * (1 - share),
            "kl_ratio": end, "extra_distance": (run.get("summary") or {}).get("extra_distance")}


def gate_share_until(run: dict[str, Any], step: int) -> float | None:
    """The share of the run's clock up to ``step`` that its searches took. Plain's step costs
    what the run's non-search steps cost (the same model, batch and machine), so the seconds
    ratio to 90% of the KL drop is the step ratio times 1 − this: no clocks of runs made
    at other times, under other loads, are compared."""
    clock = (run.get("train_seconds") or {}).get(str(step))
    if not clock:
        return None
    return sum(j.get("seconds") or 0.0 for j in run["jumps"] if j["step"] <= step) / clock


def screen(a: argparse.Namespace, results: dict[str, Any]) -> list[dict[str, Any]]:
    """Per lr: plain and EffOPD (real_lm-full's) and every variant, seed 0, beside plain."""
    rows = [compared(a, results, n, lr, 0, lr)
            for lr in a.screen_lrs for n in ("plain", "effopd", *VARIANTS)]
    return [r for r in rows if r is not None]


def plain_best(a: argparse.Namespace) -> float:
    """Plain's best lr on seed 0 in ``real_lm-full`` (its ranking); the last rival lr when
    there is none (the smoke run)."""
    full = None if a.smoke else previous_results(a.out, real_lm.FULL_STEM)
    plain = real_lm.runs_of(full, "full", "plain") if full else {}
    return real_lm.best_of(plain, sorted(plain)) if plain else a.rival_lrs[-1]


def seeds_of(a: argparse.Namespace, results: dict[str, Any], name: str, lr: float,
             plain_lr: float) -> dict[str, Any]:
    """``compared`` over the seeds, its numbers gathered per key (the runs made so far)."""
    runs = [r for s in a.seeds if (r := compared(a, results, name, lr, s, plain_lr))]
    keys = ("kl_steps_0.9", "final_kl", "final_accuracy", "clock", "gate_share", "paired",
            "steps_ratio_0.9", "seconds_ratio_0.9", "kl_ratio", "extra_distance")
    return {"name": name, "lr": lr, "plain_lr": plain_lr, "seeds": [r["seed"] for r in runs],
            **{k: [r[k] for r in runs] for k in keys}}


def advice(a: argparse.Namespace, results: dict[str, Any]) -> dict[str, Any]:
    """Each setting of Prodigy's advice on seed 0 from the first rival lr, and the pick."""
    lr = a.rival_lrs[0]
    runs = {n: results["runs"].get(f"advice|{n}|{lr:g}|0") for n in ADVICE}
    rows = [compared(a, results, n, lr, 0, plain_best(a), run) for n, run in runs.items() if run]
    return {"rows": rows, "pick": advice_pick(a, results)}


def rivals(a: argparse.Namespace, results: dict[str, Any]) -> list[dict[str, Any]]:
    """Plain at its best lr, then EffOPD and each rival at each rival lr, over the seeds,
    beside plain at its best lr."""
    best = plain_best(a)
    rows = [seeds_of(a, results, "plain", best, best)]
    rows += [seeds_of(a, results, n, lr, best) for lr in a.rival_lrs
             for n in ("effopd", *RIVALS)]
    return [r for r in rows if r["seeds"]]


def candidates(a: argparse.Namespace, results: dict[str, Any]) -> list[str]:
    """Every rule the confirmation has run (``--default`` of some call), in the order first
    run, and this call's ``--default``."""
    names = [k.split("|")[1] for k in results["runs"] if k.startswith("confirm|")]
    return [n for n in dict.fromkeys([*names, *([a.default] if a.default else [])])
            if n != "plain"]


def confirm(a: argparse.Namespace, results: dict[str, Any]) -> list[dict[str, Any]]:
    """Per candidate (``candidates``) and lr of the confirmation: the candidate beside plain
    at the same lr, over the seeds made, with the bar of item 3: steps to 90% ≥ 0.95× plain's
    on every seed (both unreached passes), the KL at the cap ≤ 1.05× plain's on every seed,
    and ≥ 1.8× fewer steps (mean) at the smallest lr. A seed that misses the bar is named in
    ``harmed`` as soon as it and plain's run beside it are made."""
    out = []
    for name in candidates(a, results):
        rows = []
        for lr in a.confirm_lrs:
            r = seeds_of(a, results, name, lr, lr)
            complete = len(r["seeds"]) == len(a.seeds) and all(r["paired"])
            steps = [x for x in r["steps_ratio_0.9"] if x is not None]
            r["harmed"] = [{"seed": s, "steps_ratio_0.9": st, "kl_ratio": kl}
                           for s, paired, st, kl in zip(r["seeds"], r["paired"],
                                                        r["steps_ratio_0.9"], r["kl_ratio"],
                                                        strict=True)
                           if paired and ((st is not None and st < 0.95) or kl is None
                                          or kl > 1.05)]
            r.update(complete=complete, no_harm=complete and not r["harmed"],
                     gain=(complete and lr == min(a.confirm_lrs)
                           and bool(steps) and sum(steps) / len(steps) >= 1.8))
            rows.append(r)
        out.append({"name": name, "rows": rows})
    return out


def resets(a: argparse.Namespace, results: dict[str, Any]) -> list[dict[str, Any]]:
    """Item 1's state question, run by run: each variant that kept a jump beside its
    ``on_jump="reset"`` twin (the same rule, Adam's moments restarted after a kept jump) and
    plain, same lr and seed: the c each kept and the held-out KL at the cap."""
    out = []
    for reset, keep in RESET_TWINS.items():
        for lr in sorted({*a.confirm_lrs, *a.screen_lrs}):
            for seed in a.seeds:
                runs = [find_run(a, results, n, lr, seed) for n in ("plain", keep, reset)]
                if None in runs or not any(j["accepted"] for j in runs[1]["jumps"]):
                    continue
                kl = [kl_at(r, a.max_steps) for r in runs]
                out.append({"lr": lr, "seed": seed, "keep": keep, "reset": reset,
                            "kept": [[j["accepted"] for j in r["jumps"] if j["accepted"]]
                                     for r in runs[1:]], "kl": kl})
    return out


def rung_ratio(search: dict[str, Any]) -> float | None:
    """The last rung's gain per unit of c over the rung's before (the rungs join the score of
    ``W_t`` at c = 0 and the candidates'), for a ladder on which every candidate improved;
    None where one did not (the ladder turned) or there are fewer than two rungs.
    ``ExtrapolationOptions.linearity`` reads the same."""
    c, f = [0.0, *search["coefficients"]], [search["score_before"], *search["scores"]]
    if len(c) < 3 or any(y <= x for x, y in zip(f[:-1], f[1:], strict=True)):
        return None
    return ((f[-1] - f[-2]) / (c[-1] - c[-2])) / ((f[-2] - f[-3]) / (c[-2] - c[-3]))


def bends(a: argparse.Namespace, results: dict[str, Any]) -> list[dict[str, Any]]:
    """Per lr and seed, the gate's step-1 ladder (the same for every rule that searches at step
    1, from the same start): did it turn, how much it bent (``rung_ratio``), and the held-out KL
    at the cap of the EffOPD runs that kept its top, against plain's at the same lr and seed."""
    full = None if a.smoke else previous_results(a.out, real_lm.FULL_STEM)
    runs = [*((full or {}).get("runs", {}).values()), *results["runs"].values()]
    out: dict[tuple[float, int], dict[str, Any]] = {}
    for r in runs:
        first = next((j for j in r.get("jumps", []) if j["step"] == 1), None)
        if first is None or r.get("kind") == "fork":
            continue
        row = out.setdefault((r["lr"], r["seed"]), {
            "lr": r["lr"], "seed": r["seed"], "turned": rung_ratio(first) is None,
            "ratio": rung_ratio(first), "kept_top": [], "plain_kl": kl_at(
                find_run(a, results, "plain", r["lr"], r["seed"]), a.max_steps)})
        if first["accepted"] is not None and first["accepted"] == first["coefficients"][-1]:
            kl = kl_at(r, a.max_steps)
            if kl is not None and row["plain_kl"]:
                row["kept_top"].append(kl / row["plain_kl"])
    return sorted(out.values(), key=lambda x: (x["lr"], x["seed"]))


def patience(a: argparse.Namespace, results: dict[str, Any]) -> list[dict[str, Any]]:
    """Item 5: per lr of the confirmation, the default's runs replayed at each ``patience`` k
    (``searches.replay_row``): a refused search leaves the weights as they were, so a stop
    that loses no kept jump leaves the run as it was, less the skipped searches' seconds."""
    if not a.default or a.default == "plain":
        return []
    out = []
    for lr in a.confirm_lrs:
        runs = [searches.replay_record(r, r["jumps"]) for s in a.seeds
                if (r := find_run(a, results, a.default, lr, s)) and r["jumps"]]
        if runs:
            out.append({"lr": lr, "rows": [searches.replay_row(runs, k)
                                           for k in searches.PATIENCES]})
    return out


def hit_rate(a: argparse.Namespace, results: dict[str, Any]) -> dict[str, Any]:
    """How often ``summary()``'s reading (``extra_distance`` > ``TOO_SMALL``: the lr may be too
    small) agrees with the truth (the lr is below plain's best), over every EffOPD run with a
    summary here and in ``real_lm-full`` (forks and Prodigy's excluded)."""
    full = None if a.smoke else previous_results(a.out, real_lm.FULL_STEM)
    runs = [r for r in results["runs"].values() if r.get("kind") not in ("fork", "advice")]
    runs += [r for r in (full or {}).get("runs", {}).values() if r.get("method") == "effopd"]
    best, hits, rows = plain_best(a), 0, []
    for r in runs:
        extra = (r.get("summary") or {}).get("extra_distance")
        if extra is None:
            continue
        agree = (extra > TOO_SMALL) == (r["lr"] < best)
        hits += agree
        rows.append({"name": r.get("name", r.get("method")), "lr": r["lr"], "seed": r["seed"],
                     "extra_distance": extra, "agrees": agree})
    return {"hits": hits, "runs": len(rows), "plain_best": best, "rows": rows}


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
            "replayed": replayed(a, results), "advice": advice(a, results),
            "rivals": rivals(a, results), "confirm": confirm(a, results),
            "resets": resets(a, results), "bends": bends(a, results),
            "patience": patience(a, results), "per_lr": per_lr(a, results),
            "hit_rate": hit_rate(a, results)}


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
    label = {"plain": "plain (real_lm-full)", "effopd": "EffOPD (real_lm-full)"}
    rows = [[f"{r['lr']:g}", label.get(r["name"], r["name"]), real_lm._steps(r, "kl"),
             f"{_n(r['kl0'])} → {_n(r['final_kl'])}",
             _n(r["steps_ratio_0.9"], "{:.2f}"), _n(r["kl_ratio"], "{:.2f}"),
             ", ".join(f"{c:g}" for c in r["kept_coefficients"]) or "none",
             _n(r["final_accuracy"], "{:.1%}"), _n(r["gate_share"], "{:.0%}"),
             _n(r["clock"], "{:.0f}")] for r in s["screen"]]
    return [markdown_table(["lr", "run", "KL steps 50/75/90%", "KL start → at cap",
                            "steps to 90%: plain / run", "KL at cap: run / plain", "c kept",
                            "accuracy at cap", "gate share", "clock (s)"], rows), ""]


def spread(values: list[Any], fmt: str = "{:.3f}", none: str = "missing") -> str:
    """'mean (min–max)' of the values, over those that are not None; how many are is said
    (``none``: what a None means, as a step count never reached)."""
    got = [v for v in values if v is not None]
    if not got:
        return none if values else ""
    text = fmt.format(sum(got) / len(got))
    if len(got) > 1:
        text += f" ({fmt.format(min(got))}–{fmt.format(max(got))})"
    return text + ("" if len(got) == len(values) else f"; {len(values) - len(got)} {none}")


def seeds_table(rows: list[dict[str, Any]], plain: str) -> list[str]:
    """One row per (method, lr): mean (min–max) over its seeds."""
    if not rows:
        return ["Not run yet.", ""]
    names = {"plain": "plain", "effopd": "EffOPD", "lr_follow": "EffOPD + lr_follow",
             "effopd+lr_follow": "EffOPD + lr_follow", "effopd(prodigy)": "EffOPD wrapping Prodigy",
             "prodigy": "Prodigy (defaults)", "prodigy, advised": "Prodigy, advised"}
    body = [[names.get(r["name"], r["name"]), f"{r['lr']:g}", len(r["seeds"]),
             spread(r["kl_steps_0.9"], "{:.0f}", "not reached"), spread(r["final_kl"], "{:.4f}"),
             spread(r["steps_ratio_0.9"], "{:.2f}", "both unreached"),
             spread(r["kl_ratio"], "{:.2f}"), spread(r["final_accuracy"], "{:.1%}"),
             spread(r["clock"], "{:.0f}")]
            for r in rows]
    return [markdown_table(["method", "lr (Prodigy: d0)", "seeds", "steps to 90% of the KL drop",
                            "KL at cap", f"steps: {plain} / run", f"KL at cap: run / {plain}",
                            "accuracy at cap", "clock (s)"], body), ""]


def advice_lines(a: argparse.Namespace, s: dict[str, Any]) -> list[str]:
    rows = s["advice"]["rows"]
    if not rows:
        return ["Not run yet.", ""]
    body = [[r["name"], real_lm._steps(r, "kl"), _n(r["final_kl"], "{:.4f}"),
             _n(r["final_accuracy"], "{:.1%}")] for r in rows]
    pick = s["advice"]["pick"]
    return [markdown_table(["Prodigy, warm-up " f"{ADVICE_WARMUP} steps, safeguard_warmup",
                            "KL steps 50/75/90%", "KL at cap", "accuracy at cap"], body), "",
            f"Picked: `{pick}`, the lowest held-out KL at the cap (seed 0, from "
            f"{a.rival_lrs[0]:g}); \"Prodigy, advised\" below runs it." if pick else
            "Not picked yet: every setting must run.", ""]


def confirm_lines(a: argparse.Namespace, s: dict[str, Any]) -> list[str]:
    if not s["confirm"]:
        return ["Not run yet: `--stages confirm --default NAME` once the screen has chosen.", ""]
    out = ["Each candidate beside plain at the same lr and seed, mean (min–max) over the seeds "
           "made. Seconds: the step ratio times 1 − the candidate's gate share up to that step "
           "(a plain step costs what its other steps cost); clocks of runs made under other "
           "loads are not compared.", ""]
    for c in s["confirm"]:
        name, rows = c["name"], [r for r in c["rows"] if r["seeds"]]
        body = [[f"{r['lr']:g}", ", ".join(map(str, r["seeds"])),
                 spread(r["steps_ratio_0.9"], "{:.2f}", "both unreached"),
                 spread(r["seconds_ratio_0.9"], "{:.2f}", "both unreached"),
                 spread(r["kl_ratio"], "{:.2f}"), spread(r["gate_share"], "{:.0%}"),
                 "no" if r["harmed"] else "yes" if r["complete"] else "so far"]
                for r in rows]
        harmed = [(r["lr"], h) for r in rows for h in r["harmed"]]
        done = all(r["complete"] for r in c["rows"])
        gain = done and c["rows"][0]["gain"]
        verdict = (
            f"**Verdict:** `{name}` harms: " + "; ".join(
                f"at {lr:g}, seed {h['seed']}, steps to 90% "
                f"{_n(h['steps_ratio_0.9'], '{:.2f}')}× plain's, KL at the cap "
                f"{_n(h['kl_ratio'], '{:.2f}')}× plain's" for lr, h in harmed)
            + "; the bar needs every seed at every lr." if harmed else
            f"**Verdict:** `{name}`: not every run is made yet." if not done else
            f"**Verdict:** `{name}` does no harm at every lr, and "
            f"{'keeps' if gain else 'does not keep'} ≥ 1.8× fewer steps at "
            f"{c['rows'][0]['lr']:g}.")
        out += [f"### `{name}`", "",
                markdown_table(["lr", "seeds", "steps to 90%: plain / it",
                                "seconds to 90%: plain / it", "KL at cap: it / plain",
                                "gate share", "no harm on every seed"], body), "",
                verdict, ""]
    return out


def reset_lines(s: dict[str, Any]) -> list[str]:
    rows = s.get("resets") or []
    if not rows:
        return ["No variant and its reset twin have both run where the variant kept a jump.", ""]

    def ratio(x: float | None, plain: float | None) -> str:
        return "—" if x is None or not plain else f"{x:.4f} ({x / plain:.2f}×)"
    body = [[f"{r['lr']:g}", r["seed"], f"`{r['keep']}` / `{r['reset']}`",
             " / ".join(", ".join(f"{c:g}" for c in k) or "none" for k in r["kept"]),
             _n(r["kl"][0], "{:.4f}"), ratio(r["kl"][1], r["kl"][0]), ratio(r["kl"][2], r["kl"][0])]
            for r in sorted(rows, key=lambda r: (r["keep"], r["lr"], r["seed"]))]
    return ["The same rule with Adam's moments kept and restarted after a kept jump "
            "(`on_jump=\"reset\"`), beside plain at the same lr and seed; '(×)': to plain.", "",
            markdown_table(["lr", "seed", "rule: kept / reset", "c kept: kept / reset",
                            "plain's KL at cap", "KL at cap, state kept", "KL at cap, reset"],
                           body), ""]


def bend_lines(s: dict[str, Any]) -> list[str]:
    rows = s.get("bends") or []
    if not rows:
        return ["No run has searched at step 1 yet.", ""]
    body = [[f"{r['lr']:g}", r["seed"], "turned" if r["turned"] else "never turned",
             _n(r["ratio"], "{:.2f}"), "yes" if r["ratio"] is not None and r["ratio"] >= BEND
             else "no", spread(r["kept_top"], "{:.2f}×") or "—"]
            for r in rows]
    return ["The gate's ladder at step 1 (W_t, then c = 1, 2, 4, 8, 16), the same for every "
            "rule from the same start. How it bends: the last rung's gain per unit of c over "
            f"the rung's before (1: straight; `linearity = {BEND:g}` keeps the top where it is "
            "at least that). Runs that kept the top (c = 16): their held-out KL at the cap over "
            "plain's, mean (min–max) over those runs ('—': none did; a ladder that turned "
            "refused its top).", "",
            markdown_table(["lr", "seed", "ladder", "last rung / rung before, per unit of c",
                            f"linearity {BEND:g} keeps it", "runs that kept it: KL at cap / "
                            "plain's"], body), ""]


def patience_lines(s: dict[str, Any]) -> list[str]:
    lrs = s.get("patience") or []
    if not lrs:
        return ["Not run yet: it replays the confirmation's runs.", ""]

    def cell(r: dict[str, Any]) -> str:
        return (f"{_n(r['gate_share'], '{:.1%}')} → {_n(r['gate_share_after'], '{:.1%}')}; "
                f"{r['skipped']} of {r['searches']} searches, {r['lost']} kept lost")
    ks = [r["patience"] for r in lrs[0]["rows"]]
    body = [[k, *(cell(x["rows"][i]) for x in lrs)] for i, k in enumerate(ks)]
    pays = [k for i, k in enumerate(ks) if all(x["rows"][i]["lost"] == 0 for x in lrs)]
    return ["Each run of the default replayed as if it had stopped searching after k refused "
            "searches in a row: the gate's share of the clock at the cap, all searches → with "
            "the stop, over the seeds made; a stop that loses no kept jump leaves the run as "
            "it was.", "",
            markdown_table(["patience k", *(f"{x['lr']:g}" for x in lrs)], body), "",
            f"The smallest k that lost no kept jump at any lr: {pays[0]}." if pays else
            "Every k lost a kept jump somewhere: a stop would change the runs.", ""]


def per_lr(a: argparse.Namespace, results: dict[str, Any]) -> list[dict[str, Any]]:
    """Per lr of the confirmation: plain, EffOPD as it was, the default, and Prodigy from that
    lr (its d0), over the seeds made so far."""
    names = ["plain", "effopd", *([a.default] if a.default not in (None, "effopd") else []),
             "prodigy"]
    return [{"lr": lr, "runs": {n: seeds_of(a, results, n, lr, lr) for n in names}}
            for lr in a.confirm_lrs]


def per_lr_lines(s: dict[str, Any]) -> list[str]:
    """The README's table: one row per lr, each method's steps to 90% of the KL drop, KL at
    the cap and seeds, means (min–max) over them."""
    rows = s["per_lr"]
    if not rows:
        return ["Not run yet.", ""]
    names = list(rows[0]["runs"])

    def cell(r: dict[str, Any]) -> str:
        if not r["seeds"]:
            return "not run"
        return (f"{spread(r['kl_steps_0.9'], '{:.0f}', 'unreached')} · "
                f"{spread(r['final_kl'], '{:.4f}')} · n = {len(r['seeds'])}")
    label = {"plain": "plain", "effopd": "EffOPD (before)", "prodigy": "Prodigy (d0 = lr)"}
    return [markdown_table(["lr", *(label.get(n, f"EffOPD, `{n}`") for n in names)],
                           [[f"{r['lr']:g}", *(cell(r["runs"][n]) for n in names)]
                            for r in rows]), ""]


def hit_lines(s: dict[str, Any]) -> list[str]:
    h = s["hit_rate"]
    if not h["runs"]:
        return ["No EffOPD run with a summary yet.", ""]
    return [f"`summary()` reads \"the lr may be too small\" when `extra_distance` > {TOO_SMALL:g}. "
            f"Below plain's best lr ({h['plain_best']:g}) that is right, at or above it wrong: "
            f"it agrees on {h['hits']} of {h['runs']} EffOPD runs (screen, rivals, confirmation "
            "and `real_lm-full`).", ""]


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
        "## Prodigy's fine-tuning advice (seed 0)", "",
        *advice_lines(a, s),
        "## The rivals", "",
        f"From {' and at '.join(f'{x:g}' for x in a.rival_lrs)}, {len(a.seeds)} seeds, "
        "beside plain at its best lr "
        f"({plain_best(a):g}) on the same seed; mean (min–max).", "",
        *seeds_table(s["rivals"], f"plain at {plain_best(a):g}"),
        "## The confirmation", "",
        *confirm_lines(a, s),
        f"![seed 0's held-out KL per lr]({a.stem}.png)", "",
        "## How the gate's ladder bends", "",
        *bend_lines(s),
        "## Adam's state after a kept jump", "",
        *reset_lines(s),
        "## Stopping the searches (patience)", "",
        *patience_lines(s),
        "## Per lr: steps to 90% of the KL drop · KL at the cap · seeds", "",
        "Means (min–max) over the seeds; 'unreached': not within the steps.", "",
        *per_lr_lines(s),
        "## What summary() reads", "",
        *hit_lines(s),
    ])


def plot(a: argparse.Namespace, results: dict[str, Any]) -> None:
    """One panel per lr of the confirmation: seed 0's held-out KL of plain, EffOPD as it was
    and every variant run there (the default bold), each labelled with the c it kept: where a
    kept jump leads early and trails later is seen at a glance."""
    plt = harness.pyplot()
    names = ["plain", "effopd", *VARIANTS]
    # one colour per variant in every panel; plain drawn thin on top, so that a default that
    # kept nothing (and so is plain) shows as plain inside a wider line
    palette = [c for c in plt.get_cmap("tab20").colors[::2] if c != plt.get_cmap("tab10")(3)]
    colour = {n: palette[i % len(palette)] for i, n in enumerate(VARIANTS)}
    panels = [(lr, [(n, r) for n in names if (r := find_run(a, results, n, lr, 0))])
              for lr in a.confirm_lrs]
    panels = [(lr, runs) for lr, runs in panels if runs]
    if not panels:
        return
    with harness.figure(f"{a.out}/{a.stem}.png", len(panels)) as (_, axes):
        for ax, (lr, runs) in zip(axes[0], panels, strict=True):
            for n, r in runs:
                kept = ", ".join(f"{j['accepted']:g}" for j in r["jumps"] if j["accepted"] is not None)
                style = ({"color": "black", "lw": 1.2, "zorder": 5} if n == "plain" else
                         {"color": "tab:red", "lw": 2, "ls": "--"} if n == "effopd" else
                         {"color": colour[n], "lw": 3.5 if n == a.default else 1.2})
                label = {"plain": "plain", "effopd": "EffOPD (before)"}.get(n, n)
                ax.plot(*zip(*r["kl"], strict=True), label=f"{label}" + (f" (c: {kept})" if kept else ""),
                        **style)
            ax.set(title=f"lr {lr:g}", xlabel="step", yscale="log")
            ax.legend(fontsize=6)
        axes[0][0].set_ylabel("held-out reverse KL to the teacher (seed 0)")


def prepare(a: argparse.Namespace, store: harness.Store) -> tuple[Any, ...]:
    """real_lm's pair, the held-out KL and the store (the teacher's accuracy in its results:
    real_lm-full's when known)."""
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
    return pair, kl, store


STUDY = harness.Study(
    STEM, __doc__, report, options=options, uses=("threads", "budget", "workers"),
    smoke=dict(max_steps=4, batch_size=8, kl_every=2, kl_size=8, eval_size=40, gate_size=8),
    configure=configure,
    report_options=("max_steps", "batch_size", "kl_every", "kl_size", "eval_size", "gate_size",
                    "default"),
    private=("only_lrs", "only_seeds"), prepare=prepare, plot=plot,
    jobs=lambda a, store, ctx: jobs(a, store.data),
    run=lambda a, ctx, job: run_one(a, *ctx, *job), summarize=summarize)
main = STUDY.main

if __name__ == "__main__":
    raise SystemExit(main())
