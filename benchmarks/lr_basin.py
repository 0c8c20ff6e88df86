"""The lr basin: how far from the best learning rate can a run start and still train at
best-lr speed? EffOPD as learning-rate insurance, against Mechanic and Prodigy.

On regime-map cells (``benchmarks/regimes.py``) and the committed zoo pairs, with **no lr
warm-up** (a warm-up is what early kept jumps made up for in ``regimes-nowarmup``):

1. AdamW's best lr on this pair, seed 0 (the regime map's grid a factor 2 apart, extended ×2
   while the best is the highest and ½ while it is the lowest);
2. from every starting lr ``best × 2^k``, k = −5..1 (best/32 … best×2), one run per method,
   best/16 first: ``adamw``; ``effopd`` (−reverse-KL gate, geometric c, searches at 1, 2, 4, 8,
   …); ``effopd-every`` (the same, searching every ``EVERY`` steps); ``effopd-follow``
   (``lr_follow``: kept jumps carry into the lr, experimental); ``mechanic`` (Mechanic around
   AdamW at the starting lr, its authors' defaults); ``prodigy`` (lr 1, its estimate ``d``
   starting from ``d0`` = the starting lr, its authors' other defaults);
3. seeds 1 and 2 at best/16, best/4 and best;
4. the sweep a user without the best lr would run: AdamW at the conservative lr (best/16)
   × 1, √10, 10, 10√10, 100 (k = 3: × 1, 10, 100).

Every run stops at 90% of the teacher's gain over the base (cap ``--max-steps``) and evaluates
greedy exact match every ``--eval-every`` steps. Results are rewritten after every run and a
rerun skips the runs in the json (``--report-only`` rewrites md/png from it).

    python -m benchmarks.lr_basin                                   # the CPU study (hours)
    python -m benchmarks.lr_basin --cells long-128/sft/adamw        # one cell
    python -m benchmarks.lr_basin --smoke --out /tmp/lr_basin       # the pipeline in minutes
"""

from __future__ import annotations

import argparse
import math
import statistics
from collections.abc import Sequence
from typing import Any

from benchmarks import harness
from benchmarks.common import markdown_table
from benchmarks.harness import CELLS, EFFOPD, STOP_FRACTION, fmt_range

STEM = "lr_basin"
LR_CELLS = ("short-512/rl/adamw", "long-128/rl/adamw", "long-128/sft/adamw")  # cheapest first
FACTORS = tuple(2.0**k for k in range(-5, 2))  # starting lr / best lr
CONSERVATIVE = 1 / 16  # the user's conservative start, × best
SEED_FACTORS = (1 / 16, 1 / 4, 1.0)  # where the 3 seeds run
SEEDS = (0, 1, 2)
SWEEP = (1.0, 10**0.5, 10.0, 10**1.5, 100.0)  # × the conservative lr; k=3 takes 1, 10, 100
EVERY = 8  # effopd-every searches every this many steps
FOLLOW_CAP = 32.0  # lr_follow's cap: enough to climb from best/32
BASIN_SLACK = 1.25  # a start is in the basin when its steps are ≤ this × AdamW's best
FRACTIONS = (0.75, 0.9)
METHODS = {  # name -> OPDConfig fields (lr handled per method in config_for)
    "adamw": {},
    "effopd": dict(EFFOPD),
    "effopd-every": {**EFFOPD, "every": EVERY},
    "effopd-follow": {**EFFOPD, "lr_follow": FOLLOW_CAP},
    "mechanic": {"optimizer": "mechanic:adamw"},
    "prodigy": {"optimizer": "prodigy"},
}


def options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cells", default=",".join(LR_CELLS), help="comma-separated regime-map cells")
    p.add_argument("--methods", default=",".join(METHODS), help="comma-separated methods")
    p.add_argument("--max-steps", type=int, default=300)
    p.add_argument("--eval-every", type=int, default=4)
    p.add_argument("--eval-size", type=int, default=harness.EVAL_SIZE)
    p.add_argument("--gate-size", type=int, default=EFFOPD["gate_size"])
    p.add_argument("--cache-dir", default=None, help="zoo cache (default: benchmarks/zoo)")


# The smoke run: one tiny cell, a few steps, two starts.
SMOKE = dict(cells="smoke/sft/adamw", max_steps=6, eval_every=2, eval_size=40, gate_size=16,
             factors=(1 / 4, 1.0), seed_factors=(1.0,), seeds=(0, 1), sweep=(1.0, 10.0))


