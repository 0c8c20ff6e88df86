"""``lookahead-opd train``: OPD (optionally EffOPD) on any Hugging Face causal LMs.

    lookahead-opd train --student Qwen/Qwen2.5-1.5B --teacher ./rl-tuned --task gsm8k:path=train.jsonl \\
        --learning_rate 1e-6 --extrapolate --gate accuracy --output_dir runs/gsm8k

Every option is a field of ``OPDConfig``; ``--config run.yaml`` fills them from a file.
Under ``torchrun --nproc-per-node N`` the ranks split each step's prompts, the gate and the
eval set, and stay identical. A local start, on the models ``lookahead-opd demo`` exports, is
``LOCAL_START`` (the end of ``--help``). Before step 0 it runs the preflight checks of
``lookahead-opd check`` (``preflight.py``); a fault stops it in one line naming the fix.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ..cli_support import parse_dataclass, quiet_loading_bars
from .config import OPDConfig

__all__ = ["build_trainer", "check_run", "parse_config", "setup_run", "teacher_top_k", "main",
           "LOCAL_START"]

# Measured in benchmarks/results/local_start.md, on the demo's shipped pair. The paper's defaults
# (reverse_kl_pg, lr 1e-6) barely move this tiny student; the full-vocabulary KL at lr 1e-3 does.
LOCAL_START = """\
a local start, on the models `lookahead-opd demo` copies to runs/demo/models:
  lookahead-opd train --student runs/demo/models/student --teacher runs/demo/models/teacher \\
      --loss reverse_kl --learning_rate 1e-3 --warmup_steps 4 --batch_size 256 \\
      --max_steps 200 --eval_every 50 --output_dir runs/train
  (greedy accuracy 49.5% -> 72.0% in 200 steps, 70.0% by step 50; under a minute of one CPU core)
running it again: --resume continues from the newest checkpoint that loads;
--overwrite_output_dir deletes the earlier run's metrics and checkpoints and starts over"""


# --------------------------------------------------------------------------- checks
def check_run(config: OPDConfig, *, check_paths: bool = True):
    """Every check of a run that can run before any model loads, once: ``config.validate()``
    (its own values), then what reads the rest of the package: the optimizer (imported) and
    its keyword arguments, the device, the teachers' URLs and what the loss reads from them,
    the task (loaded: an unknown task or a bad option fails here), and with ``check_paths``
    the output folder, an earlier run in it, and the model references. Raises ``ValueError``
    naming the first bad option; returns the loaded task (without chat template)."""
    from ..cli_support import check_device
    from .optimizers import optimizer_factory, optimizer_kwargs
    from .tasks import load_task

    config.validate()
    optimizer_factory(config.optimizer)  # imports it: a bad name fails here, before any model
    optimizer_kwargs(config.optimizer_kwargs)
    check_device(config.device)
    _check_teachers(config)
    task = load_task(config.task)  # unknown tasks and bad options fail here, before any model
    if check_paths:
        _check_paths(config)
    return task


def _check_teachers(config: OPDConfig) -> None:
    """Each teacher URL's form, and a loss a served teacher (or several teachers) can serve:
    a server sends log-probs (the sampled tokens' or the top-k), not logits, and several
    teachers' logits are not combined (``routing.py``)."""
    from .losses import teacher_needs
    from .served import check_url

    for ref in config.teacher_refs().values():
        for url in ref if isinstance(ref, list) else ():
            check_url(url)
    if not (config.served_teacher() or config.teachers):
        return
    which = "a served teacher" if config.served_teacher() else "--teachers"
    if teacher_needs(config.loss).level == "full":
        raise ValueError(f"loss={config.loss} needs the teacher's full distribution, which "
                         f"{which} does not give; use --loss reverse_kl_pg (the sampled "
                         f"tokens' log-probs), a topk_* loss (the top-k) or one in-process "
                         f"--teacher")


def _check_paths(config: OPDConfig) -> None:
    """The output folder (and no earlier run in it by accident, as the HF Trainer's scripts
    refuse) and every model reference."""
    from ..cli_support import check_model_ref, check_output_dir
    from .checkpoint import earlier_run

    check_output_dir(config.output_dir)
    found = earlier_run(Path(config.output_dir))
    if found and not (config.resume or config.overwrite_output_dir):
        shown = ", ".join(found[:3]) + (", ..." if len(found) > 3 else "")
        raise ValueError(f"output_dir {config.output_dir} holds an earlier run ({shown}); "
                         f"continue it with --resume, or delete it with "
                         f"--overwrite_output_dir")
    check_model_ref("student", config.student)
    for name, ref in config.teacher_refs().items():
        if not isinstance(ref, list):
            check_model_ref("teacher" if name is None else f"teacher {name}", ref)


