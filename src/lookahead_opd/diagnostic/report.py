"""``DiagnosticReport``: the per-node records of a diagnostic run and everything derived from them.

Averages are over *informative* nodes only (candidates whose success rates differ; the others
carry no signal and are only counted). Alignment is further averaged only where the teacher's
distillation gradient is non-zero; the zero-gradient nodes are counted per teacher. Each mean
comes with a percentile bootstrap 95% confidence interval over nodes (seeded). Output files:
``report.json``, ``nodes.jsonl`` (and ``nodes.parquet`` when pyarrow is installed; one row per
node and teacher), ``alignment_by_depth.png``, ``alignment_by_outcome.png``,
``per_question.png`` and ``report.html`` (self-contained: plots embedded as base64).
"""

from __future__ import annotations

import base64
import html
import json
import math
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["METRICS", "DiagnosticReport", "bootstrap_mean"]

# name -> (what it is, direction: +1 higher predicts a better teacher, -1 lower, 0 unclear)
METRICS: dict[str, tuple[str, int]] = {
    "alignment": ("cos(ideal gradient, distillation gradient)", 1),
    "advantage": ("teacher advantage Σ (q−p) P_succ", 1),
    "reverse_kl": ("KL(student ‖ teacher), full vocabulary", 0),
    "js": ("Jensen–Shannon(student, teacher), full vocabulary", 0),
    "topk_overlap": ("|top-K student ∩ top-K teacher| / K", 0),
    "teacher_mass_topk": ("teacher mass on the student's top-K", 0),
}


def bootstrap_mean(values: list[float], *, resamples: int = 1000, seed: int = 0,
                   level: float = 0.95) -> dict[str, float | int | None]:
    """Mean of ``values`` with a percentile bootstrap CI; ``None`` fields when empty."""
    a = np.asarray([v for v in values if v is not None], dtype=np.float64)
    if a.size == 0:
        return {"mean": None, "ci_lo": None, "ci_hi": None, "n": 0}
    out: dict[str, float | int | None] = {"mean": float(a.mean()), "n": int(a.size)}
    if a.size == 1 or resamples < 1:
        out["ci_lo"] = out["ci_hi"] = float(a.mean())
        return out
    rng = np.random.default_rng(seed)
    means = a[rng.integers(0, a.size, size=(resamples, a.size))].mean(axis=1)
    tail = (1.0 - level) / 2 * 100
    out["ci_lo"], out["ci_hi"] = (float(x) for x in np.percentile(means, [tail, 100 - tail]))
    return out


