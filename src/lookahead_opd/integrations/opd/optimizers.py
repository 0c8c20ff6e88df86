"""The OPD loop's base optimizer, from a factory: any torch optimizer, and the lr-free baselines.

``OPDConfig.optimizer`` names it, and ``optimizer_factory`` turns the name into a callable
``factory(params, lr=..., weight_decay=..., **kwargs) -> torch.optim.Optimizer``, once, in
``OPDConfig.validate`` (so a bad name fails in one line before any model loads). A name is:

- ``adamw``, ``adam``, ``sgd``: ``torch.optim.AdamW`` / ``Adam`` / ``SGD`` (``sgd`` also gets
  ``momentum``);
- an import path to an optimizer class or factory: ``torch.optim.RAdam``, ``pkg.mod:Name``;
- ``prodigy``: Prodigy (Mishchenko & Defazio 2023, arXiv 2306.06101; PyPI ``prodigyopt``), which
  estimates its own step size ``d`` from ``d0``. Its authors recommend ``lr=1.0`` for all
  networks and steering the estimate with ``d_coef`` instead, and ``safeguard_warmup=True``
  with an lr warm-up (github.com/konstmish/prodigy, README): the run's ``learning_rate`` is
  therefore not Prodigy's lr (set ``d0`` or ``d_coef`` through ``optimizer_kwargs``);
- ``mechanic:<name>``: Mechanic (Cutkosky, Defazio & Mehta 2023, arXiv 2306.00144; PyPI
  ``mechanic-pytorch``) around the optimizer ``<name>``: it learns one scale of the total update
  since the start and multiplies the base optimizer's lr by it. Its authors use the defaults
  and say the lr "can be set to anything" (github.com/optimizedlearning/mechanic, README), so
  the run's ``learning_rate`` is the base optimizer's, as given.

A Python caller may pass any callable ``factory(params, **kwargs)`` instead of a name
(``OPDTrainer(..., optimizer_factory=...)``).
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Callable, Iterable
from typing import Any

import torch

__all__ = ["OptimizerFactory", "optimizer_factory", "optimizer_kwargs", "build_optimizer",
           "NAMES"]

OptimizerFactory = Callable[..., torch.optim.Optimizer]
NAMES = {"adamw": "torch.optim.AdamW", "adam": "torch.optim.Adam", "sgd": "torch.optim.SGD",
         "prodigy": "prodigyopt.Prodigy"}
# The extras a name needs, for the error message when it is missing.
_PACKAGES = {"prodigyopt": "prodigyopt", "mechanic_pytorch": "mechanic-pytorch"}


def _import(path: str) -> Any:
    """The object at ``pkg.mod.Name`` or ``pkg.mod:Name``."""
    module, sep, name = path.partition(":") if ":" in path else path.rpartition(".")
    if not module or not name or not sep:
        raise ValueError(f"optimizer {path!r} is not one of {', '.join(NAMES)}, 'mechanic:<name>', "
                         "or an import path like 'torch.optim.RAdam' or 'pkg.module:Name'")
    try:
        obj = importlib.import_module(module)
    except ImportError as err:
        top = module.split(".")[0]
        hint = (f"; pip install {_PACKAGES[top]} (or lookahead-opd[bench])" if top in _PACKAGES
                else "")
        raise ValueError(f"optimizer {path!r}: cannot import {module!r} ({err}){hint}") from None
    try:
        for part in name.split("."):
            obj = getattr(obj, part)
    except AttributeError:
        raise ValueError(f"optimizer {path!r}: {module!r} has no {name!r}") from None
    if not callable(obj):
        raise ValueError(f"optimizer {path!r} is not a class or a callable")
    return obj


def optimizer_factory(spec: str | OptimizerFactory) -> OptimizerFactory:
    """The factory a name stands for (see the module doc); a callable is returned as is."""
    if callable(spec):
        return spec
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"optimizer must be a name or a callable, got {spec!r}")
    if spec.startswith("mechanic:"):
        inner = optimizer_factory(spec.removeprefix("mechanic:"))
        if not (isinstance(inner, type) and issubclass(inner, torch.optim.Optimizer)):
            raise ValueError(f"optimizer {spec!r}: Mechanic wraps a torch.optim.Optimizer class")
        return _import("mechanic_pytorch.mechanize")(inner)
    return _import(NAMES.get(spec, spec))


def optimizer_kwargs(text: str) -> dict[str, Any]:
    """``optimizer_kwargs``: a JSON object of extra keyword arguments (lists become tuples, as
    ``betas`` wants), or the empty string."""
    try:
        kwargs = json.loads(text) if text.strip() else {}
    except json.JSONDecodeError:
        kwargs = None
    if not isinstance(kwargs, dict):
        raise ValueError(f"optimizer_kwargs must be a JSON object, got {text!r}")
    return {k: tuple(v) if isinstance(v, list) else v for k, v in kwargs.items()}


def build_optimizer(spec: str | OptimizerFactory, params: Iterable[torch.nn.Parameter], *,
                    lr: float, weight_decay: float = 0.0, momentum: float = 0.0,
                    warmup: bool = False, **kwargs: Any) -> torch.optim.Optimizer:
    """The optimizer ``spec`` names over ``params``: ``lr`` and ``weight_decay`` as given
    (``momentum`` for SGD, or wherever it is non-zero; Prodigy: ``lr=1.0`` and ``safeguard_warmup`` with a ``warmup``, as
    its authors recommend), then ``kwargs`` over them."""
    factory = optimizer_factory(spec)
    base: dict[str, Any] = {"lr": lr, "weight_decay": weight_decay}
    if spec == "sgd" or momentum:  # a momentum given to another optimizer is passed on
        base["momentum"] = momentum
    if spec == "prodigy":
        base.update(lr=1.0, safeguard_warmup=warmup)
    return factory(list(params), **{**base, **kwargs})
