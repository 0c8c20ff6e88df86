"""Would stopping the searches after k refused ones in a row have cost a kept jump?

``patience=k`` (an ``ExtrapolatingOptimizer`` option) ends the searching once k searches in a
row kept no jump. A refused search restores the weights bit-exactly, and a run that has stopped
never searches again, so where no later search would have kept a jump, stopping changes nothing
but the gate's bill. This replays the searches recorded in the committed results (the regime
map and its follow-ups, the secant study, the speed-up study): per gate kind and k, the searches
and gate evaluations a stop would have skipped, the kept jumps it would have lost (the runs whose
path would change), and the gate's share of the training clock before and after.

``--live`` reruns one counted cell of the regime map at EffOPD's best lr with and without
patience, same seeds, and checks the claim on real runs: identical eval curves, fewer gate
evaluations, the clocks side by side.

    python -m benchmarks.patience                      # the replay: seconds
    OMP_NUM_THREADS=1 python -m benchmarks.patience --live   # + 6 OPD runs, ~6 CPU-minutes
    python -m benchmarks.patience --report-only        # rewrite the md from the json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from benchmarks import harness, regimes, secant, speedup
from benchmarks.common import machine_info, markdown_table, previous_results, write_results

STEM = "patience"
RESULTS = Path("benchmarks/results")
# The recorded searches: (json, how to read it).
SOURCES = (("regimes.json", "regimes"), ("regimes-rebuilt/regimes.json", "regimes"),
           ("regimes-nowarmup/regimes.json", "regimes"), ("secant_auc.json", "secant"),
           ("speedup.json", "speedup"))
PATIENCES = (1, 2, 3, 4)
LIVE = {"cell": "long-128/sft/adamw", "lr": 5e-4, "seeds": (0, 1, 2)}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=str(RESULTS))
    p.add_argument("--results", default=str(RESULTS), help="where the recorded runs are")
    p.add_argument("--patience", type=int, default=None,
                   help="k of the live check (default: the smallest k that lost no kept jump "
                        "with the −reverse-KL secant gate in the replay)")
    p.add_argument("--live", action="store_true", help="also rerun one cell with and without patience")
    p.add_argument("--cell", default=LIVE["cell"], help="the live check's regime-map cell")
    p.add_argument("--lr", type=float, default=LIVE["lr"])
    p.add_argument("--seeds", default=",".join(map(str, LIVE["seeds"])))
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--report-only", action="store_true", help="rewrite the md from the json")
    a = p.parse_args(argv)
    a.seed_list = [int(s) for s in a.seeds.split(",")]
    if a.cell not in regimes.CELLS:
        p.error(f"unknown cell {a.cell!r}; known: {', '.join(regimes.CELLS)}")
    if a.patience is not None and a.patience < 1:
        p.error("--patience must be >= 1")
    return a


# --------------------------------------------------------------------------- the replay


def gate_kind(options: dict[str, Any]) -> str | None:
    """A run's gate, as the replay groups it (None: ungated or not extrapolating)."""
    if not options.get("extrapolate", True) or options.get("gate") == "none":
        return None
    return options.get("gate", "neg_kl") + (", averaged" if options.get("direction") == "averaged" else "")


