"""The speed-up question on a real pretrained LM: does EffOPD beat plain OPD when the student is
SmolLM2-135M-Instruct (``smollm2-135m-gguf``) and the teacher its own base trained by RL
(issue 30, item 6)?

The paper's setting as far as one CPU core allows: the sampled-token loss (``reverse_kl_pg``),
16 prompts per step, ``--max-steps`` 40 (≤ 80: see the budget below), no lr warm-up, on
one-step word problems (``wordproblems:steps=1``, chat-templated: the teacher's task, see
``builders/real_teacher.py``);
the student trains its top ``--top-blocks`` decoder blocks and the jump extrapolates those
weights. Methods: ``plain`` (AdamW) and ``effopd`` (the same, wrapped: −reverse-KL gate on 16
fixed rollouts, geometric c, searches at steps 1, 2, 4, …). Progress is measured twice:

- the held-out reverse KL: full-vocabulary KL(student ‖ teacher), teacher-forced on 32 fixed
  rollouts of test prompts (the base's samples, the same for every run), every 5 steps;
- greedy accuracy on ``--eval-size`` 200 test problems every 20 steps (step 0: the base).

Plan, resumable (every run is appended to the json, a rerun skips the runs there):
1. seed 0 at ``--lrs`` (a factor ~3 apart, from a conservative lr up to where plain degrades;
   one lr further while plain's best is the highest), both methods, conservative first;
2. seeds 1 and 2 at the conservative lr and at each method's best lr (the highest fraction of
   the KL drop reached, in fewest steps, then lowest final KL), both methods (the seeds are
   paired: same prompts);
3. item 5's check: at the conservative lr, seed 0, both methods training every block
   (``full``), to say whether the part trained gives full training's verdict.

Between stages 1 and 2, the gradient-noise scale ``B_noise`` on this model
(``harness.NoiseProbe``): plain at its best lr, seed 0, ``NOISE_STEPS`` steps, each split
into ``NOISE_MICRO`` micro-batches — to set beside the regime map's cells, where it is
what separated the cells a jump could help.

    python -m benchmarks.real_lm --workers 2 &  python -m benchmarks.real_lm --workers 2  # study
    python -m benchmarks.real_lm --probe      # steps' cost and KL drop per k (chooses k)
    python -m benchmarks.real_lm --smoke --out /tmp/real_lm    # the pipeline on a zoo pair

``--workers 2`` lets two processes (one thread each) share one json: each claims a run before
it starts it (``harness.Store(shared=True)``). ``--report-only`` rewrites md/png from the json.

Choosing k (``--probe``, ``results/real_lm-probe.md``): EffOPD at lr 1e-4, 4 steps, on the
RL teacher (``builders/real_teacher.py``'s committed delta), one thread beside a one-thread job on the
other core (the study's own setting). Held-out KL after 4 steps and a plain step's seconds
(16 prompts):

    k = 2:   0.172 -> 0.098   37 s
    k = 8:   0.172 -> 0.091   34 s
    k = 30:  0.172 -> 0.222   25 s      (every block but embeddings and lm_head: KL up)

TOP_BLOCKS = 8: the largest drop of the three (a little over k = 2); every block at lr 1e-4
overshoots (the KL rises), which is also why item 5's check (``full``) runs at the
conservative lr. That check then showed the part caps the run: at 1e-5 every block took the
KL to 0.012 in 40 steps where 8 blocks stop near 0.06, in about the same seconds (generation
and evaluation dominate), and the two gave different verdicts; ``--top-blocks 0`` (every
block, ``real_lm-full``) is the study that answers the paper's question. The RL teacher sits
close to the base (KL 0.17), so the KL to close is small. (An earlier probe on a stand-in
teacher, the base after 10 LoRA-SFT steps at KL 1.09, on two-step problems, gave 0.64 / 0.56 /
0.41 for 60 / 62 / 76 s a step, at load ~5.)

Budget at k = 8 (the probe's numbers): a plain step ~34 s; a search adds its gate, 17–45 s
(the first: it also samples and teacher-scores the gate rollouts); a 200-problem greedy eval
≤3 min, the teacher's eval and the held-out rollouts once per process; a held-out KL ~10 s.
One run of S steps: S × 34 + searches (6 for S = 40) × 35 + (S/20 + 1) × 180 + (S/5 + 1) × 10
s, ~35 min at S = 40 (80 steps would double it). Hence ``--max-steps`` 40 by default: 18–22
runs (stage 2 runs 2 or 3 lrs) = 10.5–13 CPU-hours, 5–6.5 hours of wall with two workers.
Over 10 by up to a third: ``--budget_s`` stops starting runs (the json stays resumable), and
stage 2's third lr is the first to go.
"""

from __future__ import annotations

