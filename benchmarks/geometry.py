"""The paper's update-geometry analyses (papers.md A.5 Table 1, A.6, A.7), reproduced on the
embedded arithmetic task with OPD and RL runs of equal length.

From the same student (the zoo's tiny same-base pair: a half-trained Qwen2 base and the base
trained further as the teacher), two runs through the real ``OPDTrainer``, same seed, learning
rate, optimizer, prompts per step and number of steps:

* **OPD**: ``OPDConfig(loss=--opd-loss)`` (default the full-vocabulary ``reverse_kl``, which
  learns this task; the sampled-token ``reverse_kl_pg`` barely moves it), one rollout per prompt;
* **RL**: ``OPDConfig(loss="drgrpo", num_samples=4)``, Dr. GRPO on the exact-match reward
  (the teacher is only measured).

A callback copies the weights at evenly spaced checkpoints. Then, with ``ΔW_t = W_t − W_0``:

1. Table 1: σ1, σ1/‖ΔW‖F, effective rank, top-1% (and top-10%) energy ratio of the final
   update, per 2-D attention/MLP matrix, averaged (``lookahead_opd.geometry.summarize``);
2. subspace alignment of each checkpoint's update with the final one: |cos| between the i-th
   left singular vectors, averaged over i ≤ k and over matrices (Fig. 4b);
3. per-module update norms by layer, MLP vs attention (A.6);
4. the early checkpoints (10%, 20%, 30% of training) rescaled per parameter tensor to the final
   update's norm (β = 1), their greedy accuracy and reverse KL, and a β sweep at 10% (Fig. 4c).

    python -m benchmarks.geometry            # the committed results (2–4 min on 2 shared cores)
    python -m benchmarks.geometry --smoke    # pipeline check in seconds (fresh tiny models)
    python -m benchmarks.geometry --report-only   # rewrite md/png from the json

Writes ``geometry.json``, ``geometry.md`` and ``geometry_*.png`` under ``--out``
(``geometry-smoke.*`` with ``--smoke``).
"""

from __future__ import annotations

import argparse
import copy
import math
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks import harness
from benchmarks.common import markdown_table
from lookahead_opd.integrations import geometry as geo
from lookahead_opd.selection import ATTENTION_KEYWORDS, is_block_param

STEM = "geometry"
METHODS = {"opd": dict(loss="reverse_kl", num_samples=1),
           "rl": dict(loss="drgrpo", num_samples=4)}


# --------------------------------------------------------------------------- setup


def options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cache-dir", default=None, help="zoo cache (default $LOOKAHEAD_OPD_CACHE)")
    p.add_argument("--size", default="tiny", help="zoo size of the student and teacher")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=300, help="optimizer steps of each run")
    p.add_argument("--batch-size", type=int, default=64, help="OPD prompts per step")
    p.add_argument("--rl-batch-size", type=int, default=16,
                   help="RL prompts per step (× --rl-samples: the same rollouts per step as OPD)")
    p.add_argument("--rl-samples", type=int, default=4, help="RL completions per prompt")
    p.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate (both runs)")
    p.add_argument("--warmup", type=int, default=4, help="linear warmup steps (both runs)")
    p.add_argument("--checkpoints", type=int, default=10, help="evenly spaced checkpoints")
    p.add_argument("--early", default="0.1,0.2,0.3", help="fractions of training to rescale")
    p.add_argument("--betas", default="0,0.5,0.8,1,1.2,1.5", help="β sweep at the first --early")
    p.add_argument("--align-k", type=int, default=8, help="singular directions compared")
    p.add_argument("--eval-size", type=int, default=400, help="held-out problems per eval")
    p.add_argument("--kl-size", type=int, default=128, help="fixed base rollouts for the KL")


# The smoke run: fresh tiny models, a few steps. Operands 0..20: a fresh model samples a few
# percent right after 100 steps (a second or two), so RL's group-mean advantages are not all 0.
SMOKE = dict(steps=4, batch_size=8, rl_batch_size=8, checkpoints=4, early="0.25,0.5", warmup=0,
             betas="0,1,1.5", eval_size=24, kl_size=8)


def configure(a: argparse.Namespace, p: argparse.ArgumentParser) -> None:
    a.task = "arithmetic:max_operand=20" if a.smoke else "arithmetic"  # the zoo pair's task
    a.early_fractions = _floats(a.early, "--early")
    a.beta_values = _floats(a.betas, "--betas")
    if a.steps < 2 or a.checkpoints < 2 or a.checkpoints > a.steps:
        p.error(f"need 2 <= --checkpoints <= --steps, got {a.checkpoints}, {a.steps}")
    if any(not 0 < f < 1 for f in a.early_fractions):
        p.error(f"--early fractions must be in (0, 1), got {a.early!r}")


