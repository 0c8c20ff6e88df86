"""``ExtrapolatingOptimizer``: EffOPD's gated jump around any ``torch.optim.Optimizer``.

    opt = ExtrapolatingOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-5),
                                 eval_fn=lambda: gate_accuracy(model))
    loss.backward(); opt.step(); opt.zero_grad()   # the loop is unchanged

The wrapper stays out of the base optimizer's way (as ``timm``'s Lookahead does): it shares
the base's ``param_groups``, ``state`` and ``defaults`` so LR schedulers, ``GradScaler`` and
``isinstance`` checks see one optimizer, delegates ``step``/``zero_grad``/``add_param_group``,
and runs its ``Extrapolator`` after each step.

``lr_follow=cap`` (experimental) makes a kept jump carry into the learning rate: a kept jump
of ``c`` says the window's steps covered ``1/(1 + c)`` of the distance that paid, so the scale
on the base optimizer's lr is multiplied by ``1 + c`` (at most ``cap``); a search that refuses
its first candidate (``c = 1`` by default) halves it, not below 1. The scale is applied inside
``step()`` only — every group's ``lr`` is multiplied just before the base step and restored
right after — so an LR scheduler that rewrites ``param_groups[...]["lr"]`` each step
(``LambdaLR``, chained schedulers) never sees it: it neither erases nor compounds it. It
changes only at searches, so once ``patience`` stops them it stays where the last one left
it. It is a function of the searches' decisions, which are the same on every rank, and is
saved in ``state_dict`` (restored exactly).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from torch import Tensor
from torch.optim import Optimizer

from .extrapolator import Extrapolator, JumpRecord, ParamsSpec, Summary
from .options import ExtrapolationOptions

__all__ = ["ExtrapolatingOptimizer"]

_EXTRAPOLATOR_KEY = "extrapolator"
_LR_FOLLOW_KEY = "lr_follow_scale"


class ExtrapolatingOptimizer(Optimizer):
    """Wrap ``base`` so that the EffOPD gated search runs after scheduled steps.

    Args:
        base: any ``torch.optim.Optimizer``; it does all the learning.
        eval_fn: no arguments, returns the gate score (higher is better unless ``mode="min"``).
        params: which parameters to extrapolate; default every parameter of ``base`` that
            requires grad (and those of groups added later with ``add_param_group``).
        **options: keyword options of ``Extrapolator`` (``schedule``, ``coefficients``,
            ``snapshot``, ``rank``, ``direction``, ``on_jump``, ``reduce``, …), and
            ``lr_follow`` (see the module doc).

    ``state_dict()`` is the base's state dict plus an ``"extrapolator"`` entry; a plain
    base-optimizer state dict loads too (the extrapolator keeps its own state).
    """

    def __init__(
        self,
        base: Optimizer,
        eval_fn: Callable[[], float],
        *,
        params: ParamsSpec | None = None,
        **options: Any,
    ) -> None:
        if not isinstance(base, Optimizer):
            raise TypeError(f"base must be a torch.optim.Optimizer, got {type(base).__name__}")
        if isinstance(base, ExtrapolatingOptimizer):
            raise TypeError("base is already an ExtrapolatingOptimizer; wrap the inner optimizer once")
        if "optimizer" in options:
            raise TypeError("optimizer= is set by ExtrapolatingOptimizer itself (it is base)")
        self.base = base
        # What Optimizer.__init__ sets, minus the param groups, which stay the base's.
        self._optimizer_step_pre_hooks: dict[int, Callable] = OrderedDict()
        self._optimizer_step_post_hooks: dict[int, Callable] = OrderedDict()
        self._optimizer_state_dict_pre_hooks: dict[int, Callable] = OrderedDict()
        self._optimizer_state_dict_post_hooks: dict[int, Callable] = OrderedDict()
        self._optimizer_load_state_dict_pre_hooks: dict[int, Callable] = OrderedDict()
        self._optimizer_load_state_dict_post_hooks: dict[int, Callable] = OrderedDict()
        self._patch_step_function()
        self._follows_base = params is None
        if params is None:
            params = self._trainable(base.param_groups)
        self.lr_follow = ExtrapolationOptions(lr_follow=options.pop("lr_follow", None)).lr_follow
        self.lr_scale = 1.0  # lr_follow's factor on every group's lr, inside step() only
        self.extrapolator = Extrapolator(params, eval_fn, optimizer=base, **options)

    @staticmethod
    def _trainable(groups: list[dict[str, Any]]) -> list[tuple[str, Tensor]]:
        return [
            (f"param_groups.{g}.{i}", p)
            for g, group in enumerate(groups)
            for i, p in enumerate(group["params"])
            if p.requires_grad
        ]

    # The base owns these; properties keep them shared even when the base replaces them
    # (Optimizer.load_state_dict rebinds base.param_groups and base.state).
    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return self.base.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self.base.param_groups = value

    @property
    def state(self) -> Any:  # type: ignore[override]
        return self.base.state

    @state.setter
    def state(self, value: Any) -> None:
        self.base.state = value

    @property
    def defaults(self) -> dict[str, Any]:  # type: ignore[override]
        return self.base.defaults

    @defaults.setter
    def defaults(self, value: dict[str, Any]) -> None:
        self.base.defaults = value

    @property
    def history(self) -> list[JumpRecord]:
        """Every search so far (``JumpRecord``s), oldest first."""
        return self.extrapolator.history

    def summary(self) -> Summary:
        """What the searches bought so far (see ``Extrapolator.summary``)."""
        return self.extrapolator.summary()

    @property
    def step_count(self) -> int:
        return self.extrapolator.step_count

    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        """One base step (its lrs times ``lr_scale``), then the extrapolator's ``after_step``
        (a search when scheduled)."""
        if self.lr_scale == 1.0:
            loss = self.base.step() if closure is None else self.base.step(closure)
        else:
            lrs = [group["lr"] for group in self.base.param_groups]
            for group, lr in zip(self.base.param_groups, lrs, strict=True):
                group["lr"] = lr * self.lr_scale
            try:
                loss = self.base.step() if closure is None else self.base.step(closure)
            finally:  # the scheduler's lr again: the scale is never seen outside the step
                for group, lr in zip(self.base.param_groups, lrs, strict=True):
                    group["lr"] = lr
        searches = len(self.history)
        self.extrapolator.after_step()
        if self.lr_follow is not None and len(self.history) > searches:
            self.lr_scale = self.followed_scale(self.lr_scale, self.history[-1])
        return loss

    def followed_scale(self, scale: float, record: JumpRecord) -> float:
        """``lr_scale`` after the search ``record``: times ``1 + c`` (at most ``lr_follow``)
        for a kept jump of ``c > 0``, halved (not below 1) when it refused its first candidate,
        unchanged when it tried none."""
        if record.accepted is not None and record.accepted > 0:
            return min(float(self.lr_follow), scale * (1.0 + record.accepted))
        if record.accepted is None and record.coefficients:
            return max(1.0, scale / 2.0)
        return scale

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.base.zero_grad(set_to_none=set_to_none)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        n_groups = len(self.base.param_groups)
        self.base.add_param_group(param_group)
        if self._follows_base:
            added = self._trainable(self.base.param_groups)
            self.extrapolator.add_params(
                [(n, p) for n, p in added if int(n.split(".")[1]) >= n_groups]
            )

    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        state = self.base.state_dict()
        state[_EXTRAPOLATOR_KEY] = self.extrapolator.state_dict()
        if self.lr_follow is not None:
            state[_LR_FOLLOW_KEY] = self.lr_scale
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:  # type: ignore[override]
        state = dict(state_dict)
        extrapolator_state = state.pop(_EXTRAPOLATOR_KEY, None)
        # A state saved without lr_follow resumes at 1; one saved with it, at its scale.
        self.lr_scale = float(state.pop(_LR_FOLLOW_KEY, 1.0)) if self.lr_follow is not None else 1.0
        state.pop(_LR_FOLLOW_KEY, None)
        self.base.load_state_dict(state)
        if extrapolator_state is not None:
            self.extrapolator.load_state_dict(extrapolator_state)

    def __repr__(self) -> str:
        return f"ExtrapolatingOptimizer({self.base!r},\n  {self.extrapolator!r})"