def configure(a: argparse.Namespace, p: argparse.ArgumentParser) -> None:
    a.size, a.cell_specs = "tiny", dict(CELLS)
    if not a.smoke:  # (the smoke run's are in SMOKE)
        a.factors, a.seed_factors, a.seeds, a.sweep = FACTORS, SEED_FACTORS, SEEDS, SWEEP
    else:
        a.cell_specs = {"smoke/sft/adamw": {**CELLS["short-32/sft/adamw"], "prompts": 8,
                                            "lrs": [1e-3, 4e-3]}}
    a.names = [c.strip() for c in a.cells.split(",")]
    a.method_list = [m.strip() for m in a.methods.split(",")]
    unknown = [n for n in a.names if n not in a.cell_specs]
    if unknown:
        p.error(f"unknown cell(s) {unknown}; known: {', '.join(a.cell_specs)}")
    bad = [m for m in a.method_list if m not in METHODS]
    if bad:
        p.error(f"unknown method(s) {bad}; known: {', '.join(METHODS)}")


# --------------------------------------------------------------------------- runs


def run_key(cell: str, method: str, lr: float, seed: int) -> str:
    return f"{cell}|{method}|{lr:.6g}|{seed}"


def config_for(a: argparse.Namespace, cell: dict[str, Any], method: str, lr: float, seed: int,
               target: float) -> Any:
    fields = dict(METHODS[method])
    if method == "prodigy":  # lr 1 (its authors'); the starting lr is its first estimate d0
        fields["optimizer_kwargs"] = f'{{"d0": {lr!r}}}'
    if "gate" in fields:
        fields["gate_size"] = a.gate_size
    return harness.cell_config(a.stem, f"{method}-{lr:.6g}-{seed}", cell, lr, seed, target,
                               a.eval_size, max_steps=a.max_steps, warmup_steps=0,
                               eval_every=a.eval_every, **fields)


def run_one(a: argparse.Namespace, results: dict[str, Any], pairs: harness.Pairs, name: str,
            method: str, lr: float, seed: int) -> dict[str, Any]:
    cell = a.cell_specs[name]
    bt = harness.base_and_targets(results, pairs, cell, seed, a.eval_size)
    config = config_for(a, cell, method, lr, seed, bt["targets"][f"{STOP_FRACTION:g}"])
    run = harness.run(config, pairs.get(cell["task"], cell["teacher"]), cell["task"])
    run["evals"] = run["evals"] or [[0, bt["base"]]]
    run.update(cell=name, method=method, lr=lr, seed=seed)
    return run


def runs_of(results: dict[str, Any], cell: str, method: str, seed: int | None = 0
            ) -> dict[float, dict[str, Any]]:
    """lr -> run of ``method`` in ``cell`` (seed ``seed``)."""
    return dict(sorted((r["lr"], r) for r in results["runs"].values()
                       if r["cell"] == cell and r["method"] == method and r["seed"] == seed))


def best_lr(a: argparse.Namespace, results: dict[str, Any], cell: str) -> float | None:
    """AdamW's best lr on this pair among the search's lrs, once the search (seed 0) is
    complete; else None. Later AdamW runs (the grid, the sweep) do not move it."""
    lrs = search_lrs(a, results, cell)
    adamw = runs_of(results, cell, "adamw")
    return None if any(lr not in adamw for lr in lrs) else _best(a, results, cell, lrs)


def _best(a: argparse.Namespace, results: dict[str, Any], cell: str, lrs: list[float]) -> float:
    bt, adamw = _bt(a, results, cell, 0), runs_of(results, cell, "adamw")
    return min(lrs, key=lambda lr: harness.rank_key([adamw[lr]], bt["targets"], FRACTIONS))


def _bt(a: argparse.Namespace, results: dict[str, Any], cell: str, seed: int) -> dict[str, Any]:
    c = a.cell_specs[cell]
    return results["bases"][f"{c['task']}|{c['teacher']}|{seed}"]


