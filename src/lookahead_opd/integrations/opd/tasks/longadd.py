"""Long completions: column addition with the carries written out, then the sum.

``"4821+3967="`` → ``"1+7+0=8 2+6+0=8 8+9+0=17 4+3+1=8 (8788)"``: one ``a+b+carry=sum`` step per
column, rightmost first (the carry is the previous column's tens digit), then the final answer in
parentheses. Only the answer is graded (exact match), so a completion is 27–73 tokens of which a
handful decide the reward — the regime of the paper's long reasoning traces, where a step's
gradient averages over many tokens, unlike ``arithmetic``'s 2–5. Uses only the characters of the
default char tokenizer, so its models share the vocabulary of every other zoo task.
"""

from __future__ import annotations

import random
import re
from collections.abc import Iterator

from .base import Problem, Task

__all__ = ["LongAdditionTask", "worked_addition"]

_ANSWER = re.compile(r"\((\d+)\)")
DIGITS = (3, 7)  # 3 digits: >= 27 completion tokens; 7: <= 73 (the task's 20–80 token promise)


def worked_addition(a: int, b: int, digits: int) -> str:
    """The completion for ``a+b``: each of ``digits`` columns as ``x+y+carry=sum``, then ``(a+b)``."""
    if not (0 <= a < 10**digits and 0 <= b < 10**digits):
        raise ValueError(f"operands must be in 0..{10**digits - 1}, got {a}, {b}")
    steps, carry = [], 0
    for i in range(digits):
        x, y = a // 10**i % 10, b // 10**i % 10
        s = x + y + carry
        steps.append(f"{x}+{y}+{carry}={s}")
        carry = s // 10
    return " ".join(steps) + f" ({a + b})"


class LongAdditionTask(Task):
    """``a+b=`` with ``a, b`` uniform in ``0..10**digits - 1`` (``digits`` in 3..7); ``count``
    distinct problems drawn with a fixed seed, split train/gate/test by a stable hash of the
    prompt. The gold completion is ``worked_addition``; ``extract_answer`` reads the number in
    parentheses."""

    name = "longadd"

    def __init__(self, digits: int = 4, count: int = 30_000, max_new_tokens: int = 0) -> None:
        lo, hi = DIGITS
        if not lo <= digits <= hi:
            raise ValueError(f"digits must be in {lo}..{hi}, got {digits}")
        if count < 100 or count > (10**digits) ** 2 // 2:
            raise ValueError(f"count must be in 100..{(10**digits) ** 2 // 2} for digits={digits}, "
                             f"got {count}")
        if max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0 (0: the longest solution), got {max_new_tokens}")
        self.digits, self.count = digits, count
        top = 10**digits - 1
        self.max_new_tokens = max_new_tokens or len(worked_addition(top, top, digits)) + 2  # EOS, spare

    def generate(self) -> Iterator[tuple[str, Problem]]:
        rng, top = random.Random(f"longadd-{self.digits}"), 10**self.digits - 1
        seen: set[tuple[int, int]] = set()
        while len(seen) < self.count:
            a, b = rng.randint(0, top), rng.randint(0, top)
            if (a, b) in seen:
                continue
            seen.add((a, b))
            prompt = f"{a}+{b}="
            yield prompt, Problem(prompt, str(a + b), {"solution": worked_addition(a, b, self.digits)})

    def extract_answer(self, completion: str) -> str | None:
        m = _ANSWER.search(completion)
        return None if m is None else str(int(m.group(1)))

    def sft_text(self, problem: Problem) -> str:
        if "solution" in problem.meta:
            return problem.prompt + problem.meta["solution"]
        a, b = (int(x) for x in problem.prompt.rstrip("=").split("+"))
        return problem.prompt + worked_addition(a, b, self.digits)
