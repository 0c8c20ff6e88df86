"""``lookahead-opd train``: OPD (optionally EffOPD) on any Hugging Face causal LMs.

    lookahead-opd train --student Qwen/Qwen2.5-1.5B --teacher ./rl-tuned --task gsm8k:path=train.jsonl \\
        --learning_rate 1e-6 --extrapolate --gate accuracy --output_dir runs/gsm8k

Every option is a field of ``OPDConfig``; ``--config run.yaml`` fills them from a file.
Under ``torchrun --nproc-per-node N`` the ranks split each step's prompts, the gate and the
eval set, and stay identical.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from ..cli_support import quiet_loading_bars
from .config import OPDConfig, parse_config

__all__ = ["build_trainer", "main"]

def build_trainer(config: OPDConfig):
    """Validate, then load the models, the task and the engine, and return an ``OPDTrainer``."""
    config.validate()  # before any model loads
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .engines import make_engine
    from .tasks import load_task
    from .trainer import OPDTrainer

    _init_distributed(config)
    torch.manual_seed(config.seed)
    dtype = getattr(torch, config.dtype)  # validated: float32 | bfloat16 | float16
    task = load_task(config.task)
    tokenizer = AutoTokenizer.from_pretrained(config.student)
    if tokenizer.pad_token is None:  # decoder-only LMs often have none; batching needs one
        tokenizer.pad_token = tokenizer.eos_token
    student = AutoModelForCausalLM.from_pretrained(config.student, dtype=dtype).to(config.device)
    teacher = AutoModelForCausalLM.from_pretrained(config.teacher, dtype=dtype).to(config.device)
    if config.engine == "vllm":
        engine = make_engine("vllm", config.student, tokenizer, dtype=config.dtype, seed=config.seed,
                             gpu_memory_utilization=config.vllm_gpu_memory_utilization)
    else:
        engine = make_engine("hf", student, tokenizer)
    return OPDTrainer(config, student, teacher, task, engine, tokenizer=tokenizer)


def _init_distributed(config: OPDConfig) -> None:
    """Under ``torchrun`` (WORLD_SIZE > 1) join the process group: gloo on CPU, nccl on CUDA,
    one device per local rank. ``OPDTrainer`` then splits the work over the ranks."""
    import os

    import torch
    import torch.distributed as dist

    if int(os.environ.get("WORLD_SIZE", "1")) <= 1 or dist.is_initialized():
        return
    if config.device.startswith("cuda"):
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        config.device = f"cuda:{local}"
        dist.init_process_group("nccl")
    else:
        dist.init_process_group("gloo")


def main(argv: Sequence[str] | None = None) -> int:
    try:  # bad input: one clear line and status 2, before any model loads where it can be
        config = parse_config(argv)
        if not config.progress:
            quiet_loading_bars()
        trainer = build_trainer(config)
    except ValueError as err:
        print(f"lookahead-opd train: {err}", file=sys.stderr)
        return 2
    result = trainer.train()  # a failure while training keeps its traceback
    final = result.evals[-1][1] if result.evals else float("nan")
    if trainer.rank == 0:
        print(f"done: {trainer.step} steps, final eval accuracy {final:.1%}, "
              f"metrics in {config.output_dir}/metrics.jsonl")
    return 0