import argparse
import math
import statistics
from pathlib import Path
from typing import Any

import torch

from benchmarks import harness
from benchmarks.common import markdown_table, previous_results
from benchmarks.harness import EFFOPD, FRACTIONS, fmt_range

# The real model's names, the harness's (no_harm and topk read them here too).
STUDENT, TEACHER, TASK, LOSS = (harness.REAL_STUDENT, harness.REAL_TEACHER, harness.REAL_TASK,
                                harness.REAL_LOSS)
DELTA, KL_SEED, KL_PROBLEM_SEED = harness.REAL_DELTA, harness.KL_SEED, harness.KL_PROBLEM_SEED

STEM = "real_lm"
FULL_STEM = f"{STEM}-full"  # the every-block study: item 5 showed it is the one to ask
LEGACY_TEACHER = "smollm2-135m-gguf-rl-15c1ac6efcdd"  # its cache folder before it was one
LRS = (1e-5, 3e-5, 1e-4, 3e-4)  # conservative (paper-like) first, ×~3 apart
TOP_BLOCKS = 8  # chosen by --probe: see the module docstring
PROBE_KS = (2, 8, 30)  # --probe: top-k blocks tried (30: every block of SmolLM2-135M)
PROBE_STEPS = 4  # searches at 1, 2, 4; step 3 a plain step
SEEDS = (0, 1, 2)
METHODS = {"plain": {}, "effopd": dict(EFFOPD)}
NOISE = "noise"  # the B_noise run's method name
NOISE_STEPS, NOISE_MICRO = 8, 4  # 16 prompts: micro-batches of 4

REPORT_OPTIONS = ("max_steps", "batch_size", "kl_every", "kl_size", "eval_every", "eval_size",
                  "gate_size", "lrs", "top_blocks", "seeds", "task", "full_check")


def options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--teacher", default=None,
                   help=f"the teacher's model folder (default: {STUDENT} + the committed delta "
                   f"{DELTA.name}, rebuilt into the cache when missing)")
    p.add_argument("--lrs", default=",".join(f"{x:g}" for x in LRS),
                   help="comma-separated, conservative first")
    p.add_argument("--top-blocks", type=int, default=TOP_BLOCKS,
                   help=f"decoder blocks trained (0: every block, the study then written to "
                   f"{STEM}-full and without stage 3, which it already is)")
    p.add_argument("--max-steps", type=int, default=40, help="the step cap (see the budget)")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--kl-every", type=int, default=5)
    p.add_argument("--kl-size", type=int, default=32)
    p.add_argument("--eval-every", type=int, default=20)
    p.add_argument("--eval-size", type=int, default=200)
    p.add_argument("--gate-size", type=int, default=16)
    p.add_argument("--no-full-check", dest="full_check", action="store_false",
                   help="skip stage 3 (every block trained at the conservative lr)")
    p.add_argument("--probe", action="store_true",
                   help=f"measure a few steps per k in {PROBE_KS} instead (writes {STEM}-probe)")


# The smoke run: the committed tiny zoo pair, every stage, in a minute.
SMOKE = dict(lrs="1e-3,4e-3", top_blocks=1, max_steps=4, batch_size=8, kl_every=2, kl_size=8,
             eval_every=2, eval_size=40, gate_size=8)


def configure(a: argparse.Namespace, p: argparse.ArgumentParser) -> None:
    if isinstance(a.lrs, str):
        try:
            a.lrs = [float(x) for x in a.lrs.split(",")]
        except ValueError:
            p.error(f"--lrs: not a list of numbers: {a.lrs!r}")
    if not a.lrs or any(x <= 0 for x in a.lrs):
        p.error("--lrs: give one or more positive learning rates")
    if a.top_blocks < 0:
        p.error("--top-blocks must be >= 0 (0: every block)")
    if a.teacher is not None and not (Path(a.teacher) / "config.json").is_file():
        p.error(f"--teacher {a.teacher}: not a model folder (no config.json)")
    a.task, a.seeds, a.probe_ks = TASK, SEEDS, PROBE_KS
    if a.top_blocks == 0 and not a.smoke:  # its own json: a study's report reads one part
        a.stem = FULL_STEM
    if a.smoke:
        a.task, a.seeds, a.probe_ks = "arithmetic", (0, 1), (1, 2)
    a.noise_steps = 2 if a.smoke else NOISE_STEPS
    if a.probe:  # a few steps: accuracy only at step 0 and the last, on a few problems
        a.stem += "-probe"
        a.eval_every, a.eval_size, a.kl_every = 0, min(a.eval_size, 16), 2


# --------------------------------------------------------------------------- the pair


