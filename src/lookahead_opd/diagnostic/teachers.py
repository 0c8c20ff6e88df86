"""Teachers: any causal LM sharing the student's tokenizer, or ``self:<context>``.

``self:<context>`` is the student itself given a privileged context before the prompt — the
self-distillation setting: ``solution`` (the problem's worked solution, ``task.sft_text``),
``answer`` (the final answer only) or ``example`` (another problem's worked solution: context
that is not privileged about this problem). :class:`ContextTeacher` makes such a teacher an
ordinary module over the student's sequences, so the diagnostic and ``OPDTrainer`` use it
exactly like an external teacher.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from lookahead_opd.integrations.opd.engines import tokenize_prompts
from lookahead_opd.integrations.opd.tasks import Problem, Task

__all__ = ["SELF_CONTEXTS", "TeacherSpec", "parse_teacher_spec", "context_text", "ContextTeacher"]

SELF_CONTEXTS = ("solution", "answer", "example")


@dataclass(frozen=True)
class TeacherSpec:
    """A parsed ``--teacher`` value: ``kind`` is ``"self"`` (``context`` set) or ``"model"``
    (``path``: a Hugging Face id or local directory)."""

    kind: str
    context: str | None = None
    path: str | None = None

    @property
    def name(self) -> str:
        return f"self:{self.context}" if self.kind == "self" else str(self.path)


def parse_teacher_spec(spec: str) -> TeacherSpec:
    """``self:solution|answer|example`` or a model id/path; raises ``ValueError`` otherwise."""
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"teacher spec must be a non-empty string, got {spec!r}")
    spec = spec.strip()
    if spec.startswith("self:") or spec == "self":
        context = spec.partition(":")[2]
        if context not in SELF_CONTEXTS:
            raise ValueError(f"unknown self-teacher context {context!r} in {spec!r}; expected "
                             f"one of {', '.join('self:' + c for c in SELF_CONTEXTS)}")
        return TeacherSpec("self", context=context)
    if spec.startswith(("http://", "https://")):
        raise ValueError(f"teacher {spec}: a served teacher gives log-probs of given tokens (or "
                         f"the top-k), but the diagnostic reads each teacher's full "
                         f"distribution; pass the teacher's model directory or Hub id")
    return TeacherSpec("model", path=spec)


def context_text(task: Task, problem: Problem, context: str, *,
                 examples: Sequence[Problem] = ()) -> str:
    """The privileged text put before ``problem``'s prompt for ``self:<context>``.
    ``example`` picks one of ``examples`` (other problems) by a stable hash of the prompt."""
    if context == "solution":
        return task.sft_text(problem)
    if context == "answer":
        return problem.answer
    if context == "example":
        pool = [e for e in examples if e.prompt != problem.prompt]
        if not pool:
            raise ValueError("self:example needs at least one other problem as the worked example")
        h = int.from_bytes(hashlib.sha256(problem.prompt.encode()).digest()[:8], "big")
        return task.sft_text(pool[h % len(pool)])
    raise ValueError(f"context must be one of {', '.join(SELF_CONTEXTS)}; got {context!r}")


class ContextTeacher(nn.Module):
    """``model`` reading ``[BOS] context separator prompt completion`` while scoring the
    student's ``[BOS] prompt completion``: logits come back aligned to the student's positions.

    Each row's prompt is recognised by its token ids (``prompts``: prompt ids as
    ``tokenize_prompts`` makes them → context ids). A row whose prompt is not registered raises
    ``ValueError``. Holds no weights of its own: freeze or copy ``model`` as the use requires
    (``OPDTrainer`` freezes its teacher, so give it a copy of the student).
    """

    def __init__(self, model: nn.Module, prompts: Mapping[tuple[int, ...], Sequence[int]], *,
                 bos_token_id: int | None, pad_token_id: int) -> None:
        super().__init__()
        if not prompts:
            raise ValueError("ContextTeacher needs at least one registered prompt")
        self.model = model
        self.prompts = {tuple(k): list(v) for k, v in prompts.items()}
        self._lengths = sorted({len(k) for k in self.prompts})
        self.bos_token_id, self.pad_token_id = bos_token_id, pad_token_id

    @classmethod
    def for_task(cls, model: nn.Module, tokenizer: Any, task: Task, problems: Sequence[Problem],
                 context: str, *, separator: str = " ",
                 examples: Sequence[Problem] = ()) -> ContextTeacher:
        """Register ``problems`` with their ``context`` (see :func:`context_text`)."""
        prompt_ids = tokenize_prompts(tokenizer, [p.prompt for p in problems])
        table = {}
        for p, ids in zip(problems, prompt_ids, strict=True):
            text = context_text(task, p, context, examples=examples) + separator
            table[tuple(ids)] = tokenizer(text, add_special_tokens=False)["input_ids"]
        return cls(model, table, bos_token_id=getattr(tokenizer, "bos_token_id", None),
                   pad_token_id=tokenizer.pad_token_id)

    @property
    def config(self) -> Any:  # check_vocab_compatible and generation code read it
        return self.model.config

    def get_output_embeddings(self) -> nn.Module | None:
        return self.model.get_output_embeddings()

    def _context_for(self, valid: list[int]) -> list[int]:
        for n in self._lengths:
            ctx = self.prompts.get(tuple(valid[:n]))
            if ctx is not None:
                return ctx
        raise ValueError(f"ContextTeacher: no registered prompt starts row {valid[:12]}…")

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, **_: Any) -> SimpleNamespace:
        """Logits ``[B, T, V]`` at the input's positions; pad positions hold zeros."""
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        rows, spans = [], []
        for ids, mask in zip(input_ids.tolist(), attention_mask.tolist(), strict=True):
            where = [t for t, m in enumerate(mask) if m]
            valid = [ids[t] for t in where]
            ctx = self._context_for(valid) if valid else []
            head = 1 if valid and valid[0] == self.bos_token_id else 0
            rows.append(valid[:head] + ctx + valid[head:])
            spans.append((where, head, len(ctx)))
        width = max(1, max(len(r) for r in rows))
        ids = torch.full((len(rows), width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for b, r in enumerate(rows):
            if r:
                ids[b, width - len(r):] = torch.tensor(r)
                mask[b, width - len(r):] = 1
        device = input_ids.device
        ids, mask = ids.to(device), mask.to(device)
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        logits = self.model(input_ids=ids, attention_mask=mask, position_ids=pos).logits
        out = logits.new_zeros((*input_ids.shape, logits.shape[-1]))
        for b, (where, head, n_ctx) in enumerate(spans):
            if not where:
                continue
            start = width - len(rows[b])
            src = [start + i + (n_ctx if i >= head else 0) for i in range(len(where))]
            out[b, where] = logits[b, src]
        return SimpleNamespace(logits=out)