def search_lrs(a: argparse.Namespace, results: dict[str, Any], cell: str) -> list[float]:
    """The AdamW lr search (seed 0), as far as its runs so far decide it: the cell's lrs, then
    one lr further out while the best is at an end (×2 at the top, ½ at the bottom; two
    extensions each way)."""
    lrs = list(a.cell_specs[cell]["lrs"])
    adamw = runs_of(results, cell, "adamw")
    for _ in range(4):
        if any(lr not in adamw for lr in lrs):
            break
        best = _best(a, results, cell, lrs)
        if best == lrs[-1] and lrs[-1] / a.cell_specs[cell]["lrs"][-1] < 4:
            lrs.append(lrs[-1] * 2)
        elif best == lrs[0] and a.cell_specs[cell]["lrs"][0] / lrs[0] < 4:
            lrs.insert(0, lrs[0] / 2)
        else:
            break
    return lrs


def plan(a: argparse.Namespace, results: dict[str, Any], cell: str) -> list[tuple[str, float, int]]:
    """The cell's (method, lr, seed) runs in the order they run; after the lr search, all of
    them at once (the harness skips those done)."""
    best = best_lr(a, results, cell)
    if best is None:
        return [("adamw", lr, 0) for lr in search_lrs(a, results, cell)]
    order = sorted(a.factors, key=lambda f: (f != CONSERVATIVE, abs(math.log2(f / CONSERVATIVE))))
    out = [(m, best * f, 0) for f in order for m in a.method_list]
    out += [(m, best * f, s) for s in a.seeds[1:] for f in a.seed_factors for m in a.method_list]
    out += [("adamw", best * CONSERVATIVE * x, 0) for x in a.sweep]
    return out


# --------------------------------------------------------------------------- summary


def steps(run: dict[str, Any], bt: dict[str, Any], f: float) -> int | None:
    return harness.reached(run, bt["targets"], (f,))[f"steps_{f:g}"]


def basin(per_factor: dict[float, int | None], reference: int | None) -> float | None:
    """The factor spanned by the starting lrs (contiguous, around the method's best start)
    whose steps stay ≤ ``BASIN_SLACK`` × ``reference``; None when none does."""
    if reference is None:
        return None
    ok = [f for f, s in sorted(per_factor.items()) if s is not None and s <= BASIN_SLACK * reference]
    if not ok:
        return None
    best = min(ok, key=lambda f: per_factor[f])
    factors = sorted(per_factor)
    i = j = factors.index(best)
    while i > 0 and factors[i - 1] in ok:
        i -= 1
    while j < len(factors) - 1 and factors[j + 1] in ok:
        j += 1
    return factors[j] / factors[i]


def summarize_cell(a: argparse.Namespace, results: dict[str, Any], cell: str) -> dict[str, Any]:
    out: dict[str, Any] = {"cell": cell}
    if not any(r["cell"] == cell for r in results["runs"].values()):
        return {**out, "status": "not run"}
    bt = _bt(a, results, cell, 0)
    adamw = runs_of(results, cell, "adamw")
    out.update(base=bt["base"], teacher=bt["teacher"], search={
        f"{lr:g}": {f"steps_{f:g}": steps(adamw[lr], bt, f) for f in FRACTIONS}
        for lr in search_lrs(a, results, cell) if lr in adamw})
    best = best_lr(a, results, cell)
    if best is None:
        return {**out, "status": "lr search"}
    out["best_lr"] = best
    methods: dict[str, Any] = {}
    for m in a.method_list:
        by_seed = {s: runs_of(results, cell, m, s) for s in a.seeds}
        per: dict[str, Any] = {}
        for f in a.factors:
            rs = [by_seed[s][best * f] for s in a.seeds if best * f in by_seed[s]]
            if not rs:
                continue
            per[f"{f:g}"] = {
                **{f"steps_{fr:g}": [steps(r, _bt(a, results, cell, r["seed"]), fr) for r in rs]
                   for fr in FRACTIONS},
                "seeds": [r["seed"] for r in rs], "gate_evals": [r["gate_evals"] for r in rs],
                "gate_seconds": [r["gate_seconds"] for r in rs],
                "clock": [harness.train_clock(r) for r in rs],
                "kept": [sum(j["accepted"] is not None for j in r["jumps"]) for r in rs],
                "searches": [len(r["jumps"]) for r in rs], "crashed": [bool(r["crashed"]) for r in rs]}
        methods[m] = per
    out["methods"] = methods
    # Seed 0 over every start; then each seed over the starts every seed ran (best/16, best/4,
    # best): coarser, but it says whether a width holds across seeds.
    out["basin"] = {f"{fr:g}": {m: basin_of(methods, m, 0, fr, a.factors) for m in methods}
                    for fr in FRACTIONS}
    out["seed_basin"] = {f"{fr:g}": {m: [basin_of(methods, m, s, fr, a.seed_factors)
                                         for s in a.seeds] for m in methods} for fr in FRACTIONS}
    sweep = runs_of(results, cell, "adamw")
    c0 = best * CONSERVATIVE
    out["sweep"] = {}
    for k, xs in ((3, (1.0, 10.0, 100.0)), (5, a.sweep)):
        rs = [sweep.get(c0 * x) for x in xs if x in a.sweep]
        if len(rs) < len([x for x in xs if x in a.sweep]) or not rs or any(r is None for r in rs):
            continue
        for fr in FRACTIONS:
            got = [steps(r, bt, fr) for r in rs]
            total = sum(max(map(int, r["train_seconds"]), default=0) for r in rs)
            out["sweep"][f"{k}|{fr:g}"] = {
                "lrs": [r["lr"] for r in rs], "steps": got, "total_steps": total,
                "best_steps": min((s for s in got if s is not None), default=None)}
    done = all(f"{f:g}" in methods.get(m, {}) for m in a.method_list for f in a.factors)
    out["status"] = "grid done" if done else "partial"
    return out


