"""Build the real model's RL-near teacher (issue 30, item 4): SmolLM2-135M-Instruct (the
``smollm2-135m-gguf`` source) trained by Dr. GRPO on its own rewards on the word-problem task,
in its top ``--blocks`` decoder blocks only, stored as a delta of those blocks.

    OMP_NUM_THREADS=1 python -m benchmarks.real_teacher            # run again to continue

Every phase is resumable and writes ``<out>/state.json`` after each step it completes:
0. ``warmup``: ``--sft_steps`` of SFT on gold solutions in the same blocks (the base's
   ~10% leaves most 4-sample groups without a correct sample, so no signal); 0 skips it;
1. ``rl``: ``lookahead-opd train --loss drgrpo`` from there (a checkpoint every step,
   ``--resume``);
2. ``measure``: base and teacher greedy accuracy on ``--eval_size`` test problems and
   ``‖T−B‖/‖B‖``;
3. ``sft``: the reference, the base SFT'd in the same blocks until its probe accuracy reaches
   the teacher's (``‖T_sft−B‖/‖B‖``), as the zoo's ``rl`` pairs are judged (``rl_rejections``);
4. ``delta``: the changed tensors (``write_delta``, ≤30 MB for 2 blocks in float32) to
   ``benchmarks/results/real_teacher/smollm2-135m-rl.safetensors`` with ``build.json``; any
   machine rebuilds the teacher with ``apply_delta("smollm2-135m-gguf", delta, folder)``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

BASE = "smollm2-135m-gguf"
RESULTS = Path(__file__).parent / "results" / "real_teacher"
DELTA = RESULTS / "smollm2-135m-rl.safetensors"
logger = logging.getLogger("real_teacher")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="runs/real-teacher")
    ap.add_argument("--task", default="wordproblems")
    ap.add_argument("--blocks", type=int, default=2)
    ap.add_argument("--lr", type=float, default=5e-5)
    ap.add_argument("--sft_steps", type=int, default=10)
    # zoo.pretrain warms its lr up linearly over 50 steps: 10 steps end at a fifth of this.
    ap.add_argument("--warmup_lr", type=float, default=3e-4)
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--batch_size", type=int, default=8)
    ap.add_argument("--num_samples", type=int, default=4)
    ap.add_argument("--eval_size", type=int, default=200)
    ap.add_argument("--sft_lr", type=float, default=2e-5)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    state_path = out / "state.json"
    state = json.loads(state_path.read_text()) if state_path.is_file() else {}
    state["args"] = vars(args)

    def save() -> None:
        tmp = state_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(state, indent=2))
        os.replace(tmp, state_path)

    start_model = BASE
    if args.sft_steps:
        start_model = str(out / "warm")
        if not state.get("warmup_done"):
            _sft_warmup(args, Path(start_model))
            state["warmup_done"] = True
            save()
    rl_dir = out / "rl"
    if not state.get("rl_done"):
        cmd = [sys.executable, "-m", "lookahead_opd.cli", "train", "--student", start_model,
               "--teacher", BASE, "--task", args.task, "--loss", "drgrpo",
               "--num_samples", str(args.num_samples), "--batch_size", str(args.batch_size),
               "--train_top_blocks", str(args.blocks), "--learning_rate", str(args.lr),
               "--max_steps", str(args.steps), "--eval_every", "20", "--eval_size", "64",
               "--gate_size", "8", "--save_every", "1", "--seed", str(args.seed),
               "--output_dir", str(rl_dir), "--no_progress"]
        if any(rl_dir.glob("checkpoint-*")):
            cmd.append("--resume")
        logger.info("rl: %s", " ".join(cmd))
        done = subprocess.run(cmd)
        if done.returncode != 0:
            return done.returncode
        state["rl_done"] = True
        save()
    teacher_dir = rl_dir / (rl_dir / "latest").read_text().strip()

    import torch
    from lookahead_opd.integrations.model_sources import resolve_model, write_delta
    from lookahead_opd.integrations.opd.engines import HFEngine
    from lookahead_opd.integrations.opd.scoring import greedy_accuracy
    from lookahead_opd.integrations.opd.sharding import train_top_blocks
    from lookahead_opd.integrations.opd.tasks import load_task, with_chat_template
    from lookahead_opd.integrations.opd.zoo import pretrain, weight_distance
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(1)
    base_dir = resolve_model(BASE)
    tok = AutoTokenizer.from_pretrained(base_dir)
    task = with_chat_template(load_task(args.task), tok)
    test = task.problems("test", args.eval_size, seed=args.seed)

    def accuracy(model) -> float:
        return greedy_accuracy(HFEngine(model, tok, batch_size=16), task, test,
                               task.max_new_tokens)

    base = AutoModelForCausalLM.from_pretrained(base_dir).eval()
    if "teacher_accuracy" not in state:
        teacher = AutoModelForCausalLM.from_pretrained(teacher_dir).eval()
        state["base_accuracy"] = accuracy(base)
        state["teacher_accuracy"] = accuracy(teacher)
        state["teacher_distance"] = weight_distance(teacher, base)
        save()
        logger.info("measure: base %.3f teacher %.3f distance %.4g", state["base_accuracy"],
                    state["teacher_accuracy"], state["teacher_distance"])
    if "sft_distance" not in state:
        sft = AutoModelForCausalLM.from_pretrained(base_dir)
        train_top_blocks(sft, args.blocks)
        start = time.perf_counter()
        reached: list[float] = []

        def stop(model) -> bool:
            reached.append(accuracy(model.eval()))
            model.train()
            logger.info("sft: probe accuracy %.3f", reached[-1])
            return reached[-1] >= state["teacher_accuracy"]

        steps = pretrain(sft, tok, task, steps=400, batch_size=8, lr=args.sft_lr,
                         seed=args.seed, stop=stop, eval_every=20, progress=False, desc="sft")
        state.update(sft_steps=steps, sft_accuracy=reached[-1] if reached else None,
                     sft_distance=weight_distance(sft, base),
                     sft_seconds=time.perf_counter() - start)
        save()
    names = write_delta(teacher_dir, BASE, DELTA)
    gain = state["teacher_accuracy"] - state["base_accuracy"]
    ratio = state["teacher_distance"] / state["sft_distance"]
    state.update(delta_tensors=len(names), delta_bytes=DELTA.stat().st_size, gain=gain,
                 distance_ratio=ratio, accepted=gain >= 0.15 and ratio <= 0.5)
    save()
    (RESULTS / "build.json").write_text(json.dumps({
        "command": "OMP_NUM_THREADS=1 python -m benchmarks.real_teacher " + " ".join(
            f"--{k} {v}" for k, v in vars(args).items()),
        "base": BASE, **{k: v for k, v in state.items() if k != "args"}}, indent=2))
    logger.info("delta: %d tensors, %.1f MB; gain %.3f, distance ratio %.3f, accepted %s",
                len(names), DELTA.stat().st_size / 1e6, gain, ratio, state["accepted"])
    return 0


def _sft_warmup(args: argparse.Namespace, out: Path) -> None:
    """``args.sft_steps`` steps of SFT on gold solutions in the top ``args.blocks`` blocks,
    saved (with the tokenizer) to ``out``."""
    import torch
    from lookahead_opd.integrations.model_sources import resolve_model
    from lookahead_opd.integrations.opd.sharding import train_top_blocks
    from lookahead_opd.integrations.opd.tasks import load_task, with_chat_template
    from lookahead_opd.integrations.opd.zoo import pretrain
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    base_dir = resolve_model(BASE)
    tok = AutoTokenizer.from_pretrained(base_dir)
    model = AutoModelForCausalLM.from_pretrained(base_dir)
    train_top_blocks(model, args.blocks)
    logger.info("warmup: %d SFT steps at lr %g", args.sft_steps, args.warmup_lr)
    pretrain(model, tok, with_chat_template(load_task(args.task), tok), steps=args.sft_steps,
             batch_size=8, lr=args.warmup_lr, seed=args.seed, progress=False, desc="warmup")
    model.requires_grad_(True)
    model.save_pretrained(out)
    tok.save_pretrained(out)


if __name__ == "__main__":
    sys.exit(main())
