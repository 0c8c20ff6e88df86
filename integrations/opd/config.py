"""``OPDConfig``: every option of an on-policy distillation run, one name everywhere.

The ``lookahead-opd train`` CLI is generated from this dataclass with ``HfArgumentParser``
(TRL's convention), and ``--config run.yaml`` fills it from a file (command-line flags win).
``validate()`` checks what can be checked before any model loads, so a bad run fails in one
line and not after minutes of loading.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["OPDConfig", "parse_config"]

_ENGINES = ("hf", "vllm")
_OPTIMIZERS = ("adamw", "adam", "sgd")
_GATES = ("accuracy", "neg_kl", "none")
_PARAM_SETS = ("all", "blocks")
_SNAPSHOTS = ("full", "lowrank")
_DTYPES = ("float32", "bfloat16", "float16")
_REPORT_TO = ("none", "tensorboard", "wandb")


def _opt(default: Any, help: str, **kw: Any) -> Any:
    return field(default=default, metadata={"help": help, **kw})


@dataclass
class OPDConfig:
    """Options of ``OPDTrainer`` and ``lookahead-opd train``."""

    # models and data
    student: str = _opt("", "student: a Hugging Face causal LM id or local directory")
    teacher: str = _opt("", "teacher: a Hugging Face causal LM id or local directory")
    task: str = _opt(
        "arithmetic",
        "task spec: arithmetic[:key=value,...], longadd[:digits=4], gsm8k:path=FILE|name=HUB_ID, "
        "or module:Class",
    )
    output_dir: str = _opt("runs/opd", "where checkpoints, metrics.jsonl and plots go")
    # rollouts
    engine: str = _opt("hf", f"rollout engine: {' | '.join(_ENGINES)}")
    batch_size: int = _opt(64, "prompts per optimizer step")
    num_samples: int = _opt(1, "completions sampled per prompt")
    max_new_tokens: int | None = _opt(None, "completion length limit (default: the task's)")
    temperature: float = _opt(1.0, "sampling temperature of the student's rollouts")
    top_p: float = _opt(1.0, "nucleus sampling of the student's rollouts")
    vllm_gpu_memory_utilization: float = _opt(0.3, "vLLM engine: fraction of GPU memory")
    # loss
    loss: str = _opt("reverse_kl_pg", "reverse_kl_pg | reverse_kl | jsd | drgrpo (RL on the task's "
                     "exact-match reward, group-mean baseline; needs num_samples >= 2)")
    jsd_beta: float = _opt(0.5, "jsd loss: 0 = forward KL, 1 = reverse KL (TRL convention)")
    discount: float = _opt(0.0, "reverse_kl_pg: discount of later tokens' advantages")
    gradient_accumulation_steps: int = _opt(1, "micro-batches per optimizer step")
    # optimizer
    optimizer: str = _opt("adamw", f"base optimizer: {' | '.join(_OPTIMIZERS)}")
    learning_rate: float = _opt(1e-6, "peak learning rate (the paper: 1e-6)")
    warmup_steps: int = _opt(0, "linear warmup steps, then constant")
    weight_decay: float = _opt(0.0, "weight decay")
    momentum: float = _opt(0.0, "sgd momentum")
    max_grad_norm: float | None = _opt(1.0, "gradient clipping (None: off)")
    max_steps: int = _opt(100, "optimizer steps")
    # EffOPD
    extrapolate: bool = _opt(False, "wrap the optimizer in ExtrapolatingOptimizer (EffOPD)")
    gate: str = _opt("accuracy", "gate score: accuracy (exact match) | neg_kl (−reverse KL) | none "
                     "(ungated: every candidate is kept, a fixed ExPO-style jump)")
    gate_size: int = _opt(50, "problems in the fixed gate set")
    coefficients: str = _opt("geometric", "geometric | linear | comma-separated numbers")
    max_candidates: int = _opt(5, "candidates tried per search at most")
    snapshot: str = _opt("full", "full | lowrank")
    rank: int | None = _opt(None, "low-rank snapshot rank")
    direction: str = _opt("secant", "secant | averaged")
    direction_rank: int | None = _opt(None, "extrapolate each 2-D weight along the top-r singular "
                                      "subspace of its update only (None: the raw direction)")
    schedule: str = _opt("powers_of_two", "search steps: powers_of_two or comma-separated steps")
    extrapolate_params: str = _opt("all", "all | blocks (attention and MLP weights only, as the "
                                   "paper's code)")
    min_improvement: float = _opt(0.0, "a candidate must beat the best score by more than this")
    # evaluation, checkpoints, logging
    eval_every: int = _opt(10, "evaluate greedy accuracy every N steps (0: only at the end)")
    eval_size: int = _opt(200, "problems in the held-out eval set")
    save_every: int = _opt(0, "checkpoint every N steps (0: only at the end)")
    resume: bool = _opt(False, "continue from output_dir's checkpoint")
    stop_at_accuracy: float | None = _opt(None, "stop once eval accuracy reaches this")
    ema_decay: float | None = _opt(None, "evaluate an EMA of the weights with this decay (training "
                                   "is unchanged)")
    report_to: str = _opt("none", "none | tensorboard | wandb (comma-separated)")
    seed: int = _opt(0, "seed of the prompt order, rollouts and init")
    dtype: str = _opt("float32", f"model dtype: {' | '.join(_DTYPES)}")
    device: str = _opt("cpu", "torch device for the student and teacher")
    progress: bool = _opt(True, "show progress bars")

    def validate(self, *, check_paths: bool = True) -> None:
        """Raise ``ValueError`` naming the first bad option; nothing is loaded."""
        _choice("engine", self.engine, _ENGINES)
        _choice("optimizer", self.optimizer, _OPTIMIZERS)
        _choice("gate", self.gate, _GATES)
        _choice("snapshot", self.snapshot, _SNAPSHOTS)
        _choice("dtype", self.dtype, _DTYPES)
        _choice("direction", self.direction, ("secant", "averaged"))
        _choice("extrapolate_params", self.extrapolate_params, _PARAM_SETS)
        self.schedule_value()
        if self.ema_decay is not None and not 0 < self.ema_decay < 1:
            raise ValueError(f"ema_decay must be in (0, 1), got {self.ema_decay}")
        if not 0 <= self.momentum < 1:
            raise ValueError(f"momentum must be in [0, 1), got {self.momentum}")
        if self.loss == "drgrpo" and self.num_samples < 2:
            raise ValueError("loss=drgrpo needs num_samples >= 2 (the baseline is the group mean)")
        from .losses import LOSSES

        _choice("loss", self.loss, tuple(LOSSES))
        for name in self.report_to_list():
            _choice("report_to", name, _REPORT_TO)
        for name in ("batch_size", "num_samples", "gradient_accumulation_steps", "max_steps",
                     "gate_size", "eval_size", "max_candidates"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("eval_every", "save_every", "warmup_steps"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.max_new_tokens is not None and self.max_new_tokens <= 0:
            raise ValueError(f"max_new_tokens must be > 0, got {self.max_new_tokens}")
        if self.temperature <= 0:
            raise ValueError(f"temperature must be > 0 for on-policy rollouts, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.learning_rate <= 0:
            raise ValueError(f"learning_rate must be > 0, got {self.learning_rate}")
        if not 0 <= self.jsd_beta <= 1:
            raise ValueError(f"jsd_beta must be in [0, 1], got {self.jsd_beta}")
        if not 0 <= self.discount <= 1:
            raise ValueError(f"discount must be in [0, 1], got {self.discount}")
        if self.batch_size * self.num_samples % self.gradient_accumulation_steps:
            raise ValueError(
                f"batch_size*num_samples ({self.batch_size * self.num_samples}) must be divisible "
                f"by gradient_accumulation_steps ({self.gradient_accumulation_steps})"
            )
        if self.direction_rank is not None and self.direction_rank < 1:
            raise ValueError(f"direction_rank must be >= 1, got {self.direction_rank}")
        if self.snapshot == "lowrank" and (self.rank is None or self.rank < 1):
            raise ValueError(f"snapshot='lowrank' needs rank >= 1, got {self.rank}")
        self.coefficient_values()
        from .tasks import load_task

        load_task(self.task)  # unknown tasks and bad options fail here, before any model
        if check_paths:
            for role in ("student", "teacher"):
                _check_model_ref(role, getattr(self, role))

    def coefficient_values(self) -> str | list[float]:
        """``coefficients`` as the optimizer option: a name or a list of numbers."""
        if self.coefficients in ("geometric", "linear"):
            return self.coefficients
        try:
            return [float(c) for c in self.coefficients.split(",")]
        except ValueError:
            raise ValueError(
                f"coefficients must be geometric, linear or comma-separated numbers, "
                f"got {self.coefficients!r}"
            ) from None

    def schedule_value(self) -> str | list[int]:
        """``schedule`` as the optimizer option: ``"powers_of_two"`` or a list of steps."""
        if self.schedule == "powers_of_two":
            return self.schedule
        try:
            steps = [int(x) for x in self.schedule.split(",") if x.strip()]
        except ValueError:
            steps = []
        if not steps or min(steps) < 1:
            raise ValueError(f"schedule must be powers_of_two or comma-separated steps >= 1, "
                             f"got {self.schedule!r}")
        return steps

    def report_to_list(self) -> list[str]:
        return [s.strip() for s in self.report_to.split(",") if s.strip() and s.strip() != "none"]

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def save(self, path: str | os.PathLike) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2, sort_keys=True))


def _choice(name: str, value: str, choices: Sequence[str]) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)}; got {value!r}")


def _check_model_ref(role: str, ref: str) -> None:
    """A local path must be a saved model; a bare ``name`` or ``org/name`` is left to the Hub."""
    if not ref:
        raise ValueError(f"--{role} is required (a Hugging Face model id or a local directory)")
    path = Path(ref).expanduser()
    if path.exists():
        if not (path / "config.json").is_file():
            raise ValueError(f"{role} directory {ref} has no config.json (not a saved HF model)")
    elif ref.startswith((".", "/", "~")) or ref.count("/") > 1:
        raise ValueError(f"{role} path {ref} does not exist")


def parse_config(argv: Sequence[str] | None = None) -> OPDConfig:
    """Build an ``OPDConfig`` from ``--config FILE.yaml|json`` and flags (flags win)."""
    from transformers import HfArgumentParser

    args = list(argv or [])
    base: dict[str, Any] = {}
    if "--config" in args:
        i = args.index("--config")
        if i + 1 >= len(args):
            raise ValueError("--config needs a file path")
        base = _read_config_file(args[i + 1])
        del args[i : i + 2]
    parser = HfArgumentParser(OPDConfig, prog="lookahead-opd train")
    defaults = OPDConfig(**base)
    parser.set_defaults(**dataclasses.asdict(defaults))
    (config,) = parser.parse_args_into_dataclasses(args=args)
    return config


def _read_config_file(path: str) -> dict[str, Any]:
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"config file {path} does not exist")
    text = p.read_text()
    if p.suffix in (".yaml", ".yml"):
        import yaml

        data = yaml.safe_load(text) or {}
    else:
        data = json.loads(text)
    if not isinstance(data, dict):
        raise ValueError(f"config file {path} must hold a mapping of option: value")
    known = {f.name for f in dataclasses.fields(OPDConfig)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ValueError(f"unknown option(s) in {path}: {', '.join(unknown)}")
    return data