def teacher_top_k(config: OPDConfig) -> int:
    """The most log-probs per position a served teacher is asked for (0: the sampled
    token's only), which its ``--max-logprobs`` must allow: the loss's top-k, and the −KL
    gate's, which reads the top-k of a teacher that gives no more."""
    from .losses import teacher_needs

    gate = config.topk if config.extrapolate and config.gate == "neg_kl" else 0
    return max(teacher_needs(config.loss, config.loss_options()).k, gate)


# --------------------------------------------------------------------------- building
def build_trainer(config: OPDConfig, *, check_paths: bool = True,
                  before_load: Callable[[OPDConfig], None] | None = None):
    """An ``OPDTrainer`` for ``config``: the run's checks first (``check_run``, once), then
    ``before_load(config)`` (a command's process settings), the distributed setup, the task's
    problems (built once: ``trainer.run_problems``), the teachers (a served one probed before
    any model loads), the models and the engine."""
    import torch
    from transformers import AutoTokenizer

    from ..model_sources import resolve_model
    from .tasks import with_chat_template
    from .trainer import OPDTrainer, run_problems

    task = check_run(config, check_paths=check_paths)  # before any model loads
    if before_load is not None:
        before_load(config)
    _init_distributed(config)
    if config.fsdp:
        from .sharding import require_process_group

        require_process_group()  # before any model loads
    torch.manual_seed(config.seed)
    student_path = resolve_model(config.student)
    tokenizer = AutoTokenizer.from_pretrained(student_path)
    if tokenizer.pad_token is None:  # decoder-only LMs often have none; batching needs one
        tokenizer.pad_token = tokenizer.eos_token
    task = with_chat_template(task, tokenizer, config.chat_template)
    problems = run_problems(task, config)
    student, teacher = _load_models(config, student_path, tokenizer, task, problems)
    engine = _make_engine(config, student_path, student, tokenizer)
    return OPDTrainer(config, student, teacher, task, engine, tokenizer=tokenizer,
                      problems=problems)


def _load_models(config: OPDConfig, student_path: str, tokenizer, task, problems):
    """The student and the teacher(s): a served teacher is probed before any model loads;
    with ``--fsdp`` a model to be sharded stays on the CPU (``OPDTrainer`` shards it onto the
    device one block at a time, so no GPU ever holds the full model)."""
    import torch
    from transformers import AutoModelForCausalLM

    from ..model_sources import resolve_model

    dtype = getattr(torch, config.dtype)  # validated: float32 | bfloat16 | float16
    max_new = config.max_new_tokens or task.max_new_tokens
    teacher = (_connect(config, config.teacher_url, tokenizer, problems.train, max_new)
               if config.teacher_url else None)  # its checks before any model loads
    student = AutoModelForCausalLM.from_pretrained(student_path, dtype=dtype)
    if config.teachers:
        teacher = _teacher_router(config, tokenizer, problems, max_new, student, dtype)
    elif teacher is None:
        teacher = AutoModelForCausalLM.from_pretrained(resolve_model(config.teacher), dtype=dtype)
        if not (config.fsdp and config.fsdp_teacher == "shard"):
            teacher = teacher.to(config.device)
    if not config.fsdp:
        student = student.to(config.device)
    return student, teacher


def _make_engine(config: OPDConfig, student_path: str, student, tokenizer):
    from .engines import make_engine

    if config.engine == "vllm":
        return make_engine("vllm", student_path, tokenizer,
                           dtype=config.vllm_dtype or config.dtype, seed=config.seed,
                           gpu_memory_utilization=config.vllm_gpu_memory_utilization)
    return make_engine("hf", student, tokenizer)


def _connect(config: OPDConfig, urls: Sequence[str], tokenizer, problems, max_new_tokens: int):
    """A ``ServedTeacher`` on ``urls`` with ``config``'s ``teacher_*`` options, its servers
    probed (``served.connect``) on the run's training prompts."""
    from .served import connect

    return connect(urls, tokenizer, [p.prompt for p in problems], max_new_tokens,
                   top_k=teacher_top_k(config), max_inflight=config.teacher_max_inflight,
                   timeout=config.teacher_timeout, retries=config.teacher_retries)


def _teacher_router(config: OPDConfig, tokenizer, problems, max_new_tokens: int, student, dtype):
    """With ``--teachers``: every problem's teacher resolved (one line if one has none), the
    served ones probed, then the in-process ones loaded; a ``TeacherRouter`` over them."""
    from transformers import AutoModelForCausalLM

    from ..model_sources import resolve_model
    from .routing import TeacherRouter, teacher_names
    from .teacher import ModelTeacher
    from .vocab import check_vocab_compatible

    refs = config.teacher_refs()
    for split, group in (("training", problems.train), ("gate", problems.gate or []),
                         ("eval", problems.eval)):
        teacher_names(group, config.teacher_key, list(refs), config.default_teacher,
                      what=f"{split} problems")
    teachers = {name: _connect(config, ref, tokenizer, problems.train, max_new_tokens)
                for name, ref in refs.items() if isinstance(ref, list)}
    for name, ref in refs.items():
        if not isinstance(ref, list):
            model = AutoModelForCausalLM.from_pretrained(resolve_model(ref), dtype=dtype)
            model = model.to(config.device)
            size = check_vocab_compatible(student, model, tokenizer=tokenizer)
            teachers[name] = ModelTeacher(model.requires_grad_(False).eval(), size)
    return TeacherRouter({n: teachers[n] for n in refs}, config.teacher_key,
                         config.default_teacher)


