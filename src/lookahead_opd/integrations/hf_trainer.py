"""EffOPD's gated extrapolation inside ``transformers.Trainer`` and the TRL trainers.

    from lookahead_opd.integrations.hf_trainer import ExtrapolationCallback

    trainer = Trainer(model, args, train_dataset=train, eval_dataset=val,
                      compute_metrics=accuracy)
    trainer.add_callback(ExtrapolationCallback(gate_dataset=gate, metric="eval_accuracy"))
    trainer.train()

The callback builds an ``Extrapolator`` over the model's trainable parameters when training
begins and calls ``after_step()`` after every *optimizer* step (``on_step_end``, so gradient
accumulation micro-batches do not count). A candidate is scored either by ``eval_fn()`` or by
``trainer.evaluate(gate_dataset, metric_key_prefix="gate")`` read at ``metric``. Each search is
merged into the Trainer's logs (``extrapolation/...`` keys, so TensorBoard / W&B see them),
and the extrapolator's state (counter, anchor, history) is written beside every checkpoint as
``extrapolation_state.pt`` and read back by ``trainer.train(resume_from_checkpoint=...)``.

The callback needs the ``Trainer`` object (to evaluate, to log first, to find the checkpoint
being resumed). ``trainer.add_callback(cb)`` or ``Trainer(callbacks=[cb])`` is enough: at
``on_train_begin`` the callback finds the Trainer that is calling it. ``cb.bind(trainer)``
(or ``add_extrapolation(trainer, ...)``) does the same explicitly.
"""

from __future__ import annotations

import inspect
import logging
import os
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn
from transformers import Trainer, TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from lookahead_opd import ExtrapolatingOptimizer, Extrapolator, JumpRecord, resharding
from lookahead_opd.extrapolator import ParamsSpec

from .callback_support import (
    LOG_PREFIX,
    build_extrapolator,
    check_extrapolator_options,
    param_selector,
    summary_scalars,
)
from .callback_support import jump_scalars as jump_logs

__all__ = [
    "STATE_NAME",
    "LOG_PREFIX",
    "ExtrapolationCallback",
    "add_extrapolation",
    "gate_score",
    "jump_logs",
]

logger = logging.getLogger(__name__)

STATE_NAME = "extrapolation_state.pt"
"""File written into every ``checkpoint-<step>`` folder (``extrapolation_state-rank<r>.pt``
per rank when the parameters are sharded DTensors)."""


# Set by the callback itself, or meaningless for it.
_CONTROL_FLAGS = (
    "should_training_stop",
    "should_epoch_stop",
    "should_save",
    "should_evaluate",
    "should_log",
)


# ---------------------------------------------------------------------- gate scoring
def _metric_candidates(metric: str, prefix: str) -> list[str]:
    """Keys that may hold ``metric`` in metrics evaluated with ``metric_key_prefix=prefix``:
    ``metric`` itself, then its base name (without ``eval_`` or ``<prefix>_``) under ``prefix``."""
    base = metric
    for p in dict.fromkeys(("eval_", f"{prefix}_")):
        if base.startswith(p):
            base = base[len(p) :]
            break
    out = [metric, f"{prefix}_{base}"]
    return list(dict.fromkeys(out))


def _pick_metric(metrics: Mapping[str, Any], metric: str, prefix: str) -> float:
    tried = _metric_candidates(metric, prefix)
    for key in tried:
        if key in metrics:
            return float(metrics[key])
    raise ValueError(
        f"gate metric {metric!r} is not among the metrics the gate evaluation produced "
        f"({sorted(metrics)}); looked for {tried}. Choose one of those, or pass "
        "compute_metrics= to the Trainer so that it computes the metric"
    )


def gate_score(
    trainer: Trainer,
    dataset: Any,
    metric: str = "eval_accuracy",
    metric_key_prefix: str = "gate",
) -> float:
    """``trainer.evaluate(dataset, metric_key_prefix=...)`` read at ``metric``.

    ``metric`` may be given as ``"accuracy"``, ``"eval_accuracy"`` or ``"gate_accuracy"``;
    ``dataset`` is a dataset or the name of an entry of ``trainer.eval_dataset`` (a dict), which
    lets TRL trainers preprocess it with the other eval sets. A metric the evaluation does not
    produce raises a ``ValueError`` that lists the ones it did. Usable as the ``eval_fn`` of an
    ``ExtrapolatingOptimizer`` handed to ``Trainer(optimizers=...)``:
    ``eval_fn=lambda: gate_score(trainer, gate, "accuracy")``.
    """
    metrics = trainer.evaluate(dataset, metric_key_prefix=metric_key_prefix)
    return _pick_metric(metrics, metric, metric_key_prefix)


