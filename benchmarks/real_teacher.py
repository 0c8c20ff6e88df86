"""Build the real model's RL-near teacher (issue 30, item 4): SmolLM2-135M-Instruct (the
``smollm2-135m-gguf`` source) trained by Dr. GRPO on its own rewards on the word-problem task,
through a rank-``--rank`` LoRA on every decoder block, stored as the adapter's factors.

    OMP_NUM_THREADS=1 python -m benchmarks.real_teacher            # run again to continue

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
2. ``measure``: the adapter to ``benchmarks/results/real_teacher/smollm2-135m-rl.safetensors``
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

BASE = "smollm2-135m-gguf"
TASK = "wordproblems:steps=1"  # the study's task: see the module docstring
RESULTS = Path(__file__).parent / "results" / "real_teacher"  # the build's record
# The delta ships with the package: the named source smollm2-135m-rl is the base plus it.
DELTA = Path(__file__).resolve().parents[1] / "src/lookahead_opd/integrations/weights" / "smollm2-135m-rl.safetensors"
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


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.rl_task = args.rl_task or args.task
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from lookahead_opd.integrations.deltas import apply_delta, write_lora_delta
    from lookahead_opd.integrations.model_sources import resolve_model
    from lookahead_opd.integrations.opd.config import OPDConfig
    from lookahead_opd.integrations.opd.engines import HFEngine
    from lookahead_opd.integrations.opd.lora import add_lora, lora_deltas
    from lookahead_opd.integrations.opd.scoring import greedy_accuracy
    from lookahead_opd.integrations.opd.tasks import load_task, with_chat_template
    from lookahead_opd.integrations.opd.trainer import OPDTrainer
    from lookahead_opd.integrations.opd.zoo import pretrain, rl_rejections, weight_distance

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    state_path = out / "state.json"
    state = json.loads(state_path.read_text()) if state_path.is_file() else {}
    if state.get("args", vars(args)) != vars(args):
        raise SystemExit(f"real_teacher: {out} was built with other options {state['args']}; "
                         "rerun with those, or delete it to start over")
    state["args"] = vars(args)

    def save() -> None:
        tmp = state_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(state, indent=2))
        os.replace(tmp, state_path)

    base_dir = resolve_model(BASE)
    tok = AutoTokenizer.from_pretrained(base_dir)
    task = with_chat_template(load_task(args.task), tok)

    def load(folder=base_dir, rank: int = 0):
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        if rank:
            add_lora(model, rank)
        return model

    warm = out / "warm-lora.pt"  # the adapter after the SFT warm-up, where RL starts
    if args.warmup_sft and not warm.is_file():
        torch.manual_seed(args.seed)
        model = load(rank=args.rank)
        pretrain(model, tok, task, steps=args.warmup_sft, batch_size=8, lr=args.sft_lr,
                 seed=args.seed, progress=False, desc="warm-up")
        torch.save({k: v for k, v in model.state_dict().items() if ".lora_" in k}, f"{warm}.tmp")
        os.replace(f"{warm}.tmp", warm)
        del model
    if not state.get("rl_done"):
        torch.manual_seed(args.seed)
        policy, frozen = load(rank=args.rank), load()  # the teacher slot is only measured
        if args.warmup_sft:  # a resumed run's checkpoint replaces this
            if policy.load_state_dict(torch.load(warm), strict=False).unexpected_keys:
                raise SystemExit(f"real_teacher: {warm} is not this LoRA's adapter")
        config = OPDConfig(task=args.rl_task, loss="drgrpo", batch_size=args.batch_size,
                           num_samples=args.num_samples, temperature=args.temperature,
                           gradient_accumulation_steps=args.grad_accum,
                           learning_rate=args.lr, max_steps=args.steps, eval_every=args.eval_every,
                           eval_size=64, gate_size=8, save_every=1, seed=args.seed, resume=True,
                           output_dir=str(out / "rl"), progress=False)
        start = time.perf_counter()
        rl_task = with_chat_template(load_task(args.rl_task), tok)
        trainer = OPDTrainer(config, policy, frozen, rl_task,
                             HFEngine(policy, tok, batch_size=64), tokenizer=tok)
        trainer.train()
        write_lora_delta(policy, resolve_model(BASE), DELTA)
        state.update(rl_done=True, rl_steps=trainer.step, rl_seconds=trainer.train_seconds,
                     rl_wall_this_call=time.perf_counter() - start,
                     rl_evals=[[m["step"], m["eval_accuracy"]] for m in map(json.loads, (
                         out / "rl" / "metrics.jsonl").read_text().splitlines())
                               if "eval_accuracy" in m])
        save()
        del policy, frozen, trainer

    test = task.problems("test", args.eval_size, seed=args.seed)

    def accuracy(model) -> float:
        return greedy_accuracy(HFEngine(model.eval(), tok, batch_size=16), task, test,
                               task.max_new_tokens)

    base = load()
    if "teacher_accuracy" not in state:
        teacher_dir = apply_delta(resolve_model(BASE), DELTA, out / "teacher")
        teacher = load(teacher_dir)
        state.update(base_accuracy=accuracy(base), teacher_accuracy=accuracy(teacher),
                     teacher_distance=weight_distance(teacher, base),
                     delta_bytes=DELTA.stat().st_size)
        save()
        logger.info("measure: base %.3f teacher %.3f distance %.4g", state["base_accuracy"],
                    state["teacher_accuracy"], state["teacher_distance"])
    if "sft_distance" not in state:
        sft = load(rank=args.rank)
        base_sq = sum(float(p.detach().double().pow(2).sum()) for p in base.parameters())
        reached: list[tuple[int, float, float]] = [(0, state["base_accuracy"], 0.0)]

        def stop(model) -> bool:
            # Only the adapted weights move, each by up @ down: the merged model's distance.
            moved = sum(float((up.double() @ down.double()).pow(2).sum())
                        for up, down in lora_deltas(model).values())
            reached.append((len(reached) * args.sft_every, accuracy(model), (moved / base_sq) ** 0.5))
            model.train()
            logger.info("sft: step %d probe accuracy %.3f distance %.4g", *reached[-1])
            return reached[-1][1] >= state["teacher_accuracy"]

        start = time.perf_counter()
        steps = pretrain(sft, tok, task, steps=200, batch_size=8, lr=args.sft_lr, seed=args.seed,
                         stop=stop, eval_every=args.sft_every, progress=False, desc="sft")
        sft_delta = out / "sft.safetensors"
        write_lora_delta(sft, resolve_model(BASE), sft_delta)
        merged = load(apply_delta(resolve_model(BASE), sft_delta, out / "sft"))
        state.update(sft_steps=steps, sft_probes=reached, sft_accuracy=reached[-1][1],
                     sft_distance=equal_accuracy_distance(reached, state["teacher_accuracy"]),
                     sft_distance_at_stop=weight_distance(merged, base),
                     sft_seconds=time.perf_counter() - start)
        save()
    gain = state["teacher_accuracy"] - state["base_accuracy"]
    ratio = state["teacher_distance"] / state["sft_distance"]
    why = rl_rejections(state["base_accuracy"], state["teacher_accuracy"],
                        state["teacher_distance"], state["sft_distance"])
    state.update(gain=gain, distance_ratio=ratio, accepted=not why, rejections=why)
    save()
    (RESULTS / "build.json").write_text(json.dumps({
        "command": f"OMP_NUM_THREADS={torch.get_num_threads()} python -m benchmarks.real_teacher "
                   + " ".join(
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
