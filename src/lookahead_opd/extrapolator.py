"""The EffOPD gated search over a set of parameters, usable from any training loop.

After every optimizer step call ``after_step()``. At a scheduled step ``t`` it

1. scores the current weights ``W_t`` (``s0 = eval_fn()``) and keeps ``W_t`` exactly;
2. forms the direction ``Δ = W_t − anchor`` (``direction="secant"``) or the difference of the
   current and previous windows' weight averages (``direction="averaged"``, candidates then
   start from the current average, so ``c = 0`` is the window average itself);
3. tries ``W = base + c·Δ`` for each coefficient ``c`` in order (fp32 math, cast to the
   parameter dtype), keeping a candidate only while it beats the best score by more than
   ``min_improvement`` (and, with ``margin = z`` and per-example scores, by more than z
   standard errors of the per-example differences), and stops at the first that does not
   (with ``back_off = k``, then keeping the candidate k before the best; with
   ``linearity = q`` keeping a jump only when none stopped it and the last rung's gain per
   unit of c is at least q times the rung's before);
4. leaves the best weights in place bit-exactly and makes them the next anchor.

After a kept jump ``on_jump="reset"`` (the default) clears the optimizer's state of the jumped
parameters; ``on_jump="keep"`` leaves the state and step count alone. The defaults
(``linearity=0.5``, ``on_jump="reset"``, ``patience=3``) keep a jump only where the lr reads far
too small; ``PAPER_RULE`` (``lookahead_opd.options``) is the paper's rule.
"""

from __future__ import annotations

import logging
import math
import numbers
import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Union

import torch
from torch import Tensor

from . import distributed
from .options import ExtrapolationOptions
from .sketch import SecantSketch
from .snapshot import FullSnapshot, LowRankSnapshot, SnapshotStore

__all__ = ["Extrapolator", "JumpRecord", "ParamsSpec", "Summary"]

logger = logging.getLogger(__name__)

ParamsSpec = Union[Iterable[Tensor], Iterable[tuple[str, Tensor]]]

_STATE_VERSION = 1
_CHUNK = 1 << 16  # elements a candidate is written at a time: bounds the fp32 scratch


@dataclass
class JumpRecord:
    """What one search did. ``accepted`` is the kept coefficient, or ``None`` when the
    weights were left at ``W_t``; ``scores[i]`` is the score of ``coefficients[i]``.
    ``direction_norm`` is ``‖Δ‖`` (of the projected ``Δ`` with ``direction_rank``);
    ``secant_cosine`` and ``norm_ratio`` compare ``Δ`` with the previous search's (see
    ``lookahead_opd.sketch``), ``None`` at the first search."""

    step: int
    score_before: float
    coefficients: list[float] = field(default_factory=list)
    scores: list[float] = field(default_factory=list)
    accepted: float | None = None
    n_evals: int = 0
    seconds: float = 0.0
    direction_norm: float = 0.0
    geometry: dict[str, float] | None = None
    secant_cosine: float | None = None
    norm_ratio: float | None = None

    @property
    def best_score(self) -> float:
        """The gate score of the weights left in place."""
        if self.accepted is None:
            return self.score_before
        return self.scores[self.coefficients.index(self.accepted)]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> JumpRecord:
        return cls(**dict(d))


@dataclass
class Summary:
    """What the searches bought (``Extrapolator.summary()``). ``search_seconds`` covers gate
    evaluations and candidate writes; ``mean_secant_cosine`` is ``None`` before the second
    search; ``extra_distance`` is ``Σ c·‖Δ‖`` over kept jumps divided by ``Σ ‖Δ‖`` over all
    searches: the distance the jumps added, as a multiple of the distance the optimizer moved
    (a large value hints that a larger learning rate may do the same; with
    ``direction="averaged"`` it counts the ``c·‖Δ‖`` part of a jump, not the move to the
    window average); ``stopped_after`` is the step of the last search when ``patience`` ended
    the searching, else ``None``."""

    searches: int
    kept_jumps: int
    gate_evals: int
    search_seconds: float
    mean_secant_cosine: float | None
    extra_distance: float
    stopped_after: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def __str__(self) -> str:
        cos = "n/a" if self.mean_secant_cosine is None else f"{self.mean_secant_cosine:.2f}"
        return (
            f"{self.searches} searches, {self.kept_jumps} jumps kept, {self.gate_evals} gate "
            f"evals in {self.search_seconds:.1f}s, mean secant cosine {cos}, kept jumps moved "
            f"{self.extra_distance:.2f}x the distance the optimizer did"
            + ("" if self.stopped_after is None else
               f"; searching stopped after step {self.stopped_after} (patience)")
        )


