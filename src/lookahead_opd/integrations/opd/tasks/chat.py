"""Prompts through the tokenizer's chat template: what an instruct model was trained to read.

``with_chat_template(task, tokenizer)`` is ``task`` with every prompt rendered as one user turn
plus the assistant header (ChatML for SmolLM2: ``<|im_start|>user\\n…<|im_end|>\\n
<|im_start|>assistant\\n``); a tokenizer without a chat template (the char tokenizer, base
models) leaves the task as it is. Wrapping the task, not the engines, keeps one rendering for
rollouts, the gate, evaluation and SFT text (``sft_text`` is the rendered prompt plus the
answer, and the caller's EOS closes the assistant turn).
"""

from __future__ import annotations

from functools import cached_property
from typing import Any

from .base import SPLITS, Problem, Task

__all__ = ["ChatTemplateTask", "with_chat_template", "render_chat_prompt"]


def render_chat_prompt(tokenizer: Any, text: str) -> str:
    """``text`` as one user message, followed by the assistant's header."""
    return tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                         add_generation_prompt=True)


class ChatTemplateTask(Task):
    """``task`` whose problems' prompts are rendered by ``render_chat_prompt`` (the plain
    prompt stays in ``meta["plain_prompt"]``); answers, grading and splits are the task's."""

    def __init__(self, task: Task, tokenizer: Any) -> None:
        self.task, self.tokenizer = task, tokenizer
        self.name, self.max_new_tokens = task.name, task.max_new_tokens

    @cached_property
    def _rendered(self) -> dict[str, list[Problem]]:
        return {split: [Problem(render_chat_prompt(self.tokenizer, p.prompt), p.answer,
                                {**p.meta, "plain_prompt": p.prompt})
                        for p in self.task.all_problems(split)] for split in SPLITS}

    def all_problems(self, split: str) -> list[Problem]:
        return self._rendered[split]

    def extract_answer(self, completion: str) -> str | None:
        return self.task.extract_answer(completion)

    def is_correct(self, completion: str, problem: Problem) -> bool:
        return self.task.is_correct(completion, problem)

    def reward(self, completion: str, problem: Problem) -> float:
        return self.task.reward(completion, problem)

    def sft_text(self, problem: Problem) -> str:
        return self.task.sft_text(problem)


def with_chat_template(task: Task, tokenizer: Any, enabled: bool = True) -> Task:
    """``task`` rendered through ``tokenizer``'s chat template when it has one and ``enabled``;
    otherwise ``task`` itself."""
    if not enabled or not getattr(tokenizer, "chat_template", None):
        return task
    return ChatTemplateTask(task, tokenizer)
