"""On-policy distillation with TRL's ``DistillationTrainer`` plus EffOPD's callback, on tiny
char-level models built from a config (no downloads, a few seconds on a CPU).

    python examples/trl_distillation.py

The student learns to imitate the teacher's completions of ``"a+b="`` prompts; the gate is
the student's teacher-forced agreement with the teacher's greedy completions of held-out
prompts. Swap in real models (``model="Qwen/Qwen2.5-0.5B-Instruct"``,
``teacher_model=...``) and a real gate (task accuracy on a held-out set) for actual use; the
one EffOPD line stays the same. With an older TRL that lacks ``DistillationTrainer``, use
``trl.experimental.gkd.GKDTrainer`` with ``GKDConfig(lmbda=1.0)`` (fully on-policy).
"""

from __future__ import annotations

import json
import sys

import torch
from datasets import Dataset
from transformers import Qwen2Config, Qwen2ForCausalLM
from trl import DistillationConfig, DistillationTrainer

from lookahead_opd.integrations.hf_trainer import ExtrapolationCallback
from lookahead_opd.integrations.opd.tokenizer import char_tokenizer


def tiny_model(tok, seed: int) -> Qwen2ForCausalLM:
    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        pad_token_id=tok.pad_token_id,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
    )
    return Qwen2ForCausalLM(config)


def prompts(n: int, seed: int) -> list[str]:
    g = torch.Generator().manual_seed(seed)
    return [f"{a}+{b}=" for a, b in torch.randint(0, 10, (n, 2), generator=g).tolist()]


def main(output_dir: str = "/tmp/trl_distillation") -> dict:
    tok = char_tokenizer()
    tok.padding_side = "left"
    student, teacher = tiny_model(tok, seed=0), tiny_model(tok, seed=1)
    gate = tok(prompts(16, seed=2), return_tensors="pt", padding=True)
    target = teacher.generate(**gate, max_new_tokens=3, do_sample=False)

    def agreement() -> float:
        """The gate: how often the student's greedy next token matches the teacher's."""
        student.eval()
        with torch.no_grad():
            pred = student(input_ids=target).logits.argmax(-1)[:, -4:-1]
        return float((pred == target[:, -3:]).float().mean())

    trainer = DistillationTrainer(
        model=student,
        teacher_model=teacher,
        args=DistillationConfig(
            output_dir=output_dir,
            max_steps=8,
            per_device_train_batch_size=4,
            gradient_accumulation_steps=2,
            learning_rate=1e-2,
            max_completion_length=3,
            logging_steps=1,
            save_strategy="no",
            report_to=[],
            use_cpu=True,
            bf16=False,
            disable_tqdm=True,
            seed=0,
        ),
        train_dataset=Dataset.from_dict({"prompt": prompts(64, seed=3)}),
        processing_class=tok,
    )
    callback = ExtrapolationCallback(agreement)  # EffOPD: the one added line
    trainer.add_callback(callback)
    before = agreement()
    trainer.train()
    return {
        "agreement_before": before,
        "agreement_after": agreement(),
        "searches": [r.step for r in callback.history],
        "accepted": [r.accepted for r in callback.history],
        "logged": [h["step"] for h in trainer.state.log_history if "extrapolation/accepted" in h],
    }


if __name__ == "__main__":
    print(json.dumps(main(*sys.argv[1:2])))
