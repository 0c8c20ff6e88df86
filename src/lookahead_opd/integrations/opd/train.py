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

import sys
from collections.abc import Callable, Sequence

from ..cli_support import quiet_loading_bars
from .config import OPDConfig, parse_config

__all__ = ["build_trainer", "setup_run", "main", "LOCAL_START"]

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

def build_trainer(config: OPDConfig, *, validate: bool = True):
    """Validate (unless the caller just did), then load the models, the task and the engine,
    and return an ``OPDTrainer``."""
    if validate:
        config.validate()  # before any model loads
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ..model_sources import resolve_model
    from .engines import make_engine
    from .tasks import load_task, with_chat_template
    from .trainer import OPDTrainer

    _init_distributed(config)
    if config.fsdp:
        from .sharding import require_process_group

        require_process_group()  # before any model loads
    torch.manual_seed(config.seed)
    dtype = getattr(torch, config.dtype)  # validated: float32 | bfloat16 | float16
    task = load_task(config.task)
    student_path, teacher_path = resolve_model(config.student), resolve_model(config.teacher)
    tokenizer = AutoTokenizer.from_pretrained(student_path)
    if tokenizer.pad_token is None:  # decoder-only LMs often have none; batching needs one
        tokenizer.pad_token = tokenizer.eos_token
    task = with_chat_template(task, tokenizer, config.chat_template)
    # With --fsdp a model to be sharded stays on the CPU: OPDTrainer shards it onto the device
    # one block at a time, so no GPU ever holds the full model.
    teacher = _served_teacher(config, tokenizer, task)  # its checks before any model loads
    student = AutoModelForCausalLM.from_pretrained(student_path, dtype=dtype)
    if config.teachers:
        teacher = _teacher_router(config, tokenizer, task, student, dtype)
    elif teacher is None:
        teacher = AutoModelForCausalLM.from_pretrained(teacher_path, dtype=dtype)
        if not (config.fsdp and config.fsdp_teacher == "shard"):
            teacher = teacher.to(config.device)
    if not config.fsdp:
        student = student.to(config.device)
    if config.engine == "vllm":
        engine = make_engine("vllm", student_path, tokenizer,
                             dtype=config.vllm_dtype or config.dtype, seed=config.seed,
                             gpu_memory_utilization=config.vllm_gpu_memory_utilization)
    else:
        engine = make_engine("hf", student, tokenizer)
    return OPDTrainer(config, student, teacher, task, engine, tokenizer=tokenizer)


def _served_teacher(config: OPDConfig, tokenizer, task):
    """With ``--teacher_url``: the ``ServedTeacher``, its servers probed (``served.connect``)
    on this run's prompts; otherwise None."""
    if not config.teacher_url:
        return None
    from .served import connect

    problems = task.problems("train", seed=config.seed)
    return connect(config.teacher_url, config, tokenizer, [p.prompt for p in problems],
                   config.max_new_tokens or task.max_new_tokens,
                   top_k=config.teacher_top_k())


def _teacher_router(config: OPDConfig, tokenizer, task, student, dtype):
    """With ``--teachers``: every problem's teacher resolved (one line if one has none), the
    served ones probed, then the in-process ones loaded; a ``TeacherRouter`` over them."""
    from transformers import AutoModelForCausalLM

    from ..model_sources import resolve_model
    from .routing import TeacherRouter, teacher_names
    from .served import connect
    from .teacher import ModelTeacher
    from .vocab import check_vocab_compatible

    refs = config.teacher_refs()
    splits = {"training": task.problems("train", seed=config.seed),
              "gate": (task.problems("gate", config.gate_size, seed=config.seed)
                       if config.gated() else []),
              "eval": task.problems("test", config.eval_size, seed=config.seed)}
    for split, problems in splits.items():
        teacher_names(problems, config.teacher_key, list(refs), config.default_teacher,
                      what=f"{split} problems")
    prompts = [p.prompt for p in splits["training"]]
    max_new = config.max_new_tokens or task.max_new_tokens
    teachers = {name: connect(ref, config, tokenizer, prompts, max_new,
                              top_k=config.teacher_top_k())
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
    """What ``train`` and ``check`` do before step 0: parse and validate the command line
    (``adjust`` may then change the config), apply its process settings, build the trainer
    and run the preflight on it (``preflight.py``). Returns ``(config, trainer, findings)``;
    bad input raises ``ValueError``, before any model loads where it can."""
    from .preflight import load_teacher_tokenizers, run_preflight

    config = parse_config(argv, epilog=epilog, prog=prog)
    config.validate()  # before the process settings below and any model
    if adjust is not None:
        adjust(config)
    if config.threads is not None:  # the command's choice, for the whole process
        import torch

        torch.set_num_threads(config.threads)
    if not config.progress:
        quiet_loading_bars()
    trainer = build_trainer(config, validate=False)
    findings = run_preflight(trainer, teacher_tokenizers=load_teacher_tokenizers(config))
    return config, trainer, findings


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
