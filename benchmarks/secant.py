"""Does the secant cosine predict a kept jump? Shadow mode on real OPD runs (CPU, zoo pair).

Every run is EffOPD through the real ``OPDTrainer`` (``run_variant``), searching after steps
1, 2, 4 and then every ``--every`` steps (more searches per run than powers of two). The
searches run as they always do; each ``JumpRecord`` carries ``secant_cosine``, and this script
asks afterwards what a rule "skip the search when ``secant_cosine < θ``" would have decided:
how many searches and gate evaluations it would have saved and how many kept jumps it would
have missed. How well the cosine separates kept from rejected searches is the ROC AUC (the
probability that a kept search's cosine is higher than a rejected one's, ties half), pooled
over all runs and *within runs* (only pairs of a kept and a rejected search of the same run).
A user runs one learning rate, and a lower one gives both straighter paths and more kept
jumps, so the pooled AUC can be high with no power within a run: the within-run AUC decides.

Learning rates span 0.25–4 × the speed-up benchmark's base so that both outcomes occur;
variants: the −reverse-KL gate on 128 rollouts, the exact-match gate on 50 problems, and the
−reverse-KL gate with ``direction="averaged"``. On this zoo pair the secant's kept jumps come
early (steps 1–4, see speedup.md), when the path is also straightest, so the table also gives
the AUC of the searches after step 16 alone. Results are rewritten
after every run and reused on a rerun (``--fresh`` to start over).

    OMP_NUM_THREADS=1 python -m benchmarks.secant                  # ~30 CPU-minutes
    python -m benchmarks.secant --quick --out /tmp/secant          # the pipeline only
    python -m benchmarks.secant --report-only                      # rewrite md from the json
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any

import torch

from benchmarks import harness
from benchmarks.common import markdown_table
from benchmarks.speedup import BASE_LR, PAIRS, pair_of

STEM = "secant_auc"
LR_MULTIPLIERS = (0.25, 0.5, 1.0, 2.0, 4.0)
VARIANTS = {
    "neg_kl": dict(gate="neg_kl", gate_size=128),
    "accuracy": dict(gate="accuracy", gate_size=50),
    "neg_kl+averaged": dict(gate="neg_kl", gate_size=128, direction="averaged"),
}
LATE = 16  # "late" searches: after this step
THRESHOLDS = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)
PAIR = "same-base"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--seeds", type=int, default=2)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--every", type=int, default=8, help="search every N steps")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--cache-dir", default=None)
    p.add_argument("--fresh", action="store_true", help="ignore results of an earlier run")
    p.add_argument("--quick", action="store_true", help="a few steps of two runs (CI)")
    p.add_argument("--report-only", action="store_true", help="rewrite the md from the json")
    a = p.parse_args(argv)
    a.variants = [g.strip() for g in a.variants.split(",")]
    unknown = [g for g in a.variants if g not in VARIANTS]
    if unknown:
        p.error(f"unknown variant(s) {unknown}; known: {', '.join(VARIANTS)}")
    a.lrs = LR_MULTIPLIERS
    if a.quick:
        a.seeds, a.steps, a.every, a.batch_size, a.fresh = 1, 12, 2, 16, True
        a.variants, a.lrs = a.variants[:1], (1.0, 4.0)
    return a


def schedule(steps: int, every: int) -> str:
    """Steps 1, 2, 4, then every ``every`` steps up to ``steps``, as OPDConfig takes them."""
    return ",".join(str(s) for s in sorted({1, 2, 4, *range(every, steps + 1, every)}) if s <= steps)


def run_one(a: argparse.Namespace, models: harness.Pairs, variant: str, m: float,
            seed: int) -> dict[str, Any]:
    pair = pair_of(models, PAIR)
    task = PAIRS[PAIR][0]
    gate_options = dict(VARIANTS[variant])
    if a.quick:
        gate_options["gate_size"] = 20
    config = harness.opd_config(
        "secant", f"{variant}-{m:g}-{seed}", task=task, max_steps=a.steps,
        batch_size=a.batch_size, learning_rate=BASE_LR * m, warmup_steps=4, eval_every=0,
        eval_size=50 if a.quick else 200, seed=seed, extrapolate=True, coefficients="geometric",
        schedule=schedule(a.steps, a.every), **gate_options)
    run = harness.run(config, pair, task)
    if run["crashed"]:
        raise RuntimeError(f"secant run {variant} lr×{m:g} seed {seed}: {run['crashed']}")
    keys = ("step", "secant_cosine", "norm_ratio", "accepted", "n_evals", "seconds", "coefficients")
    return {"variant": variant, "lr_multiplier": m, "lr": config.learning_rate, "seed": seed,
            "final_accuracy": run["final_accuracy"], "wall_seconds": run["wall_seconds"],
            "gate_seconds": run["gate_seconds"],
            "searches": [{k: j[k] for k in keys} for j in run["jumps"]]}


# --------------------------------------------------------------------------- analysis


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


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
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


def report(results: dict[str, Any]) -> str:
    s, c, m = results["summary"], results["config"], results["machine"]
    pooled, within = s["all"]["auc"], s["all"]["auc_within_runs"]
    if within is None:
        verdict = "not measurable: no run had both a kept and a rejected search"
    elif within >= 0.75:
        verdict = "≥ 0.75: a skip rule on the cosine is worth shipping"
    else:
        verdict = ("< 0.75: within a run the cosine does not separate kept from rejected "
                   "searches well enough to skip on it")
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
        f"**Within-run ROC AUC: {_f(within)}** ({verdict}); pooled over runs: {_f(pooled)}. "
        "The pooled AUC mixes learning rates, and a lower one gives both a straighter path "
        "(higher cosine) and more kept jumps; a user runs one, so the within-run AUC (pairs of "
        "a kept and a rejected search of the same run) is the one that says whether a "
        "threshold on the cosine could skip searches.",
        "",
        markdown_table(
            ["searches", "n", "kept", "AUC pooled", "AUC within runs", "mean cos (kept)",
             "mean cos (rejected)"],
            [[k, v["searches"], v["kept"], _f(v["auc"]), _f(v["auc_within_runs"]),
              _f(v["mean_cosine_kept"]),
              _f(v["mean_cosine_rejected"])]
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
    lines += [
        f"The gate (all searches) took {s['gate_share_of_wall']:.1%} of the runs' wall-clock.",
    ]
    return "\n".join(lines) + "\n"


def save(store: harness.Store) -> None:
    store.data["summary"] = summarize(list(store.runs.values()))
    store.save(report(store.data))


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    torch.set_num_threads(1)
    store = harness.Store(a.out, STEM, fresh=a.fresh)
    if a.report_only:
        if store.old is None:
            raise SystemExit(f"secant: --report-only: no {STEM}.json in {a.out}")
        store.data = store.old
        save(store)
        return 0
    config = {k: v for k, v in vars(a).items()
              if k not in ("out", "fresh", "cache_dir", "report_only")}
    same = ("steps", "every", "batch_size")
    if store.old is not None and all(store.old["config"].get(k) == config[k] for k in same):
        store.data = store.old
    store.data["config"] = {**config, "lrs": list(a.lrs)}
    store.stamp()
    models = harness.Pairs(a.cache_dir)

    def jobs() -> list[tuple[str, tuple[str, float, int]]]:
        # Seeds outermost: a run cut short still covers every variant and learning rate.
        return [(f"{v}/{m:g}/{seed}", (v, m, seed))
                for seed in range(a.seeds) for v in a.variants for m in a.lrs]

    def describe(key: str, run: dict[str, Any]) -> str:
        kept = sum(s["accepted"] is not None for s in run["searches"])
        within = store.data["summary"]["all"]["auc_within_runs"]
        return (f"{key}: {run['wall_seconds']:.0f}s, {kept}/{len(run['searches'])} searches "
                f"kept, AUC within runs {_f(within)}")

    harness.run_all(store, jobs, lambda job: run_one(a, models, *job), lambda: save(store),
                    desc="secant runs", describe=describe)
    if store.runs:
        save(store)
        print(report(store.data))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