def _floats(spec: str, flag: str) -> list[float]:
    try:
        values = [float(x) for x in spec.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"{flag} must be comma-separated numbers, got {spec!r}") from None
    if not values:
        raise SystemExit(f"{flag} is empty")
    return values


def checkpoint_steps(steps: int, n: int, early: list[float]) -> list[int]:
    """Steps of the ``n`` evenly spaced checkpoints plus the early fractions, ascending."""
    out = {max(1, round(steps * i / n)) for i in range(1, n + 1)}
    out |= {max(1, round(steps * f)) for f in early}
    return sorted(out)


def load_models(a: argparse.Namespace) -> tuple[Any, Any, Any, dict[str, Any]]:
    """Tokenizer, student and teacher: the cached zoo pair, or (``--quick``) fresh tiny models,
    the teacher being the student trained a few more steps (the same-base regime)."""
    from lookahead_opd.demo.zoo import build_pair, make_model, pretrain
    from lookahead_opd.integrations.opd.tasks import load_task
    from lookahead_opd.integrations.opd.tokenizer import char_tokenizer

    if a.smoke:
        tokenizer = char_tokenizer()
        task = load_task(a.task)
        student = make_model(tokenizer, "tiny", a.seed)
        pretrain(student, tokenizer, task, steps=100, batch_size=32, seed=a.seed, progress=False)
        teacher = copy.deepcopy(student)
        pretrain(teacher, tokenizer, task, steps=100, batch_size=32, seed=a.seed + 1,
                 progress=False)
        return tokenizer, student, teacher, {"source": "fresh (smoke)", "size": "tiny",
                                             "task": a.task}
    from transformers import AutoModelForCausalLM, AutoTokenizer

    pair = build_pair(a.cache_dir, task_spec=a.task, size=a.size,
                      teacher_regime="same-base", seed=a.seed, progress=False)
    tokenizer = AutoTokenizer.from_pretrained(pair.student_path)
    student = AutoModelForCausalLM.from_pretrained(pair.student_path, dtype=torch.float32)
    teacher = AutoModelForCausalLM.from_pretrained(pair.teacher_path, dtype=torch.float32)
    return tokenizer, student, teacher, {"source": str(pair.student_path.parent), "size": a.size,
                                         "task": a.task, "zoo_accuracies": pair.accuracies}


# --------------------------------------------------------------------------- weights


class Checkpoints:
    """OPDTrainer callback: copies of the student's parameters at step 0 and at ``steps``."""

    def __init__(self, model: torch.nn.Module, steps: list[int]) -> None:
        self.model, self.steps = model, set(steps)
        self.weights: dict[int, dict[str, torch.Tensor]] = {0: self.copy()}

    def copy(self) -> dict[str, torch.Tensor]:
        return {n: p.detach().clone() for n, p in self.model.named_parameters()}

    def __call__(self, metrics: dict[str, Any]) -> None:
        if "loss" in metrics and metrics["step"] in self.steps:
            self.weights[metrics["step"]] = self.copy()


def block_kind(name: str, tensor: torch.Tensor) -> tuple[int, str] | None:
    """(layer, "attn" | "mlp") for a weight matrix of a transformer block (the parameters
    ``transformer_blocks`` selects, matrices only: no norms, no biases), else None."""
    if tensor.dim() != 2 or not is_block_param(name):
        return None
    layer = next((int(part) for part in name.split(".") if part.isdigit()), None)
    if layer is None:
        return None
    return layer, "attn" if is_block_param(name, ATTENTION_KEYWORDS) else "mlp"


def total_norm(tensors: dict[str, torch.Tensor]) -> float:
    """sqrt(Σ‖t‖²) over all tensors."""
    return geo.update_norms(tensors, group=lambda _: "all").get("all", 0.0)


def _ratio(a: float, b: float) -> float | None:
    return a / b if b > 0 else None


def load_weights(model: torch.nn.Module, weights: dict[str, torch.Tensor]) -> None:
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(weights[n])


# --------------------------------------------------------------------------- analyses


