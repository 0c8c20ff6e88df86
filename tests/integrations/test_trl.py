"""ExtrapolationCallback in TRL's trainers (they subclass transformers.Trainer): SFTTrainer
with a gate dataset, and on-policy distillation with DistillationTrainer and GKDTrainer
(lmbda=1). Tiny char-level Qwen2 models built from a config, a generated sums dataset,
four optimizer steps of two micro-batches each, so searches follow steps 1, 2 and 4."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch
from conftest import tiny_qwen2

pytest.importorskip("transformers")
datasets = pytest.importorskip("datasets")


def _import_trl():
    """Import trl and the trainer modules it loads lazily (they check for vLLM on import)."""
    module = pytest.importorskip("trl")
    importlib.import_module("trl.trainer.sft_trainer")
    if hasattr(module, "DistillationTrainer"):
        importlib.import_module("trl.trainer.distillation_trainer")
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    try:
        importlib.import_module("trl.experimental.gkd")
    except ImportError:
        pass
    return module


trl = _import_trl()

from lookahead_opd import PAPER_RULE  # noqa: E402
from lookahead_opd.integrations.hf_trainer import (  # noqa: E402
    ExtrapolationCallback,
    add_extrapolation,
)


def _char_tokenizer():
    from lookahead_opd.integrations.opd.tokenizer import char_tokenizer

    tok = char_tokenizer()
    tok.padding_side = "left"
    return tok


def _char_model(tok, seed: int):
    return tiny_qwen2(len(tok), seed, tokenizer=tok)


def _count_generate(model) -> list[int]:
    """Count the student's ``generate`` calls (each still runs): on-policy training samples
    from the student on every micro-batch."""
    calls: list[int] = []
    real = model.generate

    def generate(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    model.generate = generate
    return calls


def _sums(n: int, seed: int) -> list[tuple[str, str]]:
    g = torch.Generator().manual_seed(seed)
    ab = torch.randint(0, 10, (n, 2), generator=g).tolist()
    return [(f"{a}+{b}=", str(a + b)) for a, b in ab]


def _trl_args(tmp_path, **overrides) -> dict:
    options = dict(
        output_dir=str(tmp_path / "trl"),
        max_steps=4,
        per_device_train_batch_size=4,
        per_device_eval_batch_size=8,
        gradient_accumulation_steps=2,
        learning_rate=1e-2,
        logging_steps=100,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        bf16=False,
        gradient_checkpointing=False,
        disable_tqdm=True,
        seed=0,
    )
    options.update(overrides)
    return options


@pytest.mark.slow
def test_trl_sft_trainer_with_gate_dataset(tmp_path):
    trl = pytest.importorskip("trl")
    datasets = pytest.importorskip("datasets")
    tok = _char_tokenizer()
    tok.padding_side = "right"
    text = lambda pairs: datasets.Dataset.from_dict({"text": [p + c for p, c in pairs]})  # noqa: E731
    model = _char_model(tok, seed=0)
    trainer = trl.SFTTrainer(
        model=model,
        args=trl.SFTConfig(**_trl_args(tmp_path), max_length=16),
        train_dataset=text(_sums(64, 0)),
        eval_dataset={"gate": text(_sums(16, 1))},  # preprocessed by SFTTrainer with the rest
        processing_class=tok,
    )
    cb = ExtrapolationCallback(gate_dataset="gate", metric="eval_loss", **PAPER_RULE)
    trainer.add_callback(cb)
    trainer.train()
    assert [r.step for r in cb.history] == [1, 2, 4]
    assert any(r.accepted is not None for r in cb.history)
    assert all(0 < r.score_before < 10 for r in cb.history)
    assert sum("extrapolation/accepted" in h for h in trainer.state.log_history) == 3


@pytest.mark.slow
def test_trl_distillation_trainer_with_eval_fn(tmp_path):
    trl = pytest.importorskip("trl")
    datasets = pytest.importorskip("datasets")
    if not hasattr(trl, "DistillationTrainer"):
        pytest.skip(f"trl {trl.__version__} has no DistillationTrainer")
    tok = _char_tokenizer()
    student, teacher = _char_model(tok, seed=0), _char_model(tok, seed=1)
    gate = tok([p for p, _ in _sums(8, 2)], return_tensors="pt", padding=True)
    teacher_ids = teacher.generate(
        **gate, max_new_tokens=3, do_sample=False, pad_token_id=tok.pad_token_id
    )

    def agreement() -> float:
        """Teacher-forced agreement of the student's greedy tokens with the teacher's."""
        student.eval()
        with torch.no_grad():
            pred = student(input_ids=teacher_ids).logits.argmax(-1)[:, -4:-1]
        return float((pred == teacher_ids[:, -3:]).float().mean())

    prompts = datasets.Dataset.from_dict({"prompt": [p for p, _ in _sums(32, 3)]})
    trainer = trl.DistillationTrainer(
        model=student,
        teacher_model=teacher,
        args=trl.DistillationConfig(**_trl_args(tmp_path), max_completion_length=3, beta=1.0),
        train_dataset=prompts,
        processing_class=tok,
    )
    generated = _count_generate(student)
    cb = add_extrapolation(trainer, agreement, min_improvement=0.0, **PAPER_RULE)
    trainer.train()
    assert [r.step for r in cb.history] == [1, 2, 4]
    assert trainer.state.global_step == 4
    assert len(generated) >= 4  # completions came from the student while it trained
    assert all(0.0 <= s <= 1.0 for r in cb.history for s in [r.score_before, *r.scores])
    assert sum("extrapolation/accepted" in h for h in trainer.state.log_history) == 3


def test_trl_gkd_trainer_on_policy(tmp_path):
    pytest.importorskip("trl")
    datasets = pytest.importorskip("datasets")
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    try:
        from trl.experimental.gkd import GKDConfig, GKDTrainer
    except ImportError as e:
        pytest.skip(f"GKDTrainer unavailable: {e}")
    tok = _char_tokenizer()
    tok.chat_template = (
        "{% for m in messages %}{{ m['content'] }}{% endfor %}"
        "{% if add_generation_prompt %}{% endif %}"
    )
    student, teacher = _char_model(tok, seed=0), _char_model(tok, seed=1)
    data = datasets.Dataset.from_dict(
        {
            "messages": [
                [{"role": "user", "content": p}, {"role": "assistant", "content": c}]
                for p, c in _sums(32, 4)
            ]
        }
    )
    trainer = GKDTrainer(
        model=student,
        teacher_model=teacher,
        args=GKDConfig(**_trl_args(tmp_path), lmbda=1.0, max_new_tokens=3, max_length=16),
        train_dataset=data,
        processing_class=tok,
    )
    generated = _count_generate(student)
    cb = add_extrapolation(trainer, neg_gate_loss_on(student, tok), **PAPER_RULE)
    trainer.train()
    assert [r.step for r in cb.history] == [1, 2, 4]
    assert len(generated) == 8  # lmbda=1: every micro-batch is generated by the student
    assert any(r.accepted is not None for r in cb.history)


def neg_gate_loss_on(model, tok):
    ids = tok([p + c for p, c in _sums(8, 5)], return_tensors="pt", padding=True)["input_ids"]

    def score() -> float:
        model.eval()
        with torch.no_grad():
            return -float(model(input_ids=ids, labels=ids).loss)

    return score
