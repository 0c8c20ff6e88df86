"""What the OPD loop needs from a task: prompts, gold answers, and an answer checker."""

from __future__ import annotations

import hashlib
import random
from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

__all__ = ["Problem", "Task", "SPLITS", "split_of"]

SPLITS = ("train", "gate", "test")


@dataclass(frozen=True)
class Problem:
    """One prompt and its gold answer (``meta`` holds anything task-specific)."""

    prompt: str
    answer: str
    meta: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)


def split_of(key: str, fractions: tuple[float, float] = (0.05, 0.10)) -> str:
    """A problem's split from a stable hash of its text: disjoint and the same on every run
    (Python's ``hash`` is salted per process, so it is not used)."""
    u = int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big") / 2**64
    gate, test = fractions
    return "gate" if u < gate else "test" if u < gate + test else "train"


class Task(ABC):
    """A verifiable generation task. Subclasses set ``name`` and ``max_new_tokens``."""

    name: str = "task"
    max_new_tokens: int = 16

    def all_problems(self, split: str) -> list[Problem]:
        """Every problem of ``split`` in a fixed order: those of ``generate()`` whose key
        ``split_of`` puts in ``split`` (a task that holds its splits otherwise overrides this)."""
        return self._splits[split]

    def generate(self) -> Iterable[tuple[str, Problem]]:
        """Every problem once, in a fixed order, with the text its split is hashed from
        (usually the prompt)."""
        raise NotImplementedError(f"{type(self).__name__} must define generate() or all_problems()")

    @cached_property
    def _splits(self) -> dict[str, list[Problem]]:
        out: dict[str, list[Problem]] = {s: [] for s in SPLITS}
        for key, problem in self.generate():
            out[split_of(key)].append(problem)
        return out

    def problems(self, split: str, n: int | None = None, seed: int = 0) -> list[Problem]:
        """``n`` problems of ``split`` (all when ``None``), a seeded fixed sample."""
        if split not in SPLITS:
            raise ValueError(f"split must be one of {', '.join(SPLITS)}; got {split!r}")
        pool = self.all_problems(split)
        if not pool:
            raise ValueError(f"task {self.name!r} has no {split} problems")
        if n is None:
            return list(pool)
        if n < 1 or n > len(pool):
            raise ValueError(f"asked for {n} {split} problems; task {self.name!r} has {len(pool)}")
        return random.Random(seed).sample(pool, n)

    @abstractmethod
    def extract_answer(self, completion: str) -> str | None:
        """The answer a completion gives, or ``None`` when it gives none."""

    def is_correct(self, completion: str, problem: Problem) -> bool:
        got = self.extract_answer(completion)
        return got is not None and got == problem.answer

    def reward(self, completion: str, problem: Problem) -> float:
        """Exact-match reward (1 or 0), for RL baselines."""
        return float(self.is_correct(completion, problem))

    def sft_text(self, problem: Problem) -> str:
        """The prompt followed by the gold completion (pretraining text; EOS added by the caller)."""
        return problem.prompt + problem.answer
