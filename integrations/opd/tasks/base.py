"""What the OPD loop needs from a task: prompts, gold answers, and an answer checker."""

from __future__ import annotations

import hashlib
import importlib
import random
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Problem", "Task", "SPLITS", "split_of", "load_task"]

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

    @abstractmethod
    def all_problems(self, split: str) -> list[Problem]:
        """Every problem of ``split`` in a fixed order."""

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


def load_task(spec: str) -> Task:
    """``arithmetic[:ops=+-,digits=3]``, ``longadd[:digits=4]``, ``gsm8k:path=FILE`` or ``gsm8k:name=HUB_ID``, or
    ``package.module:ClassName`` (a ``Task`` subclass, built without arguments)."""
    from .arithmetic import ArithmeticTask
    from .gsm8k import GSM8KTask
    from .longadd import LongAdditionTask

    if not isinstance(spec, str) or not spec.strip():
        raise ValueError("task spec must be a non-empty string")
    name, _, options = spec.strip().partition(":")
    builtin: dict[str, type[Task]] = {"arithmetic": ArithmeticTask, "longadd": LongAdditionTask,
                                     "gsm8k": GSM8KTask}
    if name in builtin:
        return builtin[name](**_parse_options(builtin[name], options))
    if options and "=" not in options and "." in name:
        module_name, class_name = name, options
        try:
            cls = getattr(importlib.import_module(module_name), class_name)
        except (ImportError, AttributeError) as err:
            raise ValueError(f"cannot load task {spec!r}: {err}") from None
        if not (isinstance(cls, type) and issubclass(cls, Task)):
            raise ValueError(f"{spec!r} is not a Task subclass")
        return cls()
    raise ValueError(f"unknown task {name!r}; expected arithmetic, longadd, gsm8k or module:Class")


def _parse_options(cls: type[Task], options: str) -> dict[str, Any]:
    """``key=value,key=value`` converted to the types of the constructor's defaults.
    A value may hold commas only for ``ops`` (``ops=+-*``)."""
    import inspect

    params = {k: p for k, p in inspect.signature(cls).parameters.items() if k != "self"}
    out: dict[str, Any] = {}
    for item in filter(None, (s.strip() for s in options.split(","))):
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"task option {item!r} must be key=value")
        if key not in params:
            raise ValueError(f"unknown option {key!r} for task {cls.name!r}; valid: {', '.join(params)}")
        default = params[key].default
        try:
            if isinstance(default, bool):
                if value.lower() not in ("true", "false", "1", "0"):
                    raise ValueError(value)
                out[key] = value.lower() in ("true", "1")
            elif isinstance(default, int):
                out[key] = int(value)
            elif isinstance(default, float):
                out[key] = float(value)
            else:
                out[key] = value
        except ValueError:
            raise ValueError(f"task option {key}={value!r}: expected {type(default).__name__}") from None
    return out
