"""``OPDTrainer``: the reference on-policy distillation loop, readable top to bottom.

One optimizer step (``train_step``) is rollout → score → update:
  1. rollout: sample ``batch_size`` training prompts (a fixed function of seed and step, so a
     resumed run sees the same prompts) and roll the student out through the engine
     (temperature 1 by default);
  2. score: the sampled tokens with the student (with grad) and the teacher (no grad), the
     loss (``losses.py``) normalised by the completion tokens of the whole step across
     gradient accumulation, backward;
  3. update: clip, ``optimizer.step()`` — which, when ``extrapolate=True``, is an
     ``ExtrapolatingOptimizer`` whose gate generates through the same engine.
``train()`` then logs a JSON line (``metrics.py``), evaluates and checkpoints
(``checkpoint.py``) on schedule. Under torchrun the ranks split the prompts (``ranks.py``);
with ``fsdp`` they also shard the student (``sharding.py``).
Every generation goes through ``synced_engine``, the one place the student's weights reach
the engine.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lookahead_opd import ExtrapolatingOptimizer, Summary
from lookahead_opd.distributed import resharding
from lookahead_opd.selection import PARAM_SELECTORS

from .checkpoint import (
    clear_earlier_run,
    latest_checkpoint,
    read_checkpoint,
    read_newest_checkpoint,
    read_sharded_checkpoint,
    set_aside,
    write_checkpoint,
    write_sharded_checkpoint,
)
from .config import OPDConfig
from .engines import Engine, Rollout
from .logits import model_logits
from .losses import (
    compute_loss,
    group_advantages,
    reverse_kl_loss,
    teacher_needs,
    topk_reverse_kl_loss,
)
from .metrics import MetricsLog
from .optimizers import OptimizerFactory, build_optimizer, optimizer_kwargs
from .ranks import Ranks
from .routing import TeacherRouter
from .scoring import greedy_accuracy, greedy_correct, loss_chunk_rows, score_tokens
from .sharding import require_process_group, shard, train_top_blocks
from .tasks import Problem, Task
from .teacher import ModelTeacher, Teacher, TeacherNeeds, TeacherScores
from .vocab import check_vocab_compatible

__all__ = ["OPDTrainer", "TrainResult", "RunProblems", "run_problems"]

logger = logging.getLogger(__name__)


@dataclass
class TrainResult:
    """What ``train()`` returns: per-step metric dicts, the eval points (step, accuracy), the
    searches, and with ``extrapolate`` what they bought (``ExtrapolatingOptimizer.summary``)."""

    metrics: list[dict[str, Any]] = field(default_factory=list)
    evals: list[tuple[int, float]] = field(default_factory=list)
    jumps: list[dict[str, Any]] = field(default_factory=list)
    summary: Summary | None = None


@dataclass(frozen=True)
class RunProblems:
    """A run's problems, built once (``run_problems``) and handed to whatever needs them
    (``OPDTrainer``, the served teachers' probe, the router's check), all ranks' together:
    ``train`` (every training problem, in the seed's order), ``gate`` (the fixed gate set;
    None where there is no gate: built at first use) and ``eval`` (the held-out set)."""

    train: list[Problem]
    gate: list[Problem] | None
    eval: list[Problem]


def run_problems(task: Task, config: OPDConfig) -> RunProblems:
    """``config``'s problems of ``task``; a split too small for what the config asks fails in
    one line naming the flag (``batch_size``, ``gate_size``, ``eval_size``)."""
    train = task.problems("train", seed=config.seed)
    if len(train) < config.batch_size:
        raise ValueError(f"batch_size {config.batch_size} exceeds the {len(train)} "
                         f"training problems of task {task.name!r}")
    gate = (_sample(task, "gate", config.gate_size, config.seed, "--gate_size")
            if config.gated() else None)
    return RunProblems(train, gate,
                       _sample(task, "test", config.eval_size, config.seed, "--eval_size"))


class OPDTrainer:
    """On-policy distillation of ``student`` toward ``teacher`` on ``task``.

    ``engine`` generates the student's rollouts (``HFEngine`` over the live ``student`` module,
    or a ``VLLMEngine`` that receives the weights before every generation: rollouts, gate
    candidates, evaluations). ``teacher`` is an ``nn.Module`` (scored in process,
    ``ModelTeacher``) or any ``Teacher``; ``self.teacher_scorer`` is the ``Teacher`` the
    loss and the gate read. ``tokenizer`` defaults to ``engine.tokenizer``. ``callbacks`` are
    called with each step's metrics dict. ``problems`` are the run's (``run_problems``, built
    here when not given).

    ``config`` must be valid: ``train.build_trainer`` checks it (``train.check_run``) before it
    loads any model; whoever builds an ``OPDTrainer`` directly calls ``config.validate()``.
    """

    def __init__(
        self,
        config: OPDConfig,
        student: nn.Module,
        teacher: nn.Module | Teacher,
        task: Task,
        engine: Engine,
        *,
        tokenizer: Any = None,
        callbacks: list[Callable[[dict[str, Any]], None]] | None = None,
        optimizer_factory: OptimizerFactory | None = None,
        problems: RunProblems | None = None,
    ) -> None:
        self.optimizer_factory = optimizer_factory  # replaces config.optimizer when given
        self.config, self.student, self.teacher, self.task, self.engine = (
            config, student, teacher, task, engine)
        self.tokenizer = tokenizer if tokenizer is not None else engine.tokenizer
        self.callbacks = list(callbacks or [])
        self.loss_options = config.loss_options()
        teacher_model = teacher.model if isinstance(teacher, ModelTeacher) else teacher
        self.vocab_size = check_vocab_compatible(
            student, teacher_model if isinstance(teacher_model, nn.Module) else teacher.vocab_size,
            tokenizer=self.tokenizer)
        self.max_new_tokens = config.max_new_tokens or task.max_new_tokens
        self.output_dir = Path(config.output_dir)
        self.ranks = Ranks.current()
        self.rank, self.world = self.ranks.rank, self.ranks.world
        self._set_problems(problems or run_problems(task, config))
        self._place_models(teacher_model)
        self._set_teacher(teacher)
        student.train()
        if config.train_top_blocks:  # before the optimizer: it takes the trainable weights
            train_top_blocks(student, config.train_top_blocks)
        self.gate_evals = 0
        self.gate_seconds = 0.0
        self._gate_sequences: dict[str, torch.Tensor] | None = None
        # The teacher's scores of the fixed gate rollouts: the teacher does not change, so they
        # are computed once per gate rollouts (sampled once per run, or loaded on resume).
        self._gate_teacher: TeacherScores | None = None
        self.optimizer = self._build_optimizer()
        self.ema = None
        if config.ema_decay is not None:
            from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

            self.ema = AveragedModel(student, multi_avg_fn=get_ema_multi_avg_fn(config.ema_decay),
                                     use_buffers=True)
        warmup = config.warmup_steps
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: min(1.0, (s + 1) / warmup) if warmup else 1.0)
        self.step = 0
        self.train_seconds = 0.0  # rollouts + scoring + updates + gate; periodic evals excluded
        self.metrics_log = MetricsLog(self.output_dir, config.report_to_list(),
                                      run_config=config.to_dict(), enabled=self.ranks.is_main)

    def _set_problems(self, problems: RunProblems) -> None:
        """The training problems (all ranks'), and this rank's share of the gate set (where
        there is a gate, else built at first use, ``gate_problems``: a plain run needs no gate
        split) and of the eval set. Their sizes were checked by ``run_problems``."""
        self.train_problems = problems.train
        self._gate_problems: list[Problem] | None = (
            None if problems.gate is None else self.ranks.shard(problems.gate))
        self.eval_problems = self.ranks.shard(problems.eval)

    def _place_models(self, teacher_model: Any) -> None:
        """Every rank starts from rank 0's student; with ``fsdp`` it is sharded (and the
        teacher too with ``fsdp_teacher=shard``); the in-process teacher is frozen."""
        c = self.config
        if c.fsdp:
            self._check_fsdp()
        self.ranks.broadcast_weights(self.student)
        if c.fsdp:
            # Sharded after the broadcast, so every rank's shards come from rank 0's weights.
            shard(self.student, train=True, mixed_precision=c.fsdp_mixed_precision,
                  device=c.device)
            if c.fsdp_teacher == "shard" and isinstance(teacher_model, nn.Module):
                shard(teacher_model, train=False, mixed_precision=c.fsdp_mixed_precision,
                      device=c.device)
        if isinstance(teacher_model, nn.Module):
            teacher_model.requires_grad_(False).eval()

    def _set_teacher(self, teacher: nn.Module | Teacher) -> None:
        """``teacher_scorer`` (and ``router`` with several teachers), after checking it gives
        what the loss and the gate read and, with a router, that every problem has a teacher.
        Rows per lm_head projection in the loss and the gate (0: dense logits) are decided
        here once, from the largest micro-batch (or gate set) a rank can have, so every
        micro-batch and every rank agrees (under FSDP a chunked forward gathers the lm_head: a
        collective); gate_size counts even without a gate, so plain and EffOPD runs chunk
        alike."""
        c = self.config
        rows = max(-(-c.batch_size * c.num_samples // (self.world * c.gradient_accumulation_steps)),
                   -(-c.gate_size // self.world))
        self.loss_chunk_size = loss_chunk_rows(c.loss_chunk_size, rows * self.max_new_tokens,
                                               self.vocab_size)
        self.teacher_scorer: Teacher = (
            teacher if isinstance(teacher, Teacher)
            else ModelTeacher(teacher, self.vocab_size, chunk_size=self.loss_chunk_size))
        needs = teacher_needs(c.loss, self.loss_options)
        if needs.k > self.vocab_size:
            raise ValueError(f"--topk {needs.k} exceeds the shared vocabulary of "
                             f"{self.vocab_size} tokens; give --topk {self.vocab_size} or less")
        self.teacher_scorer.check(needs, f"--loss {c.loss}")
        self.router = teacher if isinstance(teacher, TeacherRouter) else None
        self._row_teachers: list[str] = []
        if self.router is not None:
            for split, problems in (("training", self.train_problems),
                                    ("gate", self._gate_problems or []),
                                    ("eval", self.eval_problems)):
                self.router.names(problems, what=f"{split} problems")
        if c.extrapolate and c.gate == "neg_kl":
            self.teacher_scorer.check(self._gate_needs(), "--gate neg_kl")

    # ------------------------------------------------------------------ setup
    @property
    def gate_problems(self) -> list[Problem]:
        """This rank's share of the fixed gate set: built in ``__init__`` where there is a
        gate, else at first use (``gate_reverse_kl`` as a KL probe of a plain run), so a plain
        run on a task without a gate split trains."""
        if self._gate_problems is None:
            c = self.config
            self._gate_problems = self.ranks.shard(
                _sample(self.task, "gate", c.gate_size, c.seed, "--gate_size"))
        return self._gate_problems

    @gate_problems.setter
    def gate_problems(self, problems: list[Problem]) -> None:
        self._gate_problems = problems

    def _check_fsdp(self) -> None:
        """``fsdp=True`` needs torchrun's process group, and every rank must run as many
        micro-batches as the others (each forward and backward of a sharded model is a
        collective)."""
        c = self.config
        require_process_group()
        if c.batch_size * c.num_samples % (self.world * c.gradient_accumulation_steps):
            raise ValueError(
                f"fsdp: batch_size*num_samples ({c.batch_size * c.num_samples}) must be divisible "
                f"by world size * gradient_accumulation_steps ({self.world} * "
                f"{c.gradient_accumulation_steps}), so every rank runs as many micro-batches")

    def _build_optimizer(self) -> torch.optim.Optimizer:
        c = self.config
        params = [p for p in self.student.parameters() if p.requires_grad]
        base = build_optimizer(self.optimizer_factory or c.optimizer, params, lr=c.learning_rate,
                               weight_decay=c.weight_decay, momentum=c.momentum,
                               warmup=c.warmup_steps > 0, **optimizer_kwargs(c.optimizer_kwargs))
        if not c.extrapolate:
            return base
        if c.margin and self.world > 1:  # the search reads every gate problem's score
            raise ValueError(f"--margin needs one process (this run has {self.world}); its "
                             "per-problem gate scores are not gathered across ranks yet")
        # gate="none": a score that rises at every call, so every candidate is kept (the fixed,
        # ungated jump of ExPO / AlphaRL-style baselines); it costs no evaluation.
        gate = self._timed_gate if c.gate != "none" else itertools.count().__next__
        if c.fsdp:  # each candidate is written into the shards: the next forward must gather them
            gate = resharding(self.student, gate)
        return ExtrapolatingOptimizer(base, gate, mode="max",
                                      params=PARAM_SELECTORS[c.extrapolate_params](self.student),
                                      **c.extrapolation_options())

    def _timed_gate(self) -> float:
        start = time.perf_counter()
        try:
            return self.gate_score()
        finally:
            self.gate_evals += 1
            self.gate_seconds += time.perf_counter() - start

    def synced_engine(self) -> Engine:
        """The engine, given the student's weights as they are now. Every generation goes
        through here, the one place weights reach the engine, so rollouts, gate candidates and
        evaluations always sample the weights they mean (a no-op push for ``HFEngine``)."""
        self.engine.push_weights(self.student)
        return self.engine

    # ------------------------------------------------------------------ scores
    def gate_score(self) -> float | torch.Tensor:
        """The EffOPD gate at the current weights: accuracy, or minus the reverse KL. With a
        ``margin`` one score per gate problem (their mean is the same score), so the search
        can tell a gain from the noise of the gate set."""
        if self.config.margin:
            if self.config.gate == "accuracy":
                return torch.tensor(greedy_correct(self.synced_engine(), self.task,
                                                   self.gate_problems, self.max_new_tokens),
                                    dtype=torch.float64)
            return -self.gate_reverse_kl(per_sequence=True)
        if self.config.gate == "accuracy":
            return self._accuracy(self.gate_problems, across_ranks=False)  # the gate reduces
        return -self.gate_reverse_kl()

    def _gate_needs(self) -> TeacherNeeds:
        """What the −KL gate reads from the teacher: the full distribution, or the top-k
        (``topk``) of a teacher that gives no more (a served one), whose bucketed reverse KL
        is a lower bound of the full one. A teacher giving neither is refused for the full."""
        top, capability = TeacherNeeds.topk(self.config.topk), self.teacher_scorer.capability
        if capability.covers(top) and not capability.covers(TeacherNeeds.FULL):
            return top
        return TeacherNeeds.FULL

    def gate_reverse_kl(self, per_sequence: bool = False) -> float | torch.Tensor:
        """Mean reverse KL to the teacher on the fixed gate rollouts (sampled once, at the
        first call, teacher-forced afterwards: continuous, cheap): over the full vocabulary,
        or over the teacher's top-k and a tail bucket when it gives no more
        (``_gate_needs``). The teacher's scores of them are computed at the first call too;
        each later call runs only the student. ``per_sequence``: each rollout's share of the
        token mean instead (its KL summed over its tokens, times rollouts / tokens: their
        mean is the token mean)."""
        if self._gate_sequences is None:
            r = self.synced_engine().generate(
                [p.prompt for p in self.gate_problems], max_new_tokens=self.max_new_tokens,
                temperature=self.config.temperature, seed=self.config.seed)
            self._gate_sequences = {"sequences": r.sequences, "attention_mask": r.attention_mask,
                                    "completion_mask": r.completion_mask}
            self._gate_teacher = None
        g = {k: v.to(self.config.device) for k, v in self._gate_sequences.items()}
        needs = self._gate_needs()
        if self._gate_teacher is None:
            self._gate_teacher = self.teacher_scorer.score(
                g["sequences"], g["attention_mask"], g["completion_mask"], needs)
        was_training = self.student.training
        self.student.eval()
        try:
            with torch.no_grad():
                student = model_logits(self.student, g["sequences"], g["attention_mask"],
                                       self.vocab_size, chunk_size=self.loss_chunk_size)
                mask = g["completion_mask"][:, 1:]
                if not per_sequence:
                    return self._gate_kl(student, needs, mask)
                rows = torch.eye(mask.shape[0], dtype=torch.bool, device=mask.device)
                sums = torch.tensor([self._gate_kl(student, needs, mask * rows[b, :, None])
                                     * float(mask[b].sum()) for b in range(mask.shape[0])],
                                    dtype=torch.float64)
                return sums * (mask.shape[0] / max(float(mask.sum()), 1.0))
        finally:
            self.student.train(was_training)

    def _gate_kl(self, student: Any, needs: TeacherNeeds, mask: torch.Tensor) -> float:
        """The gate's reverse KL per token over ``mask``'s tokens (0 where it has none)."""
        if needs.level == "full":
            return reverse_kl_loss(student, self._gate_teacher.full(), mask).metrics["reverse_kl"]
        return topk_reverse_kl_loss(student, self._gate_teacher.top(),
                                    mask).metrics["topk_reverse_kl"]

    def evaluate(self) -> float:
        """Greedy exact-match accuracy on the held-out eval set (of the EMA weights if any).
        With several teachers, each teacher's problems are evaluated apart and
        ``eval_by_teacher`` holds their accuracies (``eval_accuracy/NAME`` in the metrics)."""
        with self._ema_weights():
            if self.router is None:
                return self._accuracy(self.eval_problems, across_ranks=True)
            names = self.router.names(self.eval_problems)
            correct = total = 0.0
            self.eval_by_teacher = {}
            for name in self.router.teachers:
                group = [p for p, n in zip(self.eval_problems, names, strict=True) if n == name]
                acc = self._accuracy(group, across_ranks=False) if group else 0.0
                c, n = self.ranks.sum([acc * len(group), len(group)])
                if n:
                    self.eval_by_teacher[f"eval_accuracy/{name}"] = c / n
                correct, total = correct + c, total + n
            return correct / total

    def _accuracy(self, problems: list[Problem], *, across_ranks: bool) -> float:
        """Greedy exact match on this rank's ``problems``; with ``across_ranks``, of all ranks'."""
        acc = greedy_accuracy(self.synced_engine(), self.task, problems, self.max_new_tokens)
        if not across_ranks:
            return acc
        correct, total = self.ranks.sum([acc * len(problems), len(problems)])
        return correct / total

    @contextlib.contextmanager
    def _ema_weights(self):
        """Swap the EMA weights into the student for the duration (no-op without an EMA)."""
        if self.ema is None:
            yield
            return
        live = [t.detach().clone() for t in self.student.state_dict().values()]
        with torch.no_grad():
            for dst, src in zip(self.student.state_dict().values(),
                                self.ema.module.state_dict().values(), strict=True):
                dst.copy_(src)
        try:
            yield
        finally:
            with torch.no_grad():
                for dst, src in zip(self.student.state_dict().values(), live, strict=True):
                    dst.copy_(src)

    # ------------------------------------------------------------------ one step
    def train_step(self) -> dict[str, Any]:
        """Run one optimizer step (rollout → score → update) and return its metrics."""
        t0 = time.perf_counter()
        rollout, rewards = self._rollout()
        t1 = time.perf_counter()
        scored = self._score(rollout, rewards)
        t2 = time.perf_counter()
        gate_before = self.gate_seconds
        jump = self._update()
        t3 = time.perf_counter()
        self.train_seconds += t3 - t0
        tokens = scored["num_tokens"]
        metrics: dict[str, Any] = {
            "step": self.step,
            **scored,
            "lr": self.scheduler.get_last_lr()[0],
            "rollout_tokens_per_s": tokens / (t1 - t0) if t1 > t0 else None,
            "seconds_rollout": t1 - t0,
            "seconds_score": t2 - t1,
            "seconds_update": t3 - t2,
            "seconds_gate": self.gate_seconds - gate_before,
            "gate_evals_total": self.gate_evals,
            "train_seconds": self.train_seconds,
        }
        if jump is not None:
            metrics["jump"] = jump.to_dict()
        return metrics

    def _problems(self, step: int) -> list[Problem]:
        """This rank's prompts of ``step``: a fixed function of the seed and the step."""
        g = torch.Generator().manual_seed(self.config.seed * 1_000_003 + step)
        idx = torch.randperm(len(self.train_problems), generator=g)[: self.config.batch_size]
        return self.ranks.shard([self.train_problems[i] for i in idx.tolist()])

    def _rollout(self) -> tuple[Rollout, torch.Tensor]:
        """Sample this step's completions and their task rewards (one per row)."""
        c = self.config
        problems = self._problems(self.step)
        rollout = self.synced_engine().generate(
            [p.prompt for p in problems], max_new_tokens=self.max_new_tokens,
            temperature=c.temperature, top_p=c.top_p,
            seed=c.seed * 1_000_003 + self.step * self.world + self.rank,
            num_samples=c.num_samples).to(c.device)
        rows_problems = [p for p in problems for _ in range(c.num_samples)]  # prompt-major rows
        if self.router is not None:
            self._row_teachers = self.router.names(rows_problems)
        rewards = torch.tensor([self.task.reward(t, p) for t, p in
                                zip(rollout.texts, rows_problems, strict=True)])
        return rollout, rewards

    def _score(self, rollout: Rollout, rewards: torch.Tensor) -> dict[str, Any]:
        """Backward the loss of every micro-batch, normalised by the completion tokens of the
        whole step on all ranks; gradients and metrics are summed over ranks."""
        c = self.config
        advantages = group_advantages(rewards, c.num_samples).to(c.device)
        (total_tokens,) = self.ranks.sum([int(rollout.completion_mask[:, 1:].sum())])
        total_tokens = int(total_tokens)
        sums: dict[str, float] = {}
        rows = rollout.sequences.shape[0]
        chunk = rows // c.gradient_accumulation_steps
        loss_total = 0.0
        self._kl_by_teacher: dict[str, list[float]] = {}
        seconds_before = dict(self.router.seconds) if self.router is not None else {}
        for start in range(0, rows, chunk):
            sl = slice(start, start + chunk)
            out = self._micro_batch_loss(rollout, sl, max(total_tokens, 1), advantages[sl])
            out.loss.backward()
            loss_total += float(out.loss.detach())
            n = out.metrics["num_tokens"]
            for k, v in out.metrics.items():
                if k != "num_tokens":
                    sums[k] = sums.get(k, 0.0) + v * n
        if not c.fsdp:  # FSDP has reduce-scattered (summed) the gradients in backward
            self.ranks.sum_grads(self.student.parameters())
        loss_total, reward_sum, reward_n, *summed = self.ranks.sum(
            [loss_total, float(rewards.sum()), rewards.numel(), *sums.values()])
        grad_norm = None
        if c.max_grad_norm is not None:
            norm = torch.nn.utils.clip_grad_norm_(self.student.parameters(), c.max_grad_norm)
            grad_norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
        return {
            "loss": loss_total,
            **{k: v / max(total_tokens, 1) for k, v in zip(sums, summed, strict=True)},
            "num_tokens": total_tokens,
            "reward": reward_sum / reward_n,
            "grad_norm": grad_norm,
            **self._per_teacher_metrics(seconds_before),
        }

    def _per_teacher_metrics(self, seconds_before: dict[str, float]) -> dict[str, float]:
        """With several teachers: each one's sampled-token reverse KL over its rows of this
        step (all ranks) and this rank's seconds scoring them."""
        if self.router is None:
            return {}
        names = list(self.router.teachers)
        kl = [self._kl_by_teacher.get(n, [0.0, 0.0]) for n in names]
        summed = self.ranks.sum([v for pair in kl for v in pair])
        out = {}
        for i, name in enumerate(names):
            if summed[2 * i + 1]:
                out[f"reverse_kl/{name}"] = summed[2 * i] / summed[2 * i + 1]
            out[f"seconds_teacher/{name}"] = self.router.seconds[name] - seconds_before[name]
        return out

    def _update(self):
        """The optimizer step (and the EffOPD search when scheduled); the search's
        ``JumpRecord`` when one ran, else None."""
        searches_before = len(getattr(self.optimizer, "history", []))
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.ema is not None:
            self.ema.update_parameters(self.student)
        self.step += 1
        history = getattr(self.optimizer, "history", [])
        return history[-1] if len(history) > searches_before else None

    def _micro_batch_loss(self, rollout: Rollout, rows: slice, num_tokens: int,
                          advantages: torch.Tensor):
        # On-policy: the student scored here is the sampler, so importance ratios are 1.
        self.teacher_scorer.set_step(self.step + 1)  # the step as logged: named in a failure
        teacher = self.teacher_scorer
        if self.router is not None:
            teacher = self.router.for_rows(self._row_teachers[rows])
        needs = teacher_needs(self.config.loss, self.loss_options)
        scores = score_tokens(self.student, teacher, rollout.sequences[rows],
                              rollout.attention_mask[rows], rollout.completion_mask[rows],
                              self.vocab_size, needs=needs, chunk_size=self.loss_chunk_size,
                              advantages=advantages, temperature=self.config.temperature)
        out = compute_loss(self.config.loss, scores, num_tokens=num_tokens,
                           options=self.loss_options)
        if self.router is not None:  # each teacher's sampled-token reverse KL, summed per step
            with torch.no_grad():
                ls, lt = scores.logprobs()
                per_row = ((ls - lt) * scores.mask).sum(1).tolist()
                counts = scores.mask.sum(1).tolist()
            for name, kl, n in zip(self._row_teachers[rows], per_row, counts, strict=True):
                sums = self._kl_by_teacher.setdefault(name, [0.0, 0.0])
                sums[0], sums[1] = sums[0] + kl, sums[1] + n
        return out

    # ------------------------------------------------------------------ the loop
    def train(self) -> TrainResult:
        """Train to ``max_steps`` (or ``stop_at_accuracy``), resuming first when asked."""
        c = self.config
        if c.overwrite_output_dir and not c.resume and self.ranks.is_main:
            clear_earlier_run(self.output_dir)
        self.ranks.barrier()
        self.output_dir.mkdir(parents=True, exist_ok=True)
        if c.resume:
            if not self.load_checkpoint():
                logger.warning("resume: no checkpoint in %s, starting from step 0", self.output_dir)
        result = TrainResult()
        self.metrics_log.start_at(self.step)
        if self.step == 0:
            acc = self.evaluate()
            result.evals.append((0, acc))
            self._log({"step": 0, "eval_accuracy": acc, "train_seconds": 0.0,
                       "gate_evals_total": 0}, result)
        bar = _progress(c.max_steps, self.step, c.progress and self.ranks.is_main,
                        "OPD" + (" + EffOPD" if c.extrapolate else ""))
        try:
            while self.step < c.max_steps:
                m = self.train_step()
                last = self.step == c.max_steps
                if (c.eval_every and self.step % c.eval_every == 0) or last:
                    m["eval_accuracy"] = self.evaluate()
                    result.evals.append((self.step, m["eval_accuracy"]))
                self._log(m, result)
                bar.update(1)
                bar.set_postfix({k: round(m[k], 4) for k in ("loss", "reverse_kl", "eval_accuracy")
                                 if isinstance(m.get(k), float)})
                done = (c.stop_at_accuracy is not None
                        and m.get("eval_accuracy", -1.0) >= c.stop_at_accuracy)
                if (c.save_every and self.step % c.save_every == 0) or last or done:
                    self.save_checkpoint()
                if done:
                    break
        finally:
            bar.close()
            self.metrics_log.flush()
        if isinstance(self.optimizer, ExtrapolatingOptimizer):
            result.summary = self.optimizer.summary()
            if self.ranks.is_main:
                logger.info("extrapolation: %s", result.summary)
        return result

    def _log(self, m: dict[str, Any], result: TrainResult) -> None:
        if "eval_accuracy" in m and self.router is not None:
            m.update(self.eval_by_teacher)
        result.metrics.append(m)
        if "jump" in m:
            result.jumps.append(m["jump"])
        self.metrics_log.log(m)
        for cb in self.callbacks:
            cb(m)

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self) -> Path:
        """Write ``checkpoint-<step>`` atomically and point ``latest`` at it. Replicated, rank
        0 writes (the weights and optimizer state are the same on every rank); sharded
        (``fsdp``), every rank writes its shards and its own state."""
        rng = {"torch": torch.get_rng_state(), "python": random.getstate()}
        state = {
            "step": self.step,
            "scheduler": self.scheduler.state_dict(),
            "train_seconds": self.train_seconds,
            "gate_evals": self.gate_evals,
            "gate_seconds": self.gate_seconds,
        }
        if self.config.fsdp:  # the base state goes in shards: lr_follow's scale beside it
            state["lr_scale"] = getattr(self.optimizer, "lr_scale", 1.0)
            extrapolator = getattr(self.optimizer, "extrapolator", None)
            rank_state = {  # this rank's: anchor shards, gate-set slice, RNG
                "extrapolator": None if extrapolator is None else extrapolator.state_dict(),
                "gate_sequences": self._gate_sequences,
                "rng": rng,
            }
            return write_sharded_checkpoint(
                self.output_dir, self.step, model=self.student,
                optimizer=getattr(self.optimizer, "base", self.optimizer), state=state,
                rank_state=rank_state, ranks=self.ranks, tokenizer=self.tokenizer,
                config=self.config)
        final = self.output_dir / f"checkpoint-{self.step}"
        if self.ranks.is_main:
            state.update({
                "optimizer": self.optimizer.state_dict(),
                "gate_sequences": self._gate_sequences,
                "ema": None if self.ema is None else self.ema.state_dict(),
                "rng": rng,
            })
            write_checkpoint(self.output_dir, self.step, model=self.student,
                             tokenizer=self.tokenizer, state=state, config=self.config)
        self.ranks.barrier()
        return final

    def load_checkpoint(self, path: str | os.PathLike | None = None) -> bool:
        """Load ``path`` (default: the newest checkpoint in ``output_dir`` that loads, damaged
        newer ones set aside with a warning; for a sharded student, the one ``latest`` names);
        False if there is none."""
        if self.config.fsdp:
            path = latest_checkpoint(self.output_dir) if path is None else Path(path)
            if path is None:
                return False
            state, mine = read_sharded_checkpoint(
                path, self.student, getattr(self.optimizer, "base", self.optimizer), self.ranks)
            extrapolator = getattr(self.optimizer, "extrapolator", None)
            if extrapolator is not None and mine["extrapolator"] is not None:
                extrapolator.load_state_dict(mine["extrapolator"])
            if getattr(self.optimizer, "lr_follow", None) is not None:
                self.optimizer.lr_scale = float(state.get("lr_scale", 1.0))
            self._gate_sequences, rng = mine["gate_sequences"], mine["rng"]
        else:
            if path is not None:
                state = read_checkpoint(Path(path), self.student)
            else:
                found, state, damaged = read_newest_checkpoint(self.output_dir, self.student)
                self.ranks.barrier()  # every rank has read before rank 0 renames
                if self.ranks.is_main:
                    set_aside(damaged, found)
                if state is None:
                    return False
            self.optimizer.load_state_dict(state["optimizer"])
            # The saved gate rollouts are rank 0's slice; other ranks sample theirs again.
            self._gate_sequences = state["gate_sequences"] if self.ranks.is_main else None
            if self.ema is not None and state.get("ema") is not None:
                self.ema.load_state_dict(state["ema"])
            rng = state["rng"]
        self._gate_teacher = None  # scores of the gate rollouts just loaded (or to be sampled)
        self.scheduler.load_state_dict(state["scheduler"])
        self.step = state["step"]
        self.train_seconds = state["train_seconds"]
        self.gate_evals, self.gate_seconds = state["gate_evals"], state["gate_seconds"]
        torch.set_rng_state(rng["torch"])
        random.setstate(rng["python"])
        return True


def _sample(task: Task, split: str, n: int, seed: int, flag: str) -> list[Problem]:
    """``task.problems(split, n, seed)``, or one line naming the flag that asks too much."""
    have = len(task.all_problems(split))
    if have == 0:
        fix = " or --gate none" if split == "gate" else ""
        raise ValueError(f"task {task.name!r} has no {split} problems for {flag} {n}; give the "
                         f"task more problems{fix}")
    if n > have:
        raise ValueError(f"{flag} {n} exceeds the {have} {split} problems of task "
                         f"{task.name!r}; give {flag} {have} or less")
    return task.problems(split, n, seed=seed)


def _progress(total: int, initial: int, enabled: bool, desc: str):
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=initial, disable=not enabled, desc=desc, dynamic_ncols=True)