def teacher_folder(a: argparse.Namespace) -> str:
    """``--teacher``, else the named source ``TEACHER`` (the base plus the shipped delta)."""
    if a.teacher is not None:
        return a.teacher
    if not DELTA.is_file():
        raise SystemExit(f"real_lm: no teacher: {DELTA} is not built yet (python -m "
                         "benchmarks.builders.real_teacher), and no --teacher FOLDER was given")
    from lookahead_opd.integrations.model_sources import resolve_model

    return resolve_model(TEACHER)


def same_teacher(earlier: str | None, now: str) -> bool:
    """Whether a json's teacher is ``now``: the same string, or the folder the default teacher
    was built into before it became a named source (``LEGACY_TEACHER``, the same weights)."""
    return earlier in (None, now) or (Path(now).name == TEACHER
                                      and Path(earlier).name == LEGACY_TEACHER)


def load_pair(a: argparse.Namespace) -> dict[str, Any]:
    if a.smoke:
        pair = harness.Pairs(progress=False).get("arithmetic", "rl")
        if "error" in pair:
            raise SystemExit(f"real_lm --smoke: the zoo pair: {pair['error']}")
        return {**pair, "teacher_name": pair["build"]}
    teacher = teacher_folder(a)
    return {**harness.load_pair(STUDENT, teacher), "teacher_name": teacher}


# --------------------------------------------------------------------------- runs


def run_key(part: str, method: str, lr: float, seed: int) -> str:
    return f"{part}|{method}|{lr:.6g}|{seed}"


def part_name(a: argparse.Namespace, full: bool) -> str:
    return "full" if full or a.top_blocks == 0 else f"top{a.top_blocks}"


def run_one(a: argparse.Namespace, pair: dict[str, Any], kl: harness.HeldOutKL, part: str,
            method: str, lr: float, seed: int, max_steps: int | None = None) -> dict[str, Any]:
    """One run; ``method`` ``NOISE``: plain, micro-batched, measuring B_noise instead of the KL.
    A run is 35–45 minutes, so it shows the trainer's per-step bar under the study's per-run
    one."""
    noise = method == NOISE
    fields = {} if noise else dict(METHODS[method])
    if "gate" in fields:
        fields["gate_size"] = a.gate_size
    if noise:
        max_steps = a.noise_steps
        fields.update(gradient_accumulation_steps=NOISE_MICRO)
    blocks = 0 if part == "full" else int(part.removeprefix("top"))
    config = harness.opd_config(
        a.stem, f"{part}-{method}-{lr:.6g}-{seed}", task=a.task, loss=LOSS,
        max_steps=max_steps or a.max_steps, batch_size=a.batch_size, learning_rate=lr,
        warmup_steps=0, eval_every=0 if noise else a.eval_every, eval_size=a.eval_size,
        seed=seed, train_top_blocks=blocks, progress=not a.smoke, **fields)
    probes: list[Any] = []

    def watch(model: torch.nn.Module) -> list[Any]:
        probes.append(harness.NoiseProbe(model, NOISE_MICRO) if noise else kl.for_model(model))
        return probes

    run = harness.run(config, pair, a.task, callbacks=watch, engine_batch_size=64)
    run.update(part=part, method=method, lr=lr, seed=seed,
               kl=[] if noise or not probes else probes[0].curve)
    if noise and probes and probes[0].big:
        run["noise"] = probes[0].result(a.batch_size * config.num_samples)
    return run


def runs_of(results: dict[str, Any], part: str, method: str, seed: int = 0
            ) -> dict[float, dict[str, Any]]:
    """lr -> run of ``method`` training ``part`` with ``seed``."""
    return dict(sorted((r["lr"], r) for r in results["runs"].values()
                       if r["part"] == part and r["method"] == method and r["seed"] == seed))


def kl_view(run: dict[str, Any]) -> dict[str, Any]:
    """The run with its held-out KL curve as its 'accuracy' (minus the KL: higher is better),
    so the harness's ``reached`` and ``rank_key`` read it."""
    evals = [[s, -k] for s, k in run["kl"]]
    return {**run, "evals": evals, "final_accuracy": evals[-1][1] if evals else None}


def kl_targets(run: dict[str, Any]) -> dict[str, float]:
    """Minus the KL at 50 / 75 / 90% of the drop to the teacher (KL 0) from the start's."""
    kl0 = run["kl"][0][1]
    return {f"{f:g}": -(1 - f) * kl0 for f in FRACTIONS}


def lr_list(a: argparse.Namespace, results: dict[str, Any]) -> list[float]:
    """``--lrs``, and one lr further (×3) while plain's best (seed 0) is the highest."""
    lrs = list(a.lrs)
    plain = runs_of(results, part_name(a, False), "plain")
    if len(lrs) > 1 and all(lr in plain for lr in lrs) and best_of(plain, lrs) == lrs[-1]:
        lrs.append(lrs[-1] * 3)
    return lrs


