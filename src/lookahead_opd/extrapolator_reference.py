"""The EffOPD gated search written out plainly: a reference to read, and to test against.

Like the ``*_reference.py`` files of schedule_free and prodigy, this is ``Extrapolator``'s
algorithm with plain tensors: full fp32 copies, whole tensors, no chunking, sharding,
offloading or sketches, and no care for memory or time. ``tests/core/test_extrapolator_reference.py``
holds ``Extrapolator`` to it bit for bit (weights after every step, coefficients tried, scores,
kept jumps) on random small problems, for every option that changes the weights.

Call ``after_step()`` after each optimizer step ``t``. With ``direction="averaged"`` every step
first folds ``W_t`` into the running average of the weights since the last search. At a
scheduled step (``schedule``/``every``) the search

1. scores the weights, ``s0 = eval_fn()``, and keeps a copy of ``W_t``;
2. forms ``Δ = base − anchor`` with ``base = W_t`` (``direction="secant"``) or the window
   average (``"averaged"``); the anchor is what the previous search left (at first the initial
   weights). With ``direction_rank=r`` each 2-D ``Δ`` is cut to its top-r singular triplets;
3. for each ``c`` in order (``coefficients``, ``max_candidates``) writes ``base + c·Δ`` and
   scores it, keeping it while it beats the best score so far by more than ``min_improvement``
   (``mode="min"``: lower is better; a non-finite score never wins) and, with ``margin = z``,
   by more than z standard errors of the mean of the per-example score differences (``eval_fn``
   then returns one score per example, its mean the score), and stops at the first that does
   not; with ``back_off = k`` a stop keeps the candidate k before the best (none if there
   are not k before it); with ``linearity = q`` a stop keeps none, and a ladder that never
   stopped keeps its last candidate only if the last of the segments joining ``(0, s0)`` and
   the candidates' points rose at least q times as steeply as the one before it;
4. puts back the best point (``W_t`` when no candidate won) and makes it the next anchor (for
   ``"averaged"`` with no winner: the window average). On a kept jump ``on_jump="reset"``
   empties the optimizer's state of the parameters.

``patience=k`` stops the searching for good after ``k`` refused searches in a row.
``snapshot="lowrank", rank=r`` stores each anchor of two or more dims (viewed as
``shape[0] × rest``) as ``reference + U·Vᵀ``: one power iteration of rank ``r`` on
``anchor − reference``, started from the previous ``V`` (PowerSGD's warm start; a seeded random
start when it has a zero column); 1-D tensors, and matrices the factors would not shrink, stay
dense. ``reference`` defaults to the initial weights.

Two steps are written the way the fused code computes them, so that the two agree bit for bit:
a candidate is ``torch.add(base, Δ, alpha=c)`` (the CPU may fuse the multiply-add), and a
low-rank anchor that is ``anchor + Δ`` (a refused search, or a kept ``c = 0``) is compressed
from ``Δ`` (``Y = U·VᵀQ + Δ·Q``: the fused search forms it in its one pass over the weights)
rather than from the weights, unless ``Y``'s ``R`` is too ill-conditioned to invert.

Bit for bit holds at any size with the full snapshot. A low-rank store's sums of products over
a matrix's rows are grouped, in the fused code, by its pass's blocks (6801 elements and up)
and its compression groups (2¹⁸ elements), and here in one product, so on matrices larger than
that the two anchors agree to float32 rounding only.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import Tensor

from .options import ExtrapolationOptions

__all__ = ["ReferenceExtrapolator", "Search"]


class Search(NamedTuple):
    """One search: ``scores[i]`` is the score of ``coefficients[i]``; ``accepted`` is the kept
    ``c``, or ``None`` when the weights were left at ``W_t``."""

    step: int
    score_before: float
    coefficients: list[float]
    scores: list[float]
    accepted: float | None


class ReferenceExtrapolator:
    """``Extrapolator``'s search, plainly. Takes its options (a state-dict ``reference``, no
    ``offload``); ``reduce`` and ``log_geometry`` do not change the weights and are ignored."""

    def __init__(self, params, eval_fn: Callable[[], float], optimizer=None, **options: Any):
        o = self.o = ExtrapolationOptions.from_kwargs(options)
        if o.offload is not None or o.snapshot not in ("full", "lowrank"):
            raise ValueError("the reference models snapshot='full' | 'lowrank' and offload=None")
        named = [x if isinstance(x, tuple) else (f"param.{i}", x) for i, x in enumerate(params)]
        self.params, self.eval_fn, self.optimizer = [p for _, p in named], eval_fn, optimizer
        self.schedule, self.coefficients = o.make_schedule(), o.coefficient_values()
        self.step, self.count, self.history = 0, 0, []
        self.avg = [torch.zeros_like(p, dtype=torch.float32) for p in self.params]
        refs = o.reference or dict(named)  # low-rank: anchor = reference + U·Vᵀ
        self.ref = [refs[name].detach().float().clone() for name, _ in named]
        self.gen = torch.Generator().manual_seed(0)  # the low-rank random starts
        self.anchor, self.uv = [None] * len(named), [None] * len(named)
        for i, p in enumerate(self.params):
            self._set_anchor(i, p.detach().float())

    @property
    def searching(self) -> bool:
        k = self.o.patience
        return k is None or len(self.history) < k or any(
            h.accepted is not None for h in self.history[-k:])

    @torch.no_grad()
    def after_step(self) -> Search | None:
        self.step += 1
        if not self.searching:
            return None
        if self.o.direction == "averaged":  # running mean of the weights since the last search
            self.count += 1
            for a, p in zip(self.avg, self.params, strict=True):
                a.lerp_(p.float(), 1.0 / self.count)
        return self.search() if self.schedule.is_search_step(self.step) else None

    @torch.no_grad()
    def search(self) -> Search:
        o, ps = self.o, self.params
        w_t = [p.clone() for p in ps]  # 1. score W_t and keep it
        s0, x0 = self._eval()
        best, best_x = s0, x0
        base = self.avg if o.direction == "averaged" else [w.float() for w in w_t]
        full = [b - a for b, a in zip(base, self.anchor, strict=True)]  # 2. the direction Δ
        delta = full if o.direction_rank is None else [_top(d, o.direction_rank) for d in full]
        cs = self.coefficients if math.isfinite(s0) else ()
        if o.direction == "averaged" and self.count <= 1:  # the average is W_t: c = 0 ties s0
            cs = tuple(c for c in cs if c != 0)
        tried, scores, accepted, kept = [], [], None, []
        for c in cs:  # 3. candidates while they beat the best score
            for p, b, d in zip(ps, base, delta, strict=True):
                p.copy_(torch.add(b, d, alpha=c))
            s, x = self._eval()
            tried.append(c)
            scores.append(s)
            better = s > best + o.min_improvement if o.mode == "max" else (
                s < best - o.min_improvement)
            if better and o.margin:  # the gain must stand out of the examples' noise
                d = x - best_x
                se = float(d.std() / math.sqrt(d.numel())) if d.numel() > 1 else math.inf
                better = abs(s - best) > o.margin * se
            if not (math.isfinite(s) and better):
                if o.back_off:  # the score turned: keep the candidate back_off before the best
                    accepted = kept[-1 - o.back_off] if len(kept) > o.back_off else None
                if o.linearity:  # the ladder stopped: it bent
                    accepted = None
                break
            best, best_x, accepted = s, x, c
            kept.append(c)
        else:  # every candidate improved: is the last rung's slope still near the one before?
            if o.linearity and tried:
                xs, ys = ([0.0], [s0]) if tried[0] != 0 else ([], [])
                xs, ys = xs + tried, ys + scores
                if o.mode == "min":
                    ys = [-y for y in ys]
                if len(xs) < 3 or ((ys[-1] - ys[-2]) / (xs[-1] - xs[-2])
                                   < o.linearity * (ys[-2] - ys[-3]) / (xs[-2] - xs[-3])):
                    accepted = None
        for p, w, b, d in zip(ps, w_t, base, delta, strict=True):  # 4. the best point stays
            p.copy_(w if accepted is None else torch.add(b, d, alpha=accepted))
        new = base if accepted is None else [p.float() for p in ps]  # ... and is the anchor
        plus_delta = bool(cs) and o.direction_rank is None and accepted in (None, 0.0)
        for i, t in enumerate(new):
            self._set_anchor(i, t, full[i] if plus_delta else None)
        self.count = 0
        if accepted is not None and o.on_jump == "reset":
            for p in ps:
                self.optimizer.state.pop(p, None)
        self.history.append(Search(self.step, s0, tried, scores, accepted))
        return self.history[-1]

    def _eval(self) -> tuple[float, Tensor | None]:
        """The score, and the per-example scores when ``eval_fn`` gives them (the score is
        then their mean, in float64)."""
        v = self.eval_fn()
        if isinstance(v, (list, tuple)) or isinstance(v, Tensor) and v.dim() == 1:
            x = torch.as_tensor(v).detach().to("cpu", torch.float64)
            return float(x.mean()), x
        return float(v), None

    def _set_anchor(self, i: int, new: Tensor, delta: Tensor | None = None) -> None:
        """Make ``new`` (fp32) the anchor of parameter ``i``. ``delta``: ``new`` is
        ``anchor + Δ`` for this search's whole ``Δ`` (refused, or ``c = 0`` kept)."""
        r, shape = self.o.rank, new.shape
        m = shape[0] if new.dim() >= 2 else 0
        n = new.numel() // m if m else 0
        if self.o.snapshot == "full" or not m or (m + n) * r >= m * n:  # kept dense
            self.anchor[i] = new.clone()
            return
        ref, start = self.ref[i].reshape(m, n), None if self.uv[i] is None else self.uv[i][1]
        if start is None or not bool((start.norm(dim=0) > 0).all()):
            start = torch.randn(n, r, generator=self.gen)
        q, u = torch.linalg.qr(start).Q, None
        if delta is not None:  # D = new − ref = U·Vᵀ + Δ: Y = D·Q, V' = Dᵀ·P from Δ alone
            (u0, v0), d = self.uv[i], delta.reshape(m, n)
            y = torch.addmm(u0 @ (v0.T @ q), d, q)
            p, tri = torch.linalg.qr(y)
            sv = torch.linalg.svdvals(tri)
            if bool(torch.isfinite(sv).all()) and float(sv[-1]) * 100.0 > float(sv[0]):
                dtp = torch.linalg.solve_triangular(tri, d.T @ y, upper=True, left=False)
                u, v = p, torch.addmm(dtp, v0, u0.T @ p)  # Dᵀ·P = V·(UᵀP) + Δᵀ·Y·R⁻¹
        if u is None:  # one power iteration on new − reference
            d = new.reshape(m, n) - ref
            u = torch.linalg.qr(d @ q).Q
            v = d.T @ u
        self.uv[i] = (u, v)
        self.anchor[i] = torch.addmm(ref, u, v.T).view(shape)


def _top(d: Tensor, r: int) -> Tensor:
    """A 2-D ``Δ`` cut to its top ``r`` singular triplets; others whole."""
    if d.dim() != 2 or min(d.shape) <= r:
        return d
    u, s, vh = torch.linalg.svd(d, full_matrices=False)
    return (u[:, :r] * s[:r]) @ vh[:r]