def spectral_table(delta: dict[str, torch.Tensor]) -> dict[str, dict[str, float]]:
    """Mean matrix metrics of the block matrices of ``delta``: all, attention only, MLP only."""
    out = {}
    for group in ("all", "attn", "mlp"):
        sub = {n: d for n, d in delta.items()
               if (k := block_kind(n, d)) is not None and group in ("all", k[1])}
        row = geo.summarize(sub)
        row["top10pct_ratio"] = (sum(geo.top_energy_ratio(d, 0.1) for d in sub.values())
                                 / max(len(sub), 1))
        row["effective_rank_fraction"] = (
            sum(geo.effective_rank(d) / min(d.shape) for d in sub.values()) / max(len(sub), 1))
        out[group] = row
    return out


def alignment(delta_t: dict[str, torch.Tensor], delta_final: dict[str, torch.Tensor],
              k: int) -> dict[str, float]:
    """Mean |cos| of the top-k left singular directions (per matrix, then averaged over the
    block matrices: all, attention, MLP), and the cosine of the flattened updates."""
    per: dict[str, list[float]] = {"all": [], "attn": [], "mlp": []}
    for n, d in delta_t.items():
        kind = block_kind(n, d)
        if kind is None:
            continue
        s = geo.subspace_alignment(d, delta_final[n], k=k, side="left")
        per["all"].append(s)
        per[kind[1]].append(s)
    out = {g: sum(v) / len(v) for g, v in per.items() if v}
    a = torch.cat([d.flatten() for d in delta_t.values()])
    b = torch.cat([delta_final[n].flatten() for n in delta_t])
    # fp64: the fp32 cosine of a vector with itself can read 1 + 2e-6
    out["cos_flat"] = float(torch.nn.functional.cosine_similarity(a.double(), b.double(), dim=0))
    return out


def random_reference(shapes: dict[str, tuple[int, ...]], k: int, seed: int) -> dict[str, Any]:
    """The same metrics for Gaussian noise of the same shapes: what 'no structure' reads as."""
    g = torch.Generator().manual_seed(seed)
    a = {n: torch.randn(s, generator=g) for n, s in shapes.items()}
    b = {n: torch.randn(s, generator=g) for n, s in shapes.items()}
    return {"spectral": spectral_table(a), "alignment": alignment(a, b, k)}


def norms_by_layer(delta: dict[str, torch.Tensor]) -> dict[str, Any]:
    """‖ΔW‖F per (layer, attention | MLP) over the block matrices, and per other tensor group."""
    kinds = {n: block_kind(n, d) for n, d in delta.items()}

    def group(name: str) -> str:
        kind = kinds[name]
        if kind is not None:
            return f"layer{kind[0]}.{kind[1]}"
        if "embed" in name:
            return "embeddings"
        if "lm_head" in name:
            return "lm_head"
        return "norms_and_biases"

    norms = geo.update_norms(delta, group=group)
    total = math.sqrt(sum(v * v for v in norms.values()))
    return {"norms": norms, "total": total,
            "share": {g: (v * v) / (total * total) if total > 0 else 0.0
                      for g, v in norms.items()}}


# --------------------------------------------------------------------------- one run


def train(a: argparse.Namespace, method: str, tokenizer: Any, student0: Any, teacher: Any,
          task: Any) -> tuple[Any, Any, Checkpoints, Any, float]:
    """One method's run from a copy of the student, its checkpoints copied on the way; the
    trainer, the student, the checkpoints, the result and the reverse KL at step 0."""
    from lookahead_opd.integrations.opd.engines import HFEngine
    from lookahead_opd.integrations.opd.trainer import OPDTrainer

    torch.manual_seed(a.seed)
    student = copy.deepcopy(student0)
    spec = dict(METHODS[method], batch_size=a.batch_size)
    if method == "rl":
        spec.update(num_samples=a.rl_samples, batch_size=a.rl_batch_size)
    config = harness.opd_config(
        "geometry", method, task=a.task, max_steps=a.steps, learning_rate=a.lr,
        warmup_steps=a.warmup, optimizer="adamw", max_grad_norm=1.0, eval_every=0,
        eval_size=a.eval_size, gate_size=a.kl_size, seed=a.seed, save_every=0, **spec)
    engine = HFEngine(student, tokenizer, batch_size=256)
    ckpts = Checkpoints(student, checkpoint_steps(a.steps, a.checkpoints, a.early_fractions))
    trainer = OPDTrainer(config, student, teacher, task, engine, tokenizer=tokenizer,
                         callbacks=[ckpts])
    # Fix the KL probe on rollouts of the base (teacher-forced afterwards: continuous, cheap).
    kl0 = trainer.gate_reverse_kl()
    return trainer, student, ckpts, trainer.train(), kl0