def _named(params: ParamsSpec) -> list[tuple[str, Tensor]]:
    items = list(params)
    out: list[tuple[str, Tensor]] = []
    for i, item in enumerate(items):
        if isinstance(item, Tensor):
            out.append((f"param.{i}", item))
        elif (
            isinstance(item, tuple)
            and len(item) == 2
            and isinstance(item[0], str)
            and isinstance(item[1], Tensor)
        ):
            out.append(item)
        else:
            raise TypeError(
                f"params must be tensors or (name, tensor) pairs, got {type(item).__name__} at {i}"
            )
    names = [n for n, _ in out]
    if len(set(names)) != len(names):
        raise ValueError("params contain duplicate names")
    if len({id(p) for _, p in out}) != len(out):
        raise ValueError("params contain the same tensor twice")
    for name, p in out:
        if not p.is_floating_point():
            raise TypeError(f"param {name!r} has dtype {p.dtype}; only floating-point params extrapolate")
    return out


def _to_score(value: object) -> tuple[float, Tensor | None]:
    """``eval_fn``'s answer as (score, per-example scores or None): a number; or a 1-D tensor,
    list or tuple of per-example scores, whose mean is the score."""
    if isinstance(value, (list, tuple)):
        if not value or not all(isinstance(v, numbers.Real) and not isinstance(v, bool)
                                for v in value):
            raise TypeError(f"eval_fn must return a number, or a {type(value).__name__} of "
                            f"one real number per example (at least one), got {value!r}")
        value = torch.tensor(value, dtype=torch.float64)
    if isinstance(value, Tensor):
        if value.dim() != 1 and value.numel() == 1:
            return float(value.item()), None
        if value.dim() != 1 or value.is_complex():
            raise TypeError("eval_fn must return one number or a 1-D tensor of per-example "
                            f"scores, got a {value.dtype} tensor of shape {tuple(value.shape)}")
        per = value.detach().to("cpu", torch.float64)
        return float(per.mean()), per
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"eval_fn must return a real number, got {type(value).__name__}: {value!r}")
    return float(value), None


def _paired_standard_error(a: Tensor, b: Tensor) -> float:
    """The standard error of the mean of ``a − b`` (the same examples scored twice): what a
    score difference that large would be by chance alone. Infinite with fewer than 2."""
    if a.shape != b.shape:
        raise ValueError(f"eval_fn scored {a.numel()} examples, and {b.numel()} before: a "
                         "margin needs the same examples at every call")
    if a.numel() < 2:
        return math.inf
    return float((a - b).std() / math.sqrt(a.numel()))


