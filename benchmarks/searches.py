"""What a rule over the gate's searches would have decided: recorded searches replayed, in two
parts, one report each (the stems the two studies wrote when they were separate files).

**secant_auc** — does the secant cosine predict a kept jump? Shadow mode on real OPD runs (CPU,
zoo pair). Every run is EffOPD through the real ``OPDTrainer`` (``run_variant``), searching
after steps 1, 2, 4 and then every ``--every`` steps (more searches per run than powers of
two). The searches run as they always do; each ``JumpRecord`` carries ``secant_cosine``, and
the part asks afterwards what a rule "skip the search when ``secant_cosine < θ``" would have
decided: how many searches and gate evaluations it would have saved and how many kept jumps it
would have missed. How well the cosine separates kept from rejected searches is the ROC AUC
(the probability that a kept search's cosine is higher than a rejected one's, ties half),
pooled over all runs and *within runs* (only pairs of a kept and a rejected search of the same
run). A user runs one learning rate, and a lower one gives both straighter paths and more kept
jumps, so the pooled AUC can be high with no power within a run: the within-run AUC decides.
Learning rates span 0.25–4 × the speed-up study's base so that both outcomes occur; variants:
the −reverse-KL gate on 128 rollouts, the exact-match gate on 50 problems, and the −reverse-KL
gate with ``direction="averaged"``. On this zoo pair the kept jumps come early (steps 1–4, see
speedup.md), when the path is also straightest, so the table also gives the AUC of the
searches after step 16 alone.

**patience** — would stopping the searches after k refused ones in a row have cost a kept
jump? ``patience=k`` (an ``ExtrapolatingOptimizer`` option) ends the searching once k searches
in a row kept no jump. A refused search restores the weights bit-exactly, and a run that has
stopped never searches again, so where no later search would have kept a jump, stopping
changes nothing but the gate's bill. The part replays the searches recorded in the results
(the regime map and its follow-ups, the secant part's, the speed-up study's): per gate kind and
k, the searches and gate evaluations a stop would have skipped, the kept jumps it would have
lost (the runs whose path would change), and the gate's share of the training clock before and
after. ``--live`` reruns one counted cell of the regime map at EffOPD's best lr with and
without patience, same seeds: identical eval curves, fewer gate evaluations, the clocks side
by side.

    OMP_NUM_THREADS=1 python -m benchmarks.searches --part secant_auc   # 30 runs, ~35 CPU-minutes
    OMP_NUM_THREADS=1 python -m benchmarks.searches --part patience --live   # replay + 6 runs
    python -m benchmarks.searches --report-only                         # both reports
    python -m benchmarks.searches --smoke --out /tmp/searches           # the pipeline
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from benchmarks import harness
from benchmarks.common import markdown_table
from benchmarks.harness import BASE_LR, CELLS, EFFOPD, STOP_FRACTION, ZOO_PAIRS

SECANT, PATIENCE = "secant_auc", "patience"
LR_MULTIPLIERS = (0.25, 0.5, 1.0, 2.0, 4.0)
VARIANTS = {
    "neg_kl": dict(gate="neg_kl", gate_size=128),
    "accuracy": dict(gate="accuracy", gate_size=50),
    "neg_kl+averaged": dict(gate="neg_kl", gate_size=128, direction="averaged"),
}
LATE = 16  # "late" searches: after this step
THRESHOLDS = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)
PAIR = "same-base"
# The recorded searches the patience part replays: (json under --results, how to read it).
SOURCES = (("regimes.json", "regimes"), ("regimes-rebuilt/regimes.json", "regimes"),
           ("regimes-nowarmup/regimes.json", "regimes"), (f"{SECANT}.json", "secant"),
           ("speedup.json", "speedup"))
PATIENCES = (1, 2, 3, 4)
LIVE = {"cell": "long-128/sft/adamw", "lr": 5e-4, "seeds": (0, 1, 2)}


def options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--part", choices=(SECANT, PATIENCE), help="one part (default: both)")
    s = p.add_argument_group(SECANT)
    s.add_argument("--seeds", type=int, default=2)
    s.add_argument("--steps", type=int, default=200)
    s.add_argument("--every", type=int, default=8, help="search every N steps")
    s.add_argument("--batch-size", type=int, default=64)
    s.add_argument("--variants", default=",".join(VARIANTS))
    s.add_argument("--cache-dir", default=None)
    k = p.add_argument_group(PATIENCE)
    k.add_argument("--results", default=None, help="where the recorded runs are (default: --out)")
    k.add_argument("--patience", type=int, default=None,
                   help="k of the live check (default: the smallest k that lost no kept jump "
                        "with the −reverse-KL secant gate in the replay)")
    k.add_argument("--live", action="store_true", help="also rerun one cell with and without patience")
    k.add_argument("--cell", default=LIVE["cell"], help="the live check's regime-map cell")
    k.add_argument("--lr", type=float, default=LIVE["lr"], help="the live check's lr")
    k.add_argument("--live-seeds", default=",".join(map(str, LIVE["seeds"])))


def configure(a: argparse.Namespace, p: argparse.ArgumentParser) -> None:
    if isinstance(a.variants, str):
        a.variants = [g.strip() for g in a.variants.split(",")]
    unknown = [g for g in a.variants if g not in VARIANTS]
    if unknown:
        p.error(f"unknown variant(s) {unknown}; known: {', '.join(VARIANTS)}")
    a.lrs = LR_MULTIPLIERS
    if a.smoke:
        a.variants, a.lrs = a.variants[:1], (1.0, 4.0)
    a.seed_list = [int(s) for s in a.live_seeds.split(",")]
    if a.cell not in CELLS:
        p.error(f"unknown cell {a.cell!r}; known: {', '.join(CELLS)}")
    if a.patience is not None and a.patience < 1:
        p.error("--patience must be >= 1")


# --------------------------------------------------------------------------- secant: the runs


def schedule(steps: int, every: int) -> str:
    """Steps 1, 2, 4, then every ``every`` steps up to ``steps``, as OPDConfig takes them."""
    return ",".join(str(s) for s in sorted({1, 2, 4, *range(every, steps + 1, every)}) if s <= steps)


def run_one(a: argparse.Namespace, models: harness.Pairs, variant: str, m: float,
            seed: int) -> dict[str, Any]:
    pair, task = models.named(PAIR), ZOO_PAIRS[PAIR][0]
    gate_options = dict(VARIANTS[variant])
    if a.smoke:
        gate_options["gate_size"] = 20
    config = harness.opd_config(
        "secant", f"{variant}-{m:g}-{seed}", task=task, max_steps=a.steps,
        batch_size=a.batch_size, learning_rate=BASE_LR * m, warmup_steps=4, eval_every=0,
        eval_size=50 if a.smoke else 200, seed=seed, extrapolate=True, coefficients="geometric",
        schedule=schedule(a.steps, a.every), **gate_options)
    run = harness.run(config, pair, task)
    if run["crashed"]:
        raise RuntimeError(f"secant run {variant} lr×{m:g} seed {seed}: {run['crashed']}")
    keys = ("step", "secant_cosine", "norm_ratio", "accepted", "n_evals", "seconds", "coefficients")
    return {"variant": variant, "lr_multiplier": m, "lr": config.learning_rate, "seed": seed,
            "final_accuracy": run["final_accuracy"], "wall_seconds": run["wall_seconds"],
            "gate_seconds": run["gate_seconds"],
            "searches": [{k: j[k] for k in keys} for j in run["jumps"]]}


def secant_jobs(a: argparse.Namespace, store: harness.Store, models: harness.Pairs
                ) -> list[tuple[str, Any]]:
    # Seeds outermost: a run cut short still covers every variant and learning rate.
    return [(f"{v}/{m:g}/{seed}", (v, m, seed))
            for seed in range(a.seeds) for v in a.variants for m in a.lrs]


def describe_run(key: str, run: dict[str, Any]) -> str:
    kept = sum(s["accepted"] is not None for s in run["searches"])
    return f"{key}: {run['wall_seconds']:.0f}s, {kept}/{len(run['searches'])} searches kept"


# --------------------------------------------------------------------------- secant: the analysis


def _wins(pos: list[float], neg: list[float]) -> float:
    return sum((p > q) + 0.5 * (p == q) for p in pos for q in neg)


def auc(pos: list[float], neg: list[float]) -> float | None:
    """P(a positive's score > a negative's), ties counted half (the Mann–Whitney U / n·m)."""
    if not pos or not neg:
        return None
    return _wins(pos, neg) / (len(pos) * len(neg))


def within_run_auc(pts: list[dict[str, Any]]) -> float | None:
    """The AUC over pairs of a kept and a rejected search from the same run only."""
    runs: dict[tuple, tuple[list[float], list[float]]] = {}
    for p in pts:
        kept, rejected = runs.setdefault((p["variant"], p["lr_multiplier"], p["seed"]), ([], []))
        (kept if p["accepted"] is not None else rejected).append(p["secant_cosine"])
    pairs = sum(len(k) * len(r) for k, r in runs.values())
    return sum(_wins(k, r) for k, r in runs.values()) / pairs if pairs else None


def points(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The searches that had a previous direction and tried a candidate (the ones a rule
    could have skipped): cosine, kept or not, evaluations and seconds."""
    return [dict(s, variant=r["variant"], lr_multiplier=r["lr_multiplier"], seed=r["seed"])
            for r in runs for s in r["searches"]
            if s["secant_cosine"] is not None and s["coefficients"]]