# ---------------------------------------------------------------------- logging
# ---------------------------------------------------------------------- helpers
def _base_optimizer(optimizer: Any) -> Any:
    """Unwrap Accelerate's (and DeepSpeed's) ``.optimizer`` chain."""
    seen = set()
    while optimizer is not None and id(optimizer) not in seen:
        seen.add(id(optimizer))
        if isinstance(optimizer, ExtrapolatingOptimizer):
            return optimizer
        optimizer = getattr(optimizer, "optimizer", None)
    return None


def _named_list(params: list[Any]) -> list[tuple[str, torch.Tensor]]:
    return [x if isinstance(x, tuple) else (str(i), x) for i, x in enumerate(params)]


def _is_sharded(params: list[torch.Tensor]) -> bool:
    return any(type(p).__name__ == "DTensor" for p in params)


def _rank() -> int:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank()
    return 0


def _calling_trainer(callback: TrainerCallback) -> tuple[Trainer | None, str | None]:
    """The Trainer whose callback handler is calling ``callback`` right now, and the
    checkpoint its ``_inner_training_loop`` resumes from (found by walking up the stack)."""
    frame = inspect.currentframe()
    try:
        f = frame.f_back if frame is not None else None
        for _ in range(32):
            if f is None:
                break
            obj = f.f_locals.get("self")
            if isinstance(obj, Trainer) and any(
                cb is callback for cb in obj.callback_handler.callbacks
            ):
                resume = None
                if f.f_code.co_name == "_inner_training_loop":
                    resume = f.f_locals.get("resume_from_checkpoint")
                return obj, resume if isinstance(resume, (str, os.PathLike)) else None
            f = f.f_back
    finally:
        del frame
    return None, None


