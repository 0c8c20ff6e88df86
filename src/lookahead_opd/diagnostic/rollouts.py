"""Targeted continuations: force candidate ``k`` at a node, finish with the student, grade.

``P_succ,k`` is estimated from ``continuations`` student samples after ``prompt + prefix + k``.
The continuations go through the rollout engine's public ``generate`` in batches (all nodes'
candidates with the same remaining length share calls), so they use the engine's batching,
KV cache and seeding. A candidate that ends the completion (EOS, or the length limit) needs no
sampling: its outcome is read off the forced text and it costs no rollout.

The engine takes prompts as text, so each forced prefix must survive a decode → tokenize round
trip (``prefix_text``); a character tokenizer always does, a BPE one usually does. Nodes whose
prefixes do not are skipped before the budget is planned (and counted in the report).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from lookahead_opd.integrations.opd.engines import Engine, tokenize_prompts
from lookahead_opd.integrations.opd.tasks import Problem, Task

from .nodes import Node

__all__ = ["SuccessEstimates", "prefix_text", "completion_ids", "estimate_success"]


@dataclass
class SuccessEstimates:
    """Per node and candidate: the success rate ``p_succ`` and the continuations behind it
    (``counts``; 0 for a free candidate, whose rate is exactly 0 or 1). ``rollouts`` is the
    number of continuation rows generated in all."""

    p_succ: list[list[float]]
    counts: list[list[int]]
    rollouts: int


def prefix_text(tokenizer: Any, prompt: str, prompt_ids: Sequence[int],
                prefix: Sequence[int]) -> str | None:
    """``prompt`` followed by the decoded ``prefix``, or ``None`` when that text does not
    tokenize back to exactly ``prompt_ids + prefix`` (the engine would then continue from a
    different token sequence than the node's)."""
    text = prompt + tokenizer.decode(list(prefix), skip_special_tokens=False)
    ids = tokenize_prompts(tokenizer, [text])[0]
    return text if ids == [*prompt_ids, *prefix] else None


def completion_ids(sequences: torch.Tensor, completion_mask: torch.Tensor,
                   prompt_length: int) -> list[list[int]]:
    """The generated token ids of each row of a ``Rollout`` layout (EOS included)."""
    seq, mask = sequences[:, prompt_length:], completion_mask[:, prompt_length:].bool()
    return [row[m].tolist() for row, m in zip(seq, mask, strict=True)]


def _job_texts(tok: Any, problems: Sequence[Problem], prompt_ids: Mapping[int, list[int]],
               nodes: Sequence[Node], chunk: Sequence[tuple[int, int, list[int]]]) -> list[str]:
    """The text each continuation job starts from: its question's prompt plus its forced tokens
    (``(node, candidate, forced)`` jobs); raises ``ValueError`` if one does not round-trip."""
    texts = []
    for i, _, forced in chunk:
        q = nodes[i].question
        text = prefix_text(tok, problems[q].prompt, prompt_ids[q], forced)
        if text is None:
            raise ValueError(f"node prefix {forced} of question {q} does not round-trip "
                             "through the tokenizer; filter nodes with prefix_text first")
        texts.append(text)
    return texts


def estimate_success(engine: Engine, task: Task, problems: Sequence[Problem], nodes: Sequence[Node],
                     *, continuations: int, max_new_tokens: int, temperature: float = 1.0,
                     seed: int = 0, rows_per_call: int = 512,
                     on_progress: Callable[[int], None] | None = None) -> SuccessEstimates:
    """Estimate ``P_succ`` of every candidate of every node (see the module doc).

    ``problems[node.question]`` grades node ``node``. Rollouts generated = ``continuations``
    × the number of non-free candidates, exactly. ``on_progress(n)`` is called after each engine
    call with the rows it generated. Deterministic for a fixed ``seed``.
    """
    if continuations < 1:
        raise ValueError(f"continuations must be >= 1, got {continuations}")
    tok = engine.tokenizer
    eos = tok.eos_token_id
    p_succ = [[0.0] * len(n.candidates) for n in nodes]
    counts = [[0] * len(n.candidates) for n in nodes]
    questions = sorted({n.question for n in nodes})
    prompt_ids = dict(zip(questions, tokenize_prompts(tok, [problems[q].prompt for q in questions]),
                          strict=True))

    # Free candidates are graded directly; the others become jobs grouped by remaining length.
    jobs: dict[int, list[tuple[int, int, list[int]]]] = {}
    for i, node in enumerate(nodes):
        for c, cand in enumerate(node.candidates):
            forced = [*node.prefix, cand]
            remaining = max_new_tokens - len(forced)
            if cand == eos or remaining <= 0:
                text = tok.decode(forced, skip_special_tokens=True)
                p_succ[i][c] = float(task.is_correct(text, problems[node.question]))
                continue
            jobs.setdefault(remaining, []).append((i, c, forced))

    per_call = max(1, rows_per_call // continuations)
    rollouts, call = 0, 0
    for remaining in sorted(jobs):
        group = jobs[remaining]
        for start in range(0, len(group), per_call):
            chunk = group[start:start + per_call]
            texts = _job_texts(tok, problems, prompt_ids, nodes, chunk)
            out = engine.generate(texts, max_new_tokens=remaining, temperature=temperature,
                                  seed=seed * 1_000_003 + call, num_samples=continuations)
            call += 1
            new = completion_ids(out.sequences, out.completion_mask, out.prompt_length)
            for j, (i, c, forced) in enumerate(chunk):
                problem = problems[nodes[i].question]
                rows = new[j * continuations:(j + 1) * continuations]
                wins = sum(task.is_correct(tok.decode(forced + r, skip_special_tokens=True),
                                           problem) for r in rows)
                p_succ[i][c] = wins / continuations
                counts[i][c] = continuations
            rollouts += len(chunk) * continuations
            if on_progress is not None:
                on_progress(len(chunk) * continuations)
    return SuccessEstimates(p_succ, counts, rollouts)