def rescaled_points(a: argparse.Namespace, ckpts: Checkpoints, curve: list[dict[str, Any]],
                    final: dict[str, torch.Tensor], score: Any) -> tuple[list, list, int]:
    """The early checkpoints rescaled to the final norm (β = 1), the β sweep at the first one,
    and how many new evaluations they took."""
    w0, memo = ckpts.weights[0], {}

    def rescaled(step: int, beta: float) -> dict[str, Any]:
        if (step, beta) in memo:  # β = 1 at the first early step is in both tables
            return memo[step, beta]
        early = geo.state_dict_delta(w0, ckpts.weights[step])
        before = _ratio(total_norm(early), total_norm(final))
        if beta == 0.0:  # the checkpoint as is, already scored
            point = next(p for p in curve if p["step"] == step)
            memo[step, beta] = {"step": step, "beta": beta, "norm_ratio_to_final": before,
                                "norm_ratio_before": before, "accuracy": point["accuracy"],
                                "reverse_kl": point["reverse_kl"]}
            return memo[step, beta]
        moved = geo.rescale_updates(early, final, beta=beta)
        weights = {n: w0[n] + moved[n].to(w0[n].dtype) for n in w0}
        memo[step, beta] = {"step": step, "beta": beta,
                            "norm_ratio_to_final": _ratio(total_norm(moved), total_norm(final)),
                            "norm_ratio_before": before, **score(weights)}
        return memo[step, beta]

    early_steps = [max(1, round(a.steps * f)) for f in a.early_fractions]
    rescale = [{"fraction": f, **rescaled(s, 1.0)}
               for f, s in zip(a.early_fractions, early_steps, strict=True)]
    sweep = [{"fraction": a.early_fractions[0], **rescaled(early_steps[0], b)}
             for b in a.beta_values]
    return rescale, sweep, len(memo)


def run_method(a: argparse.Namespace, method: str, tokenizer: Any, student0: Any, teacher: Any,
               task: Any) -> dict[str, Any]:
    """Train one method, then every analysis that needs its model (evals of rescaled weights)."""
    t0 = time.perf_counter()
    trainer, student, ckpts, result, kl0 = train(a, method, tokenizer, student0, teacher, task)
    train_wall = time.perf_counter() - t0
    print(f"{method}: {a.steps} steps in {train_wall:.0f}s, accuracy "
          f"{result.evals[0][1]:.1%} -> {result.evals[-1][1]:.1%}", flush=True)
    w0, wT = ckpts.weights[0], ckpts.weights[a.steps]
    final = geo.state_dict_delta(w0, wT)

    def score(weights: dict[str, torch.Tensor]) -> dict[str, float]:
        load_weights(student, weights)
        return {"accuracy": trainer.evaluate(), "reverse_kl": trainer.gate_reverse_kl()}

    curve = [{"step": 0, "accuracy": result.evals[0][1], "reverse_kl": kl0}]
    align = []
    for s in sorted(ckpts.steps):
        delta = geo.state_dict_delta(w0, ckpts.weights[s])
        align.append({"step": s, "fraction": s / a.steps, **alignment(delta, final, a.align_k)})
        curve.append({"step": s, **score(ckpts.weights[s])})
    rescale, sweep, n = rescaled_points(a, ckpts, curve, final, score)
    load_weights(student, wT)
    print(f"{method}: {len(curve) - 1 + n} evals in {time.perf_counter() - t0 - train_wall:.0f}s",
          flush=True)
    return {
        "method": method, "config": {k: v for k, v in trainer.config.to_dict().items()
                                     if k not in ("student", "teacher", "output_dir")},
        "train_seconds": trainer.train_seconds, "train_wall_seconds": train_wall,
        "reward": [(m["step"], m["reward"]) for m in result.metrics if "reward" in m],
        "train_reverse_kl": [(m["step"], m["reverse_kl"]) for m in result.metrics
                             if "reverse_kl" in m],
        "curve": curve, "spectral": spectral_table(final), "alignment": align,
        "norms": norms_by_layer(final), "rescale": rescale, "beta_sweep": sweep,
        "relative_update": total_norm(final) / total_norm(w0),
        "block_shapes": {n: list(d.shape) for n, d in final.items() if block_kind(n, d)},
    }


# --------------------------------------------------------------------------- report


def recovery(run: dict[str, Any], acc: float) -> float | None:
    """(acc − base) / (final − base), None when the run gained under 2 points (noise)."""
    base, last = run["curve"][0]["accuracy"], run["curve"][-1]["accuracy"]
    if last - base < 0.02:
        return None
    return (acc - base) / (last - base)