class Extrapolator:
    """Schedule + anchor + validation-gated extrapolation over a list of parameters.

    Args:
        params: tensors or ``(name, tensor)`` pairs to extrapolate (names matter only for a
            low-rank ``reference`` state dict and for geometry logs).
        eval_fn: no arguments, returns a number, or one score per example (a 1-D tensor, list
            or tuple: the score is their mean; ``margin`` needs these); higher is better unless
            ``mode="min"``.
        optimizer: the optimizer stepping ``params``; needed by ``on_jump="reset"``.
        **options: the fields of ``ExtrapolationOptions`` (validated there): ``mode``,
            ``min_improvement``, ``margin``, ``back_off``, ``linearity``, ``schedule``/``every``, ``coefficients``/``max_candidates``,
            ``patience``, ``snapshot``/``rank``/``reference``, ``offload``, ``direction``,
            ``direction_rank``, ``on_jump``, ``reduce``/``process_group``, ``log_geometry``.
    """

    def __init__(
        self,
        params: ParamsSpec,
        eval_fn: Callable[[], float],
        *,
        optimizer: torch.optim.Optimizer | None = None,
        **options: Any,
    ) -> None:
        if not callable(eval_fn):
            raise TypeError(f"eval_fn must be callable, got {type(eval_fn).__name__}")
        o = self.options = ExtrapolationOptions.from_kwargs(options)
        if o.lr_follow is not None:  # it acts in the optimizer's step, which this does not own
            raise ValueError("lr_follow scales the base optimizer's steps inside "
                             "ExtrapolatingOptimizer.step(); wrap the optimizer in one to use it")
        if o.on_jump == "reset" and optimizer is None:
            raise ValueError("on_jump='reset' (the default) needs the optimizer whose state to "
                             "reset: pass optimizer=, or on_jump='keep'")
        self.eval_fn = eval_fn
        self.mode = o.mode
        self.min_improvement = float(o.min_improvement)
        self.margin = float(o.margin)
        self.back_off = int(o.back_off)
        self.linearity = float(o.linearity)
        self.schedule = o.make_schedule()
        self.coefficients = o.coefficient_values()
        self.patience = o.patience
        self.direction = o.direction
        self.direction_rank = o.direction_rank
        self._projected: list[Tensor | None] | None = None  # direction_rank: Δ_r of this search
        self.on_jump = o.on_jump
        self.optimizer = optimizer
        self.reduce = o.reduce
        self.process_group = o.process_group
        self.log_geometry = bool(o.log_geometry)
        self._buffer_device = None if o.offload is None else torch.device(o.offload)
        self.store = _make_store(o, self._buffer_device)

        self.step_count = 0
        self.history: list[JumpRecord] = []
        self._names: list[str] = []
        self._params: list[Tensor] = []
        self._averages: list[Tensor] = []  # direction="averaged": running mean of this window
        self._window_count = 0
        self.secant = SecantSketch(0)  # the previous search's direction, sketched
        self.add_params(params)
        if not self._params:
            raise ValueError("Extrapolator got no parameters to extrapolate")

    # ------------------------------------------------------------------ parameters
    @property
    def params(self) -> list[Tensor]:
        """The extrapolated parameters, in order."""
        return list(self._params)

    @property
    def names(self) -> list[str]:
        return list(self._names)

    def add_params(self, params: ParamsSpec) -> None:
        """Extrapolate more parameters from now on; their current values become the anchor."""
        named = _named(params)
        known = {id(p) for p in self._params}
        clash = [n for n, p in named if id(p) in known or n in self._names]
        if clash:
            raise ValueError(f"params already extrapolated: {clash}")
        if self._window_count:
            # Mid-window additions would skew the average: start it over for everyone.
            self._window_count = 0
        self._names.extend(n for n, _ in named)
        self._params.extend(p for _, p in named)
        self.secant.resize(sum(p.numel() for p in self._params))  # global sizes: same on all ranks
        if not self.searching:  # nothing to anchor any more
            return
        with torch.no_grad():
            local = [distributed.local_tensor(p).detach() for _, p in named]
            self.store.add([n for n, _ in named], local)
            if self.direction == "averaged":
                self._averages.extend(
                    torch.zeros(t.shape, dtype=torch.float32, device=self._buffer_device or t.device)
                    for t in local
                )

    def _local(self) -> Iterator[Tensor]:
        return (distributed.local_tensor(p).detach() for p in self._params)

    # ------------------------------------------------------------------ stepping
    def after_step(self) -> JumpRecord | None:
        """Count one optimizer step; run the gated search if the schedule says so."""
        self.step_count += 1
        if not self.searching:
            return None
        if self.direction == "averaged":
            self._accumulate_average()
        if self.schedule.is_search_step(self.step_count):
            return self.search()
        return None

    @property
    def searching(self) -> bool:
        """False once ``patience`` searches in a row kept no jump: later scheduled steps do not
        search (from ``history``, so a resumed run stops where the original did)."""
        return not self._stopped(self.history)

    def _stopped(self, history: Sequence[JumpRecord]) -> bool:
        """Whether ``history`` ends in ``patience`` refused searches."""
        if self.patience is None or len(history) < self.patience:
            return False
        return all(r.accepted is None for r in history[-self.patience:])

    @torch.no_grad()
    def _accumulate_average(self) -> None:
        self._window_count += 1
        w = 1.0 / self._window_count
        for avg, p in zip(self._averages, self._local(), strict=False):
            avg.lerp_(p.to(avg.device, torch.float32), w)

    def _score(self, stacklevel: int = 3) -> tuple[float, Tensor | None]:
        """``eval_fn``'s score, reduced across ranks, and its per-example scores (None when it
        gave one number); warns when the score is non-finite (``stacklevel`` for
        ``warnings.warn``: callers one frame deeper than ``search`` pass one more)."""
        raw, per = _to_score(self.eval_fn())
        if self.margin:
            if per is None:
                raise TypeError("margin > 0 needs eval_fn to return one score per example (a "
                                "1-D tensor, list or tuple), got one number")
            if distributed.is_distributed(self.process_group):
                raise ValueError("margin > 0 needs every example's score in one process; it "
                                 "does not run under torch.distributed yet")
        score = distributed.reduce_score(raw, self.reduce, self.process_group)
        if not math.isfinite(score):
            warnings.warn(
                f"eval_fn gave a non-finite score ({score}) at step {self.step_count}; "
                "treated as a rejection",
                RuntimeWarning,
                stacklevel=stacklevel,
            )
        return score, per

    def _better(self, score: float, best: float, examples: Tensor | None,
                best_examples: Tensor | None) -> bool:
        """Whether ``score`` beats ``best`` by more than ``min_improvement`` and, with a
        ``margin``, by more than that many paired standard errors of their ``examples``."""
        if not math.isfinite(score):
            return False
        if self.mode == "max":
            better = score > best + self.min_improvement
        else:
            better = score < best - self.min_improvement
        if better and self.margin:  # _score made sure both are there
            better = abs(score - best) > self.margin * _paired_standard_error(examples,
                                                                             best_examples)
        return better

    def _base(self, i: int, backup: Sequence[Tensor], device: torch.device) -> Tensor:
        """The fp32 point candidates start from: ``W_t`` or the window average."""
        src = self._averages[i] if self.direction == "averaged" else backup[i]
        return src.to(device=device, dtype=torch.float32)

    def _direction(self, i: int, backup: Sequence[Tensor]) -> Tensor:
        """``Δ`` of parameter ``i`` (its local shard), fp32, on the restore buffer's device."""
        device = backup[i].device
        return self._base(i, backup, device) - self.store.anchor(i, device)

    @torch.no_grad()
    def copy_weights(self) -> list[Tensor]:
        """A copy of the current weights ``W_t`` (on the ``offload`` device when set): the
        ``backup`` that ``apply`` extrapolates from and ``restore`` puts back."""
        return [t.to(self._buffer_device or t.device, copy=True) for t in self._local()]

    @torch.no_grad()
    def restore(self, backup: Sequence[Tensor]) -> None:
        """Put the weights of ``backup`` (from ``copy_weights``) back, bit-exactly."""
        for p, b in zip(self._local(), backup, strict=True):
            p.copy_(b)

    @torch.no_grad()
    def apply(self, c: float, backup: Sequence[Tensor], *, measure: bool = False) -> float:
        """Write the candidate ``base + c·Δ`` into every parameter, as the search does (``base``
        is ``backup``'s ``W_t``, or the window average for ``direction="averaged"``). With
        ``measure``, also return ``‖Δ‖`` (else 0), of the whole tensors when sharded."""
        sq = [0.0] * len(self._params)
        scratch: dict[torch.device, Tensor] = {}
        for i, p in enumerate(self._local()):
            base = self._base(i, backup, p.device)
            projected = None if self._projected is None else self._projected[i]
            if projected is not None:
                if measure:
                    sq[i] = float(projected.square().sum())
                p.copy_(torch.add(base, projected.to(p.device), alpha=c))  # base may be the backup
                continue
            if p.device not in scratch:
                scratch[p.device] = torch.empty(_CHUNK, device=p.device)
            with _Flat(p) as flat:
                base = base.reshape(-1)
                for a in range(0, flat.numel(), _CHUNK):
                    z = min(a + _CHUNK, flat.numel())
                    delta = self.store.delta_run(i, a, z, base[a:z], scratch[p.device][: z - a])
                    if measure:
                        sq[i] += float(delta.double().square().sum())
                    _candidate(flat[a:z], base[a:z], delta, c)
        return math.sqrt(distributed.square_sum(self._params, sq)) if measure else 0.0

    @torch.no_grad()
    def _prepare(self, first: float | None) -> tuple[list[Tensor], Tensor]:
        """One pass over the weights, a run of elements at a time: copy ``W_t`` into the
        backup, sketch ``Δ`` and, when ``first`` is a coefficient, write that candidate (what
        ``apply(first)`` writes) and hand ``Δ`` to the store (``observe``: a low-rank store
        compresses the next anchor from it). A one-candidate search thus reads the weights and
        the anchor once, and writes the backup and the candidate once. Returns
        ``(backup, sketch)``; on an exception the weights are put back first."""
        backup: list[Tensor] = []
        run, finished, done = None, 0, 0  # parameters passed; elements of the next backed up
        try:
            for i, param in enumerate(self._params):
                p = distributed.local_tensor(param).detach()
                run = run or self.secant.start(p.device, self.process_group)
                b = torch.empty(p.shape, dtype=p.dtype, device=self._buffer_device or p.device)
                backup.append(b)
                done = 0
                with _Flat(p, write=first is not None) as flat:
                    b_flat, scratch = b.view(-1), run.scratch(p.device)
                    base = flat if self.direction == "secant" else (
                        self._averages[i].to(p.device).view(-1))
                    for piece in run.pieces(i, p, distributed.shard_layout(param)):
                        a, z = piece.start, piece.stop
                        b_flat[a:z].copy_(flat[a:z])
                        done = z
                        if piece.mine or first is not None:
                            delta = self.store.delta_run(i, a, z, base[a:z], scratch[: z - a])
                            if first is not None:  # every element's Δ passes here, in order
                                _candidate(flat[a:z], base[a:z], delta, first)
                                self.store.observe(i, a, delta)
                            if piece.mine:
                                run.add(piece, delta)
                finished += 1
            sketch = run.result() if run is not None else None  # all-reduced: a collective
        except BaseException:
            if first is not None:  # candidates were written up to here: W_t comes back
                for n, (p, b) in enumerate(zip(self._local(), backup, strict=False)):
                    if n < finished:
                        p.copy_(b)
                    elif p.is_contiguous():  # a copy of a non-contiguous one was not written
                        p.view(-1)[:done].copy_(b.view(-1)[:done])
            raise
        if sketch is None:
            raise RuntimeError("no parameters to search over")
        return backup, sketch

    @torch.no_grad()
    def search(self) -> JumpRecord:
        """Run one gated search now (normally called by ``after_step``) and record it."""
        if not self.searching:
            raise RuntimeError(f"searching stopped after step {self.history[-1].step} "
                               f"(patience={self.patience}) and its anchor was freed")
        start = time.perf_counter()
        record = JumpRecord(step=self.step_count, score_before=math.nan)
        # Score W_t before the pass: it may write the first candidate into the weights.
        record.score_before, examples = self._score()
        record.n_evals = 1
        coefficients = self._schedule(record.score_before)
        projecting = bool(coefficients) and self.direction_rank is not None
        first = coefficients[0] if coefficients and not projecting else None
        # Hashed on the parameters' device even when the buffers are offloaded (GPU >> CPU).
        backup, sketch = self._prepare(first)
        record.direction_norm = math.sqrt(float(sketch[-1]))
        record.secant_cosine, record.norm_ratio = self.secant.compare(sketch)
        try:
            if self.log_geometry:
                record.geometry = self._geometry(backup)
            if projecting:
                self._projected = self._project(backup)
            self._try_candidates(record, coefficients, backup, examples,
                                 written=first is not None, projecting=projecting)
        except BaseException:
            self._projected = None
            self.restore(backup)
            raise
        self._projected = None
        self._set_anchor(record.accepted, backup, observed=first is not None)
        self.secant.remember(sketch)
        if record.accepted is not None and self.on_jump == "reset":
            for p in self._params:
                self.optimizer.state.pop(p, None)  # type: ignore[union-attr]
        record.seconds = time.perf_counter() - start
        self.history.append(record)
        logger.info(
            "search at step %d: score %.6g -> %.6g, accepted c=%s after %d evals (%.2fs)",
            record.step,
            record.score_before,
            record.best_score,
            record.accepted,
            record.n_evals,
            record.seconds,
        )
        if not self.searching:
            self._release()
        return record

    def _schedule(self, score_before: float) -> tuple[float, ...]:
        """The coefficients this search tries, in order: none when ``W_t`` scored non-finite."""
        if not math.isfinite(score_before):
            return ()
        coefficients = self.coefficients
        if self.direction == "averaged" and self._window_count <= 1:
            # A one-step window's average is W_t itself: c = 0 would tie s0.
            coefficients = tuple(c for c in coefficients if c != 0)
        return coefficients

    def _try_candidates(self, record: JumpRecord, coefficients: Sequence[float],
                        backup: Sequence[Tensor], best_examples: Tensor | None, *,
                        written: bool, projecting: bool) -> None:
        """Score the candidates in order into ``record`` until one fails to beat the best so
        far, then leave the weights at the accepted candidate (``W_t`` if none). ``written``:
        the pass already wrote the first candidate into the weights; ``best_examples``: the
        per-example scores of ``W_t``."""
        best = record.score_before
        kept: list[float] = []  # the candidates that beat the best so far, in order
        for n, c in enumerate(coefficients):
            if n > 0 or not written:  # the pass wrote the first candidate already
                norm = self.apply(c, backup, measure=projecting and n == 0)
                if projecting and n == 0:  # the projection shrinks ‖Δ‖
                    record.direction_norm = norm
            score, examples = self._score(stacklevel=4)
            record.n_evals += 1
            record.coefficients.append(c)
            record.scores.append(score)
            if not self._better(score, best, examples, best_examples):
                if self.back_off:  # the score turned: step back from its edge
                    b = self.back_off
                    record.accepted = kept[-1 - b] if len(kept) > b else None
                if self.linearity:  # a ladder that stopped bent past any linearity
                    record.accepted = None
                break
            best, record.accepted, best_examples = score, c, examples
            kept.append(c)
        else:
            if self.linearity and not self._still_linear(record):
                record.accepted = None
        if record.coefficients and record.coefficients[-1] != record.accepted:
            # Undo the rejected candidate exactly.
            if record.accepted is None:
                self.restore(backup)
            else:
                self.apply(record.accepted, backup)

    def _still_linear(self, record: JumpRecord) -> bool:
        """Whether the last rung of a ladder whose every candidate improved gained, per unit
        of c, at least ``linearity`` times the rung's before (rungs between the points
        ``(0, score_before)`` and the candidates'; a first candidate c = 0 stands for the
        first point)."""
        sign = 1.0 if self.mode == "max" else -1.0
        points = list(zip(record.coefficients, record.scores, strict=True))
        if not points or points[0][0] != 0:
            points.insert(0, (0.0, record.score_before))
        if len(points) < 3:
            return False
        (c0, s0), (c1, s1), (c2, s2) = points[-3:]
        before, last = sign * (s1 - s0) / (c1 - c0), sign * (s2 - s1) / (c2 - c1)
        return last >= self.linearity * before

    def _release(self) -> None:
        """Searching has stopped for good: drop the anchor and the running average (a copy of
        the weights each), which nothing reads any more."""
        self.store = _Released()
        self._averages = []

    @torch.no_grad()
    def _project(self, backup: Sequence[Tensor]) -> list[Tensor | None]:
        """Each 2-D parameter's ``Δ`` truncated to its top ``direction_rank`` singular triplets
        (fp32); ``None`` for the others, which keep the full ``Δ``."""
        out: list[Tensor | None] = []
        r = self.direction_rank
        for i, p in enumerate(self._local()):
            if p.dim() != 2 or min(p.shape) <= r:  # type: ignore[operator]
                out.append(None)
                continue
            base = self._base(i, backup, p.device)
            delta = base - self.store.anchor(i, p.device)
            u, sv, vh = torch.linalg.svd(delta, full_matrices=False)
            out.append((u[:, :r] * sv[:r]) @ vh[:r])
        return out

    @torch.no_grad()
    def _set_anchor(self, accepted: float | None, backup: Sequence[Tensor], observed: bool,
                    ) -> None:
        """Make the weights left in place the anchor. With ``observed`` (the pass handed the
        store this search's ``Δ``) they are ``anchor + (1 + c)·Δ``, ``c`` the kept coefficient
        (0 when refused): ``base = anchor + Δ`` and the weights are ``base + c·Δ``."""
        scale = 1.0 + (accepted or 0.0) if observed else None
        if accepted is not None:
            for i, p in enumerate(self._local()):
                self.store.advance(i, p, scale)
        elif self.direction == "secant":
            # The weights are W_t again, which the backup holds: it becomes the anchor (a full
            # store keeps the tensor itself, no copy) unless it lives on another device.
            for i, (p, b) in enumerate(zip(self._local(), backup, strict=True)):
                own = b.device == p.device
                self.store.advance(i, b if own else p, scale, own=own)
        else:
            for i, avg in enumerate(self._averages):
                self.store.advance(i, avg, scale)
        self._window_count = 0

    def _geometry(self, backup: Sequence[Tensor]) -> dict[str, float]:
        from .geometry import summarize

        return summarize(_LazyDirections(self, backup))

    def summary(self) -> Summary:
        """What the searches bought so far, from ``history`` (see ``Summary``)."""
        h = self.history
        cosines = [r.secant_cosine for r in h if r.secant_cosine is not None]
        moved = sum(r.direction_norm for r in h)
        extra = sum(r.accepted * r.direction_norm for r in h if r.accepted is not None)
        return Summary(
            searches=len(h),
            kept_jumps=sum(r.accepted is not None for r in h),
            gate_evals=sum(r.n_evals for r in h),
            search_seconds=sum(r.seconds for r in h),
            mean_secant_cosine=sum(cosines) / len(cosines) if cosines else None,
            extra_distance=extra / moved if moved > 0 else 0.0,
            stopped_after=None if self.searching else h[-1].step,
        )

    # ------------------------------------------------------------------ memory and state
    def nbytes(self) -> dict[str, int]:
        """Bytes held between searches: the anchor store, the running average and the
        sketch of the previous direction."""
        return {
            "anchor": self.store.nbytes(),
            "average": sum(a.numel() * a.element_size() for a in self._averages),
            "sketch": self.secant.nbytes(),
        }

    def state_dict(self) -> dict[str, Any]:
        """Counter, anchor, running average and history; tensors are references, as in
        ``torch.optim.Optimizer.state_dict``."""
        return {
            "version": _STATE_VERSION,
            "step_count": self.step_count,
            "direction": self.direction,
            "names": list(self._names),
            "anchor": self.store.state_dict(),
            "averages": list(self._averages),
            "window_count": self._window_count,
            "secant": self.secant.state_dict(),
            "history": [r.to_dict() for r in self.history],
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what ``state_dict`` returned, into an extrapolator over the same params."""
        if state.get("version") != _STATE_VERSION:
            raise ValueError(f"unknown extrapolator state version {state.get('version')!r}")
        if state["direction"] != self.direction:
            raise ValueError(
                f"state was saved with direction={state['direction']!r}, this is {self.direction!r}"
            )
        if len(state["names"]) != len(self._params):
            raise ValueError(
                f"state holds {len(state['names'])} params, this extrapolator has {len(self._params)}"
            )
        history = [JumpRecord.from_dict(r) for r in state["history"]]
        if state["anchor"].get("kind") == _Released.kind:
            if not self._stopped(history):
                raise ValueError("state was saved after patience stopped the searching and freed "
                                 f"the anchor; load it with the same patience (this has "
                                 f"patience={self.patience})")
            self._release()
        else:
            self.store.load_state_dict(state["anchor"])
            self._averages = [
                a.to(device=mine.device, dtype=mine.dtype, copy=True)
                for a, mine in zip(state["averages"], self._averages, strict=True)
            ]
        self.step_count = int(state["step_count"])
        self._window_count = int(state["window_count"])
        if "secant" in state:  # absent from states saved before the sketch existed
            self.secant.load_state_dict(state["secant"])
        self.history = history

    def __repr__(self) -> str:
        return (
            f"Extrapolator({len(self._params)} params, schedule={self.schedule!r}, "
            f"coefficients={self.coefficients}, direction={self.direction!r}, store={self.store!r})"
        )


class _LazyDirections(Mapping):
    """``name -> Δ`` computed on access, so geometry logging holds one direction at a time."""

    def __init__(self, ex: Extrapolator, backup: Sequence[Tensor]) -> None:
        self._ex, self._backup = ex, backup
        self._index = {n: i for i, n in enumerate(ex._names)}

    def __getitem__(self, name: str) -> Tensor:
        return self._ex._direction(self._index[name], self._backup)

    def __iter__(self) -> Iterator[str]:
        return iter(self._index)

    def __len__(self) -> int:
        return len(self._index)


class _Released(SnapshotStore):
    """The anchor store after ``patience`` stopped the searching: it holds nothing."""

    kind = "released"

    def nbytes(self) -> int:
        return 0

    def __len__(self) -> int:
        return 0

    def state_dict(self) -> dict[str, Any]:
        return {"kind": self.kind}

    def __repr__(self) -> str:
        return "released (searching stopped)"


class _Flat:
    """``with _Flat(p) as flat``: ``p`` flattened, as a view when ``p`` is contiguous, else as
    a copy that is written back on exit (``write=True``, and no exception)."""

    def __init__(self, p: Tensor, write: bool = True) -> None:
        self.p, self.write = p, write
        self.flat = p.view(-1) if p.is_contiguous() else p.contiguous().view(-1)

    def __enter__(self) -> Tensor:
        return self.flat

    def __exit__(self, kind: object, *_: object) -> None:
        if kind is None and self.write and self.flat.data_ptr() != self.p.data_ptr():
            self.p.copy_(self.flat.view_as(self.p))


def _candidate(dst: Tensor, base: Tensor, delta: Tensor, c: float) -> None:
    """``dst = base + c·delta`` in fp32, cast to ``dst``'s dtype: one formula wherever a
    candidate is written, so re-applying a kept one gives the same bits."""
    if dst.dtype == base.dtype == torch.float32 and dst.device == base.device == delta.device:
        torch.add(base, delta, alpha=c, out=dst)
    else:
        dst.copy_(torch.add(base.to(delta.device, torch.float32), delta, alpha=c))


def _make_store(o: ExtrapolationOptions, device: torch.device | None) -> SnapshotStore:
    """The anchor store the (validated) options name."""
    if isinstance(o.snapshot, SnapshotStore):
        return o.snapshot
    if o.snapshot == "lowrank":
        return LowRankSnapshot(o.rank, o.reference)
    # The averaged direction's anchor is an fp32 average: keep it in fp32.
    return FullSnapshot(device=device, dtype=torch.float32 if o.direction == "averaged" else None)