def shadow(pts: list[dict[str, Any]], theta: float) -> dict[str, Any]:
    """What ``skip when secant_cosine < theta`` would have decided on these searches."""
    skipped = [p for p in pts if p["secant_cosine"] < theta]
    kept = [p for p in pts if p["accepted"] is not None]
    return {"theta": theta, "searches": len(pts), "skipped": len(skipped),
            "kept_jumps": len(kept),
            "kept_missed": sum(p["accepted"] is not None for p in skipped),
            "evals_saved": sum(p["n_evals"] for p in skipped),
            "evals_total": sum(p["n_evals"] for p in pts),
            "seconds_saved": sum(p["seconds"] for p in skipped)}


def secant_summary(a: argparse.Namespace, results: dict[str, Any]) -> dict[str, Any]:
    runs = list(results["runs"].values())
    pts = points(runs)
    groups: dict[str, list[dict[str, Any]]] = {
        "all": pts, f"all, after step {LATE}": [p for p in pts if p["step"] > LATE]}
    for p in pts:
        groups.setdefault(p["variant"], []).append(p)
        if p["step"] > LATE:
            groups.setdefault(f"{p['variant']}, after step {LATE}", []).append(p)
        groups.setdefault(f"{p['variant']}, lr×{p['lr_multiplier']:g}", []).append(p)
    out: dict[str, Any] = {}
    for name, ps in groups.items():
        kept = [p["secant_cosine"] for p in ps if p["accepted"] is not None]
        rejected = [p["secant_cosine"] for p in ps if p["accepted"] is None]
        out[name] = {
            "searches": len(ps), "kept": len(kept), "auc": auc(kept, rejected),
            "auc_within_runs": within_run_auc(ps),
            "mean_cosine_kept": statistics.fmean(kept) if kept else None,
            "mean_cosine_rejected": statistics.fmean(rejected) if rejected else None,
        }
    out["shadow"] = {v: [shadow([p for p in pts if p["variant"] == v], t) for t in THRESHOLDS]
                     for v in dict.fromkeys(p["variant"] for p in pts)}
    out["gate_share_of_wall"] = (sum(r["gate_seconds"] for r in runs)
                                 / max(sum(r["wall_seconds"] for r in runs), 1e-9))
    return out


