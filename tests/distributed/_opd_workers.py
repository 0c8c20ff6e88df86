"""Two-rank worker for the OPD loop (``OPDTrainer`` under torch.distributed, gloo, CPU)."""

from __future__ import annotations

import torch
from conftest import tiny_qwen2


def opd_worker(rank: int, out_dir: str, extrapolate: bool) -> dict:
    from lookahead_opd.integrations.opd.config import OPDConfig
    from lookahead_opd.integrations.opd.engines import HFEngine
    from lookahead_opd.integrations.opd.tasks import ArithmeticTask
    from lookahead_opd.integrations.opd.tokenizer import char_tokenizer
    tokenizer = char_tokenizer()

    def model(seed: int):
        return tiny_qwen2(len(tokenizer), seed, tokenizer=tokenizer)

    from lookahead_opd.integrations.opd.trainer import OPDTrainer

    student = model(100 + rank)  # different per rank: the trainer must broadcast rank 0's
    teacher = model(1)
    with torch.no_grad():
        teacher.lm_head.weight.mul_(30.0)
    config = OPDConfig(output_dir=out_dir, batch_size=8, max_steps=4, learning_rate=1e-2,
                       max_new_tokens=4, eval_every=2, eval_size=16, gate_size=8, progress=False,
                       extrapolate=extrapolate, gate="neg_kl", save_every=2)
    trainer = OPDTrainer(config, student, teacher, ArithmeticTask(), HFEngine(student, tokenizer),
                         tokenizer=tokenizer)
    result = trainer.train()
    return {
        "params": {k: v.detach().clone() for k, v in student.state_dict().items()},
        "history": [j.to_dict() for j in getattr(trainer.optimizer, "history", [])],
        "evals": result.evals,
        "losses": [m["loss"] for m in result.metrics if "loss" in m],
        "gate_size": len(trainer.gate_problems),
        "prompts": [p.prompt for p in trainer._problems(0)],
    }
