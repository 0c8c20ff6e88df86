"""GSM8K-style math word problems from ``datasets`` (a local jsonl/parquet file or a hub id).

Answers are checked with ``math-verify`` when it is installed, else by numeric comparison.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

from .base import Problem, Task

__all__ = ["GSM8KTask", "MathAnswerTask"]

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")
_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")
PROMPT = "Question: {question}\nAnswer: Let's think step by step."


class MathAnswerTask(Task):
    """A task whose completions end in a number: read after ``####``, else the last
    ``\\boxed{}``, else the last number; graded with ``math-verify`` when installed."""

    def extract_answer(self, completion: str) -> str | None:
        marked = re.search(r"####\s*(.+)", completion)
        number = _NUMBER.search(marked.group(1)) if marked else None
        if number:
            return number.group(0).replace(",", "")
        boxed = _BOXED.findall(completion)
        if boxed:
            return boxed[-1].strip()
        numbers = _NUMBER.findall(completion)
        return numbers[-1].replace(",", "") if numbers else None

    def is_correct(self, completion: str, problem: Problem) -> bool:
        got = self.extract_answer(completion)
        if got is None:
            return False
        try:
            from math_verify import parse, verify
        except ImportError:
            return _same_number(got, problem.answer)
        return bool(verify(parse(problem.answer), parse(got))) or _same_number(got, problem.answer)


class GSM8KTask(MathAnswerTask):
    """Rows with ``question`` and ``answer`` (GSM8K's ``"... #### 42"``). ``path`` is a local
    ``.jsonl``/``.json``/``.parquet`` file, ``name`` a ``datasets`` hub id (``split`` of it).
    The file's rows are divided into train/gate/test by a stable hash of the question."""

    name = "gsm8k"

    def __init__(self, path: str = "", name: str = "", config: str = "main", split: str = "train",
                 max_new_tokens: int = 512, template: str = PROMPT) -> None:
        if bool(path) == bool(name):
            raise ValueError("gsm8k needs exactly one of path=FILE or name=HUB_ID")
        self.path, self.hub_name, self.config, self.split = path, name, config, split
        self.max_new_tokens, self.template = max_new_tokens, template

    def generate(self) -> Iterator[tuple[str, Problem]]:
        import datasets

        if self.path:
            suffix = self.path.rsplit(".", 1)[-1]
            kind = {"jsonl": "json", "json": "json", "parquet": "parquet"}.get(suffix)
            if kind is None:
                raise ValueError(f"gsm8k path must be .jsonl, .json or .parquet, got {self.path}")
            ds = datasets.load_dataset(kind, data_files=self.path, split="train")
        else:
            ds = datasets.load_dataset(self.hub_name, self.config, split=self.split)
        missing = {"question", "answer"} - set(ds.column_names)
        if missing:
            raise ValueError(f"gsm8k data needs columns question, answer; missing {sorted(missing)}")
        if len(ds) == 0:
            raise ValueError(f"gsm8k data {self.path or self.hub_name} is empty")
        for row in ds:  # the split follows the question, whatever the template
            gold = row["answer"].split("####")[-1].strip().replace(",", "")
            yield row["question"], Problem(self.template.format(question=row["question"]), gold,
                                           {"solution": row["answer"]})

    def sft_text(self, problem: Problem) -> str:
        return problem.prompt + " " + problem.meta.get("solution", problem.answer)


def _same_number(a: str, b: str) -> bool:
    try:
        return abs(float(a.rstrip(".")) - float(b)) < 1e-6
    except ValueError:
        return a.strip() == b.strip()