@dataclass
class DiagnosticReport:
    """The result of :func:`~lookahead_opd.diagnostic.diagnose`.

    ``nodes`` holds one dict per scored node (question, sample, depth, rollout_correct,
    candidates, student probabilities, ``p_succ``, ``counts``, ``value``, ``informative``, and
    ``teachers[name]`` with that teacher's scores). ``counts`` says how many nodes were seen,
    kept, informative and skipped; ``rollouts_used`` the continuation rollouts generated;
    ``questions`` one dict per question (index, prompt, answer, the student's solve rate).
    """

    teachers: list[str]
    nodes: list[dict[str, Any]]
    counts: dict[str, int]
    rollouts_used: int
    budget: int
    config: dict[str, Any] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)
    rank_by: str = "alignment"
    resamples: int = 1000
    seed: int = 0
    questions: list[dict[str, Any]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.rank_by not in METRICS:
            raise ValueError(f"rank_by must be one of {', '.join(METRICS)}; got {self.rank_by!r}")

    # ------------------------------------------------------------------ statistics
    def _stats(self, values: list[float | None]) -> dict[str, Any]:
        return bootstrap_mean([v for v in values if v is not None], resamples=self.resamples,
                              seed=self.seed)

    def _values(self, teacher: str, metric: str, nodes: list[dict[str, Any]] | None = None
                ) -> list[float | None]:
        pool = self.informative_nodes if nodes is None else nodes
        return [n["teachers"][teacher][metric] for n in pool]

    @cached_property
    def informative_nodes(self) -> list[dict[str, Any]]:
        """Nodes whose candidates' success rates differ."""
        return [n for n in self.nodes if n["informative"]]

    @cached_property
    def summary(self) -> dict[str, dict[str, Any]]:
        """Per teacher: each metric's mean and CI, zero-gradient node count, alignment and
        advantage split by rollout outcome and by depth, and per-question mean alignment."""
        out: dict[str, dict[str, Any]] = {}
        nodes = self.informative_nodes
        depths = sorted({n["depth"] for n in nodes})
        questions = sorted({n["question"] for n in nodes})
        for name in self.teachers:
            s: dict[str, Any] = {m: self._stats(self._values(name, m)) for m in METRICS}
            s["zero_gradient_nodes"] = sum(n["teachers"][name]["zero_gradient"] for n in nodes)
            s["by_outcome"] = {
                label: {m: self._stats(self._values(name, m, [n for n in nodes
                                                              if n["rollout_correct"] == flag]))
                        for m in ("alignment", "advantage")}
                for label, flag in (("correct", True), ("incorrect", False))}
            s["by_depth"] = {str(d): self._stats(self._values(
                name, "alignment", [n for n in nodes if n["depth"] == d])) for d in depths}
            per_q: dict[str, Any] = {}
            for q in questions:
                vals = [v for v in self._values(name, "alignment", [n for n in nodes
                                                                    if n["question"] == q])
                        if v is not None]
                per_q[str(q)] = float(np.mean(vals)) if vals else None
            s["per_question_alignment"] = per_q
            out[name] = s
        return out

    def ranking(self, metric: str | None = None) -> list[str]:
        """Teachers best first by ``metric`` (default ``rank_by``); teachers without a value
        last. For proxies with no agreed direction, higher ranks first."""
        metric = metric or self.rank_by
        if metric not in METRICS:
            raise ValueError(f"metric must be one of {', '.join(METRICS)}; got {metric!r}")
        sign = -1.0 if METRICS[metric][1] < 0 else 1.0

        def key(name: str) -> tuple[int, float]:
            mean = self.summary[name][metric]["mean"]
            return (1, 0.0) if mean is None else (0, -sign * mean)

        return sorted(self.teachers, key=key)

    # ------------------------------------------------------------------ rendering
    def table(self) -> str:
        """The ranked table printed by the CLI (means with 95% bootstrap CIs)."""
        c = self.counts
        lines = [
            f"{c.get('nodes', 0)} nodes scored ({c.get('informative', 0)} informative, "
            f"{c.get('uninformative', 0)} with equal success rates excluded); "
            f"{self.rollouts_used}/{self.budget} continuation rollouts",
            "",
            f"{'rank':<5}{'teacher':<28}{'alignment [95% CI]':<26}{'incorrect':>10}{'correct':>9}"
            f"{'advantage':>11}{'rev KL':>9}{'JS':>8}{'top-K ovl':>10}{'mass':>7}{'zero-g':>8}",
        ]

        def fmt(v: Any, width: int, digits: int = 3) -> str:
            return f"{'—' if v is None else f'{v:.{digits}f}':>{width}}"

        for rank, name in enumerate(self.ranking(), 1):
            s = self.summary[name]
            a = s["alignment"]
            ci = ("—" if a["mean"] is None
                  else f"{a['mean']:+.3f} [{a['ci_lo']:+.3f}, {a['ci_hi']:+.3f}]")
            short = name if len(name) <= 27 else "…" + name[-26:]
            lines.append(
                f"{rank:<5}{short:<28}{ci:<26}"
                f"{fmt(s['by_outcome']['incorrect']['alignment']['mean'], 10)}"
                f"{fmt(s['by_outcome']['correct']['alignment']['mean'], 9)}"
                f"{fmt(s['advantage']['mean'], 11)}{fmt(s['reverse_kl']['mean'], 9)}"
                f"{fmt(s['js']['mean'], 8)}{fmt(s['topk_overlap']['mean'], 10, 2)}"
                f"{fmt(s['teacher_mass_topk']['mean'], 7, 2)}{s['zero_gradient_nodes']:>8}")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        """Everything but the per-node records (those go to nodes.jsonl)."""
        return {"teachers": self.teachers, "ranking": self.ranking(), "rank_by": self.rank_by,
                "metrics": {k: v[0] for k, v in METRICS.items()}, "counts": self.counts,
                "rollouts_used": self.rollouts_used, "budget": self.budget,
                "seconds": self.seconds, "config": self.config, "questions": self.questions,
                "summary": self.summary}

    def node_rows(self) -> list[dict[str, Any]]:
        """One flat row per node and teacher (the nodes.jsonl / parquet layout)."""
        rows = []
        for n in self.nodes:
            base = {k: v for k, v in n.items() if k != "teachers"}
            for name, scores in n["teachers"].items():
                rows.append({**base, "teacher": name, **scores})
        return rows

    def save(self, output_dir: str | Path, *, plots: bool = True) -> dict[str, Path]:
        """Write the report files under ``output_dir``; return their paths by name."""
        out = Path(output_dir)
        out.mkdir(parents=True, exist_ok=True)
        paths = {"report.json": out / "report.json", "nodes.jsonl": out / "nodes.jsonl"}
        paths["report.json"].write_text(json.dumps(_clean(self.to_dict()), indent=1) + "\n")
        rows = self.node_rows()
        with paths["nodes.jsonl"].open("w") as f:
            for r in rows:
                f.write(json.dumps(_clean(r)) + "\n")
        try:
            import pyarrow as pa
            import pyarrow.parquet as pq
        except ImportError:
            pass
        else:
            paths["nodes.parquet"] = out / "nodes.parquet"
            pq.write_table(pa.Table.from_pylist(rows), paths["nodes.parquet"])
        if plots:
            for name, fn in (("alignment_by_depth.png", self._plot_by_depth),
                             ("alignment_by_outcome.png", self._plot_by_outcome),
                             ("per_question.png", self._plot_per_question)):
                paths[name] = out / name
                fn(paths[name])
            paths["report.html"] = out / "report.html"
            paths["report.html"].write_text(self.html(
                [paths[k] for k in ("alignment_by_depth.png", "alignment_by_outcome.png",
                                    "per_question.png")]))
        return paths

    def html(self, images: list[Path]) -> str:
        """A small self-contained HTML page: the table, the counts and the embedded plots."""
        imgs = "\n".join(
            f'<figure><img alt="{html.escape(p.stem)}" src="data:image/png;base64,'
            f'{base64.b64encode(p.read_bytes()).decode()}"/></figure>' for p in images)
        cfg = html.escape(json.dumps(_clean(self.config), indent=1))
        return (
            "<!doctype html><html><head><meta charset='utf-8'><title>Teacher diagnostic</title>"
            "<style>body{font-family:sans-serif;max-width:1100px;margin:2em auto}"
            "pre{background:#f4f4f4;padding:1em;overflow-x:auto}img{max-width:100%}</style>"
            "</head><body><h1>Teacher selection diagnostic</h1>"
            f"<h2>Ranking (by {html.escape(self.rank_by)})</h2>"
            f"<pre>{html.escape(self.table())}</pre>"
            "<p>Alignment: cosine between the ideal logit gradient p⊙(P_succ−V) and the "
            "teacher's distillation gradient on each node's candidate set; averages over "
            "informative nodes, 95% bootstrap CIs.</p>"
            f"<h2>Plots</h2>{imgs}<h2>Configuration</h2><pre>{cfg}</pre></body></html>\n")

    # ------------------------------------------------------------------ plots
    def _figure(self) -> tuple[Any, Any]:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        return plt, plt.subplots(figsize=(7, 4))

    def _plot_by_depth(self, path: Path) -> None:
        plt, (fig, ax) = self._figure()
        for name in self.teachers:
            pts = [(int(d), s) for d, s in self.summary[name]["by_depth"].items()
                   if s["mean"] is not None]
            if not pts:
                continue
            d, s = zip(*pts, strict=True)
            mean = np.array([x["mean"] for x in s])
            err = np.array([[m - x["ci_lo"] for m, x in zip(mean, s, strict=True)],
                            [x["ci_hi"] - m for m, x in zip(mean, s, strict=True)]])
            ax.errorbar(d, mean, yerr=err, marker="o", capsize=3, label=name)
        ax.set_xscale("log", base=2)
        depths = sorted({n["depth"] for n in self.informative_nodes})
        if depths:
            ax.set_xticks(depths, [str(d) for d in depths])
            ax.minorticks_off()
        ax.set_xlabel("node depth (token position in the completion)")
        _finish(plt, fig, ax, path, "mean alignment (95% CI)")

    def _plot_by_outcome(self, path: Path) -> None:
        plt, (fig, ax) = self._figure()
        width = 0.8 / max(1, len(self.teachers))
        for i, name in enumerate(self.teachers):
            stats = [self.summary[name]["by_outcome"][o]["alignment"]
                     for o in ("incorrect", "correct")]
            mean = np.array([np.nan if s["mean"] is None else s["mean"] for s in stats])
            err = np.array([[0.0 if s["mean"] is None else s["mean"] - s["ci_lo"] for s in stats],
                            [0.0 if s["mean"] is None else s["ci_hi"] - s["mean"] for s in stats]])
            ax.bar(np.arange(2) + i * width, mean, width, yerr=err, capsize=3, label=name)
        ax.set_xticks(np.arange(2) + width * (len(self.teachers) - 1) / 2,
                      ["incorrect rollouts", "correct rollouts"])
        _finish(plt, fig, ax, path, "mean alignment (95% CI)")

    def _plot_per_question(self, path: Path) -> None:
        plt, (fig, ax) = self._figure()
        solve = {q["index"]: q["solve_rate"] for q in self.questions}
        for name in self.teachers:
            per_q = self.summary[name]["per_question_alignment"].items()
            pts = [(solve.get(int(q), math.nan), v) for q, v in per_q if v is not None]
            if pts:
                x, y = zip(*pts, strict=True)
                ax.scatter(x, y, alpha=0.7, label=name)
        ax.set_xlabel("question: fraction of the student's rollouts that are correct")
        _finish(plt, fig, ax, path, "question's mean alignment")


def _finish(plt: Any, fig: Any, ax: Any, path: Path, ylabel: str) -> None:
    """Zero line, y label, legend (when anything is labelled), save, close."""
    ax.axhline(0.0, color="gray", lw=0.8)
    ax.set_ylabel(ylabel)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _clean(obj: Any) -> Any:
    """JSON-safe: NaN/inf → None, numpy scalars → Python."""
    if isinstance(obj, dict):
        return {str(k): _clean(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_clean(v) for v in obj]
    if isinstance(obj, np.generic):
        obj = obj.item()
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    return obj