def _f(x: float | None, fmt: str = "{:.2f}") -> str:
    return "—" if x is None else fmt.format(x)


def secant_verdict(within: float | None) -> str:
    if within is None:
        return "not measurable: no run had both a kept and a rejected search"
    if within >= 0.75:
        return "≥ 0.75: a skip rule on the cosine is worth shipping"
    return ("< 0.75: within a run the cosine does not separate kept from rejected "
            "searches well enough to skip on it")


def secant_report(a: argparse.Namespace, results: dict[str, Any]) -> str:
    s, c, m = results["summary"], results["config"], results["machine"]
    pooled, within = s["all"]["auc"], s["all"]["auc_within_runs"]
    lines = [
        "# Does the secant cosine predict a kept jump? (shadow mode, CPU zoo pair)",
        "",
        f"`{m['command']}` on {m.get('cpu_model')}, torch {m.get('torch')}, commit "
        f"{m.get('git_commit')}. Pair `{PAIR}` (tiny), full-vocabulary reverse KL, "
        f"{c['steps']} steps, batch {c['batch_size']}, searches after steps 1, 2, 4 and every "
        f"{c['every']} steps (geometric c), lr = {BASE_LR:g} × {', '.join(f'{x:g}' for x in c['lrs'])}, "
        f"{c['seeds']} seeds, variants {', '.join(c['variants'])}. A point is a search with a previous "
        "direction that tried a candidate; 'kept' means the gate kept a jump.",
        "",
        f"**Within-run ROC AUC: {_f(within)}** ({secant_verdict(within)}); pooled over runs: "
        f"{_f(pooled)}. The pooled AUC mixes learning rates, and a lower one gives both a "
        "straighter path (higher cosine) and more kept jumps; a user runs one, so the within-run "
        "AUC (pairs of a kept and a rejected search of the same run) is the one that says "
        "whether a threshold on the cosine could skip searches.",
        "",
        markdown_table(
            ["searches", "n", "kept", "AUC pooled", "AUC within runs", "mean cos (kept)",
             "mean cos (rejected)"],
            [[k, v["searches"], v["kept"], _f(v["auc"]), _f(v["auc_within_runs"]),
              _f(v["mean_cosine_kept"]), _f(v["mean_cosine_rejected"])]
             for k, v in s.items() if isinstance(v, dict) and "auc" in v]),
        "",
        "## Shadow rule: skip the search when secant_cosine < θ",
        "",
        "Per variant, all its runs (every learning rate and seed) together; 'seconds' are the "
        "searches' own (gate evaluations and candidate writes).",
        "",
    ]
    for variant, rows in s["shadow"].items():
        lines += [f"### {variant}", "", markdown_table(
            ["θ", "searches skipped", "kept jumps missed", "gate evals saved", "seconds saved"],
            [[f"{r['theta']:g}", f"{r['skipped']}/{r['searches']}",
              f"{r['kept_missed']}/{r['kept_jumps']}", f"{r['evals_saved']}/{r['evals_total']}",
              f"{r['seconds_saved']:.1f}"] for r in rows]), ""]
    lines += [f"The gate (all searches) took {s['gate_share_of_wall']:.1%} of the runs' wall-clock."]
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- patience: the replay


