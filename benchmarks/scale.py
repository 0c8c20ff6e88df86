"""Scale study: does EffOPD pay off on a >= 50M-parameter student at a large batch and a small
learning rate, the regime of the paper (1024 prompts per step, lr 1e-6 on 1.5B+)?

The CPU benchmarks use ~0.4M-parameter models, where the update direction rotates and gated
jumps are rejected after step 8. Scale is the most likely reason the paper sees a straight path
where tiny models do not, so this script builds a larger model from scratch on one GPU, with no
downloaded weights:

1. pretrain a base (Qwen2 shape, ``--size``) on generated arithmetic until its held-out greedy
   accuracy is low (the student), within a time limit;
2. train the same base further into the teacher (the paper's teacher is the RL-tuned version of
   the student's own base), within a time limit;
3. for each learning rate: plain OPD and EffOPD (``ExtrapolatingOptimizer``) from the same
   student with the same seed, prompts and rollout seeds, through the real ``OPDTrainer``;
   record eval accuracy, reverse KL, accepted jumps, wall-clock (gate evals included), and how
   straight the plain path is: the cosine between successive secants
   ``W_{2^n} − W_{2^{n−1}}`` at the search steps 1, 2, 4, 8, …

Results are rewritten after every run (a time-out keeps what finished; ``--budget_s``, default
440 s for the whole study, skips the runs that would not fit). ``--smoke`` runs the same code on
CPU in a couple of minutes (tiny model, few steps).

    python -m benchmarks.scale --device cuda --out benchmarks/results   # one H200: ~5-7 minutes
    python -m benchmarks.scale --smoke --out /tmp/scale                  # CPU check of the pipeline
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

STEM = "scale"


# --------------------------------------------------------------------------- setup


def options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--size", default="large", help="zoo size of the base (large: ~69M params)")
    p.add_argument("--task", default="arithmetic:ops=+*,digits=2")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--pretrain-lr", type=float, default=5e-4)
    p.add_argument("--pretrain-batch", type=int, default=512)
    p.add_argument("--base-seconds", type=float, default=90.0, help="time limit of the base")
    p.add_argument("--teacher-seconds", type=float, default=120.0, help="time limit of the teacher")
    p.add_argument("--base-target", type=float, default=0.15, help="stop the base at this accuracy")
    p.add_argument("--teacher-target", type=float, default=0.97)
    p.add_argument("--batch-size", type=int, default=1024, help="prompts per OPD step")
    p.add_argument("--steps", type=int, default=128, help="OPD steps per run")
    p.add_argument("--lrs", default="1e-5,3e-5,3e-6", help="OPD learning rates, in run order")
    p.add_argument("--gate-size", type=int, default=256, help="neg_kl gate set size")
    p.add_argument("--eval-size", type=int, default=512)
    p.add_argument("--eval-every", type=int, default=8)
    p.add_argument("--no-paper-variant", dest="paper_variant", action="store_false",
                   help="skip the paper's EffOPD (accuracy gate on 50, linear 2k) at the first lr")


BUDGET_S = 440.0  # --budget_s: seconds for the whole study; runs that would not fit are skipped
# The smoke run: a tiny model, few steps, on the CPU.
SMOKE = dict(size="tiny", device="cpu", batch_size=32, steps=8, base_seconds=20.0,
             teacher_seconds=20.0, pretrain_lr=3e-3, pretrain_batch=128, gate_size=32,
             eval_size=64, eval_every=4, lrs="3e-4", task="arithmetic")


def configure(a: argparse.Namespace, p: argparse.ArgumentParser) -> None:
    a.budget_s = BUDGET_S if a.budget_s is None else a.budget_s


def lr_list(spec: str) -> list[float]:
    try:
        lrs = [float(x) for x in spec.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"--lrs must be comma-separated numbers, got {spec!r}") from None
    if not lrs or any(lr <= 0 for lr in lrs):
        raise SystemExit(f"--lrs must be positive numbers, got {spec!r}")
    return lrs


def build_models(a: argparse.Namespace, log: Any) -> tuple[Any, Any, Any, Any, dict[str, Any]]:
    """Base (the student) and teacher (the base trained further), each within a time limit."""
    from lookahead_opd.demo.zoo import make_model, pretrain
    from lookahead_opd.integrations.opd.scoring import model_accuracy as greedy_accuracy
    from lookahead_opd.integrations.opd.tasks import load_task
    from lookahead_opd.integrations.opd.tokenizer import char_tokenizer

    task = load_task(a.task)
    tokenizer = char_tokenizer()
    probe = task.problems("test", min(256, len(task.problems("test"))), seed=a.seed)
    test = task.problems("test", min(2000, len(task.problems("test"))), seed=a.seed + 1)
    model = make_model(tokenizer, a.size, a.seed).to(a.device)
    n_params = sum(p.numel() for p in model.parameters())
    log(f"base: {a.size}, {n_params / 1e6:.1f}M params, task {a.task}")

    def acc(m: Any, problems: list[Any]) -> float:
        return greedy_accuracy(m, tokenizer, task, problems, batch_size=1024)

    def until(target: float, seconds: float) -> Any:
        start = time.perf_counter()
        return lambda m: acc(m, probe) >= target or time.perf_counter() - start > seconds

    t0 = time.perf_counter()
    base_steps = pretrain(model, tokenizer, task, steps=100_000, batch_size=a.pretrain_batch,
                          lr=a.pretrain_lr, seed=a.seed, eval_every=10, progress=False,
                          stop=until(a.base_target, a.base_seconds))
    base_acc = acc(model, test)
    base_seconds = time.perf_counter() - t0
    log(f"base: {base_steps} steps, {base_seconds:.0f}s, test accuracy {base_acc:.1%}")
    student = copy.deepcopy(model)
    t1 = time.perf_counter()
    teacher_steps = pretrain(model, tokenizer, task, steps=100_000, batch_size=a.pretrain_batch,
                             lr=a.pretrain_lr, seed=a.seed + 1, eval_every=25, progress=False,
                             stop=until(a.teacher_target, a.teacher_seconds))
    teacher_acc = acc(model, test)
    teacher_seconds = time.perf_counter() - t1
    log(f"teacher: {teacher_steps} more steps, {teacher_seconds:.0f}s, test accuracy {teacher_acc:.1%}")
    info = {"size": a.size, "params": n_params, "task": a.task,
            "student_accuracy": base_acc, "teacher_accuracy": teacher_acc,
            "base_steps": base_steps, "teacher_extra_steps": teacher_steps,
            "base_seconds": base_seconds, "teacher_seconds": teacher_seconds}
    return task, tokenizer, student, model, info


# --------------------------------------------------------------------------- path geometry


class PathRecorder(harness.SecantProbe):
    """The harness's secant probe, plus the weights at every search step (0, 1, 2, 4, …), to
    compare each displacement from the start with the final one."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__(model)
        self.points: dict[int, torch.Tensor] = {}

    def __call__(self, metrics: dict[str, Any]) -> None:
        super().__call__(metrics)
        if not self.points and self.last is not None:  # step 0: the probe's first copy
            self.points[0] = self.last
        if self.norms and self.norms[-1][0] == metrics["step"]:
            self.points[metrics["step"]] = self.last

    def summary(self) -> dict[str, Any]:
        """Cosines between successive secants, and of each displacement with the last one."""
        steps = sorted(self.points)
        cos = torch.nn.functional.cosine_similarity
        norms = dict(self.norms)
        successive = [{"step": s, "cos_with_previous_secant": c, "norm": norms[s]}
                      for s, c in self.cosines]
        final = self.points[steps[-1]] - self.points[0]
        to_final = [{"step": s, "cos_displacement_with_final": float(cos(self.points[s] - self.points[0],
                                                                         final, dim=0))}
                    for s in steps[1:-1]]
        return {"secants": successive, "displacement_vs_final": to_final,
                "relative_displacement": float(final.norm() / self.points[0].norm())}


