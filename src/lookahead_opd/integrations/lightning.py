"""EffOPD's gated extrapolation as a PyTorch Lightning callback.

    from lookahead_opd.integrations.lightning import ExtrapolationCallback

    trainer = L.Trainer(max_steps=1000, callbacks=[ExtrapolationCallback(eval_fn=gate_score)])
    trainer.fit(module, train_loader)

The callback builds an ``Extrapolator`` over the module's trainable parameters when training
starts and counts *optimizer* steps by watching ``trainer.global_step`` at the end of every
batch, so the micro-batches of ``accumulate_grad_batches`` do not count and the searches fall
after optimizer steps 1, 2, 4, 8, ... Each search is sent to every logger of the Trainer as
``extrapolation/...`` scalars. The extrapolator's state (counter, anchor, history) is the
callback's ``state_dict``, which Lightning writes into every checkpoint and restores on
``trainer.fit(..., ckpt_path=...)``.

Under DDP every rank scores its own slice of the gate and the scores are averaged
(``reduce="mean"``), so all ranks take the same decision. This module imports ``lightning``
(or ``pytorch_lightning``) and torch only; no Hugging Face packages.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

try:  # the unified package first, then the standalone one
    from lightning.pytorch import Callback, LightningModule, Trainer
except ImportError:  # pragma: no cover - depends on what is installed
    from pytorch_lightning import Callback, LightningModule, Trainer

from lookahead_opd import ExtrapolatingOptimizer, Extrapolator, JumpRecord
from lookahead_opd.extrapolator import ParamsSpec

from .callback_support import (
    LOG_PREFIX,
    build_extrapolator,
    check_extrapolator_options,
    jump_scalars,
    param_selector,
    summary_scalars,
)

__all__ = ["LOG_PREFIX", "ExtrapolationCallback", "jump_scalars"]

logger = logging.getLogger(__name__)


def _single_optimizer(trainer: Trainer) -> torch.optim.Optimizer | None:
    optimizers = list(trainer.optimizers)
    if not optimizers:
        return None
    found = [getattr(o, "optimizer", o) for o in optimizers]
    if any(isinstance(o, ExtrapolatingOptimizer) for o in found):
        raise ValueError(
            "the LightningModule's optimizer is already an ExtrapolatingOptimizer: use either "
            "it or ExtrapolationCallback, not both, or every search would run twice"
        )
    return found[0] if len(found) == 1 else None


class ExtrapolationCallback(Callback):
    """Run the EffOPD gated search after scheduled optimizer steps of a Lightning Trainer.

    Args:
        eval_fn: no arguments, returns the gate score (higher is better unless ``mode="min"``).
            It may switch the module to eval mode; the callback restores the mode afterwards.
        params: ``"trainable"`` (default), ``"transformer_blocks"`` or ``module -> params``.
        **extrapolator_options: keyword options of ``lookahead_opd.Extrapolator``
            (``schedule``, ``every``, ``coefficients``, ``max_candidates``, ``min_improvement``,
            ``mode``, ``snapshot``, ``rank``, ``reference``, ``offload``, ``direction``,
            ``on_jump``, ``reduce``, ``process_group``, ``log_geometry``).

    ``history`` lists the searches; ``extrapolator`` is the core object (``None`` before
    training starts).
    """

    def __init__(
        self,
        eval_fn: Callable[[], float],
        *,
        params: str | Callable[[nn.Module], ParamsSpec] = "trainable",
        **extrapolator_options: Any,
    ) -> None:
        if not callable(eval_fn):
            raise TypeError(
                f"eval_fn must be a no-argument callable returning the gate score, got "
                f"{type(eval_fn).__name__}"
            )
        check_extrapolator_options(extrapolator_options)
        self.eval_fn = eval_fn
        self.select_params = param_selector(params)
        self.options = dict(extrapolator_options)
        self.extrapolator: Extrapolator | None = None
        self._loaded: dict[str, Any] | None = None
        self._seen_step = 0
        self._module: nn.Module | None = None

    @property
    def history(self) -> list[JumpRecord]:
        """Every search so far, oldest first (restored on resume)."""
        return [] if self.extrapolator is None else self.extrapolator.history

    # ------------------------------------------------------------------ hooks
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Build the extrapolator over the (restored) weights; load a checkpoint's state."""
        self._module = pl_module
        self.extrapolator = build_extrapolator(
            self.select_params(pl_module), self.eval_fn, _single_optimizer(trainer), self.options)
        self._seen_step = trainer.global_step
        if self._loaded:
            self.extrapolator.load_state_dict(self._loaded)
            if self.extrapolator.step_count != trainer.global_step:
                raise ValueError(
                    f"the checkpoint's extrapolation state is at step "
                    f"{self.extrapolator.step_count}, the Trainer at {trainer.global_step}"
                )
        elif trainer.global_step > 0:
            self.extrapolator.step_count = trainer.global_step
            logger.warning(
                "resuming at step %d without saved extrapolation state: the schedule continues "
                "from this step with the current weights as anchor and an empty history",
                trainer.global_step,
            )
        self._loaded = None

    def on_train_batch_end(
        self,
        trainer: Trainer,
        pl_module: LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        """Count the optimizer steps taken since the last batch; search when scheduled."""
        if self.extrapolator is None:
            return
        while self._seen_step < trainer.global_step:
            self._seen_step += 1
            training = pl_module.training
            try:
                record = self.extrapolator.after_step()
            finally:
                pl_module.train(training)
            if record is not None:
                values = jump_scalars(record, self.extrapolator.history)
                for lg in trainer.loggers:
                    lg.log_metrics(values, step=trainer.global_step)

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Log what the searches bought (``Extrapolator.summary``)."""
        if self.extrapolator is None:
            return
        summary = self.extrapolator.summary()
        logger.info("extrapolation: %s", summary)
        for lg in trainer.loggers:
            lg.log_metrics(summary_scalars(summary), step=trainer.global_step)

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """The extrapolator's state; Lightning stores it in every checkpoint."""
        if self.extrapolator is None:
            return dict(self._loaded or {})
        return self.extrapolator.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Keep a checkpoint's state until the extrapolator is (re)built at
        ``on_train_start``, over the weights restored from the same checkpoint."""
        self._loaded = dict(state_dict)

    def __repr__(self) -> str:
        return f"ExtrapolationCallback(eval_fn, options={self.options!r})"
