"""Build the real model's RL-near teacher (issue 30, item 4): SmolLM2-135M-Instruct (the
``smollm2-135m-gguf`` source) trained by Dr. GRPO on its own rewards on the word-problem task,
through a rank-``--rank`` LoRA on every decoder block, stored as the adapter's factors.

    OMP_NUM_THREADS=1 python -m benchmarks.builders.real_teacher   # run again to continue

Why LoRA: full training moves this model far in a few steps (SFT, lr 5e-5: 3% → 58% greedy
accuracy in 20 steps of 8 problems), its top two blocks alone barely (5% → 12% in 60 steps at
lr 3e-4), and a full-model delta is the whole 538 MB model. A rank-16 LoRA on every block
learned like full training (5% → 52% in 30 SFT steps at lr 5e-4) and is ~20 MB; LoRA is known
to match full training for RL (Schulman et al., "LoRA Without Regret", 2025).

Why one-step problems (``TASK``, ``wordproblems:steps=1``, which the real-model study then
uses): RL could not start on the two-step default. The base's samples there were right 2–9%
of the time, most groups of 8 held no correct sample, and the policy drifted without learning
(``attempt-*-metrics.jsonl``: 10 steps at lr 2e-4 with and without 20 SFT steps first, 9 at lr
5e-4; the sampled-token KL to the base 0 → 0.19). Nor did one-step skill carry over: RL on
one-step prompts alone learned to stop after one operation (0 of 64 two-step problems right),
and on a 1–2-step mix (``--rl_task wordproblems:min_steps=1``) the completions collapsed to
~25 tokens in 12 steps with the reward at 5–16%. On one-step problems the base is right 22.5%
of the time and Dr. GRPO climbs at once (sampled reward 9% → 61% by step 17).

Why lr 1e-4 for 40 steps (the defaults: the committed ``build.json``): at lr 5e-4, 19 steps
reached 74.5% but 0.91× the distance of the SFT teacher of equal accuracy
(``attempt-steps1-lr5e-4-build.json``: rejected); at 1e-4, 40 steps reached 83.5% at 0.43× the
distance of SFT at the same lr (accepted). The SFT reference takes the RL lr, so that only the
training signal differs between the two.

Every phase is resumable and writes ``<out>/state.json`` after each phase it completes:
0. ``warm-up``: ``--warmup_sft`` SFT steps on gold solutions through the same LoRA (0 by
   default; the issue's "a few SFT steps first if rewards are too sparse"); they count in the
   teacher's distance from the base;
1. ``rl``: the loop's ``OPDTrainer`` with ``loss="drgrpo"`` on the LoRA student, in process (a
   checkpoint every step; a rerun resumes), on ``--rl_task``'s prompts sampled at
   ``--temperature``;
2. ``measure``: the adapter to the package's delta (``DELTA``: ``src/lookahead_opd/integrations/weights``)
   (``write_lora_delta``), the teacher rebuilt from base + delta (``apply_delta``: what any
   machine gets), base and teacher greedy accuracy on ``--eval_size`` test problems and
   ``‖T−B‖/‖B‖``;
3. ``sft``: the reference, the base SFT'd through the same LoRA at ``--sft_lr`` until its
   probe accuracy reaches the teacher's; its ``‖T_sft−B‖/‖B‖`` at the teacher's accuracy is
   read off the probes by linear interpolation between the two that bracket it (the first
   probe past it would overstate the SFT teacher's distance by up to ``--sft_every`` steps'
   travel, in the RL teacher's favour); judged as the zoo's ``rl`` pairs are
   (``rl_rejections``: ≥15 points gained, at most half the SFT teacher's distance);
4. ``build.json`` beside the delta: the command, the numbers and the verdict.
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks import harness

BASE = harness.REAL_STUDENT
TASK = harness.REAL_TASK  # the studies' task: see the module docstring
RESULTS = Path(__file__).resolve().parents[1] / "results" / "real_teacher"  # the build's record
# The delta ships with the package: the named source smollm2-135m-rl is the base plus it.
DELTA = harness.REAL_DELTA
logger = logging.getLogger("real_teacher")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="runs/real-teacher", help="checkpoints and state")
    ap.add_argument("--task", default=TASK, help="the task the teacher is judged on")
    ap.add_argument("--rl_task", default=None,
                    help="the prompts RL trains on, when not --task's (a curriculum)")
    ap.add_argument("--rank", type=int, default=16, help="LoRA rank (alpha = 2 x rank)")
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--steps", type=int, default=40, help="RL steps")
    ap.add_argument("--batch_size", type=int, default=8)
    ap.add_argument("--num_samples", type=int, default=8)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--warmup_sft", type=int, default=0,
                    help="SFT steps through the same LoRA before RL (0: none)")
    # 64 rollouts' activations through 30 blocks in one backward took 21 GB: 8 rollouts at a time
    ap.add_argument("--grad_accum", type=int, default=8, help="micro-batches per step")
    ap.add_argument("--eval_every", type=int, default=10)
    ap.add_argument("--eval_size", type=int, default=200)
    ap.add_argument("--sft_lr", type=float, default=1e-4,
                    help="the SFT reference's lr (the RL lr: only the training signal differs)")
    ap.add_argument("--sft_every", type=int, default=10, help="SFT probe every N steps")
    ap.add_argument("--seed", type=int, default=0)
    return ap.parse_args(argv)


class Build:
    """The build's state (``<out>/state.json``, written after every phase), the base's
    tokenizer and task, and the models it loads."""

    def __init__(self, args: argparse.Namespace) -> None:
        from transformers import AutoTokenizer

        from lookahead_opd.integrations.model_sources import resolve_model
        from lookahead_opd.integrations.opd.tasks import load_task, with_chat_template

        self.args, self.out = args, Path(args.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.state_path = self.out / "state.json"
        self.state = json.loads(self.state_path.read_text()) if self.state_path.is_file() else {}
        if self.state.get("args", vars(args)) != vars(args):
            raise SystemExit(f"real_teacher: {self.out} was built with other options "
                             f"{self.state['args']}; rerun with those, or delete it to start over")
        self.state["args"] = vars(args)
        self.base_dir = resolve_model(BASE)
        self.tok = AutoTokenizer.from_pretrained(self.base_dir)
        self.task = with_chat_template(load_task(args.task), self.tok)
        self.test = self.task.problems("test", args.eval_size, seed=args.seed)

    def save(self) -> None:
        tmp = self.state_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.state, indent=2))
        os.replace(tmp, self.state_path)

    def load(self, folder: Any = None, rank: int = 0) -> Any:
        import torch
        from transformers import AutoModelForCausalLM

        from lookahead_opd.integrations.opd.lora import add_lora

        model = AutoModelForCausalLM.from_pretrained(folder or self.base_dir, dtype=torch.float32)
        if rank:
            add_lora(model, rank)
        return model

    def accuracy(self, model: Any) -> float:
        from lookahead_opd.integrations.opd.engines import HFEngine
        from lookahead_opd.integrations.opd.scoring import greedy_accuracy

        return greedy_accuracy(HFEngine(model.eval(), self.tok, batch_size=16), self.task,
                               self.test, self.task.max_new_tokens)


def warm_up(b: Build) -> Path:
    """0. ``--warmup_sft`` SFT steps through the LoRA (once); the adapter RL starts from."""
    import torch

    from lookahead_opd.demo.zoo import pretrain

    args, warm = b.args, b.out / "warm-lora.pt"
    if args.warmup_sft and not warm.is_file():
        torch.manual_seed(args.seed)
        model = b.load(rank=args.rank)
        pretrain(model, b.tok, b.task, steps=args.warmup_sft, batch_size=8, lr=args.sft_lr,
                 seed=args.seed, progress=False, desc="warm-up")
        torch.save({k: v for k, v in model.state_dict().items() if ".lora_" in k}, f"{warm}.tmp")
        os.replace(f"{warm}.tmp", warm)
    return warm


def rl(b: Build, warm: Path) -> None:
    """1. Dr. GRPO on the LoRA student, resumable from its checkpoints; the adapter to DELTA."""
    import torch

    from lookahead_opd.integrations.deltas import write_lora_delta
    from lookahead_opd.integrations.opd.config import OPDConfig
    from lookahead_opd.integrations.opd.engines import HFEngine
    from lookahead_opd.integrations.opd.tasks import load_task, with_chat_template
    from lookahead_opd.integrations.opd.trainer import OPDTrainer

    args = b.args
    torch.manual_seed(args.seed)
    policy, frozen = b.load(rank=args.rank), b.load()  # the teacher slot is only measured
    if args.warmup_sft:  # a resumed run's checkpoint replaces this
        if policy.load_state_dict(torch.load(warm), strict=False).unexpected_keys:
            raise SystemExit(f"real_teacher: {warm} is not this LoRA's adapter")
    config = OPDConfig(task=args.rl_task, loss="drgrpo", batch_size=args.batch_size,
                       num_samples=args.num_samples, temperature=args.temperature,
                       gradient_accumulation_steps=args.grad_accum,
                       learning_rate=args.lr, max_steps=args.steps, eval_every=args.eval_every,
                       eval_size=64, gate_size=8, save_every=1, seed=args.seed, resume=True,
                       output_dir=str(b.out / "rl"), progress=False)
    start = time.perf_counter()
    rl_task = with_chat_template(load_task(args.rl_task), b.tok)
    trainer = OPDTrainer(config, policy, frozen, rl_task,
                         HFEngine(policy, b.tok, batch_size=64), tokenizer=b.tok)
    trainer.train()
    write_lora_delta(policy, b.base_dir, DELTA)
    metrics = map(json.loads, (b.out / "rl" / "metrics.jsonl").read_text().splitlines())
    b.state.update(rl_done=True, rl_steps=trainer.step, rl_seconds=trainer.train_seconds,
                   rl_wall_this_call=time.perf_counter() - start,
                   rl_evals=[[m["step"], m["eval_accuracy"]] for m in metrics
                             if "eval_accuracy" in m])
    b.save()


def measure(b: Build, base: Any) -> None:
    """2. The teacher rebuilt from base + delta (what any machine gets): accuracies, distance."""
    from lookahead_opd.demo.zoo import weight_distance
    from lookahead_opd.integrations.deltas import apply_delta

    teacher = b.load(apply_delta(b.base_dir, DELTA, b.out / "teacher"))
    b.state.update(base_accuracy=b.accuracy(base), teacher_accuracy=b.accuracy(teacher),
                   teacher_distance=weight_distance(teacher, base),
                   delta_bytes=DELTA.stat().st_size)
    b.save()
    logger.info("measure: base %.3f teacher %.3f distance %.4g", b.state["base_accuracy"],
                b.state["teacher_accuracy"], b.state["teacher_distance"])


def sft_reference(b: Build, base: Any) -> None:
    """3. The base SFT'd through the same LoRA until its probe accuracy reaches the teacher's;
    its distance at that accuracy, read between the probes that bracket it."""
    from lookahead_opd.demo.zoo import pretrain, weight_distance
    from lookahead_opd.integrations.deltas import apply_delta, write_lora_delta
    from lookahead_opd.integrations.opd.lora import lora_deltas

    args, state = b.args, b.state
    sft = b.load(rank=args.rank)
    base_sq = sum(float(p.detach().double().pow(2).sum()) for p in base.parameters())
    reached: list[tuple[int, float, float]] = [(0, state["base_accuracy"], 0.0)]

    def stop(model: Any) -> bool:
        # Only the adapted weights move, each by up @ down: the merged model's distance.
        moved = sum(float((up.double() @ down.double()).pow(2).sum())
                    for up, down in lora_deltas(model).values())
        reached.append((len(reached) * args.sft_every, b.accuracy(model), (moved / base_sq) ** 0.5))
        model.train()
        logger.info("sft: step %d probe accuracy %.3f distance %.4g", *reached[-1])
        return reached[-1][1] >= state["teacher_accuracy"]

    start = time.perf_counter()
    steps = pretrain(sft, b.tok, b.task, steps=200, batch_size=8, lr=args.sft_lr, seed=args.seed,
                     stop=stop, eval_every=args.sft_every, progress=False, desc="sft")
    sft_delta = b.out / "sft.safetensors"
    write_lora_delta(sft, b.base_dir, sft_delta)
    merged = b.load(apply_delta(b.base_dir, sft_delta, b.out / "sft"))
    state.update(sft_steps=steps, sft_probes=reached, sft_accuracy=reached[-1][1],
                 sft_distance=equal_accuracy_distance(reached, state["teacher_accuracy"]),
                 sft_distance_at_stop=weight_distance(merged, base),
                 sft_seconds=time.perf_counter() - start)
    b.save()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.rl_task = args.rl_task or args.task
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    import torch

    from lookahead_opd.demo.zoo import rl_rejections

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    b = Build(args)
    warm = warm_up(b)
    if not b.state.get("rl_done"):
        rl(b, warm)
    base = b.load()
    if "teacher_accuracy" not in b.state:
        measure(b, base)
    if "sft_distance" not in b.state:
        sft_reference(b, base)
    state = b.state
    gain = state["teacher_accuracy"] - state["base_accuracy"]
    ratio = state["teacher_distance"] / state["sft_distance"]
    why = rl_rejections(state["base_accuracy"], state["teacher_accuracy"],
                        state["teacher_distance"], state["sft_distance"])
    state.update(gain=gain, distance_ratio=ratio, accepted=not why, rejections=why)
    b.save()
    (RESULTS / "build.json").write_text(json.dumps({
        "command": f"OMP_NUM_THREADS={torch.get_num_threads()} python -m "
                   "benchmarks.builders.real_teacher " + " ".join(
                       f"--{k} {v}" for k, v in vars(args).items()),
        "base": BASE, **{k: v for k, v in state.items() if k != "args"}}, indent=2) + "\n")
    logger.info("teacher: gain %+.3f, distance ratio %.3f, %s", gain, ratio,
                "accepted" if not why else f"rejected ({'; '.join(why)})")
    return 0


def equal_accuracy_distance(probes: list[tuple[int, float, float]], accuracy: float) -> float:
    """The distance at which the ``(step, accuracy, distance)`` probes (step 0 the base) first
    reach ``accuracy``, linear between the two probes that bracket it; the last probe's
    distance when none reaches it (the SFT teacher of equal accuracy is at least that far)."""
    for (_, a0, d0), (_, a1, d1) in itertools.pairwise(probes):
        if a1 >= accuracy:
            return d1 if a1 <= a0 else d0 + (d1 - d0) * max(0.0, accuracy - a0) / (a1 - a0)
    return probes[-1][2]


if __name__ == "__main__":
    sys.exit(main())