def best_of(runs: dict[float, dict[str, Any]], lrs: list[float]) -> float:
    """The lr whose run reaches the highest fraction of the KL drop, in fewest steps, to the
    lowest final KL (``harness.rank_key`` on the KL curve); a crashed run ranks last."""
    def key(lr: float) -> tuple[float, ...]:
        r = runs[lr]
        if r.get("crashed") or not r["kl"] or any(math.isnan(k) for _, k in r["kl"]):
            return (math.inf,)
        return harness.rank_key([kl_view(r)], kl_targets(r), FRACTIONS)
    return min(lrs, key=key)


def best_lrs(a: argparse.Namespace, results: dict[str, Any]) -> dict[str, float] | None:
    """Each method's best lr (seed 0) once stage 1 is complete, else None."""
    lrs, part = lr_list(a, results), part_name(a, False)
    out = {}
    for m in METHODS:
        runs = runs_of(results, part, m)
        if any(lr not in runs for lr in lrs):
            return None
        out[m] = best_of(runs, lrs)
    return out


def plan(a: argparse.Namespace, results: dict[str, Any]) -> list[tuple[str, str, float, int]]:
    """The (part, method, lr, seed) runs in the order they run; stage 2 once stage 1 is done."""
    part, lrs = part_name(a, False), lr_list(a, results)
    out = [(part, m, lr, 0) for lr in lrs for m in METHODS]
    best = best_lrs(a, results)
    if best is None:
        return out
    seed_lrs = sorted({lrs[0], *best.values()})
    out.append((part, NOISE, best["plain"], 0))
    out += [(part, m, lr, s) for s in a.seeds[1:] for lr in seed_lrs for m in METHODS]
    if a.full_check and a.top_blocks:
        out += [("full", m, lrs[0], 0) for m in METHODS]
    return out


# --------------------------------------------------------------------------- summary


def describe_run(a: argparse.Namespace, results: dict[str, Any], r: dict[str, Any]
                 ) -> dict[str, Any]:
    teacher = results["teacher_accuracy"]
    base = r["evals"][0][1] if r["evals"] else None
    acc_t = ({f"{f:g}": base + f * (teacher - base) for f in FRACTIONS}
             if base is not None and teacher > base else None)
    at_cap = lambda curve: (curve[-1][1] if curve and curve[-1][0] == a.max_steps  # noqa: E731
                            else None)
    kept = [j for j in r["jumps"] if j.get("accepted") is not None]
    cosines = [j["secant_cosine"] for j in r["jumps"] if j.get("secant_cosine") is not None]
    out = {"base": base, "final_accuracy": at_cap(r["evals"]), "final_kl": at_cap(r["kl"]),
           "kl0": r["kl"][0][1] if r["kl"] else None, "crashed": r.get("crashed"),
           "kept": len(kept), "searches": len(r["jumps"]),
           "kept_coefficients": [j["accepted"] for j in kept],
           "gate_share": harness.gate_share(r), "clock": harness.train_clock(r),
           "secant_cosine": statistics.fmean(cosines) if cosines else None}
    for f in FRACTIONS:
        out[f"kl_steps_{f:g}"] = (harness.reached(kl_view(r), kl_targets(r), (f,))[f"steps_{f:g}"]
                                  if r["kl"] else None)
        out[f"acc_steps_{f:g}"] = (harness.reached(r, acc_t, (f,))[f"steps_{f:g}"]
                                   if acc_t else None)
    return out


def ratio(plain: int | float | None, eff: int | float | None, cap: float) -> float | None:
    """plain / effopd (>1: EffOPD faster or lower); a target not reached counts as ``cap``."""
    if plain is None and eff is None:
        return None
    return (cap if plain is None else plain) / (cap if eff is None else eff)


def step_ratios(pairs: list[tuple[dict[str, Any], dict[str, Any]]], cap: float
                ) -> dict[float, list[float | None]]:
    """Per fraction of the KL drop, plain / EffOPD steps to it for each (plain, effopd) pair."""
    return {f: [ratio(p[f"kl_steps_{f:g}"], e[f"kl_steps_{f:g}"], cap) for p, e in pairs]
            for f in FRACTIONS}


def highest_fraction(ratios: dict[float, list[float | None]]) -> float | None:
    """The highest of ``FRACTIONS`` of the KL drop whose plain / EffOPD step ratios are all
    defined (a pair counts when one of its runs reached it, the other at the cap): the
    comparisons use it, as the drop is to KL 0, which 40 steps on part of the student need
    not reach, and a fixed 75% could leave nothing to compare."""
    got = [f for f in FRACTIONS if ratios[f] and None not in ratios[f]]
    return got[-1] if got else None


