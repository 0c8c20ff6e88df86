"""Several teachers in one run (``--teachers name=URL_or_path … --teacher_key FIELD``): each
problem names its teacher in a task field (verl's ``teacher_key``, TRL's ``teacher_id``
column), and that teacher scores its rows.

``teacher_names`` resolves every problem's teacher before step 0 (an unknown or missing key is
one line, unless ``default`` names a teacher). ``TeacherRouter`` holds the teachers;
``for_rows(names)`` is the ``Teacher`` of one batch: it groups the rows per teacher, scores each
group with its teacher (served groups use that teacher's in-flight limit, per process) and puts
the scores back in row order, timing each teacher.

Several teachers give the sampled tokens' log-probs or top-k, not the full distribution: one
batch's rows would need each teacher's logits (or hidden states and output head) side by side.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from .teacher import Teacher, TeacherNeeds, TeacherScores

__all__ = ["TeacherRouter", "teacher_names"]


def teacher_names(problems: Sequence[Any], key: str, names: Sequence[str],
                  default: str | None = None, *, what: str = "problems") -> list[str]:
    """Each problem's teacher: its ``key`` field (``Problem.meta[key]``), or ``default`` when
    that is missing or not one of ``names``; ``ValueError`` in one line otherwise."""
    out, bad = [], []
    for p in problems:
        meta = getattr(p, "meta", None) or {}
        value = meta.get(key, getattr(p, key, None))
        name = None if value is None else str(value)
        if name not in names:
            if default is None:
                bad.append(name)
                continue
            name = default
        out.append(name)
    if bad:
        shown = "missing" if bad[0] is None else repr(bad[0])
        raise ValueError(f"{len(bad)} of the {len(problems)} {what} have no teacher: teacher_key "
                         f"{key!r} is {shown} (first of them), not one of {', '.join(names)}; "
                         f"give --default_teacher NAME or fix the task's {key!r} field")
    return out


class TeacherRouter(Teacher):
    """``teachers`` by name, each problem's named by its ``key`` field (``default`` for the
    rest). Score a batch through ``for_rows(names)``; ``seconds[name]`` sums each teacher's
    scoring time. ``set_step`` passes the step on to every teacher."""

    def __init__(self, teachers: Mapping[str, Teacher], key: str,
                 default: str | None = None) -> None:
        if not teachers:
            raise ValueError("TeacherRouter needs at least one teacher")
        if default is not None and default not in teachers:
            raise ValueError(f"default teacher {default!r} is not one of {', '.join(teachers)}")
        self.teachers, self.key, self.default = dict(teachers), key, default
        self.vocab_size = min(t.vocab_size for t in teachers.values())  # the shared part
        self.seconds = dict.fromkeys(self.teachers, 0.0)

    def names(self, problems: Sequence[Any], what: str = "problems") -> list[str]:
        return teacher_names(problems, self.key, list(self.teachers), self.default, what=what)

    def set_step(self, step: int | None) -> None:
        for t in self.teachers.values():
            t.set_step(step)

    @property
    def capability(self) -> TeacherNeeds:
        caps = [t.capability for t in self.teachers.values()]
        least = next(c for c in caps if all(o.covers(c) for o in caps))
        if least.level == "full":  # see the module doc
            return TeacherNeeds.topk(self.vocab_size)
        return least

    def for_rows(self, names: Sequence[str]) -> Teacher:
        """The ``Teacher`` of a batch whose row ``i`` belongs to teacher ``names[i]``."""
        return _Routed(self, list(names))

    def score(self, sequences: torch.Tensor, attention_mask: torch.Tensor,
              completion_mask: torch.Tensor, needs: TeacherNeeds) -> TeacherScores:
        raise TypeError("TeacherRouter scores a batch through for_rows(names): which teacher "
                        "each row belongs to")

    def close(self) -> None:
        for t in self.teachers.values():
            t.close()


class _Routed(Teacher):
    def __init__(self, router: TeacherRouter, names: list[str]) -> None:
        self.router, self.names, self.vocab_size = router, names, router.vocab_size

    @property
    def capability(self) -> TeacherNeeds:
        return self.router.capability

    @torch.no_grad()
    def score(self, sequences: torch.Tensor, attention_mask: torch.Tensor,
              completion_mask: torch.Tensor, needs: TeacherNeeds) -> TeacherScores:
        self.check(needs)
        if len(self.names) != sequences.shape[0]:
            raise ValueError(f"{len(self.names)} teacher names for {sequences.shape[0]} rows")
        shape = (sequences.shape[0], sequences.shape[1] - 1)
        out = TeacherScores(token_logprobs=torch.zeros(shape, device=sequences.device))
        if needs.level == "topk":
            out.topk_logprobs = torch.full((*shape, needs.k), float("-inf"),
                                           device=sequences.device)
            out.topk_ids = torch.zeros((*shape, needs.k), dtype=torch.long,
                                       device=sequences.device)
        for name, teacher in self.router.teachers.items():
            rows = [i for i, n in enumerate(self.names) if n == name]
            if not rows:
                continue
            idx = torch.tensor(rows, device=sequences.device)
            start = time.perf_counter()
            got = teacher.score(sequences[idx], attention_mask[idx], completion_mask[idx], needs)
            self.router.seconds[name] += time.perf_counter() - start
            out.token_logprobs[idx] = got.sampled(sequences[idx][:, 1:],
                                                  completion_mask[idx][:, 1:].bool()).float()
            if needs.level == "topk":
                out.topk_logprobs[idx] = got.topk_logprobs.float()
                out.topk_ids[idx] = got.topk_ids
        return out