def basin_of(methods: dict[str, Any], method: str, seed: int, fr: float,
             factors: Sequence[float]) -> float | str | None:
    """``basin`` of one seed over the starts ``factors``, against AdamW's steps at the best lr
    on that seed; "none" when no start is within the slack, None until every start has run
    (a part of the grid would shrink it)."""
    def at(m: str, f: float) -> tuple[bool, int | None]:
        d = methods.get(m, {}).get(f"{f:g}")
        if d is None or seed not in d["seeds"]:
            return False, None
        return True, d[f"steps_{fr:g}"][d["seeds"].index(seed)]
    got = {f: at(method, f) for f in factors}
    ran_ref, ref = at("adamw", 1.0)
    if not ran_ref or not all(ran for ran, _ in got.values()):
        return None
    width = basin({f: st for f, (_, st) in got.items()}, ref)
    return "none" if width is None else width


def summarize(a: argparse.Namespace, results: dict[str, Any]) -> dict[str, Any]:
    ran = {r["cell"] for r in results["runs"].values()}
    return {n: summarize_cell(a, results, n) for n in a.cell_specs if n in a.names or n in ran}


# --------------------------------------------------------------------------- report


def fmt_width(w: float | str | None) -> str:
    return "—" if w is None else w if isinstance(w, str) else f"{w:g}×"


def fmt_widths(widths: list[float | str | None]) -> str:
    """Per-seed widths, then their min–max: '4× / 16× / 4× (4–16×)'; '—' a seed not run yet."""
    each = " / ".join(map(fmt_width, widths))
    got = [0.0 if w == "none" else w for w in widths if w is not None]
    if len(got) < 2 or len(got) < len(widths):
        return each
    lo, hi = min(got), max(got)
    span = (f"{lo:g}×" if lo else "none") + ("" if lo == hi else f"–{hi:g}×")
    return f"{each} ({span})"


def method_row(a: argparse.Namespace, c: dict[str, Any], meth: str, per: dict[str, Any]
               ) -> list[str]:
    """A method's row: steps from every start (seed 0), its basin widths, best/16's numbers."""
    cells = []
    for f in a.factors:
        d = per.get(f"{f:g}")
        cells.append("—" if d is None else " / ".join(
            "·" if d[f"steps_{fr:g}"][0] is None else str(d[f"steps_{fr:g}"][0])
            for fr in FRACTIONS))
    d16 = per.get(f"{CONSERVATIVE:g}")
    return [meth, *cells, fmt_width(c["basin"]["0.75"][meth]),
            fmt_width(c["basin"]["0.9"][meth]), fmt_widths(c["seed_basin"]["0.75"][meth]),
            "—" if d16 is None else " / ".join(fmt_range(d16[f"steps_{fr:g}"])
                                               for fr in FRACTIONS),
            "—" if d16 is None else f"{fmt_range(d16['gate_evals'])} / "
            f"{fmt_range(d16['gate_seconds'], '{:.1f}')}"]