def summarize(a: argparse.Namespace, results: dict[str, Any]) -> dict[str, Any]:
    runs = {k: describe_run(a, results, r) for k, r in results["runs"].items()
            if r["method"] in METHODS}
    part = part_name(a, False)
    s: dict[str, Any] = {"runs": runs, "lrs": lr_list(a, results), "best": best_lrs(a, results)}
    noise = [r for r in results["runs"].values() if r["method"] == NOISE and r.get("noise")]
    s["noise"] = {"lr": noise[0]["lr"], **noise[0]["noise"]} if noise else None
    cap = a.max_steps + a.kl_every  # not reached: one measurement past the cap
    paired: dict[str, Any] = {}
    for lr in sorted({r["lr"] for r in results["runs"].values() if r["part"] == part}):
        pairs = []
        for seed in a.seeds:
            p, e = run_key(part, "plain", lr, seed), run_key(part, "effopd", lr, seed)
            if p in runs and e in runs:
                pairs.append((seed, runs[p], runs[e]))
        if not pairs:
            continue
        steps = step_ratios([(p, e) for _, p, e in pairs], cap)
        paired[f"{lr:g}"] = {
            "seeds": [sd for sd, _, _ in pairs], "fraction": highest_fraction(steps),
            **{f"kl_steps_{f:g}": steps[f] for f in FRACTIONS},
            "final_kl": [None if p["final_kl"] is None or e["final_kl"] is None
                         else p["final_kl"] / e["final_kl"] if e["final_kl"] > 0 else None
                         for _, p, e in pairs],
            "final_accuracy": [None if p["final_accuracy"] is None or e["final_accuracy"] is None
                               else e["final_accuracy"] - p["final_accuracy"]
                               for _, p, e in pairs]}
    s["paired"] = paired
    full = {m: runs.get(run_key("full", m, a.lrs[0], 0)) for m in METHODS}
    part0 = {m: runs.get(run_key(part, m, a.lrs[0], 0)) for m in METHODS}
    if a.top_blocks and all(full.values()) and all(part0.values()):
        steps = step_ratios([(d["plain"], d["effopd"]) for d in (full, part0)], cap)
        f = highest_fraction(steps)

        def says(r: float | None) -> str:
            return "no target" if r is None else "effopd faster" if r > 1 else (
                "same" if r == 1 else "plain faster")
        full_says, part_says = (["no target"] * 2 if f is None else map(says, steps[f]))
        s["full_check"] = {"lr": a.lrs[0], "fraction": f, "full": full_says, part: part_says,
                           "same_verdict": full_says == part_says}
    s["verdict"] = verdict(a, s)
    return s


# --------------------------------------------------------------------------- report


def _n(x: Any, fmt: str = "{:.3f}") -> str:
    return "—" if x is None else fmt.format(x)


def _steps(r: dict[str, Any], kind: str) -> str:
    return " / ".join("·" if r[f"{kind}_steps_{f:g}"] is None else str(r[f"{kind}_steps_{f:g}"])
                      for f in FRACTIONS)


def verdict(a: argparse.Namespace, s: dict[str, Any]) -> str:
    """The one sentence: EffOPD against plain at the conservative lr and at plain's best lr, by
    paired-seed ratios of steps to ``highest_fraction`` of the held-out KL drop, and of the KL
    at the cap."""
    said = []
    best = (s.get("best") or {}).get("plain")
    for label, lr in (("the conservative lr", a.lrs[0]), ("plain's best lr", best)):
        d = None if lr is None else s["paired"].get(f"{lr:g}")
        if d is None or len(d["seeds"]) < len(a.seeds):
            said.append(f"at {label}: not measured yet")
            continue
        f = d["fraction"]
        if f is None:
            said.append(f"at {label} ({lr:g}): neither method reached 50% of the KL drop")
            continue
        rs, ends = d[f"kl_steps_{f:g}"], d["final_kl"]
        word = "beats" if min(rs) > 1 else "loses to" if max(rs) < 1 else "does not clearly beat"
        end = ("" if None in ends else
               f", KL at the cap {fmt_range(ends, '{:.2f}', single=False)}")
        said.append(f"at {label} ({lr:g}) EffOPD {word} plain OPD (plain / EffOPD over "
                    f"{len(rs)} paired seeds: steps to {f:.0%} of the KL drop "
                    f"{fmt_range(rs, '{:.2f}', single=False)}{end})")
    return "On this student and teacher, " + "; ".join(said) + "."


