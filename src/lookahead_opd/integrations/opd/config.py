"""``OPDConfig``: every option of an on-policy distillation run, one name everywhere.

The ``lookahead-opd train`` CLI is generated from this dataclass (``train.parse_config``:
``HfArgumentParser``, TRL's convention), and ``--config run.yaml`` fills it from a file
(command-line flags win). ``validate()`` checks the config's own values and nothing else: it
imports no other module of the package but ``lookahead_opd.options``, so importing the config
pulls in no loop. What needs the rest of the package (the optimizer, the task, the teacher
servers, the output folder, the model references) is checked once where a run is built,
``train.check_run`` (called by ``train.build_trainer``), before any model loads.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lookahead_opd.options import (
    ExtrapolationOptions,
    check_choice,
    check_fields,
    config_fields,
    option,
)

__all__ = ["OPDConfig", "EffOPDOptions", "with_defaults", "DTYPES", "LOSS_NAMES",
           "PARAM_SELECTOR_NAMES", "LOSS_OPTIONS"]

_ENGINES = ("hf", "vllm")
_GATES = ("accuracy", "neg_kl", "none")
DTYPES = ("float32", "bfloat16", "float16")
_REPORT_TO = ("none", "tensorboard", "wandb")
_FSDP_TEACHER = ("replicate", "shard")
_MIXED_PRECISION = ("none", "bfloat16", "float16")
# The names the loop's registries define, repeated here so that the config imports none of
# them (tests/opd/test_config.py checks they agree): ``losses.LOSSES``'s keys, the
# options any loss reads (``losses.LOSS_INPUTS``), the top-k losses' default k
# (``losses.DEFAULT_TOPK``) and ``lookahead_opd.selection.PARAM_SELECTORS``'s keys.
LOSS_NAMES = ("reverse_kl_pg", "reverse_kl", "jsd", "topk_forward_kl", "topk_reverse_kl",
              "topk_jsd", "drgrpo")
LOSS_OPTIONS = ("discount", "jsd_beta", "topk")
_DEFAULT_TOPK = 20
PARAM_SELECTOR_NAMES = ("trainable", "transformer_blocks")


# The options of the gated search, from the core's ``ExtrapolationOptions``: every one of them
# is a field (and a flag) here, except ``mode`` (the OPD gate is always maximised) and those
# that only take objects. ``max_candidates`` keeps OPD's cap of 5 for explicit coefficients.
EffOPDOptions = dataclasses.make_dataclass(
    "EffOPDOptions", config_fields(exclude=("mode",), defaults={"max_candidates": 5}))
EffOPDOptions.__module__ = __name__
EffOPDOptions.__doc__ = "The ``ExtrapolationOptions`` an OPD run sets (all but ``mode``)."


@dataclass
class OPDConfig(EffOPDOptions):
    """Options of ``OPDTrainer`` and ``lookahead-opd train``: the run's own, and the gated
    search's (``EffOPDOptions``, from the core's ``ExtrapolationOptions``)."""

    # models and data
    student: str = option("", "student: a Hugging Face causal LM id, a local directory, or a "
                          "named source (smollm2-135m-gguf: the real SmolLM2-135M, no Hub)")
    teacher: str = option("", "teacher: a Hugging Face causal LM id, a local directory, or a "
                          "named source")
    teacher_url: list[str] = option([], "the teacher behind vLLM's OpenAI-compatible server "
                                    "(`vllm serve`), instead of --teacher: one URL, or several "
                                    "serving the same model (least-in-flight balancing)")
    teachers: list[str] = option([], "several teachers, name=URL_or_path each (a URL list "
                                 "comma-separated); --teacher_key picks each problem's")
    teacher_key: str | None = option(None, "with --teachers: the task field naming each "
                                     "problem's teacher")
    default_teacher: str | None = option(None, "with --teachers: the teacher of problems whose "
                                         "key is missing or unknown (None: such a problem is "
                                         "an error before step 0)")
    teacher_max_inflight: int = option(16, "served teachers: requests in flight at once, per "
                                       "process (each torchrun rank has its own)", minimum=1)
    teacher_timeout: float = option(600.0, "served teachers: seconds one request may take")
    teacher_retries: int = option(5, "served teachers: tries after a connection error, timeout, "
                                  "HTTP 429 or 5xx (backoff 0.5 s, doubling); a 4xx is not "
                                  "retried", minimum=0)
    task: str = option(
        "arithmetic",
        "task spec: arithmetic[:key=value,...], longadd[:digits=4], gsm8k:path=FILE|name=HUB_ID, "
        "or module:Class",
    )
    chat_template: bool = option(True, "render prompts through the student tokenizer's chat "
                                 "template when it has one (instruct models)",
                                 negated_help="plain prompts, even when the tokenizer has a chat "
                                              "template")
    output_dir: str = option("runs/opd", "where checkpoints, metrics.jsonl and plots go")
    # rollouts
    engine: str = option("hf", "rollout engine", choices=_ENGINES)
    batch_size: int = option(64, "prompts per optimizer step", minimum=1)
    num_samples: int = option(1, "completions sampled per prompt", minimum=1)
    max_new_tokens: int | None = option(None, "completion length limit (default: the task's)")
    temperature: float = option(1.0, "sampling temperature of the student's rollouts")
    top_p: float = option(1.0, "nucleus sampling of the student's rollouts")
    vllm_gpu_memory_utilization: float = option(0.3, "vLLM engine: fraction of GPU memory")
    vllm_dtype: str | None = option(None, "vLLM engine: dtype of its copy of the student (None: "
                                    "--dtype; bfloat16 halves it while training stays in --dtype)",
                                    choices=(None, *DTYPES))
    # loss
    loss: str = option("reverse_kl_pg", "distillation loss (drgrpo: RL on the task's exact-match "
                       "reward, group-mean baseline; needs num_samples >= 2; topk_*: over the "
                       "teacher's --topk tokens and one tail bucket, which a served teacher "
                       "gives)", choices=LOSS_NAMES)
    jsd_beta: float = option(0.5, "jsd and topk_jsd losses: 0 = forward KL, 1 = reverse KL (TRL "
                             "convention)")
    topk: int = option(_DEFAULT_TOPK, "topk_* losses, and the -KL gate of a served teacher: the "
                       "teacher's k most likely tokens read at each position, the rest of the "
                       "vocabulary one tail bucket (a served teacher's --max-logprobs must "
                       "allow k)", minimum=1)
    discount: float = option(0.0, "reverse_kl_pg: discount of later tokens' advantages")
    loss_chunk_size: int | None = option(
        None, "completion tokens per lm_head projection in the loss (from the final hidden "
        "states, recomputed in the backward: the full-vocabulary losses, the sampled tokens' "
        "log-probs and the -KL gate never hold tokens x vocab logits); 0: dense logits; "
        "default: 128 when a micro-batch's largest completion (rows x max_new_tokens) x vocab "
        "reaches 2^26 logits, dense below")
    gradient_accumulation_steps: int = option(1, "micro-batches per optimizer step", minimum=1)
    train_top_blocks: int = option(0, "train only the top k decoder blocks (0: every weight); "
                                   "the rest, embeddings and lm_head stay frozen", minimum=0)
    # optimizer
    optimizer: str = option("adamw", "base optimizer: adamw, adam, sgd, prodigy, mechanic:<name> "
                            "(Mechanic around <name>), or an import path (torch.optim.RAdam, "
                            "pkg.module:Name); see lookahead_opd.integrations.opd.optimizers")
    optimizer_kwargs: str = option("", "extra keyword arguments of the optimizer, a JSON object "
                                   "(e.g. '{\"d0\": 1e-5}' for prodigy)")
    learning_rate: float = option(1e-6, "peak learning rate (the paper: 1e-6)")
    warmup_steps: int = option(0, "linear warmup steps, then constant", minimum=0)
    weight_decay: float = option(0.0, "weight decay")
    momentum: float = option(0.0, "sgd momentum")
    max_grad_norm: float | None = option(1.0, "gradient clipping (None: off)")
    max_steps: int = option(100, "optimizer steps", minimum=1)
    # EffOPD
    extrapolate: bool = option(False, "wrap the optimizer in ExtrapolatingOptimizer (EffOPD)")
    gate: str = option("accuracy", "gate score (accuracy: exact match; neg_kl: −reverse KL to the "
                       "teacher on fixed rollouts; none: ungated, every candidate kept, a fixed "
                       "ExPO-style jump)", choices=_GATES)
    gate_size: int = option(50, "problems in the fixed gate set", minimum=1)
    extrapolate_params: str = option("trainable", "which weights jump (transformer_blocks: "
                                     "attention and MLP weights only, as the paper's code)",
                                     choices=PARAM_SELECTOR_NAMES)
    # evaluation, checkpoints, logging
    eval_every: int = option(10, "evaluate greedy accuracy every N steps (0: only at the end)", minimum=0)
    eval_size: int = option(200, "problems in the held-out eval set", minimum=1)
    save_every: int = option(0, "checkpoint every N steps (0: only at the end)", minimum=0)
    resume: bool = option(False, "continue from output_dir's newest checkpoint that loads (a "
                          "damaged one is set aside as corrupt-checkpoint-N)")
    overwrite_output_dir: bool = option(False, "start over in an output_dir that holds an earlier "
                                        "run: its metrics and checkpoints are deleted first")
    stop_at_accuracy: float | None = option(None, "stop once eval accuracy reaches this")
    ema_decay: float | None = option(None, "evaluate an EMA of the weights with this decay (training "
                                   "is unchanged)")
    report_to: str = option("none", f"{' | '.join(_REPORT_TO)} (comma-separated)")
    seed: int = option(0, "seed of the prompt order, rollouts and init")
    dtype: str = option("float32", "model dtype", choices=DTYPES)
    # sharding (under torchrun)
    fsdp: bool = option(False, "shard the student over the torchrun ranks with FSDP2 (each decoder "
                        "block and the root): parameters, gradients, optimizer state and the EffOPD "
                        "anchor are split over the ranks")
    fsdp_teacher: str = option("replicate", "with --fsdp: a full teacher on every rank, or sharded "
                               "(gathered block by block in each forward)", choices=_FSDP_TEACHER)
    fsdp_mixed_precision: str = option("none", "with --fsdp: the dtype the gathered weights compute "
                                       "in; gradients are reduced in float32, shards and optimizer "
                                       "state keep --dtype", choices=_MIXED_PRECISION)
    device: str = option("cpu", "torch device for the student and teacher")
    threads: int | None = option(1, "torch CPU threads of the command (set by the CLI, not by "
                                 "OPDTrainer; as torchrun does, 1: on a shared 2-core machine it "
                                 "was faster than torch's default, benchmarks/results/threads.md)",
                                 minimum=1)
    progress: bool = option(True, "show progress bars",
                            negated_help="no progress bars (training, and model loading and "
                                         "writing)")
    # preflight (`lookahead-opd check`, and `train` before step 0; preflight.py)
    allow_template_mismatch: bool = option(False, "train although the student's and the "
                                           "teacher's chat templates or special tokens differ "
                                           "(the teacher then scores prompts rendered in the "
                                           "student's format)")
    preflight_rollouts: bool = option(False, "also run the preflight checks that sample a few "
                                      "rollouts: student-as-teacher gives a zero loss and gate, "
                                      "and the teacher's top-k mass for top-k losses")

    def validate(self) -> None:
        """Raise ``ValueError`` naming the first bad option. The config's own values only
        (their types, ranges and combinations); ``train.check_run`` checks the rest."""
        check_fields(self)
        ExtrapolationOptions.from_kwargs(self.extrapolation_options())
        self._check_combinations()
        self._check_ranges()
        for name in self.report_to_list():
            check_choice("report_to", name, _REPORT_TO)
        if self.batch_size * self.num_samples % self.gradient_accumulation_steps:
            raise ValueError(
                f"batch_size*num_samples ({self.batch_size * self.num_samples}) must be divisible "
                f"by gradient_accumulation_steps ({self.gradient_accumulation_steps})"
            )
        self._check_teachers()

    def _check_combinations(self) -> None:
        """Options that exclude one another."""
        if self.fsdp and self.ema_decay is not None:
            raise ValueError("ema_decay is not supported with fsdp (the average would be a full "
                             "replica of the student on every rank); drop --ema_decay")
        if self.fsdp and self.train_top_blocks:
            raise ValueError("train_top_blocks is not supported with fsdp (a sharded block mixes "
                             "frozen and trained weights); drop one of them")
        if self.loss == "drgrpo" and self.num_samples < 2:
            raise ValueError("loss=drgrpo needs num_samples >= 2 (the baseline is the group mean)")
        if self.resume and self.overwrite_output_dir:
            raise ValueError("resume and overwrite_output_dir contradict each other; give one")

    def _check_ranges(self) -> None:
        """Numbers outside the range their option has a meaning in."""
        if self.ema_decay is not None and not 0 < self.ema_decay < 1:
            raise ValueError(f"ema_decay must be in (0, 1), got {self.ema_decay}")
        if not 0 <= self.momentum < 1:
            raise ValueError(f"momentum must be in [0, 1), got {self.momentum}")
        if self.loss_chunk_size is not None and self.loss_chunk_size < 0:
            raise ValueError(f"loss_chunk_size must be >= 0 (0: dense), got {self.loss_chunk_size}")
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
        if self.teacher_timeout <= 0:
            raise ValueError(f"teacher_timeout must be > 0 seconds, got {self.teacher_timeout}")

    def teacher_refs(self) -> dict[str | None, str | list[str]]:
        """Every teacher by name (``None``: the run's only teacher): a model reference
        (Hub id or directory, run in process) or a list of server URLs."""
        if self.teachers:
            refs: dict[str | None, str | list[str]] = {}
            for entry in self.teachers:
                name, sep, ref = entry.partition("=")
                if not sep or not name.strip() or not ref.strip():
                    raise ValueError(f"--teachers entries are name=URL_or_path, got {entry!r}")
                if name.strip() in refs:
                    raise ValueError(f"--teachers names {name.strip()!r} twice")
                urls = [u.strip() for u in ref.split(",")]
                refs[name.strip()] = urls if urls[0].startswith(("http://", "https://")) else ref
            return refs
        return {None: list(self.teacher_url) if self.teacher_url else self.teacher}

    def gated(self) -> bool:
        """Whether the run scores a gate set (``extrapolate`` with a gate other than
        ``none``): only then are the task's gate problems built, and needed."""
        return self.extrapolate and self.gate != "none"

    def served_teacher(self) -> bool:
        """Whether any teacher is behind a server (so only sampled-token and top-k scores
        exist)."""
        return any(isinstance(r, list) for r in self.teacher_refs().values())

    def _check_teachers(self) -> None:
        """One way to name the teacher(s), and what a served one or several cannot do, in one
        line each (``train.check_run`` adds the URLs' form and the loss's needs)."""
        given = [flag for flag, v in (("--teacher", self.teacher), ("--teacher_url",
                 self.teacher_url), ("--teachers", self.teachers)) if v]
        if len(given) > 1:
            raise ValueError(f"give one of --teacher, --teacher_url, --teachers; got "
                             f"{' and '.join(given)}")
        if self.teachers and not self.teacher_key:
            raise ValueError("--teachers needs --teacher_key FIELD (the task field naming each "
                             "problem's teacher)")
        if not self.teachers and (self.teacher_key or self.default_teacher):
            raise ValueError("--teacher_key and --default_teacher go with --teachers")
        refs = self.teacher_refs()
        if self.default_teacher is not None and self.default_teacher not in refs:
            raise ValueError(f"default_teacher {self.default_teacher!r} is not one of --teachers "
                             f"({', '.join(map(str, refs))})")
        # One served teacher scores the gate by its top-k (OPDTrainer.gate_reverse_kl); the
        # gate rollouts are not routed over several teachers.
        if self.teachers and self.extrapolate and self.gate == "neg_kl":
            raise ValueError("gate=neg_kl scores the gate rollouts with one teacher, and "
                             "--teachers gives several; use --gate accuracy (or one --teacher "
                             "or --teacher_url)")
        if (self.served_teacher() or self.teachers) and self.fsdp and self.fsdp_teacher == "shard":
            raise ValueError("fsdp_teacher=shard shards an in-process teacher; a served teacher "
                             "has none to shard")

    def extrapolation_options(self) -> dict[str, Any]:
        """The ``ExtrapolatingOptimizer`` keyword options this config sets. ``gate="none"`` is
        the fixed jump: its score only rises, so ``linearity``, which reads the ladder's shape
        from the scores, is off there (it would keep nothing)."""
        options = {f.name: getattr(self, f.name) for f in dataclasses.fields(EffOPDOptions)}
        if self.gate == "none":
            options["linearity"] = 0.0
        return options

    def loss_options(self) -> dict[str, Any]:
        """The options the losses read (``LOSS_OPTIONS``), by name: what
        ``losses.compute_loss`` and ``losses.teacher_needs`` take as ``options``."""
        return {name: getattr(self, name) for name in LOSS_OPTIONS}

    def report_to_list(self) -> list[str]:
        return [s.strip() for s in self.report_to.split(",") if s.strip() and s.strip() != "none"]

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def save(self, path: str | os.PathLike) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2, sort_keys=True))


def with_defaults(cls: type, **defaults: Any) -> type:
    """A subclass of the config dataclass ``cls`` whose fields ``defaults`` names default to
    other values (same types and help): a derived CLI without re-declaring them."""
    known = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(defaults) - set(known))
    if unknown:
        raise ValueError(f"{cls.__name__} has no option(s) {unknown}")
    sub = dataclasses.make_dataclass(cls.__name__, [
        (name, known[name].type, dataclasses.field(default=value, metadata=known[name].metadata))
        for name, value in defaults.items()], bases=(cls,))
    sub.__module__ = cls.__module__  # where the field types (strings) resolve
    return sub