def sweep_lines(c: dict[str, Any]) -> list[str]:
    sw = c.get("sweep", {})
    if not sw:
        return []
    lines = ["**One run from best/16 against a blind AdamW sweep** (conservative lr × 1, "
             "10, 100 for k = 3; × 1, √10, 10, 10√10, 100 for k = 5; the sweep's result "
             "is its best run, its cost all its runs' steps):", ""]
    for key, d in sw.items():
        k, fr = key.split("|")
        lines.append(f"- k = {k}, to {float(fr):.0%}: best run "
                     f"{d['best_steps'] or 'none reached'} steps, sweep cost "
                     f"{d['total_steps']} steps")
    return [*lines, ""]


def cell_lines(a: argparse.Namespace, name: str, c: dict[str, Any]) -> list[str]:
    """A cell's section: its lr search, then every method from every start."""
    lines = [f"## {name}", ""]
    if c["status"] == "not run":
        return [*lines, "Not run yet.", ""]
    lines += [f"Base {c['base']:.1%} → teacher {c['teacher']:.1%}. AdamW lr search (seed 0), "
              "steps to 75 / 90% of the gain: " + "; ".join(
                  f"{lr}: {d['steps_0.75'] or '—'} / {d['steps_0.9'] or '—'}"
                  for lr, d in c["search"].items()) + ".", ""]
    if c["status"] == "lr search":
        return [*lines, "The lr search is not finished.", ""]
    headers = ["method", *[f"best×{f:g}" for f in a.factors], "basin (75%)", "basin (90%)",
               "basin (75%) on best/16, /4, 1: seeds " + " / ".join(map(str, a.seeds)),
               "steps at best/16 (75% / 90%)", "gate evals / seconds at best/16"]
    rows = [method_row(a, c, meth, per) for meth, per in c["methods"].items()]
    return [*lines, f"AdamW's best lr: **{c['best_lr']:g}**.", "",
            "Steps to 75 / 90% of the gain from each starting lr (seed 0; '·': not reached; "
            "the best/16 column: mean [min–max] over the seeds run there).", "",
            markdown_table(headers, rows), "", *sweep_lines(c)]


def report(a: argparse.Namespace, results: dict[str, Any]) -> str:
    s, m = results["summary"], results["machine"]
    lines = [
        "# The lr basin: EffOPD, Mechanic and Prodigy from a mis-set learning rate", "",
        "Made by " + ", then ".join(f"`{c}`" for c in results.get("commands", [m["command"]]))
        + f", last at {m.get('git_commit')}, on {m.get('cpu_model')} (torch {m.get('torch')}, "
        f"{m.get('torch_threads')} thread). No lr warm-up; full-vocabulary reverse KL; eval "
        f"every {a.eval_every} steps on min({a.eval_size}, the test split) held-out problems; "
        f"runs stop at 90% of the teacher's gain (cap {a.max_steps} steps); a run that misses a "
        "target within the cap counts as not reached. Starting lrs are AdamW's best lr on the "
        "committed pair × 1/32 … 2. Methods: " + ", ".join(f"`{k}`" for k in a.method_list)
        + f" (EffOPD: −reverse-KL gate on {a.gate_size} fixed rollouts, geometric c; `-every`: "
        f"searches every {EVERY} steps; `-follow`: `lr_follow={FOLLOW_CAP:g}`, experimental; "
        "Mechanic around AdamW at the starting lr; Prodigy at lr 1 with d0 = the starting lr). "
        f"Basin width: the factor spanned by the starting lrs whose steps stay ≤ {BASIN_SLACK}× "
        "AdamW's at its best lr (seed 0 over every start; then each seed over the three starts "
        "every seed ran, against AdamW at the best lr on the same seed, with the min–max).", "",
        *[line for name, c in s.items() for line in cell_lines(a, name, c)],
        "## Verdict", "", verdict(a, s), ""]
    return "\n".join(lines)


