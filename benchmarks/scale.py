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

Results are rewritten after every run (a time-out keeps what finished). ``--smoke`` runs the
same code on CPU in a couple of minutes (tiny model, few steps).

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
from benchmarks.common import machine_info, markdown_table, previous_results, write_results

STEM = "scale"


# --------------------------------------------------------------------------- setup


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", default="benchmarks/results")
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
    p.add_argument("--time-budget", type=float, default=440.0,
                   help="seconds for the whole script; runs that would not fit are skipped")
    p.add_argument("--smoke", action="store_true", help="tiny model, few steps, CPU: checks the pipeline")
    p.add_argument("--stem", default=STEM, help="the results' file name (<stem>.json/.md/.png)")
    p.add_argument("--report-only", action="store_true", help="rewrite md/png from the json")
    a = p.parse_args(argv)
    if a.smoke:
        a.size, a.device, a.batch_size, a.steps = "tiny", "cpu", 32, 8
        a.base_seconds, a.teacher_seconds, a.pretrain_lr, a.pretrain_batch = 20.0, 20.0, 3e-3, 128
        a.gate_size, a.eval_size, a.eval_every, a.lrs = 32, 64, 4, "3e-4"
        a.task = "arithmetic"
    return a


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
    from lookahead_opd.integrations.opd.tasks import load_task
    from lookahead_opd.integrations.opd.tokenizer import char_tokenizer
    from lookahead_opd.integrations.opd.zoo import greedy_accuracy, make_model, pretrain

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
        self.points: dict[int, torch.Tensor] = {0: self.last}

    def __call__(self, metrics: dict[str, Any]) -> None:
        super().__call__(metrics)
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
            coefficients: str = "geometric", out_dir: Path) -> dict[str, Any]:
    from lookahead_opd.integrations.opd.compare import run_variant

    config = harness.opd_config(
        STEM, name, task=a.task, output_dir=str(out_dir / name), batch_size=a.batch_size, max_steps=a.steps,
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


def report(results: dict[str, Any]) -> str:
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
    for r in results["runs"]:
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
    for r in results["runs"]:
        if r["extrapolate"]:
            continue
        cs = " ".join(f"{x['step']}:{x['cos_with_previous_secant']:.2f}" for x in r["path"]["secants"])
        prow.append([r["name"], f"{r['lr']:g}", cs, f"{r['path']['relative_displacement']:.2e}"])
    lines.append(markdown_table(["run", "lr", "cos(secant_n, secant_n−1) at step", "‖W_T − W_0‖/‖W_0‖"],
                                prow))
    if results.get("skipped"):
        lines += ["", f"Skipped for time: {', '.join(results['skipped'])}."]
    return "\n".join(lines)


def plot(results: dict[str, Any], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    lrs = sorted({r["lr"] for r in results["runs"]})
    fig, axes = plt.subplots(2, len(lrs), figsize=(4.5 * len(lrs), 6.5), squeeze=False)
    for col, lr in enumerate(lrs):
        for r in (r for r in results["runs"] if r["lr"] == lr):
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
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    start = time.perf_counter()
    out = Path(a.out)
    if a.report_only:
        old = previous_results(out, a.stem)
        if old is None:
            raise SystemExit(f"scale: --report-only: no {a.stem}.json in {out}")
        write_results(str(out), a.stem, old, report(old))
        plot(old, out / f"{a.stem}.png")
        return 0
    out.mkdir(parents=True, exist_ok=True)
    work = Path("/tmp") / "lookahead-opd-scale"

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - start:6.0f}s] {msg}", flush=True)

    if a.device.startswith("cuda"):
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    device = torch.device(a.device)
    task, tokenizer, student, teacher, models = build_models(a, log)
    lrs = lr_list(a.lrs)
    plan: list[dict[str, Any]] = []
    for lr in lrs:
        plan.append(dict(name=f"opd lr={lr:g}", lr=lr, extrapolate=False))
        plan.append(dict(name=f"effopd neg_kl lr={lr:g}", lr=lr, extrapolate=True))
        if a.paper_variant and lr == lrs[0]:
            plan.append(dict(name=f"effopd paper lr={lr:g}", lr=lr, extrapolate=True,
                             gate="accuracy", gate_size=50, coefficients="linear"))
    results: dict[str, Any] = {
        "config": vars(a), "machine": machine_info(device), "models": models, "runs": [],
        "skipped": [],
    }
    # The targets come from the teacher and the first plain run's initial KL.
    results["target_accuracy"] = 0.9 * models["teacher_accuracy"]
    results["target_kl"] = math.nan
    longest = 0.0
    for item in plan:
        remaining = a.time_budget - (time.perf_counter() - start)
        if remaining < 1.2 * longest:
            results["skipped"].append(item["name"])
            log(f"skip {item['name']}: {remaining:.0f}s left, a run took up to {longest:.0f}s")
            continue
        log(f"run {item['name']}")
        run = run_opd(a, task, tokenizer, student, teacher, out_dir=work, **item)
        longest = max(longest, run["wall_seconds"])
        if math.isnan(results["target_kl"]) and run["reverse_kl"]:
            results["target_kl"] = 0.5 * run["reverse_kl"][0][1]
        results["runs"].append(run)
        for r in results["runs"]:
            r["summary"] = summarize(r, results["target_accuracy"], results["target_kl"])
        s = run["summary"]
        log(f"  {run['wall_seconds']:.0f}s, final acc {s['final_accuracy']:.1%}, final KL "
            f"{s['final_reverse_kl']:.4f}, ½-KL at step {s['steps_to_half_kl']}, accepted {s['accepted']}")
        results["elapsed_seconds"] = time.perf_counter() - start
        write_results(str(out), a.stem, results, report(results))
        plot(results, out / f"{a.stem}.png")
    print(report(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