def gate_kind(options: dict[str, Any]) -> str | None:
    """A run's gate, as the replay groups it (None: ungated or not extrapolating)."""
    if not options.get("extrapolate", True) or options.get("gate") == "none":
        return None
    return options.get("gate", "neg_kl") + (", averaged" if options.get("direction") == "averaged" else "")


def sources(a: argparse.Namespace) -> list[tuple[str, str]]:
    """``SOURCES``; with ``--smoke`` the secant part's smoke json alone."""
    return [(f"{SECANT}-smoke.json", "secant")] if a.smoke else list(SOURCES)


def recorded_searches(kind: str, data: dict[str, Any], run: dict[str, Any]
                      ) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """A recorded run's options (as far as its json says them) and its searches."""
    if kind == "regimes":
        options = {**EFFOPD} if run["method"] == "effopd" else {"extrapolate": False}
        return options, run["jumps"]
    if kind == "secant":
        return dict(VARIANTS[run["variant"]]), run["searches"]
    # speedup: the options its summary records per variant
    options = data.get("summary", {}).get(run["variant"], {}).get("options")
    return {"extrapolate": False, **(options or {})}, run.get("jumps") or []


def recorded_runs(a: argparse.Namespace, results_dir: Path) -> Iterator[dict[str, Any]]:
    """Every recorded EffOPD run with searches: source, gate kind, its searches as (kept, gate
    evaluations), its gate seconds and evaluations, and its training clock."""
    for name, kind in sources(a):
        path = results_dir / name
        if not path.exists():
            continue
        data = json.loads(path.read_text())
        runs = data["runs"].values() if isinstance(data["runs"], dict) else data["runs"]
        for run in runs:
            options, searches = recorded_searches(kind, data, run)
            gate = gate_kind(options)
            if gate is None or not searches:
                continue
            yield {"source": name, "gate": gate, **replay_record(run, searches)}