def both_ends(a: argparse.Namespace, s: dict[str, Any]) -> str:
    """Does EffOPD from the conservative lr get the fast lr's early speed (steps to 50% of the
    KL drop: plain at its best lr) *and* the small lr's end point (KL at the cap: plain at the
    conservative lr)? Means over the seeds run at both. Where every one of those runs got
    further than 50%, the steps to the highest such fraction follow: early is not the whole
    race."""
    part, best = part_name(a, False), (s.get("best") or {}).get("plain")
    if best is None:
        return "Not measured yet (the lr stage is not finished)."

    def runs(method: str, lr: float) -> list[dict[str, Any]]:
        return [r for sd in a.seeds if (r := s["runs"].get(run_key(part, method, lr, sd)))]

    eff, fast, slow = runs("effopd", a.lrs[0]), runs("plain", best), runs("plain", a.lrs[0])
    cap = a.max_steps + a.kl_every

    def steps(f: float) -> list[float | None]:
        return [harness.mean([cap if r[f"kl_steps_{f:g}"] is None else r[f"kl_steps_{f:g}"]
                              for r in rs]) for rs in (eff, fast)]

    early, end = steps(0.5), [harness.mean([r["final_kl"] for r in rs]) for rs in (eff, slow)]
    if None in early or None in end:
        return "Not measured yet."
    far = [f for f in FRACTIONS if all(r[f"kl_steps_{f:g}"] is not None for r in eff + fast)]
    later = ("; to {:.0%}: {:.0f} against {:.0f}".format(far[-1], *steps(far[-1]))
             if far and far[-1] > 0.5 else "")
    return (f"EffOPD from the conservative lr {a.lrs[0]:g}: {early[0]:.0f} steps to 50% of the "
            f"KL drop against plain's {early[1]:.0f} at its best lr {best:g} "
            f"({'as fast' if early[0] <= early[1] else 'slower'}{later}); KL at the cap "
            f"{end[0]:.3f} against plain's {end[1]:.3f} at the conservative lr "
            f"({'as low' if end[0] <= end[1] else 'higher'}). Means over {len(eff)}, "
            f"{len(fast)} and {len(slow)} seeds; not reached counts as {cap} steps.")


def every_block_verdict(a: argparse.Namespace, s: dict[str, Any]) -> list[str]:
    """Where the part trained gave a different verdict from every block (item 5), the study's
    answer is the every-block study's: its verdict, read from its json, follows this one."""
    fc = s.get("full_check")
    full = previous_results(a.out, FULL_STEM) if a.stem == STEM and fc else None
    said = full and not fc["same_verdict"] and full.get("summary", {}).get("verdict")
    return ["", f"Training the top {a.top_blocks} blocks gave a different verdict from training "
            f"every block (item 5, below), so the study's answer is the every-block study's "
            f"([{FULL_STEM}.md]({FULL_STEM}.md)): {said}"] if said else []


def every_run_table(results: dict[str, Any]) -> str:
    """One row per run, by part, method, lr (as a number) and seed."""
    s = results["summary"]
    headers = ["part", "method", "lr", "KL start → at cap", "KL steps 50/75/90%",
               "accuracy base → at cap", "acc. steps 50/75/90%", "kept / searches",
               "gate share", "secant cos", "clock (s)"]
    rows = []

    def order(key: str) -> tuple[Any, ...]:
        run = results["runs"][key]
        return run["part"], run["method"], run["lr"], run["seed"]

    for key in sorted(s["runs"], key=order):
        r, run = s["runs"][key], results["runs"][key]
        rows.append([run["part"], run["method"], f"{run['lr']:g}" + (
            f" (seed {run['seed']})" if run["seed"] else ""),
            f"{_n(r['kl0'])} → {_n(r['final_kl'])}", _steps(r, "kl"),
            f"{_n(r['base'], '{:.1%}')} → {_n(r['final_accuracy'], '{:.1%}')}", _steps(r, "acc"),
            f"{r['kept']} / {r['searches']}", _n(r["gate_share"], "{:.0%}"),
            _n(r["secant_cosine"], "{:.2f}"), _n(r["clock"], "{:.0f}")
            + (" (crashed)" if r["crashed"] else "")])
    return markdown_table(headers, rows)