def _describe(models: dict[str, Any]) -> str:
    if models["source"].startswith("fresh"):
        return "a fresh tiny model (--quick: 100 pretraining steps; teacher 100 more)"
    acc = models.get("zoo_accuracies", {})
    return (f"the zoo's `{models['size']}` same-base pair (base {acc.get('student', 0):.1%}, "
            f"teacher {acc.get('teacher', 0):.1%} on the full test split)")


def _fmt(x: float | None, spec: str = "{:.2f}") -> str:
    return "—" if x is None else spec.format(x)


def _pct(x: float | None) -> str:
    return "—" if x is None else f"{x:.1%}"


def per_method_rows(runs: dict[str, Any], names: list[str], key: str, labels: list[str],
                    cells: Any) -> list[list[str]]:
    """One row per label: the label, then ``cells(method, runs[method][key][i])`` per method."""
    return [[label, *[x for m in names for x in cells(m, runs[m][key][i])]]
            for i, label in enumerate(labels)]


def intro(results: dict[str, Any], names: list[str]) -> list[str]:
    """What ran, how it is measured, and each run's start and end."""
    c, runs = results["config"], results["runs"]
    rows = [[m.upper(), f"{runs[m]['curve'][0]['accuracy']:.1%}",
             f"{runs[m]['curve'][-1]['accuracy']:.1%}",
             f"{runs[m]['curve'][0]['reverse_kl']:.4f}", f"{runs[m]['curve'][-1]['reverse_kl']:.4f}",
             f"{runs[m]['relative_update']:.2e}", f"{runs[m]['train_seconds']:.0f}"]
            for m in names]
    return [
        "# Update geometry: OPD vs RL on the embedded arithmetic task",
        "",
        f"Student: {_describe(results['models'])} "
        f"({results['models']['params']:,} parameters, Qwen2 shape), task "
        f"`{results['models']['task']}`; OPD "
        f"(`{METHODS['opd']['loss']}`) and RL (`drgrpo`, Dr. GRPO on exact match, "
        f"{c['rl_batch_size']} prompts × {c['rl_samples']} samples per step) from the same "
        f"student for {c['steps']} steps each (OPD: {c['batch_size']} prompts × 1 sample), AdamW "
        f"lr {c['lr']:g} with {c['warmup']} warmup steps, seed {c['seed']}, one seed. "
        f"Accuracy: greedy exact match on {c['eval_size']} held-out problems (±"
        f"{100 * math.sqrt(0.25 / c['eval_size']):.1f} points at most, one standard error). "
        f"Reverse KL: to the teacher, teacher-forced on {c['kl_size']} fixed rollouts of the base."
        f" Machine: {results['machine'].get('cpu_model')}, {results['machine']['cpu_count']} "
        f"cores (shared); {results['elapsed_seconds']:.0f}s in all.",
        "",
        markdown_table(["run", "acc start", "acc end", "KL start", "KL end",
                        "‖ΔW‖/‖W0‖", "train s"], rows)]


def spectral_section(results: dict[str, Any], names: list[str]) -> list[str]:
    runs, ref = results["runs"], results["random_reference"]
    keys = [("sigma1", "σ1", "{:.4f}"), ("spectral_ratio", "σ1/‖ΔW‖F", "{:.1%}"),
            ("effective_rank", "effective rank", "{:.1f}"),
            ("effective_rank_fraction", "effective rank / min(m, n)", "{:.1%}"),
            ("top1pct_ratio", "top-1% ratio", "{:.1%}"), ("top10pct_ratio", "top-10% ratio",
                                                           "{:.1%}")]
    rows = []
    for key, label, fmt in keys:
        for group in ("all", "attn", "mlp"):
            row = [label if group == "all" else f"  {group}"]
            row += [fmt.format(runs[m]["spectral"][group][key]) for m in names]
            row.append("—" if key == "sigma1" else fmt.format(ref["spectral"][group][key]))
            rows.append(row)
    return ["", "## Table 1: spectrum of the final update ΔW = W_T − W_0", "",
            "Mean over the 2-D attention (q, k, v, o) and MLP (gate, up, down) weight matrices "
            "of every layer, as the paper's Table 1. The matrices here have rank ≤ 64, so the "
            "top-1% ratio keeps k = ⌈0.01·r⌉ = 1 direction and equals σ1/‖ΔW‖F; the top-10% "
            "ratio (k = 4–7) is added. The last column is Gaussian noise of the same shapes.",
            "", markdown_table(["metric (all / attn / mlp)", *[m.upper() for m in names],
                                "Gaussian"], rows)]