def _init_distributed(config: OPDConfig) -> None:
    """Under ``torchrun`` (WORLD_SIZE > 1, or any WORLD_SIZE with ``--fsdp``) join the process
    group: gloo on CPU, nccl on CUDA, one device per local rank. ``OPDTrainer`` then splits the
    work over the ranks."""
    import os

    import torch
    import torch.distributed as dist

    world = os.environ.get("WORLD_SIZE")
    if world is None or (int(world) <= 1 and not config.fsdp) or dist.is_initialized():
        return
    if config.device.startswith("cuda"):
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        config.device = f"cuda:{local}"
        dist.init_process_group("nccl")
    else:
        dist.init_process_group("gloo")


def setup_run(argv: Sequence[str] | None, prog: str, *, epilog: str | None = LOCAL_START,
              adjust: Callable[[OPDConfig], None] | None = None):
    """What ``train`` and ``check`` do before step 0: parse the command line (``adjust`` may
    then change the config), build the trainer (``build_trainer``: the run's checks once,
    then the command's process settings, then the models) and run the preflight on it
    (``preflight.py``). Returns ``(config, trainer, findings)``; bad input raises
    ``ValueError``, before any model loads where it can."""
    from .preflight import load_teacher_tokenizers, run_preflight

    config = parse_config(argv, epilog=epilog, prog=prog)
    if adjust is not None:
        adjust(config)
    trainer = build_trainer(config, before_load=_process_settings)
    findings = run_preflight(trainer, teacher_tokenizers=load_teacher_tokenizers(config))
    return config, trainer, findings


def _process_settings(config: OPDConfig) -> None:
    """The command's choices for the whole process: torch's CPU threads, the loading bars."""
    if config.threads is not None:
        import torch

        torch.set_num_threads(config.threads)
    if not config.progress:
        quiet_loading_bars()


def parse_config(argv: Sequence[str] | None = None, *, epilog: str | None = None,
                 prog: str = "lookahead-opd train") -> OPDConfig:
    """Build an ``OPDConfig`` from ``--config FILE.yaml|json`` and flags (flags win);
    ``epilog`` ends ``--help``; ``prog`` is the command (``train``, ``check``)."""
    args = list(argv or [])
    base: dict[str, Any] = {}
    if "--config" in args:
        i = args.index("--config")
        if i + 1 >= len(args):
            raise ValueError("--config needs a file path")
        base = _read_config_file(args[i + 1])
        del args[i : i + 2]
    return parse_dataclass(OPDConfig, args, prog=prog,
                           defaults=dataclasses.asdict(OPDConfig(**base)), epilog=epilog)



def _read_config_file(path: str) -> dict[str, Any]:
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"config file {path} does not exist")
    text = p.read_text()
    if p.suffix in (".yaml", ".yml"):
        import yaml

        try:
            data = yaml.safe_load(text) or {}
        except yaml.YAMLError as err:
            mark = getattr(err, "problem_mark", None)
            where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
            problem = getattr(err, "problem", None) or type(err).__name__
            raise ValueError(f"config file {path} is not valid YAML{where}: {problem}") from None
    else:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as err:
            raise ValueError(f"config file {path} is not valid JSON: {err}") from None
    if not isinstance(data, dict):
        raise ValueError(f"config file {path} must hold a mapping of option: value")
    known = {f.name for f in dataclasses.fields(OPDConfig)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ValueError(f"unknown option(s) in {path}: {', '.join(unknown)}")
    return data


def main(argv: Sequence[str] | None = None) -> int:
    from .preflight import report
    from .served import TeacherServerError

    prog = "lookahead-opd train"
    try:  # bad input: one clear line and status 2, before any model loads where it can be
        config, trainer, findings = setup_run(argv, prog)
    except ValueError as err:
        print(f"{prog}: {err}", file=sys.stderr)
        return 2
    except TeacherServerError as err:  # a served teacher failed the preflight's scoring
        print(f"{prog}: {err}", file=sys.stderr)
        return 1
    if report(findings, prog, show_ok=False, enabled=trainer.rank == 0):
        return 2  # each fault was one line naming its fix
    try:
        result = trainer.train()  # any other failure while training keeps its traceback
    except TeacherServerError as err:  # already one line naming the server and the step
        print(f"{prog}: {err}", file=sys.stderr)
        return 1
    final = result.evals[-1][1] if result.evals else float("nan")
    if trainer.rank == 0:
        print(f"done: {trainer.step} steps, final eval accuracy {final:.1%}, "
              f"metrics in {config.output_dir}/metrics.jsonl")
    return 0
