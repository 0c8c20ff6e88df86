"""Scoring sampled completions with a model: logits over the rollout layout, the aligned
per-token view every loss reads (``TokenScores``), and greedy exact-match accuracy.

Used by the trainer (loss and gate), the zoo, the teacher-selection diagnostic and the
benchmarks, so none of them imports another's module to get these.
"""

from __future__ import annotations

import torch
from torch import nn

from .engines import Engine, Rollout
from .losses import TokenScores, shift_for_next_token
from .tasks import Problem, Task
from .vocab import align_vocab

__all__ = ["sequence_logits", "score_tokens", "greedy_accuracy"]


def sequence_logits(model: nn.Module, rollout: Rollout | None = None, *,
                    sequences: torch.Tensor | None = None,
                    attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Logits over left-padded sequences with the positions ``generate`` used (from the mask)."""
    if rollout is not None:
        sequences, attention_mask = rollout.sequences, rollout.attention_mask
    assert sequences is not None and attention_mask is not None
    position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
    return model(input_ids=sequences, attention_mask=attention_mask, position_ids=position_ids).logits


def score_tokens(student: nn.Module, teacher: nn.Module, sequences: torch.Tensor,
                 attention_mask: torch.Tensor, completion_mask: torch.Tensor, vocab_size: int, *,
                 advantages: torch.Tensor | None = None) -> TokenScores:
    """Both models' next-token logits on the sampled ``sequences``, shifted onto the tokens
    they predict and cut to the shared ``vocab_size``. The student keeps its graph (unless the
    caller disables grad); the teacher never has one."""
    student_logits = sequence_logits(student, sequences=sequences, attention_mask=attention_mask)
    with torch.no_grad():
        teacher_logits = sequence_logits(teacher, sequences=sequences, attention_mask=attention_mask)
    ls, tokens, mask = shift_for_next_token(student_logits, sequences, completion_mask)
    return TokenScores(align_vocab(ls, vocab_size), align_vocab(teacher_logits[:, :-1], vocab_size),
                       tokens, mask, advantages)


def greedy_accuracy(engine: Engine, task: Task, problems: list[Problem], max_new_tokens: int) -> float:
    """Exact-match accuracy of greedy completions generated through ``engine``."""
    rollout = engine.generate([p.prompt for p in problems], max_new_tokens=max_new_tokens,
                              temperature=0.0)
    return sum(task.is_correct(t, p) for t, p in zip(rollout.texts, problems, strict=True)) / len(problems)