def alignment_section(results: dict[str, Any], names: list[str]) -> list[str]:
    runs, c = results["runs"], results["config"]
    rows = []
    for i, item in enumerate(runs[names[0]]["alignment"]):
        row = [f"{item['step']} ({item['fraction']:.0%})"]
        for m in names:
            al = runs[m]["alignment"][i]
            row += [f"{al['all']:.3f}", f"{al['attn']:.3f}", f"{al['mlp']:.3f}",
                    f"{al['cos_flat']:.3f}"]
        rows.append(row)
    head = ["step"] + [f"{m.upper()} {g}" for m in names for g in ("all", "attn", "mlp", "flat")]
    return ["", f"## Subspace alignment with the final update (top-{c['align_k']} directions)",
            "",
            "|cos| between the i-th left singular vectors of ΔW_t and ΔW_T, averaged over "
            f"i ≤ {c['align_k']} and over the block matrices (the paper's Fig. 4b); `flat` is "
            "the cosine between the whole flattened updates. Two independent Gaussian matrices "
            f"of the same shapes give {results['random_reference']['alignment']['all']:.3f}.", "",
            markdown_table(head, rows)]


def norms_section(results: dict[str, Any], names: list[str]) -> list[str]:
    runs = results["runs"]
    groups = list(runs[names[0]]["norms"]["norms"])
    rows = [[g, *[f"{runs[m]['norms']['norms'][g]:.4f} ({runs[m]['norms']['share'][g]:.1%})"
                  for m in names]] for g in groups]
    rows.append(["total", *[f"{runs[m]['norms']['total']:.4f}" for m in names]])
    return ["", "## Update norms by module (A.6)", "",
            "‖ΔW‖F of the final update per layer and module type, and its share of the whole "
            "update's squared norm.", "",
            markdown_table(["module", *[f"{m.upper()} ‖ΔW‖F (share)" for m in names]], rows)]


def rescale_section(results: dict[str, Any], names: list[str]) -> list[str]:
    runs, c = results["runs"], results["config"]

    def rescaled(m: str, r: dict[str, Any]) -> list[str]:
        raw = next(p for p in runs[m]["curve"] if p["step"] == r["step"])
        return [f"{raw['accuracy']:.1%} ({_pct(recovery(runs[m], raw['accuracy']))})",
                f"{r['accuracy']:.1%} ({_pct(recovery(runs[m], r['accuracy']))})",
                f"{raw['reverse_kl']:.4f} → {r['reverse_kl']:.4f}", _fmt(r["norm_ratio_before"])]

    rows = per_method_rows(runs, names, "rescale", [f"{f:.0%}" for f in c["early_fractions"]],
                           rescaled)
    head = ["checkpoint"]
    for m in names:
        head += [f"{m.upper()} acc as is (recovery)", f"{m.upper()} acc rescaled (recovery)",
                 f"{m.upper()} KL as is → rescaled", f"{m.upper()} ‖ΔW_early‖/‖ΔW_T‖"]
    sweep = per_method_rows(runs, names, "beta_sweep", [f"{b:g}" for b in c["beta_values"]],
                            lambda m, r: [f"{r['accuracy']:.1%}", f"{r['reverse_kl']:.4f}",
                                          _fmt(r["norm_ratio_to_final"])])
    return ["", "## Early checkpoints rescaled to the final norm (A.7, Fig. 4c)", "",
            "ΔW_early per parameter tensor rescaled to the final update's norm "
            "(`geometry.rescale_updates`, β = 1), applied to W_0. Recovery is (acc − acc_0) / "
            "(acc_T − acc_0); it is omitted when the run itself gained under 2 points.", "",
            markdown_table(head, rows),
            "", f"β sweep at the {c['early_fractions'][0]:.0%} checkpoint (β = 0: as is; β = 1: "
            "the final norm):", "",
            markdown_table(["β"] + [f"{m.upper()} {x}" for m in names
                                    for x in ("acc", "KL", "‖ΔW‖/‖ΔW_T‖")], sweep)]


def report(a: argparse.Namespace, results: dict[str, Any]) -> str:
    names = [m for m in ("opd", "rl") if m in results["runs"]]
    if "random_reference" not in results:  # between the runs
        return f"# Update geometry: in progress ({', '.join(names) or 'no run'} done)"
    return "\n".join([*intro(results, names), *spectral_section(results, names),
                      *alignment_section(results, names), *norms_section(results, names),
                      *rescale_section(results, names), "", "## Reading", "",
                      *findings(results)])


