"""Scoring sampled completions with a model: logits over the rollout layout, the aligned
per-token view every loss reads (``TokenScores``: the student's logits and what the
``Teacher`` gave), when to chunk the loss (``loss_chunk_rows``), and greedy exact-match
accuracy (``greedy_accuracy``, the one; ``model_accuracy`` runs it on a bare model).

Used by the trainer (loss and gate), the demo's zoo, the teacher-selection diagnostic and the
benchmarks, so none of them imports another's module to get these.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .engines import Engine, HFEngine, Rollout
from .logits import model_logits
from .losses import TokenScores
from .tasks import Problem, Task
from .teacher import ModelTeacher, Teacher, TeacherNeeds

__all__ = ["sequence_logits", "score_tokens", "greedy_correct", "greedy_accuracy", "model_accuracy",
           "loss_chunk_rows",
           "AUTO_CHUNK_ROWS", "AUTO_CHUNK_ELEMENTS"]

# --loss_chunk_size's default: chunk when a micro-batch's completion tokens × vocabulary can
# reach 2^26 logits (256 MiB per fp32 copy; the dense loss holds about a dozen), 128 rows at a
# time (benchmarks/results/loss_memory.md).
AUTO_CHUNK_ELEMENTS = 1 << 26
AUTO_CHUNK_ROWS = 128


def loss_chunk_rows(setting: int | None, num_tokens: int, vocab_size: int) -> int:
    """Rows per ``lm_head`` projection for micro-batches of up to ``num_tokens`` completion
    tokens: ``setting`` when given (0: dense logits), else ``AUTO_CHUNK_ROWS`` once
    ``num_tokens × vocab_size`` reaches ``AUTO_CHUNK_ELEMENTS`` and dense below."""
    if setting is not None:
        return setting
    return AUTO_CHUNK_ROWS if num_tokens * vocab_size >= AUTO_CHUNK_ELEMENTS else 0


def sequence_logits(model: nn.Module, rollout: Rollout | None = None, *,
                    sequences: torch.Tensor | None = None,
                    attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Logits over left-padded sequences with the positions ``generate`` used (from the mask)."""
    if rollout is not None:
        sequences, attention_mask = rollout.sequences, rollout.attention_mask
    assert sequences is not None and attention_mask is not None
    position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
    return model(input_ids=sequences, attention_mask=attention_mask, position_ids=position_ids).logits


def score_tokens(student: nn.Module, teacher: Teacher | nn.Module, sequences: torch.Tensor,
                 attention_mask: torch.Tensor, completion_mask: torch.Tensor, vocab_size: int, *,
                 needs: TeacherNeeds = TeacherNeeds.FULL, chunk_size: int = 0,
                 advantages: torch.Tensor | None = None, temperature: float = 1.0) -> TokenScores:
    """The student's next-token logits on the sampled ``sequences`` (dense, or chunked when
    ``chunk_size`` > 0) and the teacher's scores of what the loss ``needs``, shifted onto the
    tokens they predict and cut to the shared ``vocab_size``. The student keeps its graph
    (unless the caller disables grad); the teacher never has one. A bare ``nn.Module`` teacher
    is scored in process (``ModelTeacher``, with the same ``chunk_size``). ``temperature``: the
    one ``sequences`` were sampled at (``TokenScores.temperature``)."""
    if not isinstance(teacher, Teacher):
        teacher = ModelTeacher(teacher, vocab_size, chunk_size=chunk_size)
    logits = model_logits(student, sequences, attention_mask, vocab_size, chunk_size=chunk_size)
    scored = teacher.score(sequences, attention_mask, completion_mask, needs)
    return TokenScores(logits, scored, sequences[:, 1:], completion_mask[:, 1:], advantages,
                       temperature)


def greedy_correct(engine: Engine, task: Task, problems: list[Problem], max_new_tokens: int
                   ) -> list[bool]:
    """Whether each problem's greedy completion, generated through ``engine``, is right."""
    rollout = engine.generate([p.prompt for p in problems], max_new_tokens=max_new_tokens,
                              temperature=0.0)
    return [task.is_correct(t, p) for t, p in zip(rollout.texts, problems, strict=True)]


def greedy_accuracy(engine: Engine, task: Task, problems: list[Problem], max_new_tokens: int) -> float:
    """Exact-match accuracy of greedy completions generated through ``engine``."""
    return sum(greedy_correct(engine, task, problems, max_new_tokens)) / len(problems)


def model_accuracy(model: nn.Module, tokenizer: Any, task: Task, problems: list[Problem], *,
                   batch_size: int = 512, max_new_tokens: int | None = None) -> float:
    """``greedy_accuracy`` of a bare ``model`` (an ``HFEngine`` over it, ``batch_size`` prompts
    per generation); ``max_new_tokens`` defaults to the task's."""
    return greedy_accuracy(HFEngine(model, tokenizer, batch_size=batch_size), task, problems,
                           max_new_tokens or task.max_new_tokens)