def replay_record(run: dict[str, Any], searches: list[dict[str, Any]]) -> dict[str, Any]:
    """What ``replay_row`` reads of a run: its searches as (kept, gate evaluations), its gate
    seconds and evaluations, and its training clock (its wall clock when it records none)."""
    clock = harness.train_clock(run)
    return {"gate_seconds": run["gate_seconds"],
            "gate_evals": run.get("gate_evals") or sum(_evals(s) for s in searches),
            "clock": clock if clock is not None else run["wall_seconds"],
            "searches": [(s["accepted"] is not None, _evals(s)) for s in searches]}


def _evals(search: dict[str, Any]) -> int:
    return search.get("n_evals") or 1 + len(search["scores"])


def replay(searches: list[tuple[bool, int]], patience: int) -> dict[str, int]:
    """What stopping after ``patience`` refused searches in a row would have skipped."""
    refused, out = 0, {"skipped": 0, "skipped_evals": 0, "lost": 0}
    for i, (kept, _) in enumerate(searches):
        if refused >= patience:
            later = searches[i:]
            out.update(skipped=len(later), skipped_evals=sum(e for _, e in later),
                       lost=sum(k for k, _ in later))
            break
        refused = 0 if kept else refused + 1
    return out


def replay_row(runs: list[dict[str, Any]], patience: int) -> dict[str, Any]:
    """One row of the table: ``runs`` replayed at ``patience``."""
    rows = [(r, replay(r["searches"], patience)) for r in runs]
    saved = sum(r["gate_seconds"] * x["skipped_evals"] / r["gate_evals"] for r, x in rows if r["gate_evals"])
    gate, clock = sum(r["gate_seconds"] for r in runs), sum(r["clock"] for r in runs)
    return {
        "patience": patience, "runs": len(runs),
        "searches": sum(len(r["searches"]) for r in runs),
        "kept": sum(k for r in runs for k, _ in r["searches"]),
        "skipped": sum(x["skipped"] for _, x in rows),
        "gate_evals": sum(r["gate_evals"] for r in runs),
        "skipped_evals": sum(x["skipped_evals"] for _, x in rows),
        "lost": sum(x["lost"] for _, x in rows),
        "runs_changed": sum(x["lost"] > 0 for _, x in rows),
        "gate_share": gate / clock if clock else None,
        "gate_share_after": (gate - saved) / clock if clock else None,
    }


def replay_all(a: argparse.Namespace, results_dir: Path) -> dict[str, Any]:
    runs = list(recorded_runs(a, results_dir))
    groups: dict[str, list[dict[str, Any]]] = {}
    for r in runs:
        groups.setdefault(r["gate"], []).append(r)
    table = {g: [replay_row(rs, k) for k in PATIENCES] for g, rs in groups.items()}
    k = recommended(table)
    per_source = {} if k is None else {
        g: {src: replay_row([r for r in rs if r["source"] == src], k)
            for src in dict.fromkeys(r["source"] for r in rs)} for g, rs in groups.items()}
    return {"table": table, "per_source": per_source, "recommended": k,
            "sources": [name for name, _ in sources(a) if (results_dir / name).exists()]}


def recommended(table: dict[str, list[dict[str, Any]]]) -> int | None:
    """The smallest k that lost no kept jump with the −reverse-KL secant gate."""
    return next((row["patience"] for row in table.get("neg_kl", []) if row["lost"] == 0), None)


# --------------------------------------------------------------------------- patience: live


