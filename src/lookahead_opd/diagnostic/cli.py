"""``lookahead-opd diagnose``: rank candidate teachers for OPD without training.

    lookahead-opd diagnose --student ./base --teacher ./rl-tuned --teacher self:solution \\
        --task arithmetic --questions 32 --budget 20000 --output_dir runs/diagnose

Every option is a field of ``DiagnoseConfig`` (the CLI is generated from it with
``HfArgumentParser``); ``--teacher`` may be repeated or given several values. Bad input (an
unknown teacher spec, a teacher with another tokenizer, an empty task, a budget too small for
one node) fails with one line before any model weights load or any rollout runs.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lookahead_opd.integrations.cli_support import parse_dataclass
from lookahead_opd.integrations.opd.config import DTYPES
from lookahead_opd.integrations.opd.tasks import SPLITS
from lookahead_opd.options import check_fields, option

from .nodes import SPACINGS
from .report import METRICS
from .scores import DISTILL_LOSSES
from .teachers import SELF_CONTEXTS

__all__ = ["DiagnoseConfig", "parse_config", "prepare", "run", "main"]


@dataclass
class DiagnoseConfig:
    """Options of ``lookahead-opd diagnose`` (see ``diagnose()`` for what each one does)."""

    student: str = option("", "student: a Hugging Face causal LM id, local directory or named "
                          "source (smollm2-135m-gguf)")
    teacher: list[str] = option([], "teacher(s): model id/directory or "
                                f"self:{'|'.join(SELF_CONTEXTS)}; repeat the flag or give several")
    task: str = option("arithmetic",
                     "task spec: arithmetic[:key=value,...], gsm8k:path=FILE, module:Class")
    questions: int = option(32, "questions to roll the student out on")
    budget: int = option(20_000, "total continuation rollouts (never exceeded)")
    output_dir: str = option("runs/diagnose", "report.json, nodes.jsonl/parquet, plots, report.html")
    split: str = option("test", "task split the questions come from", choices=SPLITS)
    samples_per_question: int = option(2, "student rollouts per question")
    top_k: int = option(4, "candidates per node: the student's top-K plus the sampled token")
    continuations: int = option(8, "student continuations per candidate (estimates P_succ)")
    loss: str = option("reverse_kl", "distillation loss whose gradient is scored",
                       choices=DISTILL_LOSSES)
    jsd_beta: float = option(0.5, "jsd: 0 = forward KL, 1 = reverse KL (TRL convention)")
    temperature: float = option(1.0, "the student's sampling temperature (rollouts and p)")
    max_new_tokens: int | None = option(None, "completion length limit (default: the task's)")
    spacing: str = option("exponential", "node depths (exponential: 1, 2, 4, …)", choices=SPACINGS)
    context_separator: str = option(" ", "text between a self-teacher's context and the prompt")
    rank_by: str = option("alignment", "the metric teachers are ranked by", choices=METRICS)
    resamples: int = option(1000, "bootstrap resamples for the confidence intervals")
    seed: int = option(0, "seed of the questions, rollouts and bootstrap")
    dtype: str = option("float32", "model dtype", choices=DTYPES)
    device: str = option("cpu", "torch device of the student and teachers")
    batch_size: int = option(256, "rows per generate call of the engine")
    plots: bool = option(True, "write the plots and report.html",
                         negated_help="skip the plots and report.html (report.json and the nodes "
                                      "are still written)")
    progress: bool = option(True, "show progress bars",
                            negated_help="no progress bars (rollouts, and model loading and "
                                         "writing)")

    def validate(self, *, check_paths: bool = True) -> None:
        """Raise ``ValueError`` naming the first bad option; nothing is loaded but the task."""
        from lookahead_opd.integrations.cli_support import (
            check_device,
            check_model_ref,
            check_output_dir,
        )
        from lookahead_opd.integrations.opd.tasks import load_task

        from .diagnose import check_options
        from .teachers import parse_teacher_spec

        check_options(budget=self.budget, questions=self.questions,
                      samples_per_question=self.samples_per_question, top_k=self.top_k,
                      continuations=self.continuations, loss=self.loss, jsd_beta=self.jsd_beta,
                      temperature=self.temperature, spacing=self.spacing, rank_by=self.rank_by)
        check_fields(self)
        check_device(self.device)
        if self.max_new_tokens is not None and self.max_new_tokens <= 0:
            raise ValueError(f"max_new_tokens must be > 0, got {self.max_new_tokens}")
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {self.batch_size}")
        if not self.teacher:
            raise ValueError(f"give at least one --teacher (a model or "
                             f"self:{'|'.join(SELF_CONTEXTS)})")
        if len(set(self.teacher)) != len(self.teacher):
            raise ValueError(f"--teacher values must be distinct, got {self.teacher}")
        specs = [parse_teacher_spec(t) for t in self.teacher]
        task = load_task(self.task)
        pool = task.all_problems(self.split)
        if not pool:
            raise ValueError(
                f"task {self.task!r} has no {self.split} problems: nothing to diagnose")
        if check_paths:
            check_output_dir(self.output_dir)
            check_model_ref("student", self.student)
            for s in specs:
                if s.kind == "model":
                    check_model_ref("teacher", s.path)


def _merge_repeated(args: list[str], flag: str) -> list[str]:
    """``--teacher a --teacher b`` → ``--teacher a b`` (argparse's nargs='+' keeps the last)."""
    values, rest, i = [], [], 0
    while i < len(args):
        if args[i] == flag:
            i += 1
            while i < len(args) and not args[i].startswith("--"):
                values.append(args[i])
                i += 1
        else:
            rest.append(args[i])
            i += 1
    return rest + ([flag, *values] if values else [])


def parse_config(argv: Sequence[str] | None = None) -> DiagnoseConfig:
    """Build a ``DiagnoseConfig`` from command-line flags."""
    args = _merge_repeated(list(argv or []), "--teacher")
    return parse_dataclass(DiagnoseConfig, args, prog="lookahead-opd diagnose")


def prepare(config: DiagnoseConfig):
    """Validate and check every teacher's tokenizer against the student's (tokenizers are
    cheap: all are checked before any weights load). Returns the student's tokenizer."""
    config.validate()
    from transformers import AutoTokenizer

    from lookahead_opd.integrations.model_sources import resolve_model
    from lookahead_opd.integrations.opd.vocab import check_vocab_compatible

    from .teachers import parse_teacher_spec

    tokenizer = AutoTokenizer.from_pretrained(resolve_model(config.student))
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    for t in config.teacher:
        spec = parse_teacher_spec(t)
        if spec.kind == "model":
            try:
                check_vocab_compatible(tokenizer,
                                       AutoTokenizer.from_pretrained(resolve_model(spec.path)))
            except (OSError, ValueError) as err:
                raise ValueError(
                    f"teacher {t!r} does not share the student's tokenizer: {err}") from None
    return tokenizer


def run(config: DiagnoseConfig, tokenizer: Any = None):
    """``prepare`` (unless its ``tokenizer`` is given), load the student, diagnose, save.
    Returns the ``DiagnosticReport``."""
    import torch
    from transformers import AutoModelForCausalLM

    from lookahead_opd.integrations.model_sources import resolve_model
    from lookahead_opd.integrations.opd.engines import HFEngine
    from lookahead_opd.integrations.opd.tasks import load_task

    from .diagnose import diagnose

    if tokenizer is None:
        tokenizer = prepare(config)
    dtype = getattr(torch, config.dtype)
    student = AutoModelForCausalLM.from_pretrained(resolve_model(config.student),
                                                   dtype=dtype).to(config.device)
    engine = HFEngine(student, tokenizer, batch_size=config.batch_size)
    report = diagnose(
        student, list(config.teacher), load_task(config.task), budget=config.budget,
        tokenizer=tokenizer, engine=engine, questions=config.questions, split=config.split,
        samples_per_question=config.samples_per_question, top_k=config.top_k,
        continuations=config.continuations, loss=config.loss, jsd_beta=config.jsd_beta,
        temperature=config.temperature, max_new_tokens=config.max_new_tokens,
        spacing=config.spacing, context_separator=config.context_separator,
        rank_by=config.rank_by, seed=config.seed, resamples=config.resamples,
        progress=config.progress, teacher_dtype=dtype)
    report.config["cli"] = dataclasses.asdict(config)
    report.save(config.output_dir, plots=config.plots)
    return report


def main(argv: Sequence[str] | None = None) -> int:
    from lookahead_opd.integrations.cli_support import quiet_loading_bars

    try:  # bad input: one clear line and status 2, before any weights load
        config = parse_config(argv)
        if not config.progress:
            quiet_loading_bars()
        tokenizer = prepare(config)
    except ValueError as err:
        print(f"lookahead-opd diagnose: {err}", file=sys.stderr)
        return 2
    report = run(config, tokenizer)  # a failure while diagnosing keeps its traceback
    print(report.table())
    print(f"\nreport: {Path(config.output_dir) / 'report.html'} (and report.json, nodes.jsonl)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

