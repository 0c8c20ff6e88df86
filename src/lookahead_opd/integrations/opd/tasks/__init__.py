"""Verifiable tasks for OPD: generated arithmetic (the demo's), worked long additions, GSM8K,
or your own ``Task``."""

from .arithmetic import ArithmeticTask
from .base import SPLITS, Problem, Task, split_of
from .chat import ChatTemplateTask, with_chat_template
from .gsm8k import GSM8KTask
from .longadd import LongAdditionTask
from .registry import TASKS, load_task
from .wordproblems import WordProblemTask

__all__ = ["Problem", "Task", "ArithmeticTask", "GSM8KTask", "LongAdditionTask", "load_task",
           "split_of", "SPLITS", "TASKS", "ChatTemplateTask", "with_chat_template",
           "WordProblemTask"]