def live_seed(a: argparse.Namespace, models: harness.Pairs, pair: dict[str, Any], book: dict,
              patience: int, seed: int) -> dict[str, Any]:
    """One seed of the live check: the regime map's EffOPD run, without and with patience."""
    cell = CELLS[a.cell]
    bt = harness.base_and_targets(book, models, cell, seed, harness.EVAL_SIZE)
    base = harness.cell_config(PATIENCE, f"{a.lr:g}-{seed}", cell, a.lr, seed,
                               bt["targets"][f"{STOP_FRACTION:g}"], **harness.REGIME_RUN, **EFFOPD)
    runs = {}
    for k in (None, patience):
        config = dataclasses.replace(base, patience=k,
                                     output_dir=harness.scratch_folder(PATIENCE, f"{seed}-{k}"))
        run = harness.run(config, pair, cell["task"])
        runs[str(k)] = {"evals": run["evals"], "gate_evals": run["gate_evals"],
                        "gate_seconds": run["gate_seconds"], "clock": harness.train_clock(run),
                        "searches": [(j["step"], j["accepted"]) for j in run["jumps"]],
                        "stopped_after": (run["summary"] or {}).get("stopped_after")}
    full, stop = runs["None"], runs[str(patience)]
    return {"seed": seed, "runs": runs, "same_evals": full["evals"] == stop["evals"],
            "clock_ratio": full["clock"] / stop["clock"]}


def live(a: argparse.Namespace, patience: int) -> dict[str, Any]:
    """One cell at one lr, each seed with and without ``patience``."""
    from tqdm.auto import tqdm

    cell, models, book = CELLS[a.cell], harness.Pairs(a.cache_dir), {"bases": {}}
    pair = models.get(cell["task"], cell["teacher"])
    if "error" in pair:
        raise SystemExit(f"patience: the {a.cell} pair is not available: {pair['error']}")
    out = []
    for seed in tqdm(a.seed_list, desc="live seeds"):
        out.append(live_seed(a, models, pair, book, patience, seed))
        full, stop = out[-1]["runs"]["None"], out[-1]["runs"][str(patience)]
        tqdm.write(f"seed {seed}: same evals {out[-1]['same_evals']}, gate evals "
                   f"{full['gate_evals']} -> {stop['gate_evals']}, clock {full['clock']:.1f} -> "
                   f"{stop['clock']:.1f}s")
    return {"cell": a.cell, "lr": a.lr, "patience": patience, "pair": pair["build"],
            "bases": book["bases"], "seeds": out}


def measure_patience(a: argparse.Namespace, store: harness.Store, ctx: Any) -> None:
    """The replay, then (``--live``) the live check; the json holds what this call measured."""
    results_dir = Path(a.results or a.out)
    rep = replay_all(a, results_dir)
    if not rep["table"]:
        raise SystemExit(f"patience: no recorded searches under {results_dir}")
    store.data["replay"] = rep
    store.data.pop("live", None)
    if a.live:
        k = a.patience or rep["recommended"]
        if k is None:
            raise SystemExit("patience: the replay recommends no k; pass --patience")
        store.data["live"] = live(a, k)


# --------------------------------------------------------------------------- patience: report


def _pct(x: float | None) -> str:
    return "—" if x is None else f"{100 * x:.2f}%"


def patience_verdict(rep: dict[str, Any]) -> str:
    k = rep["recommended"]
    verdict = ("no k up to "
               f"{PATIENCES[-1]} lost no kept jump with the −reverse-KL secant gate" if k is None else
               f"**k = {k} is the smallest patience that lost no kept jump with the −reverse-KL "
               "secant gate**")
    always = [g for g, table in rep["table"].items() if all(row["lost"] for row in table)]
    if always:
        verdict += (f"; with the {' and the '.join(f'`{g}` gate' for g in always)}, refused "
                    f"streaks were followed by kept jumps at every k up to {PATIENCES[-1]}, so "
                    "there a stop changes the run")
    return verdict


def replay_tables(rep: dict[str, Any]) -> list[str]:
    headers = ["gate", "k", "runs", "searches (kept)", "searches skipped", "gate evals skipped",
               "kept jumps lost (runs changed)", "gate share of the clock: all searches → with the stop"]
    rows = [[g, row["patience"], row["runs"], f"{row['searches']} ({row['kept']})",
             f"{row['skipped']} ({row['skipped'] / row['searches']:.0%})",
             f"{row['skipped_evals']} of {row['gate_evals']} ({row['skipped_evals'] / row['gate_evals']:.0%})",
             f"{row['lost']} ({row['runs_changed']})",
             f"{_pct(row['gate_share'])} → {_pct(row['gate_share_after'])}"]
            for g, table in rep["table"].items() for row in table]
    lines = [markdown_table(headers, rows), ""]
    k = rep["recommended"]
    if k is not None:
        rows = [[g, src, row["runs"], f"{row['skipped_evals']} of {row['gate_evals']}",
                 f"{row['lost']} ({row['runs_changed']})",
                 f"{_pct(row['gate_share'])} → {_pct(row['gate_share_after'])}"]
                for g, by_src in rep["per_source"].items() for src, row in by_src.items()]
        lines += [f"Per source at k = {k}:", "",
                  markdown_table(["gate", "source", "runs", "gate evals skipped",
                                  "kept jumps lost (runs changed)", "gate share → with the stop"],
                                 rows), ""]
    return lines