def verdict(a: argparse.Namespace, s: dict[str, Any]) -> str:
    """Whether EffOPD (with or without lr_follow) beats Mechanic and Prodigy from best/16."""
    said: list[str] = []
    wins: dict[str, list[bool]] = {}  # rival -> per cell, whether EffOPD's best variant beat it
    for name, c in s.items():
        per = c.get("methods")
        if not per:
            continue
        at = {m: (p.get(f"{CONSERVATIVE:g}") or {}).get("steps_0.75") for m, p in per.items()}
        if any(v is None for v in at.values()):
            continue
        mean = {m: statistics.fmean(x if x is not None else a.max_steps + a.eval_every for x in v)
                for m, v in at.items()}
        eff = min((m for m in mean if m.startswith("effopd")), key=mean.get, default=None)
        rivals = [m for m in ("mechanic", "prodigy") if m in mean]
        if eff is None or not rivals:
            continue
        beats = all(mean[eff] < mean[r] for r in rivals)
        for r in rivals:
            wins.setdefault(r, []).append(mean[eff] < mean[r])
        d = per[eff][f"{CONSERVATIVE:g}"]  # its gate, counted: the rivals have none
        shares = [g / c for g, c in zip(d["gate_seconds"], d["clock"], strict=True) if c]
        share = f", {statistics.fmean(shares):.0%} of its clock" if shares else ""
        said.append(f"{name}: {eff} {mean[eff]:.0f} steps ({statistics.fmean(d['gate_evals']):.0f}"
                    f" gate evaluations{share}) vs " + ", ".join(
            f"{r} {mean[r]:.0f}" for r in rivals) + (" (EffOPD ahead)" if beats else " (not ahead)"))
    if not said:
        return ("Not measured yet: no cell has every method's runs at best/16. The comparison "
                "(one run from a conservative lr, gate evaluations counted) is open.")
    one = ", ".join(f"{r.capitalize()} on {sum(w)} of {len(w)}" for r, w in wins.items())
    return ("**One run from a conservative lr (best/16), gate evaluations counted: EffOPD's best "
            f"variant beats {one} cells.** Mean steps to 75% of the gain from best/16 (not "
            "reached counts as the cap + one eval): " + "; ".join(said) + ".")


def plot(a: argparse.Namespace, results: dict[str, Any]) -> None:
    cells = [c for c in results["summary"].values() if c.get("methods")]
    if not cells:
        return
    with harness.figure(f"{a.out}/{a.stem}.png", len(cells), panel=(5, 4)) as (_, axes):
        for ax, c in zip(axes[0], cells, strict=True):
            for m, per in c["methods"].items():
                fs = sorted(float(f) for f in per)
                ys = [per[f"{f:g}"]["steps_0.75"][0] for f in fs]
                ax.plot(fs, [a.max_steps * 1.1 if y is None else y for y in ys], marker="o",
                        label=m)
            ax.set_xscale("log", base=2)
            ax.axhline(a.max_steps, color="gray", ls=":")
            ax.set_xlabel("starting lr / AdamW's best lr")
            ax.set_ylabel("steps to 75% of the gain (above the line: not reached)")
            ax.set_title(c["cell"], fontsize=9)
            ax.legend(fontsize=7)


# --------------------------------------------------------------------------- the study


def prepare(a: argparse.Namespace, store: harness.Store) -> tuple[harness.Pairs, list[str]]:
    """The committed pairs, and the cells whose pair is the json's."""
    results, pairs, ready = store.data, harness.Pairs(a.cache_dir), []
    for name in a.names:
        cell = a.cell_specs[name]
        pair = pairs.get(cell["task"], cell["teacher"])
        why = (f"pair not available: {pair['error']}" if "error" in pair
               else harness.check_pair(results, cell, pair))
        if why is None:
            results["unavailable"].pop(name, None)
            ready.append(name)
        else:
            results["unavailable"][name] = why
    return pairs, ready


def jobs(a: argparse.Namespace, store: harness.Store, ctx: Any) -> list[tuple[str, Any]]:
    for name in ctx[1]:  # cell by cell: a budget cut leaves whole cells
        todo = [(run_key(name, m, lr, sd), (store.data, name, m, lr, sd))
                for m, lr, sd in plan(a, store.data, name)]
        if any(k not in store.runs for k, _ in todo):
            return todo
    return []


STUDY = harness.Study(
    STEM, __doc__, report, options=options, uses=("threads", "budget"), smoke=SMOKE,
    configure=configure, fields=dict(bases=dict, unavailable=dict, pairs=dict),
    report_options=("max_steps", "eval_every", "eval_size", "gate_size", "method_list",
                    "factors", "seed_factors", "seeds", "sweep"),
    private=("cell_specs",), prepare=prepare, jobs=jobs,
    run=lambda a, ctx, job: run_one(a, job[0], ctx[0], *job[1:]), summarize=summarize,
    plot=plot)
main = STUDY.main

if __name__ == "__main__":
    raise SystemExit(main())