def report(a: argparse.Namespace, results: dict[str, Any]) -> str:
    s, m = results["summary"], results["machine"]
    part = part_name(a, False)
    lines = [
        "# EffOPD on a real pretrained LM: SmolLM2-135M-Instruct and its RL-near teacher", "",
        "Made by " + ", then ".join(f"`{c}`" for c in results.get("commands") or [m["command"]])
        + f", last at {m.get('git_commit')}, on {m.get('cpu_model')} (torch {m.get('torch')}, "
        f"{m.get('torch_threads')} thread). Student `{results['student']}` training "
        + (f"its top {a.top_blocks} decoder blocks" if a.top_blocks else "every block")
        + f"; teacher `{results['teacher']}` (greedy accuracy "
        f"{results['teacher_accuracy']:.1%} on the seed-0 eval set); task `{a.task}`"
        + (" (chat template)" if results.get("chat_template") else "")
        + f"; loss `{LOSS}`; {a.batch_size} prompts per step, {a.max_steps} steps, no "
        f"warm-up. EffOPD: −reverse-KL gate on {a.gate_size} fixed rollouts, geometric c. "
        f"Held-out reverse KL on {a.kl_size} fixed rollouts every {a.kl_every} steps; greedy "
        f"accuracy on {a.eval_size} test problems every {a.eval_every} steps. Steps to a "
        "fraction: of the KL drop to 0, or of the teacher's accuracy gain over the base "
        "('·': not reached within the cap).", "",
        "## Verdict", "", s["verdict"], *every_block_verdict(a, s), "", both_ends(a, s), "",
        "## Every run", "",
    ]
    lines += [every_run_table(results), ""]
    if s.get("best"):
        lines += ["Best lr (seed 0; most of the KL drop, fewest steps, lowest final KL): "
                  + ", ".join(f"{k} {v:g}" for k, v in s["best"].items()) + ".", ""]
    if s["paired"]:
        lines += ["## Paired seeds (plain / EffOPD; > 1: EffOPD ahead)", "",
                  markdown_table(
                      ["lr", "seeds", "KL steps 50%", "KL steps 75%", "KL steps 90%",
                       "final KL", "final accuracy (EffOPD − plain)"],
                      [[lr, ",".join(map(str, d["seeds"])),
                        *[fmt_range(d[f"kl_steps_{f:g}"], "{:.2f}", single=False)
                          for f in FRACTIONS],
                        fmt_range(d["final_kl"], "{:.2f}", single=False),
                        fmt_range(d["final_accuracy"], "{:+.1%}", single=False)]
                       for lr, d in s["paired"].items()]), ""]
    nz = s.get("noise")
    lines += ["## Gradient noise", "",
              f"B_noise = tr(Σ)/|G|² (McCandlish et al. 2018, the simple scale) of plain at "
              f"lr {nz['lr']:g}, over {nz['steps']} steps of {nz['rows']} rows split into "
              f"{nz['micro_batches']} micro-batches: **{nz['b_noise_rows']:.0f} rows** "
              f"({nz['b_noise_tokens']:.0f} completion tokens; a step has {nz['rows']} rows, "
              f"{_n(nz['tokens_per_step'], '{:.0f}')} tokens). The regime map's cells are in "
              "`regimes.md`." if nz else "Not measured yet (after stage 1).", ""]
    if not a.top_blocks:  # this study is item 5's reference, not a part to check against it
        return "\n".join(lines)
    fc = s.get("full_check")
    lines += ["## The part trained against every block (item 5)", ""]
    lines += [f"At lr {fc['lr']:g}, seed 0, by steps to {_n(fc['fraction'], '{:.0%}')} of the "
              f"KL drop (the highest both comparisons reached): every block — "
              f"{fc['full']}; top {a.top_blocks} — {fc[part]}: "
              + ("the same verdict." if fc["same_verdict"] else "**different verdicts**.")
              if fc else "Not run yet.", ""]
    return "\n".join(lines)


def plot(a: argparse.Namespace, results: dict[str, Any]) -> None:
    runs = [r for r in results["runs"].values() if r["seed"] == 0 and r["method"] in METHODS]
    if not runs:
        return
    plt = harness.pyplot()
    with harness.figure(f"{a.out}/{a.stem}.png", 2, panel=(5.5, 4)) as (fig, axes):
        kl_ax, acc_ax = axes[0]
        lrs = sorted({r["lr"] for r in runs})
        colors = {lr: plt.cm.viridis(i / max(1, len(lrs) - 1)) for i, lr in enumerate(lrs)}
        for r in sorted(runs, key=lambda r: (r["part"], r["lr"], r["method"])):
            style = {"color": colors[r["lr"]], "ls": "-" if r["method"] == "plain" else "--",
                     "marker": "o" if r["part"] == "full" else None, "ms": 3}
            label = f"{r['part']} {r['method']} {r['lr']:g}"
            if r["kl"]:
                kl_ax.plot(*zip(*r["kl"], strict=True), label=label, **style)
            if r["evals"]:
                acc_ax.plot(*zip(*r["evals"], strict=True), **style)
        kl_ax.set(xlabel="step", ylabel="held-out reverse KL to the teacher", yscale="log")
        acc_ax.set(xlabel="step", ylabel="greedy accuracy")
        acc_ax.axhline(results["teacher_accuracy"], color="gray", ls=":", label="teacher")
        kl_ax.legend(fontsize=6)
        acc_ax.legend(fontsize=6)
        fig.suptitle("seed 0: plain (solid) vs EffOPD (dashed); "
                     + ("dots: every block trained" if a.top_blocks else "every block trained"),
                     fontsize=9)


