"""Verifiable tasks for OPD: generated arithmetic (the demo's), GSM8K, or your own ``Task``."""

from .arithmetic import ArithmeticTask
from .base import SPLITS, Problem, Task, load_task, split_of
from .gsm8k import GSM8KTask

__all__ = ["Problem", "Task", "ArithmeticTask", "GSM8KTask", "load_task", "split_of", "SPLITS"]