def recorded_runs(results_dir: Path) -> Iterator[dict[str, Any]]:
    """Every recorded EffOPD run with searches: source, gate kind, its searches as (kept, gate
    evaluations), its gate seconds and evaluations, and its training clock."""
    for name, kind in SOURCES:
        path = results_dir / name
        if not path.exists():
            continue
        data = json.loads(path.read_text())
        runs = data["runs"].values() if isinstance(data["runs"], dict) else data["runs"]
        for run in runs:
            if kind == "regimes":
                options, searches = ({**harness.EFFOPD} if run["method"] == "effopd" else {"extrapolate": False}), run["jumps"]
            elif kind == "secant":
                options, searches = dict(secant.VARIANTS[run["variant"]]), run["searches"]
            else:
                known = speedup.VARIANTS.get(run["variant"])
                options = known["config"] if known else {"extrapolate": False}
                options, searches = {"extrapolate": False, **options}, run.get("jumps") or []
            gate = gate_kind(options)
            if gate is None or not searches:
                continue
            clock = harness.train_clock(run)
            yield {"source": name, "gate": gate, "gate_seconds": run["gate_seconds"],
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


def summarize(runs: list[dict[str, Any]], patience: int) -> dict[str, Any]:
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


def replay_all(results_dir: Path) -> dict[str, Any]:
    runs = list(recorded_runs(results_dir))
    groups: dict[str, list[dict[str, Any]]] = {}
    for r in runs:
        groups.setdefault(r["gate"], []).append(r)
    table = {g: [summarize(rs, k) for k in PATIENCES] for g, rs in groups.items()}
    k = recommended(table)
    per_source = {} if k is None else {
        g: {src: summarize([r for r in rs if r["source"] == src], k)
            for src in dict.fromkeys(r["source"] for r in rs)} for g, rs in groups.items()}
    return {"table": table, "per_source": per_source, "recommended": k}


def recommended(table: dict[str, list[dict[str, Any]]]) -> int | None:
    """The smallest k that lost no kept jump with the −reverse-KL secant gate."""
    return next((row["patience"] for row in table.get("neg_kl", []) if row["lost"] == 0), None)


# --------------------------------------------------------------------------- the live check


def live(a: argparse.Namespace, patience: int) -> dict[str, Any]:
    """One cell at one lr, each seed with and without ``patience``."""
    from tqdm.auto import tqdm

    r = regimes.parse_args(["--cells", a.cell])
    cell, models, book = r.cell_specs[a.cell], regimes.pairs_for(r), {"bases": {}}
    pair = models.get(cell["task"], cell["teacher"])
    if "error" in pair:
        raise SystemExit(f"patience: the {a.cell} pair is not available: {pair['error']}")
    out = []
    for seed in tqdm(a.seed_list, desc="live seeds"):
        bt = regimes.base_and_targets(r, book, models, a.cell, seed)
        base = regimes.config_for(r, cell, "effopd", a.lr, seed, bt["targets"][f"{regimes.STOP_FRACTION:g}"])
        runs = {}
        for k in (None, patience):
            config = dataclasses.replace(base, patience=k, output_dir=f"/tmp/lookahead-opd-{STEM}/{seed}-{k}")
            run = harness.run(config, pair, cell["task"])
            runs[str(k)] = {"evals": run["evals"], "gate_evals": run["gate_evals"],
                            "gate_seconds": run["gate_seconds"], "clock": harness.train_clock(run),
                            "searches": [(j["step"], j["accepted"]) for j in run["jumps"]],
                            "stopped_after": (run["summary"] or {}).get("stopped_after")}
        full, stop = runs["None"], runs[str(patience)]
        out.append({"seed": seed, "runs": runs, "same_evals": full["evals"] == stop["evals"],
                    "clock_ratio": full["clock"] / stop["clock"]})
        tqdm.write(f"seed {seed}: same evals {out[-1]['same_evals']}, gate evals "
                   f"{full['gate_evals']} -> {stop['gate_evals']}, clock {full['clock']:.1f} -> "
                   f"{stop['clock']:.1f}s")
    return {"cell": a.cell, "lr": a.lr, "patience": patience, "pair": pair["build"],
            "bases": book["bases"], "seeds": out}


# --------------------------------------------------------------------------- report


def _pct(x: float | None) -> str:
    return "—" if x is None else f"{100 * x:.2f}%"


def report(results: dict[str, Any]) -> str:
    rep, m = results["replay"], results["machine"]
    k = rep["recommended"]
    lines = ["# Stopping the searches after k refused ones (`patience=k`)", "",
             f"Made by `{m['command']}` at {m['git_commit']} on {m['cpu_model']} (torch "
             f"{m['torch']}). The replay reads the searches recorded in the committed results "
             f"({', '.join(f'`{s}`' for s, _ in SOURCES)}) and asks, per gate kind and k, what "
             "ending the searching after k refused searches in a row would have skipped. A "
             "refused search restores the weights bit-exactly, so a run that lost no kept jump "
             "would have followed the same path; the gate seconds saved are each run's mean "
             "seconds per gate evaluation times the evaluations skipped, over the run's training "
             "clock (its wall clock in the secant study, which records no training clock).", ""]
    verdict = ("no k up to "
               f"{PATIENCES[-1]} lost no kept jump with the −reverse-KL secant gate" if k is None else
               f"**k = {k} is the smallest patience that lost no kept jump with the −reverse-KL "
               "secant gate**")
    always = [g for g, table in rep["table"].items() if all(row["lost"] for row in table)]
    if always:
        verdict += (f"; with the {' and the '.join(f'`{g}` gate' for g in always)}, refused "
                    f"streaks were followed by kept jumps at every k up to {PATIENCES[-1]}, so "
                    "there a stop changes the run")
    lines += [f"**Answer.** {verdict}.", ""]
    headers = ["gate", "k", "runs", "searches (kept)", "searches skipped", "gate evals skipped",
               "kept jumps lost (runs changed)", "gate share of the clock: all searches → with the stop"]
    rows = [[g, row["patience"], row["runs"], f"{row['searches']} ({row['kept']})",
             f"{row['skipped']} ({row['skipped'] / row['searches']:.0%})",
             f"{row['skipped_evals']} of {row['gate_evals']} ({row['skipped_evals'] / row['gate_evals']:.0%})",
             f"{row['lost']} ({row['runs_changed']})",
             f"{_pct(row['gate_share'])} → {_pct(row['gate_share_after'])}"]
            for g, table in rep["table"].items() for row in table]
    lines += [markdown_table(headers, rows), ""]
    if k is not None:
        lines += [f"Per source at k = {k}:", ""]
        rows = [[g, src, row["runs"], f"{row['skipped_evals']} of {row['gate_evals']}",
                 f"{row['lost']} ({row['runs_changed']})",
                 f"{_pct(row['gate_share'])} → {_pct(row['gate_share_after'])}"]
                for g, by_src in rep["per_source"].items() for src, row in by_src.items()]
        lines += [markdown_table(["gate", "source", "runs", "gate evals skipped",
                                  "kept jumps lost (runs changed)", "gate share → with the stop"], rows), ""]
    lv = results.get("live")
    if lv:
        lines += [f"## Live check: {lv['cell']}, EffOPD at lr {lv['lr']:g}, patience {lv['patience']} "
                  "vs none", "",
                  f"The regime map's settings (pair `{lv['pair']}`); each seed run twice, stopped "
                  f"at {regimes.STOP_FRACTION:.0%} of the gain; the ratio is the training clock "
                  "without patience ÷ with it (>1: the stop is faster).", ""]
        rows = []
        for s in lv["seeds"]:
            full, stop = s["runs"]["None"], s["runs"][str(lv["patience"])]
            rows.append([s["seed"], "yes" if s["same_evals"] else "**no**",
                         ", ".join(f"{st}" + ("" if acc is None else f" (c={acc:g})") for st, acc in full["searches"]),
                         stop["stopped_after"] or "—", f"{full['gate_evals']} → {stop['gate_evals']}",
                         f"{full['gate_seconds']:.2f} → {stop['gate_seconds']:.2f}",
                         f"{full['clock']:.1f} → {stop['clock']:.1f}", f"{s['clock_ratio']:.2f}"])
        lines += [markdown_table(["seed", "same eval curve", "searches without patience (kept c)",
                                  "stopped after step", "gate evals", "gate seconds",
                                  "training clock (s)", "clock ratio"], rows), ""]
        ratios = [s["clock_ratio"] for s in lv["seeds"]]
        lines += [f"Clock ratio {statistics.fmean(ratios):.2f} [{min(ratios):.2f}–{max(ratios):.2f}] "
                  f"over {len(ratios)} seeds; the two runs of a seed ran one after the other on a "
                  "shared 2-core machine, so the clock carries that noise; the gate seconds are "
                  "the measured difference.", ""]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    torch.set_num_threads(a.threads)
    if a.report_only:
        old = previous_results(a.out, STEM)
        if old is None:
            raise SystemExit(f"patience: --report-only: no {STEM}.json in {a.out}")
        write_results(a.out, STEM, old, report(old))
        return 0
    rep = replay_all(Path(a.results))
    if not rep["table"]:
        raise SystemExit(f"patience: no recorded searches under {a.results}")
    results: dict[str, Any] = {"replay": rep, "machine": machine_info(torch.device("cpu"))}
    if a.live:
        k = a.patience or rep["recommended"]
        if k is None:
            raise SystemExit("patience: the replay recommends no k; pass --patience")
        results["live"] = live(a, k)
    write_results(a.out, STEM, results, report(results))
    print(report(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
