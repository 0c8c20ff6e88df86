"""The teacher seam: beside ``Engine`` (which generates), a ``Teacher`` scores given token ids.

Each loss declares what it reads from the teacher (``TeacherNeeds``, cheapest first):

- ``TeacherNeeds.SAMPLED``: the log-prob of each sampled token (``reverse_kl_pg``, ``drgrpo``'s
  reverse-KL metric) — what an inference server returns as prompt log-probs;
- ``TeacherNeeds.topk(k)``: the ``k`` largest log-probs at each position and their token ids
  (the ``topk_*`` losses; the −KL gate of a teacher that gives no more, e.g. a served one);
- ``TeacherNeeds.FULL``: the whole next-token distribution (``reverse_kl``, ``jsd``, the −KL
  gate) as ``NextTokenLogits``: dense logits, or final hidden states and the output head that
  a loss projects a chunk of rows at a time, so no (tokens × vocab) tensor need exist.

``Teacher.score(sequences, attention_mask, completion_mask, needs)`` returns ``TeacherScores``
aligned with ``tokens = sequences[:, 1:]`` (``[B, T-1]``; position ``t`` scores
``sequences[:, t + 1]`` given what precedes it), meaningful where ``completion_mask[:, 1:]`` is
set. A teacher gives at least what was asked (more is fine); ``capability`` is the most it can
give, and ``check(needs)`` refuses a loss it cannot serve in one line, before any step.

``ModelTeacher`` is the in-process implementation (an ``nn.Module`` run under ``no_grad``).

Pure torch: this module must not import transformers.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from .logits import NextTokenLogits, model_logits

__all__ = ["TeacherNeeds", "TeacherScores", "Teacher", "ModelTeacher"]

_LEVELS = ("sampled", "topk", "full")


@dataclass(frozen=True)
class TeacherNeeds:
    """What a loss reads from the teacher: ``level`` is ``"sampled"``, ``"topk"`` (with ``k``)
    or ``"full"``. Ordered: ``a.covers(b)`` when a teacher giving ``a`` serves a loss that
    needs ``b``."""

    level: str
    k: int = 0

    SAMPLED: ClassVar[TeacherNeeds]
    FULL: ClassVar[TeacherNeeds]

    def __post_init__(self) -> None:
        if self.level not in _LEVELS:
            raise ValueError(f"TeacherNeeds.level must be one of {', '.join(_LEVELS)}, "
                             f"got {self.level!r}")
        if (self.level == "topk") != (self.k > 0):
            raise ValueError(f"TeacherNeeds: k > 0 goes with level 'topk' only, got "
                             f"level={self.level!r}, k={self.k}")

    @classmethod
    def topk(cls, k: int) -> TeacherNeeds:
        return cls("topk", k)

    def covers(self, other: TeacherNeeds) -> bool:
        """Whether what ``self`` describes includes what ``other`` asks for."""
        rank, other_rank = _LEVELS.index(self.level), _LEVELS.index(other.level)
        if self.level == other.level == "topk":
            return self.k >= other.k
        return rank >= other_rank

    def __str__(self) -> str:
        return f"top-{self.k} log-probs" if self.level == "topk" else {
            "sampled": "the sampled tokens' log-probs", "full": "the full distribution"}[self.level]


TeacherNeeds.SAMPLED = TeacherNeeds("sampled")
TeacherNeeds.FULL = TeacherNeeds("full")


@dataclass
class TeacherScores:
    """A teacher's scores of one batch, aligned with ``tokens = sequences[:, 1:]``
    (``[B, T-1]``; fp32; meaningful on completion positions only). What is filled depends on
    the ``TeacherNeeds`` asked for (a teacher may fill more):

    - ``token_logprobs`` ``[B, T-1]``: log-prob of each sampled token (sampled; a full teacher
      may leave it None, it is then computed from ``logits``);
    - ``topk_logprobs``, ``topk_ids`` ``[B, T-1, k]``: the k largest log-probs, descending,
      and their token ids (topk);
    - ``logits``: the next-token logits, dense or as hidden states + head (full).
    """

    token_logprobs: torch.Tensor | None = None
    topk_logprobs: torch.Tensor | None = None
    topk_ids: torch.Tensor | None = None
    logits: NextTokenLogits | None = None

    def sampled(self, tokens: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """The sampled tokens' log-probs ``[B, T-1]``, from ``logits`` when not given."""
        if self.token_logprobs is not None:
            return self.token_logprobs
        if self.logits is None:
            raise ValueError("the teacher gave neither the sampled tokens' log-probs nor logits")
        with torch.no_grad():
            return self.logits.token_logprobs(tokens, mask)

    def full(self) -> NextTokenLogits:
        if self.logits is None:
            raise ValueError("this loss reads the teacher's full distribution, which this "
                             "teacher did not give (see TeacherNeeds)")
        return self.logits

    def top(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The top-k log-probs and their token ids, each ``[B, T-1, k]``."""
        if self.topk_logprobs is None or self.topk_ids is None:
            raise ValueError("this loss reads the teacher's top-k log-probs, which this "
                             "teacher did not give (see TeacherNeeds)")
        return self.topk_logprobs, self.topk_ids


class Teacher(ABC):
    """Scores given token ids (see the module doc). ``vocab_size``: the shared vocabulary its
    scores are cut to."""

    vocab_size: int

    @property
    def capability(self) -> TeacherNeeds:
        """The most this teacher can give (default: everything)."""
        return TeacherNeeds.FULL

    def check(self, needs: TeacherNeeds, what: str = "the loss") -> None:
        """Raise ``ValueError`` in one line when this teacher cannot give ``needs``."""
        if not self.capability.covers(needs):
            raise ValueError(f"{what} reads {needs} from the teacher, but "
                             f"{type(self).__name__} gives at most {self.capability}")

    @abstractmethod
    def score(self, sequences: torch.Tensor, attention_mask: torch.Tensor,
              completion_mask: torch.Tensor, needs: TeacherNeeds) -> TeacherScores:
        """Score ``sequences`` ``[B, T]`` (left-padded prompts, right-padded completions, the
        ``Rollout`` layout) for what ``needs`` asks; no gradient."""

    def set_step(self, step: int | None) -> None:  # noqa: B027 - optional hook
        """The training step the next scores are for (as logged), which a teacher that can fail
        (a served one) names in its error; the trainer calls it before each step's scoring."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Free the teacher's resources (connections, processes)."""


class ModelTeacher(Teacher):
    """The in-process teacher: ``model`` (an ``nn.Module`` causal LM) run under ``no_grad``.
    With ``chunk_size`` > 0 (rows per head projection; 0: dense logits) ``FULL`` is the final
    hidden states and the output head, not logits, and ``SAMPLED`` and ``topk`` are computed a
    chunk of rows at a time from those."""

    def __init__(self, model: nn.Module, vocab_size: int, *, chunk_size: int = 0) -> None:
        self.model, self.vocab_size, self.chunk_size = model, vocab_size, chunk_size

    @torch.no_grad()
    def score(self, sequences: torch.Tensor, attention_mask: torch.Tensor,
              completion_mask: torch.Tensor, needs: TeacherNeeds) -> TeacherScores:
        logits = model_logits(self.model, sequences, attention_mask, self.vocab_size,
                              chunk_size=self.chunk_size)
        if needs.level == "full":
            return TeacherScores(logits=logits)
        tokens, mask = sequences[:, 1:], completion_mask[:, 1:].bool()
        if needs.level == "sampled":
            return TeacherScores(token_logprobs=logits.token_logprobs(tokens, mask))
        values, ids = logits.topk(needs.k, mask)
        return TeacherScores(token_logprobs=logits.token_logprobs(tokens, mask),
                             topk_logprobs=values, topk_ids=ids)