# --------------------------------------------------------------------------- one run


def run_opd(a: argparse.Namespace, task: Any, tokenizer: Any, student0: Any, teacher: Any, *,
            name: str, lr: float, extrapolate: bool, gate: str = "neg_kl", gate_size: int | None = None,
            coefficients: str = "geometric") -> dict[str, Any]:
    from lookahead_opd.demo.compare import run_variant

    config = harness.opd_config(
        STEM, name, task=a.task, batch_size=a.batch_size, max_steps=a.steps,
        learning_rate=lr, warmup_steps=0, optimizer="adamw", loss="reverse_kl_pg",
        max_grad_norm=1.0, extrapolate=extrapolate, gate=gate,
        gate_size=gate_size or a.gate_size, coefficients=coefficients, max_candidates=5,
        eval_every=a.eval_every, eval_size=a.eval_size, seed=a.seed, device=a.device,
        save_every=0)
    paths: list[PathRecorder] = []

    def record_path(model: Any) -> list[PathRecorder]:
        paths.append(PathRecorder(model))
        return paths

    run = run_variant(config, student0, teacher, task, tokenizer, engine_batch_size=2048,
                      callbacks=record_path)
    run.update(name=name, lr=lr, extrapolate=extrapolate, gate=gate if extrapolate else None,
               gate_size=(gate_size or a.gate_size) if extrapolate else None,
               coefficients=coefficients if extrapolate else None, path=paths[0].summary())
    return run


# --------------------------------------------------------------------------- summary


def first_step(points: list[tuple[int, float]], ok: Any) -> int | None:
    return next((s for s, v in points if ok(v)), None)