def findings(results: dict[str, Any]) -> list[str]:
    """Plain comparisons computed from the numbers above (no hand-written verdicts)."""
    runs = results["runs"]
    if not {"opd", "rl"} <= set(runs):
        return ["- Only one method ran."]
    o, r = runs["opd"], runs["rl"]
    so, sr = o["spectral"]["all"], r["spectral"]["all"]
    out = []
    stalled = [m.upper() for m in ("opd", "rl")
               if runs[m]["curve"][-1]["accuracy"] - runs[m]["curve"][0]["accuracy"] < 0.02]
    if stalled:
        out.append(
            f"- **{' and '.join(stalled)} did not raise held-out accuracy by 2 points in "
            f"{results['config']['steps']} steps.** The paper analyses trained models; an update "
            "that has not improved the model measures the optimizer's path more than what "
            "distillation (or RL) learned, so read the comparisons below with that in mind.")
    out += [
        f"- σ1/‖ΔW‖F: OPD {so['spectral_ratio']:.1%} vs RL {sr['spectral_ratio']:.1%}; effective "
        f"rank OPD {so['effective_rank']:.1f} vs RL {sr['effective_rank']:.1f} (the paper: OPD "
        "has the higher ratio and the lower effective rank at every size). Here OPD's update is "
        + ("lower-rank than RL's" if so["effective_rank"] < sr["effective_rank"]
           and so["spectral_ratio"] > sr["spectral_ratio"] else
           "not uniformly lower-rank than RL's") + ".",
    ]
    n_early = max(1, sum(x["fraction"] <= 0.3 + 1e-9 for x in o["alignment"]))
    ao = sum(x["all"] for x in o["alignment"][:n_early]) / n_early
    ar = sum(x["all"] for x in r["alignment"][:n_early]) / n_early
    out.append(
        f"- Mean top-{results['config']['align_k']} alignment with the final update over the "
        f"first {n_early} checkpoints (≤ 30% of training): OPD {ao:.3f} vs RL {ar:.3f} "
        f"(Gaussian {results['random_reference']['alignment']['all']:.3f}); the paper reports "
        "OPD much more aligned early. Here OPD is "
        + ("more" if ao > ar else "not more") + " aligned early.")
    mlp = [(m, sum(v * v for g, v in runs[m]["norms"]["norms"].items() if g.endswith(".mlp")),
            sum(v * v for g, v in runs[m]["norms"]["norms"].items() if g.endswith(".attn")))
           for m in ("opd", "rl")]
    out.append("- Share of the block update's squared norm in the MLPs: "
               + ", ".join(f"{m.upper()} {a / (a + b):.1%}" for m, a, b in mlp if a + b > 0) + ".")
    for m in ("opd", "rl"):
        first = runs[m]["rescale"][0]
        rec = recovery(runs[m], first["accuracy"])
        out.append(
            f"- {m.upper()}: the {first['fraction']:.0%} checkpoint rescaled to the final norm "
            f"scores {first['accuracy']:.1%} (final {runs[m]['curve'][-1]['accuracy']:.1%}, "
            f"base {runs[m]['curve'][0]['accuracy']:.1%}"
            + (f"; recovery {rec:.0%}" if rec is not None else "; the run gained < 2 points")
            + ("; the paper: about 80% of the final performance" if m == "opd" else "")
            + ").")
    out.append("- One seed, a 0.13M-parameter model with 2 layers: the depth profile (A.6) has "
               "two points, and these are not the paper's conditions (1.5B–14B, lr 1e-6).")
    return out


COLORS = {"opd": "tab:blue", "rl": "tab:red"}


def plot_alignment(results: dict[str, Any], names: list[str], axes: Any) -> None:
    runs = results["runs"]
    for m in names:
        st = [0] + [x["step"] for x in runs[m]["alignment"]]
        for g, ls in (("all", "-"), ("attn", ":"), ("mlp", "--")):
            vals = [float("nan")] + [x[g] for x in runs[m]["alignment"]]
            axes[0].plot(st, vals, ls, color=COLORS[m], marker="." if g == "all" else None,
                         label=f"{m.upper()} {g}")
        axes[1].plot([p["step"] for p in runs[m]["curve"]],
                     [p["accuracy"] for p in runs[m]["curve"]], marker=".", color=COLORS[m],
                     label=m.upper())
    axes[0].axhline(results["random_reference"]["alignment"]["all"], color="gray", ls=":",
                    label="Gaussian")
    axes[0].set_xlabel("step")
    axes[0].set_ylabel(f"top-{results['config']['align_k']} alignment with ΔW_T")
    axes[0].set_ylim(0, 1.02)
    axes[0].legend(fontsize=7, ncol=2)
    axes[1].set_xlabel("step")
    axes[1].set_ylabel("greedy held-out accuracy")
    axes[1].legend()


