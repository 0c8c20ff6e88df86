"""Where to look: node depths along each student rollout, candidate sets, and the budget plan.

A node is a prefix the student visited: question ``i``'s rollout cut after ``depth − 1``
completion tokens, so the ``depth``-th token is the decision scored there. Depths are
exponentially spaced (1, 2, 4, 8, … tokens into the completion), so the cost of a rollout's
nodes grows with the log of its length, not the length. The candidate set is the student's
top-K tokens at the node plus the token it actually sampled.

Nodes are taken depth-major (every rollout's depth-1 node, then every depth-2 node, …, rollouts
in a seeded order within a depth) until the next node's continuations would exceed the budget.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

__all__ = ["SPACINGS", "Node", "node_depths", "candidate_set", "node_cost", "plan_nodes"]

SPACINGS = ("exponential", "all")


@dataclass
class Node:
    """One scored decision. ``prefix`` holds the completion tokens before it; ``candidates`` the
    token ids compared there (student top-K first, by probability, then the sampled token when
    it is not among them); ``student_probs`` the student's (unrenormalised) probabilities of
    the candidates; ``free`` marks candidates whose continuation needs no sampling (EOS, or the
    length limit reached): their outcome is decided by the forced prefix alone."""

    row: int
    question: int
    sample: int
    depth: int
    prefix: list[int]
    sampled: int
    candidates: list[int]
    student_probs: list[float]
    rollout_correct: bool
    free: list[bool] = field(default_factory=list)

    @property
    def position(self) -> int:
        """Index of the decided token within the completion (0-based)."""
        return self.depth - 1


def node_depths(length: int, spacing: str = "exponential") -> list[int]:
    """Depths (1-based) of the nodes along a completion of ``length`` tokens: 1, 2, 4, 8, …
    (``exponential``) or every position (``all``)."""
    if spacing not in SPACINGS:
        raise ValueError(f"node spacing must be one of {', '.join(SPACINGS)}; got {spacing!r}")
    if length < 1:
        return []
    if spacing == "all":
        return list(range(1, length + 1))
    out, d = [], 1
    while d <= length:
        out.append(d)
        d *= 2
    return out


def candidate_set(student_logprobs: torch.Tensor, sampled: int, k: int) -> list[int]:
    """The student's top-``k`` token ids (most probable first) plus ``sampled`` if missing."""
    if k < 1:
        raise ValueError(f"top_k must be >= 1, got {k}")
    top = student_logprobs.topk(min(k, student_logprobs.shape[-1])).indices.tolist()
    return top if sampled in top else [*top, int(sampled)]


def node_cost(node: Node, continuations: int) -> int:
    """Continuation rollouts the node needs: ``continuations`` per candidate that is not free."""
    return continuations * sum(not f for f in node.free)


def plan_nodes(nodes_by_depth: Sequence[Sequence[Node]], budget: int, continuations: int,
               seed: int) -> tuple[list[Node], int]:
    """Take nodes depth level by depth level (a seeded order of rollouts within a level) until
    the next one would not fit in ``budget``; return them and the rollouts they use
    (``≤ budget``). Nodes that need no rollouts at all are always taken."""
    rng = random.Random(seed)
    chosen: list[Node] = []
    used = 0
    for level in nodes_by_depth:
        order = list(level)
        rng.shuffle(order)
        for node in order:
            cost = node_cost(node, continuations)
            if used + cost > budget:
                return chosen, used
            chosen.append(node)
            used += cost
    return chosen, used