def summarize(run: dict[str, Any], target_acc: float, target_kl: float) -> dict[str, Any]:
    acc_step = first_step(run["evals"], lambda v: v >= target_acc)
    kl_step = first_step(run["reverse_kl"], lambda v: v <= target_kl)
    secs = run["train_seconds"]
    return {
        "steps_to_target_accuracy": acc_step,
        "seconds_to_target_accuracy": None if acc_step is None else secs.get(acc_step),
        "steps_to_half_kl": kl_step,
        "seconds_to_half_kl": None if kl_step is None else secs.get(kl_step),
        "final_accuracy": run["evals"][-1][1],
        "final_reverse_kl": run["reverse_kl"][-1][1] if run["reverse_kl"] else None,
        "accepted": [(j["step"], j["accepted"]) for j in run["jumps"] if j["accepted"] is not None],
        "searches": len(run["jumps"]),
    }


def ratio(plain: float | None, other: float | None) -> str:
    if plain is None or other is None or other == 0:
        return "—"
    return f"{plain / other:.2f}×"


def runs_of(results: dict[str, Any]) -> list[dict[str, Any]]:
    """The runs in the order they ran (a json before the harness's store kept them in a list)."""
    runs = results["runs"]
    return list(runs.values()) if isinstance(runs, dict) else runs


def summarize_runs(a: argparse.Namespace, results: dict[str, Any]) -> None:
    """Each run's summary against the targets, kept in the run."""
    for r in runs_of(results):
        r["summary"] = summarize(r, results["target_accuracy"], results["target_kl"])


def report(a: argparse.Namespace, results: dict[str, Any]) -> str:
    if not runs_of(results):
        return "# Scale study: no run yet"
    m = results["models"]
    lines = [
        f"# Scale study: OPD vs EffOPD on a {m['params'] / 1e6:.1f}M-parameter student",
        "",
        f"Machine: {results['machine'].get('gpu') or results['machine'].get('cpu_model')}; "
        f"task `{m['task']}`; student {m['student_accuracy']:.1%}, teacher "
        f"{m['teacher_accuracy']:.1%} greedy test accuracy; batch {results['config']['batch_size']} "
        f"prompts per step, AdamW, {results['config']['steps']} OPD steps per run, one seed.",
        f"Targets: accuracy ≥ {results['target_accuracy']:.1%} (0.9 × teacher); reverse KL on the "
        f"training rollouts ≤ {results['target_kl']:.4f} (half the initial). Wall-clock includes "
        "rollouts, scoring, updates and gate evals; measurement evals excluded.",
        "",
    ]
    rows = []
    by_lr: dict[float, dict[str, Any]] = {}
    for r in runs_of(results):
        s = r["summary"]
        plain = by_lr.setdefault(r["lr"], {}).get("opd")
        if not r["extrapolate"]:
            by_lr[r["lr"]]["opd"] = s
            plain = None
        rows.append([
            r["name"], f"{r['lr']:g}",
            s["steps_to_target_accuracy"] if s["steps_to_target_accuracy"] is not None else "not reached",
            s["steps_to_half_kl"] if s["steps_to_half_kl"] is not None else "not reached",
            "—" if plain is None else ratio(plain["steps_to_half_kl"], s["steps_to_half_kl"]),
            "—" if plain is None else ratio(plain["seconds_to_half_kl"], s["seconds_to_half_kl"]),
            f"{s['final_accuracy']:.1%}",
            f"{s['final_reverse_kl']:.4f}" if s["final_reverse_kl"] is not None else "—",
            "—" if not r["extrapolate"] else f"{len(s['accepted'])}/{s['searches']} "
            + " ".join(f"{st}:{c:g}" for st, c in s["accepted"]),
        ])
    lines.append(markdown_table(
        ["run", "lr", "steps to acc target", "steps to ½ KL", "speed-up (steps, ½ KL)",
         "speed-up (wall, ½ KL)", "final acc", "final KL", "jumps kept/searches (step:c)"], rows))
    lines += ["", "## How straight is the plain OPD path?", "",
              "Cosine between successive secants `W_2^n − W_2^(n−1)` (the direction EffOPD "
              "extrapolates) in the plain runs; 1 is a straight line.", ""]
    prow = []
    for r in runs_of(results):
        if r["extrapolate"]:
            continue
        cs = " ".join(f"{x['step']}:{x['cos_with_previous_secant']:.2f}" for x in r["path"]["secants"])
        prow.append([r["name"], f"{r['lr']:g}", cs, f"{r['path']['relative_displacement']:.2e}"])
    lines.append(markdown_table(["run", "lr", "cos(secant_n, secant_n−1) at step", "‖W_T − W_0‖/‖W_0‖"],
                                prow))
    if results.get("skipped"):
        lines += ["", f"Skipped for time: {', '.join(results['skipped'])}."]
    return "\n".join(lines)