def probe_report(a: argparse.Namespace, results: dict[str, Any]) -> str:
    """--probe: per k, the seconds of each step (1, 2, 4 search; 3 plain) and the KL drop."""
    m = results["machine"]
    rows = []
    for r in results["runs"].values():
        clock = {int(k): v for k, v in r["train_seconds"].items()}
        per = {s: clock[s] - clock[s - 1] for s in clock if s - 1 in clock}
        gate = {j["step"]: j.get("seconds", 0.0) for j in r["jumps"]}
        rows.append([r["part"], f"{r['lr']:g}", _n(per.get(3), "{:.1f}"),
                     " / ".join(_n(per.get(s), "{:.1f}") for s in (1, 2, 4)),
                     " / ".join(_n(gate.get(s), "{:.1f}") for s in (1, 2, 4)),
                     " → ".join(f"{k:.4f}" for _, k in r["kl"]),
                     _n(r["wall_seconds"], "{:.0f}")])
    return "\n".join([
        "# real_lm probe: what a step costs, and how far the student moves, per k", "",
        f"Made by `{m['command']}` at {m.get('git_commit')} on {m.get('cpu_model')} "
        f"({m.get('torch_threads')} thread, a shared machine). EffOPD, {PROBE_STEPS} steps "
        f"(searches at 1, 2, 4; step 3 plain), {a.batch_size} prompts, loss `{LOSS}`, teacher "
        f"`{results['teacher']}`; held-out reverse KL on {a.kl_size} rollouts every 2 steps.", "",
        markdown_table(["part", "lr", "plain step (s)", "search steps 1/2/4 (s)",
                        "their gate (s)", "held-out KL", "wall (s)"], rows), ""])


# --------------------------------------------------------------------------- the study


def prepare(a: argparse.Namespace, store: harness.Store) -> tuple[dict[str, Any], Any]:
    """The pair (its teacher the json's), the teacher's accuracy once, the held-out KL probe."""
    pair = load_pair(a)  # before the json changes: no teacher, one line
    old, results = store.old or {}, store.data
    if not same_teacher(old.get("teacher"), pair["teacher_name"]):
        raise SystemExit(f"real_lm: the json's runs used teacher {old['teacher']}, not "
                         f"{pair['teacher_name']}; write elsewhere with --out, or --fresh")
    results["student"] = pair["path"] if a.smoke else STUDENT
    results["teacher"] = pair["teacher_name"]
    results["chat_template"] = bool(getattr(pair["tokenizer"], "chat_template", None))
    task = harness.load_task(a.task, pair["tokenizer"])
    results["teacher_accuracy"] = old.get("teacher_accuracy")
    if results["teacher_accuracy"] is None and not a.probe:  # on seed 0's eval set, once
        results["teacher_accuracy"] = harness.accuracy(pair["teacher"], pair["tokenizer"], a.task,
                                                       a.eval_size, 0)
    kl = harness.HeldOutKL(pair["student"], pair["teacher"], pair["tokenizer"], task,
                           task.problems("test", a.kl_size, seed=KL_PROBLEM_SEED),
                           every=a.kl_every, max_new_tokens=task.max_new_tokens, seed=KL_SEED)
    return pair, kl


def jobs(a: argparse.Namespace, store: harness.Store, ctx: Any) -> list[tuple[str, Any]]:
    if a.probe:  # EffOPD at the middle lr, a few steps, per k
        lr = a.lrs[len(a.lrs) // 2]
        return [(run_key(f"top{k}", "effopd", lr, 0), (f"top{k}", "effopd", lr, 0))
                for k in a.probe_ks]
    return [(run_key(*job), job) for job in plan(a, store.data)]


def run(a: argparse.Namespace, ctx: Any, job: tuple[str, str, float, int]) -> dict[str, Any]:
    return run_one(a, *ctx, *job, max_steps=PROBE_STEPS if a.probe else None)


STUDY = harness.Study(
    STEM, __doc__, lambda a, results: (probe_report if a.probe else report)(a, results),
    options=options, uses=("threads", "budget", "workers"), smoke=SMOKE, configure=configure,
    report_options=("max_steps", "batch_size", "kl_every", "kl_size", "eval_every", "eval_size",
                    "gate_size", "lrs", "top_blocks", "seeds", "task", "full_check"),
    prepare=prepare, jobs=jobs, run=run,
    summarize=lambda a, results: None if a.probe else summarize(a, results),
    plot=lambda a, results: None if a.probe else plot(a, results))
main = STUDY.main

if __name__ == "__main__":
    raise SystemExit(main())
