"""Task specs to tasks: the built-in tasks by name, or any ``Task`` subclass by import path.

Kept apart from ``base`` (which every task imports) so that no module imports one that imports it.
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any

from .arithmetic import ArithmeticTask
from .base import Task
from .gsm8k import GSM8KTask
from .longadd import LongAdditionTask
from .wordproblems import WordProblemTask

__all__ = ["TASKS", "load_task"]

# The built-in tasks by the name a spec starts with.
TASKS: dict[str, type[Task]] = {
    ArithmeticTask.name: ArithmeticTask,
    LongAdditionTask.name: LongAdditionTask,
    GSM8KTask.name: GSM8KTask,
    WordProblemTask.name: WordProblemTask,
}


def load_task(spec: str) -> Task:
    """``arithmetic[:ops=+-,digits=3]``, ``longadd[:digits=4]``, ``gsm8k:path=FILE`` or ``gsm8k:name=HUB_ID``, or
    ``package.module:ClassName`` (a ``Task`` subclass, built without arguments)."""
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError("task spec must be a non-empty string")
    name, _, options = spec.strip().partition(":")
    if name in TASKS:
        return TASKS[name](**_parse_options(TASKS[name], options))
    if options and "=" not in options and "." in name:
        module_name, class_name = name, options
        try:
            cls = getattr(importlib.import_module(module_name), class_name)
        except (ImportError, AttributeError) as err:
            raise ValueError(f"cannot load task {spec!r}: {err}") from None
        if not (isinstance(cls, type) and issubclass(cls, Task)):
            raise ValueError(f"{spec!r} is not a Task subclass")
        return cls()
    raise ValueError(f"unknown task {name!r}; expected {', '.join(TASKS)} or module:Class")


def _parse_options(cls: type[Task], options: str) -> dict[str, Any]:
    """``key=value,key=value`` converted to the types of the constructor's defaults.
    A value may hold commas only for ``ops`` (``ops=+-*``)."""
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