def plot(a: argparse.Namespace, results: dict[str, Any]) -> None:
    if not runs_of(results):
        return
    lrs = sorted({r["lr"] for r in runs_of(results)})
    with harness.figure(Path(a.out) / f"{a.stem}.png", len(lrs), 2,
                        panel=(4.5, 3.25)) as (_, axes):
        for col, lr in enumerate(lrs):
            for r in (r for r in runs_of(results) if r["lr"] == lr):
                ax_acc, ax_kl = axes[0][col], axes[1][col]
                line, = ax_acc.plot(*zip(*r["evals"], strict=True), marker=".", label=r["name"])
                ax_kl.plot(*zip(*r["reverse_kl"], strict=True), color=line.get_color(), label=r["name"])
                for st, _c in r["summary"]["accepted"]:
                    ax_acc.axvline(st, color=line.get_color(), ls="--", alpha=0.4)
            axes[0][col].axhline(results["target_accuracy"], color="gray", ls=":")
            axes[0][col].set_title(f"lr {lr:g}")
            axes[0][col].set_ylabel("greedy test accuracy")
            axes[1][col].set_ylabel("reverse KL (train rollouts)")
            axes[1][col].set_yscale("log")
            axes[1][col].set_xlabel("OPD step")
            axes[0][col].legend(fontsize=7)


# --------------------------------------------------------------------------- the study


def plan(a: argparse.Namespace) -> list[dict[str, Any]]:
    """Per lr: plain OPD, EffOPD, and at the first lr the paper's EffOPD."""
    lrs, out = lr_list(a.lrs), []
    for lr in lrs:
        out.append(dict(name=f"opd lr={lr:g}", lr=lr, extrapolate=False))
        out.append(dict(name=f"effopd neg_kl lr={lr:g}", lr=lr, extrapolate=True))
        if a.paper_variant and lr == lrs[0]:
            out.append(dict(name=f"effopd paper lr={lr:g}", lr=lr, extrapolate=True,
                            gate="accuracy", gate_size=50, coefficients="linear"))
    return out


def prepare(a: argparse.Namespace, store: harness.Store) -> dict[str, Any]:
    """The models (built within their time limits), and the targets: the accuracy from the
    teacher, the KL from the first plain run's initial one."""
    ctx = {"start": time.perf_counter(), "longest": 0.0}

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - ctx['start']:6.0f}s] {msg}", flush=True)

    if a.device.startswith("cuda"):
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    ctx["task"], ctx["tokenizer"], ctx["student"], ctx["teacher"], models = build_models(a, log)
    store.data.update(models=models, skipped=[], target_kl=math.nan,
                      target_accuracy=0.9 * models["teacher_accuracy"])
    return ctx


def jobs(a: argparse.Namespace, store: harness.Store, ctx: dict[str, Any]) -> list[tuple[str, Any]]:
    """The plan's runs not done; none once the time left would not fit the longest run so far
    (those left are recorded as skipped)."""
    todo = [(item["name"], item) for item in plan(a) if item["name"] not in store.runs]
    remaining = a.budget_s - (time.perf_counter() - ctx["start"])
    if todo and remaining < 1.2 * ctx["longest"]:
        store.data["skipped"] = [name for name, _ in todo]
        print(f"skip {', '.join(store.data['skipped'])}: {remaining:.0f}s left, a run took up "
              f"to {ctx['longest']:.0f}s", flush=True)
        return []
    return todo


def run(a: argparse.Namespace, ctx: dict[str, Any], item: dict[str, Any]) -> dict[str, Any]:
    r = run_opd(a, ctx["task"], ctx["tokenizer"], ctx["student"], ctx["teacher"], **item)
    ctx["longest"] = max(ctx["longest"], r["wall_seconds"])
    return r


def measure(a: argparse.Namespace, store: harness.Store, ctx: dict[str, Any]) -> None:
    store.data["elapsed_seconds"] = time.perf_counter() - ctx["start"]


def summarize_all(a: argparse.Namespace, results: dict[str, Any]) -> None:
    first = next((r for r in runs_of(results) if r["reverse_kl"]), None)
    if math.isnan(results["target_kl"]) and first is not None:
        results["target_kl"] = 0.5 * first["reverse_kl"][0][1]
    summarize_runs(a, results)


STUDY = harness.Study(
    STEM, __doc__, report, options=options, uses=("threads", "budget"),
    devices=("cuda", "cpu") if torch.cuda.is_available() else ("cpu", "cuda"), smoke=SMOKE,
    configure=configure, prepare=prepare, jobs=jobs, run=run, measure=measure,
    summarize=summarize_all, plot=plot)
main = STUDY.main

if __name__ == "__main__":
    raise SystemExit(main())