# ---------------------------------------------------------------------- the callback
class ExtrapolationCallback(TrainerCallback):
    """Run the EffOPD gated search after scheduled optimizer steps of a ``Trainer``.

    Args:
        eval_fn: no arguments, returns the gate score (higher is better unless ``mode="min"``).
        gate_dataset: instead of ``eval_fn``, score candidates with
            ``trainer.evaluate(gate_dataset, metric_key_prefix=metric_key_prefix)``; a dataset
            or the name of an entry of the Trainer's ``eval_dataset`` dict.
        metric: the metric read from that evaluation (``"eval_accuracy"``, ``"accuracy"`` and
            ``"gate_accuracy"`` all name the same one). Unless ``mode`` is given, a metric
            ending in ``loss`` is minimised, any other maximised (``greater_is_better``'s rule).
        metric_key_prefix: prefix of the gate evaluations' metrics in the logs. Kept apart
            from ``"eval"`` so that gate evaluations are not mistaken for the regular ones
            (``EarlyStoppingCallback``, ``metric_for_best_model``).
        params: which parameters to extrapolate: ``"trainable"`` (default), ``"transformer_blocks"``
            (attention and MLP weights, as the EffOPD code does) or ``model -> params``.
        **extrapolator_options: keyword options of ``lookahead_opd.Extrapolator``
            (``schedule``, ``every``, ``coefficients``, ``max_candidates``, ``min_improvement``,
            ``mode``, ``snapshot``, ``rank``, ``reference``, ``offload``, ``direction``,
            ``on_jump``, ``reduce``, ``process_group``, ``log_geometry``).

    ``history`` lists the searches (``JumpRecord``); ``extrapolator`` is the core object
    (``None`` before training begins).
    """

    def __init__(
        self,
        eval_fn: Callable[[], float] | None = None,
        *,
        gate_dataset: Any = None,
        metric: str = "eval_accuracy",
        metric_key_prefix: str = "gate",
        params: str | Callable[[nn.Module], ParamsSpec] = "trainable",
        **extrapolator_options: Any,
    ) -> None:
        if (eval_fn is None) == (gate_dataset is None):
            raise ValueError(
                "ExtrapolationCallback needs exactly one of eval_fn= (a no-argument function "
                "returning the gate score) or gate_dataset= (scored with trainer.evaluate and "
                f"read at metric=); got {'both' if eval_fn is not None else 'neither'}"
            )
        if eval_fn is not None and not callable(eval_fn):
            raise TypeError(f"eval_fn must be callable, got {type(eval_fn).__name__}")
        if not isinstance(metric, str) or not metric:
            raise TypeError(f"metric must be a non-empty str, got {metric!r}")
        if not isinstance(metric_key_prefix, str) or not metric_key_prefix:
            raise TypeError(f"metric_key_prefix must be a non-empty str, got {metric_key_prefix!r}")
        options = dict(extrapolator_options)
        if gate_dataset is not None and "mode" not in options:
            base = _metric_candidates(metric, metric_key_prefix)[-1]
            options["mode"] = "min" if base.endswith("loss") else "max"
        check_extrapolator_options(options)
        self.eval_fn = eval_fn
        self.gate_dataset = gate_dataset
        self.metric = metric
        self.metric_key_prefix = metric_key_prefix
        self.select_params = param_selector(params)
        self.options = options
        self.extrapolator: Extrapolator | None = None
        self.trainer: Trainer | None = None
        self._model: nn.Module | None = None
        self._pending: list[JumpRecord] = []
        self._searching = False

    # ------------------------------------------------------------------ binding
    def bind(self, trainer: Trainer) -> ExtrapolationCallback:
        """Attach to ``trainer``: register with it if needed, and run first among its
        callbacks so that reporting callbacks (TensorBoard, W&B) see the jump keys and the
        gate evaluations run before ``DefaultFlowCallback`` sets the step's flags."""
        if not isinstance(trainer, Trainer):
            raise TypeError(f"bind() needs a transformers.Trainer, got {type(trainer).__name__}")
        callbacks = trainer.callback_handler.callbacks
        for i, cb in enumerate(callbacks):
            if cb is self:
                del callbacks[i]
                break
        # Safe while the handler iterates: callbacks after ours keep their index.
        callbacks.insert(0, self)
        self.trainer = trainer
        return self

    @property
    def history(self) -> list[JumpRecord]:
        """Every search so far, oldest first (restored on resume)."""
        return [] if self.extrapolator is None else self.extrapolator.history

    def _score(self) -> float:
        if self.eval_fn is not None:
            return self.eval_fn()
        assert self.trainer is not None
        return gate_score(self.trainer, self.gate_dataset, self.metric, self.metric_key_prefix)

    # ------------------------------------------------------------------ events
    def on_train_begin(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        model: nn.Module | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        **kwargs: Any,
    ) -> None:
        found, resume = _calling_trainer(self)
        trainer = self.trainer if self.trainer is not None else found
        if trainer is not None:
            self.bind(trainer)
        elif self.gate_dataset is not None:
            raise RuntimeError(
                "ExtrapolationCallback(gate_dataset=...) needs the Trainer to evaluate with "
                "and could not find it on the call stack: call callback.bind(trainer) or use "
                "add_extrapolation(trainer, ...) before trainer.train()"
            )
        if model is None:
            raise RuntimeError("on_train_begin got no model= from the Trainer")
        if _base_optimizer(optimizer) is not None:
            raise ValueError(
                "the Trainer's optimizer is already an ExtrapolatingOptimizer: use either it "
                "(Trainer(optimizers=(ExtrapolatingOptimizer(...), None))) or "
                "ExtrapolationCallback, not both, or every search would run twice"
            )
        self._model = model
        self._pending = []
        self.extrapolator = self._build(model, optimizer)
        if state.global_step > 0:
            self._resume(args, state, resume)

    def _build(self, model: nn.Module, optimizer: Any) -> Extrapolator:
        params = list(self.select_params(model))
        partitioned = [
            n for n, p in _named_list(params) if hasattr(p, "ds_id") or hasattr(p, "ds_tensor")
        ]
        if partitioned:
            raise ValueError(
                f"DeepSpeed ZeRO-3 partitions the parameters ({partitioned[:3]}...), so the "
                "extrapolator would see empty placeholders; use ZeRO stage 1 or 2, or FSDP2 "
                "(fsdp_version=2), whose DTensor shards the extrapolator handles"
            )
        # Under FSDP2 a gate forward leaves the root module unsharded, blind to the candidates
        # written into the shards; resharding() drops that copy (a no-op without FSDP2).
        score = resharding(model, self._score)
        return build_extrapolator(params, score, optimizer, self.options)

    def _state_paths(self, folder: str) -> list[str]:
        assert self.extrapolator is not None
        paths = [os.path.join(folder, STATE_NAME)]
        if _is_sharded(self.extrapolator.params):
            paths.insert(0, os.path.join(folder, f"extrapolation_state-rank{_rank()}.pt"))
        return paths

    def _resume(self, args: TrainingArguments, state: TrainerState, resume: str | None) -> None:
        assert self.extrapolator is not None
        folders = [os.path.join(args.output_dir, f"checkpoint-{state.global_step}")]
        if resume is not None:
            folders.insert(0, os.fspath(resume))
        for folder in dict.fromkeys(folders):
            for path in self._state_paths(folder):
                if os.path.isfile(path):
                    self.extrapolator.load_state_dict(
                        torch.load(path, map_location="cpu", weights_only=True)
                    )
                    logger.info("extrapolation state restored from %s", path)
                    return
        # A checkpoint from a run without the callback: continue the schedule from here.
        self.extrapolator.step_count = state.global_step
        logger.warning(
            "resuming at step %d but found no %s in %s: the extrapolation schedule continues "
            "from this step with the current weights as anchor and an empty history",
            state.global_step,
            STATE_NAME,
            list(dict.fromkeys(folders)),
        )

    def on_step_end(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        model: nn.Module | None = None,
        **kwargs: Any,
    ) -> None:
        if self.extrapolator is None:
            return
        accelerator = getattr(self.trainer, "accelerator", None)
        if accelerator is not None and accelerator.optimizer_step_was_skipped:
            return  # a GradScaler skipped the step: nothing moved, nothing to count
        flags = {f: getattr(control, f) for f in _CONTROL_FLAGS}
        modules = [
            m
            for m in (model, self._model, getattr(self.trainer, "model_wrapped", None))
            if m is not None
        ]
        modes = [(m, m.training) for m in dict.fromkeys(modules)]
        self._searching = True
        try:
            record = self.extrapolator.after_step()
        finally:
            self._searching = False
            # Gate evaluations go through the Trainer's event handlers, which clear the
            # step's should_log / should_evaluate flags and leave the model in eval mode.
            for f, v in flags.items():
                setattr(control, f, v)
            for m, training in modes:
                m.train(training)
        if record is not None:
            self._pending.append(record)
            if args.logging_strategy != "no":
                control.should_log = True

    def on_log(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        logs: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        if self._searching or not self._pending or logs is None or self.extrapolator is None:
            return
        extra = jump_logs(self._pending[-1], self.extrapolator.history)
        self._pending = []
        logs.update(extra)
        # Trainer.log appended a copy of logs to log_history just before calling on_log.
        if state.log_history and state.log_history[-1].get("step") == state.global_step:
            state.log_history[-1].update(extra)

    def on_train_end(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        **kwargs: Any,
    ) -> None:
        """Log what the searches bought (``Extrapolator.summary``) and keep it in
        ``state.log_history``."""
        if self.extrapolator is None:
            return
        summary = self.extrapolator.summary()
        logger.info("extrapolation: %s", summary)
        state.log_history.append({**summary_scalars(summary), "step": state.global_step})

    def on_save(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        **kwargs: Any,
    ) -> None:
        if self.extrapolator is None or args.save_only_model:
            return
        sharded = _is_sharded(self.extrapolator.params)
        if not (sharded or args.should_save):
            return
        folder = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
        os.makedirs(folder, exist_ok=True)
        path = self._state_paths(folder)[0]
        tmp = path + ".tmp"
        torch.save(self.extrapolator.state_dict(), tmp)
        os.replace(tmp, path)

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """The extrapolator's state (what ``on_save`` writes)."""
        if self.extrapolator is None:
            raise RuntimeError("the extrapolator is built at on_train_begin; no state yet")
        return self.extrapolator.state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if self.extrapolator is None:
            raise RuntimeError("the extrapolator is built at on_train_begin; load state after it")
        self.extrapolator.load_state_dict(state)

    def __repr__(self) -> str:
        gate = "eval_fn" if self.eval_fn is not None else f"gate_dataset, metric={self.metric!r}"
        return f"ExtrapolationCallback({gate}, options={self.options!r})"


def add_extrapolation(
    trainer: Trainer,
    eval_fn: Callable[[], float] | None = None,
    **kwargs: Any,
) -> ExtrapolationCallback:
    """Build an ``ExtrapolationCallback(eval_fn, **kwargs)``, bind it to ``trainer`` and
    return it (its ``history`` is filled as ``trainer.train()`` runs)."""
    return ExtrapolationCallback(eval_fn, **kwargs).bind(trainer)