def live_lines(lv: dict[str, Any] | None) -> list[str]:
    if not lv:
        return []
    lines = [f"## Live check: {lv['cell']}, EffOPD at lr {lv['lr']:g}, patience {lv['patience']} "
             "vs none", "",
             f"The regime map's settings (pair `{lv['pair']}`); each seed run twice, stopped "
             f"at {STOP_FRACTION:.0%} of the gain; the ratio is the training clock "
             "without patience ÷ with it (>1: the stop is faster).", ""]
    rows = []
    for s in lv["seeds"]:
        full, stop = s["runs"]["None"], s["runs"][str(lv["patience"])]
        rows.append([s["seed"], "yes" if s["same_evals"] else "**no**",
                     ", ".join(f"{st}" + ("" if acc is None else f" (c={acc:g})") for st, acc in full["searches"]),
                     stop["stopped_after"] or "—", f"{full['gate_evals']} → {stop['gate_evals']}",
                     f"{full['gate_seconds']:.2f} → {stop['gate_seconds']:.2f}",
                     f"{full['clock']:.1f} → {stop['clock']:.1f}", f"{s['clock_ratio']:.2f}"])
    ratios = [s["clock_ratio"] for s in lv["seeds"]]
    return [*lines, markdown_table(["seed", "same eval curve", "searches without patience (kept c)",
                                    "stopped after step", "gate evals", "gate seconds",
                                    "training clock (s)", "clock ratio"], rows), "",
            f"Clock ratio {statistics.fmean(ratios):.2f} [{min(ratios):.2f}–{max(ratios):.2f}] "
            f"over {len(ratios)} seeds; the two runs of a seed ran one after the other on a "
            "shared 2-core machine, so the clock carries that noise; the gate seconds are "
            "the measured difference.", ""]


def patience_report(a: argparse.Namespace, results: dict[str, Any]) -> str:
    rep, m = results["replay"], results["machine"]
    read = rep.get("sources") or [name for name, _ in SOURCES]
    lines = ["# Stopping the searches after k refused ones (`patience=k`)", "",
             f"Made by `{m['command']}` at {m['git_commit']} on {m['cpu_model']} (torch "
             f"{m['torch']}). The replay reads the searches recorded in the committed results "
             f"({', '.join(f'`{s}`' for s in read)}) and asks, per gate kind and k, what "
             "ending the searching after k refused searches in a row would have skipped. A "
             "refused search restores the weights bit-exactly, so a run that lost no kept jump "
             "would have followed the same path; the gate seconds saved are each run's mean "
             "seconds per gate evaluation times the evaluations skipped, over the run's training "
             "clock (its wall clock in the secant study, which records no training clock).", "",
             f"**Answer.** {patience_verdict(rep)}.", "",
             *replay_tables(rep), *live_lines(results.get("live"))]
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- the study

OPTIONS = dict(options=options, configure=configure, uses=("threads", "budget"))
SECANT_STUDY = harness.Study(
    SECANT, __doc__, secant_report, **OPTIONS, same=("steps", "every", "batch_size"),
    smoke=dict(seeds=1, steps=12, every=2, batch_size=16),
    prepare=lambda a, store: harness.Pairs(a.cache_dir), jobs=secant_jobs,
    run=lambda a, models, job: run_one(a, models, *job), describe=describe_run,
    summarize=secant_summary)
PATIENCE_STUDY = harness.Study(PATIENCE, __doc__, patience_report, **OPTIONS,
                               measure=measure_patience)


def main(argv: list[str] | None = None) -> int:
    return harness.main(SECANT_STUDY, PATIENCE_STUDY, argv=argv)


if __name__ == "__main__":
    raise SystemExit(main())
