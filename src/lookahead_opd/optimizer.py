"""``ExtrapolatingOptimizer``: EffOPD's gated jump around any ``torch.optim.Optimizer``.

    opt = ExtrapolatingOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-5),
                                 eval_fn=lambda: gate_accuracy(model))
    loss.backward(); opt.step(); opt.zero_grad()   # the loop is unchanged

The wrapper stays out of the base optimizer's way (as ``timm``'s Lookahead does): it shares
the base's ``param_groups``, ``state`` and ``defaults`` so LR schedulers, ``GradScaler`` and
``isinstance`` checks see one optimizer, delegates ``step``/``zero_grad``/``add_param_group``,
and runs its ``Extrapolator`` after each step.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from torch import Tensor
from torch.optim import Optimizer

from .extrapolator import Extrapolator, JumpRecord, ParamsSpec, Summary

__all__ = ["ExtrapolatingOptimizer"]

_EXTRAPOLATOR_KEY = "extrapolator"


class ExtrapolatingOptimizer(Optimizer):
    """Wrap ``base`` so that the EffOPD gated search runs after scheduled steps.

    Args:
        base: any ``torch.optim.Optimizer``; it does all the learning.
        eval_fn: no arguments, returns the gate score (higher is better unless ``mode="min"``).
        params: which parameters to extrapolate; default every parameter of ``base`` that
            requires grad (and those of groups added later with ``add_param_group``).
        **options: keyword options of ``Extrapolator`` (``schedule``, ``coefficients``,
            ``snapshot``, ``rank``, ``direction``, ``on_jump``, ``reduce``, …).

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
        """One base step, then the extrapolator's ``after_step`` (a search when scheduled)."""
        loss = self.base.step() if closure is None else self.base.step(closure)
        self.extrapolator.after_step()
        return loss

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
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:  # type: ignore[override]
        state = dict(state_dict)
        extrapolator_state = state.pop(_EXTRAPOLATOR_KEY, None)
        self.base.load_state_dict(state)
        if extrapolator_state is not None:
            self.extrapolator.load_state_dict(extrapolator_state)

    def __repr__(self) -> str:
        return f"ExtrapolatingOptimizer({self.base!r},\n  {self.extrapolator!r})"