def plot_norms(results: dict[str, Any], names: list[str], axes: Any) -> None:
    runs, ax = results["runs"], axes[0]
    groups = [g for g in runs[names[0]]["norms"]["norms"] if g.startswith("layer")]
    width = 0.8 / len(names)
    for i, m in enumerate(names):
        ax.bar([x + i * width for x in range(len(groups))],
               [runs[m]["norms"]["norms"][g] for g in groups], width, color=COLORS[m],
               label=m.upper())
    ax.set_xticks([x + width * (len(names) - 1) / 2 for x in range(len(groups))], groups)
    ax.set_ylabel("‖ΔW_T‖F")
    ax.set_title("final update norm by layer and module")
    ax.legend()


def plot_rescale(results: dict[str, Any], names: list[str], axes: Any) -> None:
    runs = results["runs"]
    for m in names:
        sw = runs[m]["beta_sweep"]
        axes[0].plot([x["beta"] for x in sw], [x["accuracy"] for x in sw], marker="o",
                     color=COLORS[m], label=m.upper())
        axes[0].axhline(runs[m]["curve"][-1]["accuracy"], color=COLORS[m], ls=":", lw=0.8)
        fr = [x["fraction"] for x in runs[m]["rescale"]]
        axes[1].plot(fr, [x["accuracy"] for x in runs[m]["rescale"]], marker="o",
                     color=COLORS[m], label=f"{m.upper()} rescaled")
        raw = {p["step"]: p["accuracy"] for p in runs[m]["curve"]}
        axes[1].plot(fr, [raw[x["step"]] for x in runs[m]["rescale"]], marker="x", ls="--",
                     color=COLORS[m], label=f"{m.upper()} as is")
    axes[0].set_xlabel(f"β (checkpoint at {results['config']['early_fractions'][0]:.0%})")
    axes[0].set_ylabel("greedy accuracy (dotted: final)")
    axes[0].legend()
    axes[1].set_xlabel("checkpoint (fraction of training)")
    axes[1].set_ylabel("greedy accuracy")
    axes[1].legend(fontsize=8)


def plot(a: argparse.Namespace, results: dict[str, Any]) -> None:
    names = [m for m in ("opd", "rl") if m in results["runs"]]
    if not names:
        return
    for kind, draw, cols, width in (("alignment", plot_alignment, 2, 5), ("norms", plot_norms, 1, 7),
                                    ("rescale", plot_rescale, 2, 5)):
        with harness.figure(Path(a.out) / f"{a.stem}_{kind}.png", cols,
                            panel=(width, 3.8)) as (_, axes):
            draw(results, names, axes[0])


# --------------------------------------------------------------------------- the study


def prepare(a: argparse.Namespace, store: harness.Store) -> tuple[Any, ...]:
    """The models (the zoo pair, or fresh ones for --smoke) and the task."""
    from lookahead_opd.integrations.opd.tasks import load_task

    a.start = time.perf_counter()
    tokenizer, student, teacher, models = load_models(a)
    models["params"] = sum(p.numel() for p in student.parameters())
    store.data["models"] = models
    return tokenizer, student, teacher, load_task(a.task)


def measure(a: argparse.Namespace, store: harness.Store, ctx: Any) -> None:
    """Gaussian noise of the runs' shapes: what 'no structure' reads as."""
    shapes = {n: tuple(s) for n, s in store.runs["opd"]["block_shapes"].items()}
    store.data["random_reference"] = random_reference(shapes, a.align_k, a.seed)
    store.data["elapsed_seconds"] = time.perf_counter() - a.start


STUDY = harness.Study(
    STEM, __doc__, report, options=options, smoke=SMOKE, configure=configure,
    private=("early", "betas", "start"), prepare=prepare,
    jobs=lambda a, store, ctx: [(m, m) for m in METHODS],
    run=lambda a, ctx, method: run_method(a, method, *ctx), measure=measure, plot=plot)
main = STUDY.main

if __name__ == "__main__":
    raise SystemExit(main())
