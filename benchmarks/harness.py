"""The one benchmark harness: what the OPD studies share, so each study is a short file of its
own questions (which runs, what to compare, the report).

- **cells and pairs**: the regime map's cells (task, prompts per step, teacher, optimizer) and
  ``Pairs``, which loads each zoo pair once — from ``benchmarks/zoo``, the committed pairs, or
  the package's shipped pairs (``zoo.SHIPPED_PAIRS``), so a study reproduces on another machine
  instead of rebuilding a different pair;
- ``opd_config``: an ``OPDConfig`` with the studies' defaults (full-vocabulary reverse KL, the
  search as the studies ran it, no progress bar, a scratch output folder per run);
- ``run``: one OPD run through ``run_variant``, with its training clock, its gate accounting and
  its searches, a crash or a time limit kept as a partial record instead of an exception;
- ``SecantProbe``: the eval curve, the clock and the secant cosine of the path at the search
  steps, measured with the library's ``SecantSketch``;
- ``Store``: the study's ``<stem>.json`` of run records, resumed on a rerun and rewritten with
  the report after every run; ``run_all`` is the resume loop;
- ``Study``: the protocol every study runs on: it declares its options, jobs (or a one-shot
  ``measure``), summary and report, and gets the one command line (``--out``, ``--stem``,
  ``--fresh``, ``--report-only``, ``--smoke``, ``--device``; ``--threads``,
  ``--budget_s``/``--max-runs``, ``--workers`` where they apply) and the one flow; ``main``
  runs a study of several parts (``--part``);
- the shared constants: the regime map's cells and run settings, the speed-up study's pairs
  and lr, the real model's names;
- the steps-to-fraction tables: ``reached``, ``fmt_range``, ``train_clock``, ``gate_share``;
- ``figure``: a study's plot, a grid of panels saved and closed in one block.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import json
import math
import os
import shutil
import statistics
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, TypedDict

import torch

from benchmarks.common import machine_info, previous_results, write_results
from lookahead_opd import PAPER_RULE

ZOO = Path(__file__).resolve().parent / "zoo"  # the committed pairs (a zoo cache folder)
LOSS = "reverse_kl"  # every study's loss unless it asks for another
# EffOPD as the studies run it: −reverse-KL gate on 128 fixed rollouts, geometric c.
EFFOPD = dict(extrapolate=True, gate="neg_kl", gate_size=128, coefficients="geometric")
# The search's options as every study here ran them before the no-harm study (issue 38) changed
# the library's defaults: each study's runs keep their meaning, and a report regenerates from a
# resumed json. A study's own fields override them (no_harm's variants do).
AS_RUN = dict(PAPER_RULE)
SCRATCH = "/tmp/lookahead-opd-"  # + "<study>/<run>": each run's checkpoint and metrics, deleted after
FRACTIONS = (0.5, 0.75, 0.9)  # of the teacher's gain over the base
# What a run record keeps of each search (``JumpRecord``): enough to replay the gate's bill.
JUMP_KEYS = ("step", "score_before", "accepted", "coefficients", "scores", "n_evals", "seconds",
             "secant_cosine", "norm_ratio")

# --------------------------------------------------------------------------- cells and pairs

# task key -> OPD task spec. The long task: a worked solution of 20-80 tokens, then the answer.
TASKS = {"short": "arithmetic", "long": "longadd"}
# level -> (task key, prompts per step)
LEVELS = {"short-32": ("short", 32), "short-512": ("short", 512), "long-128": ("long", 128)}
# teacher key -> zoo teacher_regime
TEACHERS = {"sft": "same-base", "rl": "rl", "retention": "retention"}
# The retention pair (zoo regime ``retention``): a base competent on + and on the steep part of
# −, a teacher SFT'd on the mix; − is distilled, + is measured.
RETENTION = {"task": "arithmetic:ops=-", "held_out": "arithmetic:ops=+"}


def cell(level: str, teacher: str, optimizer: str, lrs: Sequence[float], *, kind: str = "main",
         stage2: str = "two-best") -> tuple[str, dict[str, Any]]:
    """A regime cell: ``(name, spec)`` with the task, prompts per step, teacher and optimizer."""
    task_key, prompts = LEVELS[level]
    task = RETENTION["task"] if kind == "retention" else TASKS[task_key]
    return f"{level}/{teacher}/{optimizer}", {
        "level": level, "task": task, "prompts": prompts, "teacher": teacher,
        "optimizer": optimizer, "lrs": list(lrs), "kind": kind, "stage2": stage2}


# The regime map's learning rates (a factor 2 apart) and its runs' settings, which the studies
# on its cells (lr_basin, the live patience check) share.
ADAMW_LRS = (5e-4, 1e-3, 2e-3, 4e-3)
SGD_LRS = (0.025, 0.05, 0.1)
SGD_MOMENTUM = 0.9
EVAL_SIZE = 1000  # held-out problems per eval: min(this, the test split)
REGIME_RUN = dict(max_steps=300, eval_every=4, warmup_steps=4)  # a regime-map run's defaults
STOP_FRACTION = 0.9  # a run stops at this fraction of the teacher's gain over the base


def _cells() -> dict[str, dict[str, Any]]:
    """name -> cell spec, in the order the regime map runs them (most informative first: the
    rl teacher, then the levels by tokens per step, highest first)."""
    cells = [cell(level, teacher, "adamw", ADAMW_LRS)
             for teacher in ("rl", "sft") for level in ("long-128", "short-512", "short-32")]
    cells += [cell(level, "rl", "sgd", SGD_LRS, stage2="best")  # the two upper levels
              for level in ("long-128", "short-512")]
    cells.append(cell("short-512", "retention", "adamw", ADAMW_LRS[:3], kind="retention",
                      stage2="three-best"))
    return dict(cells)


CELLS = _cells()

# The speed-up study's pairs, which the search studies share: name -> (task, size, regime);
# and its learning rate (full-vocabulary reverse KL; × multipliers in its sweeps).
ZOO_PAIRS: dict[str, tuple[str, str, str]] = {
    "same-base": ("arithmetic", "tiny", "same-base"),
    "independent": ("arithmetic", "tiny", "independent"),
    "small": ("arithmetic", "small", "same-base"),
    "multiop": ("arithmetic:ops=+-", "tiny", "same-base"),
}
BASE_LR = 1e-3

# The real model (real_lm, no_harm): SmolLM2-135M-Instruct and its RL-near teacher, the base
# plus the delta the package ships (``benchmarks/builders/real_teacher.py`` builds it).
REAL_STUDENT = "smollm2-135m-gguf"
REAL_TEACHER = "smollm2-135m-rl"
REAL_TASK = "wordproblems:steps=1"  # the teacher's task (one-step problems), and the studies'
REAL_LOSS = "reverse_kl_pg"  # the paper's: the sampled token's log-ratio as its reward
REAL_DELTA = (Path(__file__).resolve().parents[1] / "src/lookahead_opd/integrations/weights"
              / "smollm2-135m-rl.safetensors")
KL_SEED = 0  # the held-out rollouts' sampling seed (one yardstick for every run)
KL_PROBLEM_SEED = 1000  # which test prompts they are drawn from


class Pairs:
    """Loads each zoo pair once (building it on first use, into ``cache_dir``: by default the
    committed ``benchmarks/zoo``); a pair the zoo cannot build (a teacher regime or task not
    there yet) is remembered with the reason, as ``{"error": ...}``."""

    def __init__(self, cache_dir: str | Path | None = None, size: str = "tiny",
                 device: str = "cpu", progress: bool = True) -> None:
        self.cache_dir = ZOO if cache_dir is None else cache_dir
        self.size, self.device, self.progress = size, device, progress
        self._pairs: dict[tuple[str, str, str], dict[str, Any]] = {}

    def get(self, task_spec: str, teacher: str, size: str | None = None) -> dict[str, Any]:
        """The pair of ``task_spec`` and ``teacher`` (a ``TEACHERS`` key or a zoo regime)."""
        size = size or self.size
        key = (task_spec, teacher, size)
        if key not in self._pairs:
            from lookahead_opd.demo.zoo import build_pair

            regime = TEACHERS.get(teacher, teacher)
            extra = {"retain": [RETENTION["held_out"]]} if regime == "retention" else {}
            try:
                pair = build_pair(self.cache_dir, task_spec=task_spec, size=size,
                                  teacher_regime=regime, progress=self.progress,
                                  device=self.device, **extra)
            except (ValueError, RuntimeError) as err:  # regime or task not in the zoo yet
                self._pairs[key] = {"error": f"{type(err).__name__}: {err}"}
                return self._pairs[key]

            self._pairs[key] = {**load_pair(pair.student_path, pair.teacher_path, self.device),
                                "accuracies": pair.accuracies,
                                "build": Path(pair.student_path).parent.name}
        return self._pairs[key]

    def named(self, name: str) -> dict[str, Any]:
        """The pair ``ZOO_PAIRS[name]``."""
        task, size, regime = ZOO_PAIRS[name]
        return self.get(task, regime, size=size)


def load_pair(student: str | Path, teacher: str | Path, device: str = "cpu") -> dict[str, Any]:
    """A student/teacher pair as ``Pairs.get`` returns it, from any two model folders or named
    sources (``model_sources``: a real pretrained model, not a zoo pair): ``tokenizer`` (the
    student's), ``student``, ``teacher`` (float32, on ``device``) and ``path`` (the student's
    folder). A zoo pair adds its ``accuracies`` and ``build``; a study of another pair measures
    its own."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from lookahead_opd.integrations.model_sources import resolve_model

    def load(path: str) -> Any:
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device)

    student, teacher = resolve_model(str(student)), resolve_model(str(teacher))
    return {"tokenizer": AutoTokenizer.from_pretrained(student), "student": load(student),
            "teacher": load(teacher), "path": student}


def check_pair(results: dict[str, Any], cell: dict[str, Any], pair: dict[str, Any]) -> str | None:
    """Why ``pair`` is not the pair the json's earlier runs of this task and teacher used, or
    None. Zoo builds are seeded but not reproducible across machines and thread counts, so a
    rebuilt pair can differ; runs on two different pairs must not be mixed in one study."""
    key = f"{cell['task']}|{cell['teacher']}"
    record = {"build": pair["build"], "accuracies": pair["accuracies"]}
    seen = results.setdefault("pairs", {}).get(key)
    if seen is None:
        # A json written before pairs were recorded: the teachers' accuracies in its bases.
        old = [b["teacher"] for k, b in results["bases"].items() if k.startswith(key + "|")]
        if cell["kind"] == "retention" or not old or math.isclose(old[0], pair["accuracies"]["teacher"]):
            results["pairs"][key] = record
            return None
        seen = {"build": "an earlier build", "accuracies": {"teacher": old[0]}}
    common = [k for k, v in record["accuracies"].items()
              if isinstance(v, float) and isinstance(seen["accuracies"].get(k), float)]
    if all(math.isclose(seen["accuracies"][k], record["accuracies"][k]) for k in common):
        return None

    def accs(d: dict[str, Any]) -> str:
        return ", ".join(f"{k} {v:.1%}" for k, v in d.items() if isinstance(v, float))

    return (f"the zoo pair here ({pair['build']}: {accs(record['accuracies'])}) is not the one the "
            f"json's {key} runs used ({seen['build']}: {accs(seen['accuracies'])}); write this "
            "study elsewhere with --out, or start over with --fresh")


def load_task(spec: str, tokenizer: Any = None) -> Any:
    """The task of ``spec``, its prompts rendered through ``tokenizer``'s chat template when it
    has one (an instruct model's; the zoo's char tokenizer has none, so zoo tasks are as they
    were), as the CLI renders them."""
    from lookahead_opd.integrations.opd.tasks import load_task as load
    from lookahead_opd.integrations.opd.tasks import with_chat_template

    task = load(spec)
    return task if tokenizer is None else with_chat_template(task, tokenizer)


def eval_problems(task: Any, n: int, seed: int) -> list[Any]:
    """A run's eval set: ``n`` test problems, or all of them when the split holds fewer."""
    return task.problems("test", min(n, len(task.problems("test"))), seed=seed)


def accuracy(model: Any, tokenizer: Any, task_spec: str, n: int, seed: int) -> float:
    """Greedy exact match of ``model`` on ``eval_problems(task_spec, n, seed)``."""
    from lookahead_opd.integrations.opd.scoring import model_accuracy as greedy_accuracy

    task = load_task(task_spec, tokenizer)
    return greedy_accuracy(model, tokenizer, task, eval_problems(task, n, seed))


def base_and_targets(results: dict[str, Any], pairs: Pairs, cell: dict[str, Any], seed: int,
                     eval_size: int) -> dict[str, Any]:
    """The base's accuracy on this seed's eval set, the teacher's (all of test), the gain's
    standard error and the accuracy at each of ``FRACTIONS`` of the gain; kept in
    ``results["bases"]`` under ``task|teacher|seed``."""
    key = f"{cell['task']}|{cell['teacher']}|{seed}"
    if key not in results["bases"]:
        pair = pairs.get(cell["task"], cell["teacher"])
        base = accuracy(pair["student"], pair["tokenizer"], cell["task"], eval_size, seed)
        if cell["kind"] == "retention":
            teacher = accuracy(pair["teacher"], pair["tokenizer"], cell["task"], 10**9, 0)
        else:
            teacher = pair["accuracies"]["teacher"]
        n = len(eval_problems(load_task(cell["task"]), eval_size, seed))
        se = math.sqrt(base * (1 - base) / n + teacher * (1 - teacher) / n)
        entry = {"base": base, "teacher": teacher, "eval_n": n, "gain": teacher - base,
                 "gain_se": se, "targets": {f"{f:g}": base + f * (teacher - base) for f in FRACTIONS}}
        if cell["kind"] == "retention":
            entry["retention_base"] = accuracy(pair["student"], pair["tokenizer"],
                                               RETENTION["held_out"], eval_size, seed)
        results["bases"][key] = entry
    return results["bases"][key]


# --------------------------------------------------------------------------- one run


def scratch_folder(study: str, name: str) -> str:
    """Where a study's run ``name`` writes its checkpoint and metrics: ``run`` deletes it once
    the record is taken (a final checkpoint of the 135M model is ~1.6 GB; a study's dozens of
    runs filled the disk)."""
    return f"{SCRATCH}{study}/{name}"


def opd_config(study: str, name: str, **fields: Any) -> Any:
    """``OPDConfig(**fields)`` with the studies' defaults: ``LOSS``, ``AS_RUN``, no progress bar, and
    the scratch folder ``scratch_folder(study, name)``; validated here, so that a bad option (or
    an optimizer not installed) stops the study instead of reading as a crashed run."""
    from lookahead_opd.integrations.opd.config import OPDConfig
    from lookahead_opd.integrations.opd.train import check_run

    config = OPDConfig(**{"loss": LOSS, "progress": False, **AS_RUN,
                          "output_dir": scratch_folder(study, name), **fields})
    check_run(config, check_paths=False)
    return config


def cell_config(study: str, name: str, cell: dict[str, Any], lr: float, seed: int,
                target: float | None, eval_size: int = EVAL_SIZE, **fields: Any) -> Any:
    """A run on a regime-map ``cell`` at ``lr``: its task, prompts per step and optimizer (SGD
    with momentum ``SGD_MOMENTUM``), min(``eval_size``, the test split) eval problems, stopping
    at accuracy ``target`` (None: at the cap); ``fields``: the rest (steps, evals, warm-up,
    the method's options)."""
    opt = dict(optimizer="sgd", momentum=SGD_MOMENTUM) if cell["optimizer"] == "sgd" else {}
    eval_n = len(eval_problems(load_task(cell["task"]), eval_size, seed))
    return opd_config(study, name, task=cell["task"], batch_size=cell["prompts"],
                      learning_rate=lr, eval_size=eval_n, seed=seed, stop_at_accuracy=target,
                      **opt, **fields)


class Run(TypedDict, total=False):
    """A run record as ``run`` writes it (studies add their own keys: cell, method, lr, seed)."""

    evals: list[list[float]]  # [step, greedy accuracy], step 0 first
    train_seconds: dict[str, float]  # step -> the run's training clock (gate included)
    jumps: list[dict[str, Any]]  # the searches, ``JUMP_KEYS`` of each
    summary: dict[str, Any] | None  # ``ExtrapolatingOptimizer.summary()``
    gate_evals: int
    gate_seconds: float
    wall_seconds: float
    final_accuracy: float | None
    extra: Any  # ``on_student``'s value
    crashed: str | None  # the error that ended it (NaN weights make sampling fail)
    stopped: str | None  # the time limit that ended it (a partial curve)
    secant_cosines: list[tuple[int, float]]  # (search step, cosine), from ``SecantProbe``
    tokens_per_step: float | None


class OutOfTime(Exception):
    """Raised by ``SecantProbe`` when a run passes its time limit."""


class SecantProbe:
    """An ``OPDTrainer`` callback: the eval curve, the clock and the tokens of a run, and the
    secant cosine ``cos(W_s − W_{s/2}, W_{s/2} − W_{s/4})`` at the search steps 1, 2, 4, …:
    how well one window's displacement predicts the next, the bet a jump ``W + c·Δ`` makes.
    The cosine is the library's estimate (``SecantSketch``, within 0.05 of the exact one), so
    the probe keeps one copy of the weights, the last search step's: those the trainer trains,
    read at step 0 (after ``train_top_blocks`` froze the rest). Raises ``OutOfTime`` past
    ``time_limit`` seconds of training, after recording the step."""

    def __init__(self, model: torch.nn.Module, time_limit: float | None = None) -> None:
        self.model, self.time_limit = model, time_limit
        self.params: list[torch.Tensor] = []
        self.last: torch.Tensor | None = None  # the weights at the last search step
        self.cosines: list[tuple[int, float]] = []
        self.norms: list[tuple[int, float]] = []  # ‖W_s − W_{s/2}‖ (exact)
        self.tokens: list[int] = []
        self.evals: list[list[float]] = []
        self.seconds: dict[str, float] = {}

    def _flat(self) -> torch.Tensor:
        with torch.no_grad():
            return torch.cat([p.detach().reshape(-1).float().cpu() for p in self.params])

    def __call__(self, m: dict[str, Any]) -> None:
        step = m["step"]
        self.seconds[str(step)] = m["train_seconds"]
        if "eval_accuracy" in m:
            self.evals.append([step, m["eval_accuracy"]])
        if "num_tokens" in m:
            self.tokens.append(int(m["num_tokens"]))
        if self.time_limit is not None and m["train_seconds"] > self.time_limit:
            raise OutOfTime(f"stopped at step {step}: past {self.time_limit:.0f}s of training")
        if self.last is None:  # step 0: the trainer has frozen what it does not train
            from lookahead_opd.sketch import SecantSketch

            self.params = [p for p in self.model.parameters() if p.requires_grad]
            self.sketch = SecantSketch(sum(p.numel() for p in self.params))
            self.last = self._flat()
        if step < 1 or step & (step - 1) or "loss" not in m:
            return
        now = self._flat()
        sketch = self.sketch.measure([(0, now - self.last, None)])
        cosine, _ = self.sketch.compare(sketch)
        self.sketch.remember(sketch)
        self.norms.append((step, math.sqrt(float(sketch[-1]))))
        if cosine is not None:
            self.cosines.append((step, cosine))
        self.last = now


class NoiseProbe:
    """The gradient-noise scale ``B_noise = tr(Σ)/|G|²`` (McCandlish et al. 2018, "simple"
    scale) from the run's own gradients: the step is split into ``micro`` equal micro-batches
    (``gradient_accumulation_steps``, which leaves the summed gradient unchanged); a
    post-accumulate hook on every parameter snapshots the running gradient after each
    micro-batch's backward, so micro-batch and whole-step gradients come from the same
    rollouts. With ``E|G_b|² = |G|² + tr(Σ)/b`` at both sizes b < B, the two unknowns follow;
    numerator and denominator are averaged over the steps before dividing. The trainer
    normalises by the whole step's tokens, so a micro-batch's gradient is taken as ``micro``
    times its contribution (exact for equal token counts per micro-batch)."""

    def __init__(self, model: torch.nn.Module, micro: int) -> None:
        self.micro = micro
        self.grads: dict[int, list[torch.Tensor]] = {}
        self.small: list[float] = []  # mean |G_b|² per step
        self.big: list[float] = []  # |G_B|² per step
        self.tokens: list[int] = []
        for p in model.parameters():
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(self._hook)

    def _hook(self, p: torch.Tensor) -> None:
        self.grads.setdefault(id(p), []).append(p.grad.detach().clone())

    def __call__(self, m: dict[str, Any]) -> None:
        if not self.grads:
            return
        small, big = 0.0, 0.0
        for snaps in self.grads.values():
            if len(snaps) != self.micro:  # a parameter some micro-batch did not reach
                continue
            prev = torch.zeros_like(snaps[0])
            for s in snaps:
                small += float(((s - prev) * self.micro).pow(2).sum()) / self.micro
                prev = s
            big += float(snaps[-1].pow(2).sum())
        self.small.append(small)
        self.big.append(big)
        self.tokens.append(int(m.get("num_tokens", 0)))
        self.grads.clear()

    def result(self, rows: int) -> dict[str, Any]:
        """B_noise in rows (prompts × samples) and in completion tokens."""
        big_b, small_b = float(rows), rows / self.micro
        gs, gb = statistics.fmean(self.small), statistics.fmean(self.big)
        g2 = (big_b * gb - small_b * gs) / (big_b - small_b)
        trace = (gs - gb) / (1 / small_b - 1 / big_b)
        tokens_per_row = statistics.fmean(self.tokens) / rows if self.tokens else float("nan")
        b_noise = trace / g2 if g2 > 0 else float("inf")
        return {"steps": len(self.big), "rows": rows, "micro_batches": self.micro,
                "grad_sq_small": gs, "grad_sq_big": gb, "grad_sq_true": g2, "trace_sigma": trace,
                "b_noise_rows": b_noise, "b_noise_tokens": b_noise * tokens_per_row,
                "tokens_per_step": statistics.fmean(self.tokens) if self.tokens else None}


class HeldOutKL:
    """An ``OPDTrainer`` callback: the student's full-vocabulary reverse KL to the teacher,
    teacher-forced on fixed rollouts of held-out prompts, at step 0 and every ``every`` steps —
    a continuous progress measure at a few forwards' cost, where greedy accuracy on hundreds
    of problems costs minutes of generation. The rollouts are the starting student's samples
    (temperature 1, seed ``seed``: the same for every run from one student), drawn at
    construction without touching the global RNG; the teacher scores them once. ``curve``:
    ``[step, reverse KL]``."""

    def __init__(self, model: torch.nn.Module, teacher: torch.nn.Module, tokenizer: Any,
                 task: Any, problems: Sequence[Any], *, every: int, max_new_tokens: int,
                 seed: int = 0) -> None:
        from lookahead_opd.integrations.opd.engines import HFEngine
        from lookahead_opd.integrations.opd.scoring import loss_chunk_rows
        from lookahead_opd.integrations.opd.teacher import ModelTeacher, TeacherNeeds
        from lookahead_opd.integrations.opd.vocab import check_vocab_compatible

        self.model, self.every = model, every
        self.vocab = check_vocab_compatible(model, teacher, tokenizer=tokenizer)
        self.chunk = loss_chunk_rows(None, len(problems) * max_new_tokens, self.vocab)
        with torch.random.fork_rng(devices=[]):
            r = HFEngine(model, tokenizer).generate([p.prompt for p in problems],
                                                    max_new_tokens=max_new_tokens, seed=seed)
        self.rollouts = (r.sequences, r.attention_mask, r.completion_mask)
        self.teacher = ModelTeacher(teacher, self.vocab, chunk_size=self.chunk).score(
            *self.rollouts, TeacherNeeds.FULL).full()
        self.curve: list[list[float]] = []

    def for_model(self, model: torch.nn.Module) -> HeldOutKL:
        """The same rollouts and teacher scores, measuring ``model`` (a run's copy of the
        student): one sampling and one teacher pass serve every run of a study."""
        probe = copy.copy(self)
        probe.model, probe.curve = model, []
        return probe

    def measure(self) -> float:
        from lookahead_opd.integrations.opd.logits import model_logits
        from lookahead_opd.integrations.opd.losses import reverse_kl_loss

        sequences, attention, completion = self.rollouts
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.no_grad():
                student = model_logits(self.model, sequences, attention, self.vocab,
                                       chunk_size=self.chunk)
                return float(reverse_kl_loss(student, self.teacher, completion[:, 1:])
                             .metrics["reverse_kl"])
        finally:
            self.model.train(was_training)

    def __call__(self, m: dict[str, Any]) -> None:
        if m["step"] % self.every == 0:
            self.curve.append([m["step"], self.measure()])


def run(config: Any, pair: dict[str, Any], task_spec: str, *, time_limit: float | None = None,
        on_student: Callable[[torch.nn.Module], Any] | None = None,
        trainer_class: type | None = None, engine_batch_size: int = 1024,
        callbacks: Callable[[torch.nn.Module], list[Any]] | None = None) -> Run:
    """One OPD run of ``config`` from ``pair``'s student (a copy), its record with a
    ``SecantProbe``'s cosines; ``callbacks(model)`` adds the study's own. A crash (NaN weights make sampling fail) or ``time_limit``
    seconds of training end it with the curve so far: ``crashed`` or ``stopped`` says which.
    A scratch ``output_dir`` (``scratch_folder``'s) is deleted when the record is taken."""
    from lookahead_opd.demo.compare import run_variant

    probes: list[SecantProbe] = []

    def watch(model: torch.nn.Module) -> list[Any]:
        probes.append(SecantProbe(model, time_limit))
        return [*probes, *(callbacks(model) if callbacks else ())]

    t0 = time.perf_counter()
    try:
        record = run_variant(config, pair["student"], pair["teacher"],
                             load_task(task_spec, pair["tokenizer"]),
                             pair["tokenizer"], callbacks=watch, on_student=on_student,
                             trainer_class=trainer_class, engine_batch_size=engine_batch_size)
        record["jumps"] = [{k: j[k] for k in JUMP_KEYS if k in j} for j in record["jumps"]]
        record["crashed"] = record["stopped"] = None
    except (RuntimeError, ValueError, OutOfTime) as err:
        probe = probes[0] if probes else None
        stopped = isinstance(err, OutOfTime)
        evals = probe.evals if probe is not None and probe.evals else []
        record = {"evals": evals, "train_seconds": probe.seconds if probe is not None else {},
                  "jumps": [], "final_accuracy": evals[-1][1] if stopped and evals else None,
                  "extra": None, "gate_evals": 0, "gate_seconds": 0.0,
                  "crashed": None if stopped else f"{type(err).__name__}: {err}"[:300],
                  "stopped": str(err) if stopped else None}
    record["train_seconds"] = {str(k): v for k, v in record["train_seconds"].items()}
    record.pop("reverse_kl", None)
    record["wall_seconds"] = time.perf_counter() - t0
    if str(config.output_dir).startswith(SCRATCH):
        shutil.rmtree(config.output_dir, ignore_errors=True)
        with contextlib.suppress(OSError):  # the study's folder, once its last run is gone
            Path(config.output_dir).parent.rmdir()
    if probes:
        record["secant_cosines"] = probes[0].cosines
        record["tokens_per_step"] = statistics.fmean(probes[0].tokens) if probes[0].tokens else None
    return record


# --------------------------------------------------------------------------- the store


class Store:
    """A study's ``<stem>.json`` under ``out``: ``runs`` (key -> run record) and the study's own
    fields, resumed from an earlier json unless ``fresh``; ``save`` rewrites it with the report
    after every run, so a killed study loses one run at most. ``commands`` and ``machines``
    accumulate the calls and machines the runs came from.

    ``shared``: several processes (one thread each) run one study into the same json. Each
    claims a run before starting it (``claim``: a file under ``.claims-<stem>``, taken over
    when the process that wrote it is gone), and ``sync`` (under ``locked``, before a report is
    written) takes in the runs the others stored."""

    def __init__(self, out: str | Path, stem: str, *, fresh: bool = False,
                 shared: bool = False) -> None:
        self.out, self.stem, self.shared = Path(out), stem, shared
        self.old = previous_results(self.out, stem, fresh=fresh)
        self.data: dict[str, Any] = {"runs": {}}
        self.claims = self.out / f".claims-{stem}"

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """Hold the json's lock (shared stores only): sync, report and write as one."""
        if not self.shared:
            yield
            return
        import fcntl

        with open(self.out / f".{self.stem}.lock", "w") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)

    def sync(self) -> None:
        """Take in the runs other processes stored in the json since (shared stores only)."""
        path = self.out / f"{self.stem}.json"
        if self.shared and path.exists():
            for key, record in json.loads(path.read_text()).get("runs", {}).items():
                self.runs.setdefault(key, record)

    def claim(self, key: str) -> bool:
        """Whether this process may run ``key``: always unshared; shared, when no live process
        claimed it first (a claim is a file holding the claimer's pid)."""
        if not self.shared:
            return True
        self.claims.mkdir(parents=True, exist_ok=True)
        path = self.claims / key.replace("/", "_")
        for _ in range(2):
            try:
                fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            except FileExistsError:
                try:
                    pid = int(path.read_text() or 0)
                except (OSError, ValueError):
                    return False  # being written right now: someone else's
                if pid == os.getpid():
                    return True
                if pid and _alive(pid):
                    return False
                path.unlink(missing_ok=True)  # its process is gone: take it over
                continue
            with os.fdopen(fd, "w") as f:
                f.write(str(os.getpid()))
            return True
        return False

    def release(self, key: str) -> None:
        if self.shared:
            (self.claims / key.replace("/", "_")).unlink(missing_ok=True)

    def resume(self, **fields: Callable[[], Any]) -> None:
        """Take ``runs`` and ``fields`` from the earlier json (``fields[key]()`` where it has
        none, e.g. ``bases=dict, commands=list``)."""
        old = self.old or {}
        for key, empty in {"runs": dict, **fields}.items():
            self.data[key] = old.get(key, empty())

    def stamp(self, device: str = "cpu") -> None:
        """Record this call: its machine, and its command and CPU among the runs' own."""
        self.data["machine"] = info = machine_info(torch.device(device))
        for key, value in (("commands", info["command"]), ("machines", info["cpu_model"])):
            seen = self.data.setdefault(key, [])
            if value not in seen:
                seen.append(value)

    @property
    def runs(self) -> dict[str, Any]:
        return self.data["runs"]

    def save(self, markdown: str) -> list[str]:
        return write_results(str(self.out), self.stem, self.data, markdown)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def run_all(store: Store, jobs: Callable[[], Sequence[tuple[str, Any]]],
            run_job: Callable[[Any], dict[str, Any]], save: Callable[[], None], *,
            budget_s: float | None = None, desc: str = "runs",
            describe: Callable[[str, dict[str, Any]], str] | None = None,
            poll_s: float = 30.0, max_runs: int | None = None) -> bool:
    """The resume loop: while ``jobs()`` (asked again after every run, so a plan may depend on
    the runs so far) lists ``(key, job)`` pairs whose key is not in the store, run the first,
    store it and ``save()``. Starts no run after ``budget_s`` seconds or ``max_runs`` runs;
    returns False then. With a shared store it runs the first run no other process has
    claimed, and waits (``poll_s``) while every run left is another's (a plan waiting on their
    results)."""
    from tqdm.auto import tqdm

    start, done = time.perf_counter(), 0
    bar = tqdm(desc=desc, dynamic_ncols=True, unit="run")
    try:
        while True:
            store.sync()
            todo = [(k, j) for k, j in jobs() if k not in store.runs]
            if not todo:
                break
            if budget_s is not None and time.perf_counter() - start > budget_s:
                tqdm.write(f"budget of {budget_s:.0f}s spent; rerun to continue")
                return False
            if max_runs is not None and done >= max_runs:
                tqdm.write(f"{max_runs} runs done; rerun to continue")
                return False
            mine = next(((k, j) for k, j in todo if store.claim(k)), None)
            if mine is None:  # the rest are running elsewhere
                time.sleep(poll_s)
                continue
            key, job = mine
            bar.set_postfix_str(key)
            try:
                store.runs[key] = record = run_job(job)
                save()
            finally:
                store.release(key)
            done += 1
            bar.update(1)
            tqdm.write(describe(key, record) if describe else
                       f"{key}: {record.get('wall_seconds', 0):.0f}s, final {record.get('final_accuracy')}")
    finally:
        bar.close()
    return True


# --------------------------------------------------------------------------- the study protocol

RESULTS = Path(__file__).resolve().parent / "results"  # every study's default --out
# The options every study takes, and those it takes where they apply (``Study.uses``).
SHARED = ("out", "stem", "fresh", "report_only", "smoke", "device")
OPTIONAL = ("threads", "budget", "workers")


@dataclasses.dataclass
class Study:
    """What a study declares; ``main`` is the rest, the same for every study.

    One command line (``--out``, ``--stem``, ``--fresh``, ``--report-only``, ``--smoke``,
    ``--device``, and ``--threads``, ``--budget_s``/``--max-runs``, ``--workers`` where
    ``uses`` names them) and one flow: parse; apply ``smoke`` (the smoke run's settings, an
    option given on the command line winning); ``configure`` (derived settings, checks); then
    either ``--report-only`` (the earlier json as it is, the ``report_options`` its runs were
    made with set back on the options around a second ``configure``) or a run: resume the json
    (``fields``, unless ``--fresh``), ``prepare`` what the runs share, run the ``jobs`` not in
    the json yet (``harness.run_all``: one ``run`` each, the json and report rewritten after
    every one), then ``measure`` what is not a grid (a one-shot study: everything), and
    ``close`` what ``prepare`` opened (a server). Every save
    is ``summarize`` → ``data[summary_key]``, ``report`` → ``<stem>.md``, and, at the end,
    ``plot``. A study file is its own questions: these functions and its constants."""

    stem: str
    doc: str
    report: Callable[[argparse.Namespace, dict[str, Any]], str]
    options: Callable[[argparse.ArgumentParser], None] | None = None
    uses: Sequence[str] = ("threads",)
    devices: Sequence[str] = ("cpu",)  # device prefixes the study runs on; the first the default
    smoke: dict[str, Any] = dataclasses.field(default_factory=dict)
    configure: Callable[[argparse.Namespace, argparse.ArgumentParser], None] | None = None
    report_options: Sequence[str] = ()
    fields: dict[str, Callable[[], Any]] = dataclasses.field(default_factory=dict)
    private: Sequence[str] = ()  # options not written to the json's config
    same: Sequence[str] = ()  # options an earlier json's runs must share to be resumed
    prepare: Callable[[argparse.Namespace, Store], Any] | None = None
    jobs: Callable[[argparse.Namespace, Store, Any], Sequence[tuple[str, Any]]] | None = None
    run: Callable[[argparse.Namespace, Any, Any], dict[str, Any]] | None = None
    describe: Callable[[str, dict[str, Any]], str] | None = None
    measure: Callable[[argparse.Namespace, Store, Any], None] | None = None
    close: Callable[[Any], None] | None = None  # releases what prepare took, whatever happened
    summarize: Callable[[argparse.Namespace, dict[str, Any]], Any] | None = None
    summary_key: str = "summary"
    plot: Callable[[argparse.Namespace, dict[str, Any]], None] | None = None

    def parser(self) -> argparse.ArgumentParser:
        p = argparse.ArgumentParser(description=self.doc,
                                    formatter_class=argparse.RawDescriptionHelpFormatter)
        add_shared_options(p, self.uses, self.devices[0])
        if self.options:
            self.options(p)
        return p

    def parse(self, argv: Sequence[str] | None = None) -> argparse.Namespace:
        """The options, smoke settings applied and ``configure`` run (the CLI's view)."""
        p = self.parser()
        a = p.parse_args(argv)
        given = explicit_options(p, argv)
        if a.smoke:
            for key, value in self.smoke.items():
                if key not in given:
                    setattr(a, key, value)
        if not any(a.device.startswith(d) for d in self.devices):
            p.error(f"--device {a.device}: this study runs on {' or '.join(self.devices)}")
        a.parser, a.stem_given = p, a.stem
        self._configure(a)
        return a

    def _configure(self, a: argparse.Namespace) -> None:
        a.stem = a.stem_given or self.stem + ("-smoke" if a.smoke else "")
        if self.configure:
            self.configure(a, a.parser)
        if a.stem_given:  # an explicit --stem wins over the study's own choice
            a.stem = a.stem_given

    def config(self, a: argparse.Namespace) -> dict[str, Any]:
        """What the json keeps of the options."""
        skip = {"parser", "stem_given", *self.private}
        return {k: v for k, v in vars(a).items() if k not in skip}

    def save(self, a: argparse.Namespace, store: Store, plot: bool = False) -> None:
        with store.locked():
            store.sync()
            summary = self.summarize(a, store.data) if self.summarize else None
            if summary is not None:
                store.data[self.summary_key] = summary
            store.save(self.report(a, store.data))
            if plot and self.plot:
                self.plot(a, store.data)

    def report_only(self, a: argparse.Namespace, store: Store) -> None:
        """Rewrite the report from the earlier json as it is, with the options its runs were
        made with (``report_options`` of its config, set before and after ``configure``)."""
        if store.old is None:
            raise SystemExit(f"{a.stem}: --report-only: no {a.stem}.json in {store.out}")
        store.data = store.old
        config = store.old.get("config", {})

        def restore() -> None:  # a tuple the json made a list is a tuple again
            for key in self.report_options:
                if key in config:
                    value, now = config[key], getattr(a, key, None)
                    setattr(a, key, tuple(value) if isinstance(now, tuple) else value)
        restore()
        self._configure(a)
        restore()
        self.save(a, store, plot=True)

    def main(self, argv: Sequence[str] | None = None) -> int:
        a = self.parse(argv)
        if a.threads:
            torch.set_num_threads(a.threads)
        store = Store(a.out, a.stem, fresh=a.fresh, shared=a.workers > 1)
        if a.report_only:
            self.report_only(a, store)
            return 0
        config = (store.old or {}).get("config", {})
        for key in self.same:
            if key in config and config[key] != getattr(a, key):
                raise SystemExit(f"{a.stem}: the json's runs were made with {key} {config[key]}, "
                                 "not this call's; write elsewhere with --out, or start over "
                                 "with --fresh")
        store.resume(commands=list, machines=list, **self.fields)
        store.data["config"] = self.config(a)
        store.stamp(a.device)
        ctx = self.prepare(a, store) if self.prepare else None
        try:
            if self.jobs and self.run:
                jobs, run = self.jobs, self.run
                run_all(store, lambda: jobs(a, store, ctx), lambda job: run(a, ctx, job),
                        lambda: self.save(a, store), budget_s=a.budget_s, max_runs=a.max_runs,
                        desc=f"{a.stem} runs", describe=self.describe)
            if self.measure:
                self.measure(a, store, ctx)
        finally:
            if self.close:
                self.close(ctx)
        self.save(a, store, plot=True)
        return 0


def add_shared_options(p: argparse.ArgumentParser, uses: Sequence[str] = OPTIONAL,
                       device: str = "cpu") -> None:
    """The shared options (``SHARED``, and those of ``OPTIONAL`` in ``uses``)."""
    g = p.add_argument_group("every study")
    g.add_argument("--out", default=str(RESULTS), help="where the json, md and png go")
    g.add_argument("--stem", default=None, help="their file name (default: the study's; "
                   "<stem>-smoke with --smoke)")
    g.add_argument("--fresh", action="store_true", help="ignore the runs of an earlier json")
    g.add_argument("--report-only", action="store_true",
                   help="rewrite md/png from the json, with the options its runs were made with")
    g.add_argument("--smoke", action="store_true", help="the pipeline at tiny sizes (CI)")
    g.add_argument("--device", default=device, help=f"cpu or cuda[:N] (default {device})")
    if "threads" in uses:
        g.add_argument("--threads", type=int, default=1, help="torch threads (1: the fastest "
                       "for these models on a shared machine; 0: torch's default)")
    if "budget" in uses:
        g.add_argument("--budget_s", "--budget-s", dest="budget_s", type=float, default=None,
                       help="start no run after this many seconds (the json stays resumable)")
        g.add_argument("--max-runs", type=int, default=None,
                       help="start at most this many runs now (rerun to continue)")
    if "workers" in uses:
        g.add_argument("--workers", type=int, default=1, help="processes sharing this "
                       "study's json (start each with the same options)")
    unused = {"threads": {"threads": 0}, "budget": {"budget_s": None, "max_runs": None},
              "workers": {"workers": 1}}
    p.set_defaults(**{k: v for use, d in unused.items() if use not in uses for k, v in d.items()})


def explicit_options(p: argparse.ArgumentParser, argv: Sequence[str] | None) -> set[str]:
    """The options given on the command line (not left at their defaults): parsed again with
    every default suppressed."""
    saved, parser_defaults = [(a, a.default) for a in p._actions], p._defaults
    try:
        p._defaults = {}
        for action, _ in saved:
            action.default = argparse.SUPPRESS
        return set(vars(p.parse_args(argv)))
    finally:
        p._defaults = parser_defaults
        for action, default in saved:
            action.default = default


def main(*studies: Study, argv: Sequence[str] | None = None) -> int:
    """A study of several parts (each a ``Study``, one report each, one command line: their
    ``options`` declare ``--part`` too): ``--part STEM`` runs one, and without it every part runs
    in turn (``--report-only``: every report)."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--part", choices=[s.stem for s in studies])
    known, rest = pre.parse_known_args(argv)
    if "-h" in rest or "--help" in rest:
        return studies[0].main(rest)
    for study in studies:
        if known.part in (None, study.stem):
            study.main(rest)
    return 0


# --------------------------------------------------------------------------- tables


def mean(xs: Sequence[float | None]) -> float | None:
    """The mean, or None when there is nothing or a value is missing."""
    return statistics.fmean(xs) if xs and all(x is not None for x in xs) else None  # type: ignore[arg-type]


def fmt_range(xs: Sequence[Any], fmt: str = "{:.0f}", *, single: bool = True) -> str:
    """``mean [min–max]`` over seeds ('k/n reached (mean of those)' when some are None; one
    value alone as itself unless ``single=False``)."""
    if not xs:
        return "—"
    got = [x for x in xs if x is not None]
    if len(got) < len(xs):
        return f"{len(got)}/{len(xs)} reached" + (f" ({fmt.format(statistics.fmean(got))})" if got else "")
    if len(xs) == 1 and single:
        return fmt.format(xs[0])
    return f"{fmt.format(statistics.fmean(xs))} [{fmt.format(min(xs))}–{fmt.format(max(xs))}]"


def train_clock(run: dict[str, Any]) -> float | None:
    """A run's training clock (gate included) at its last step; None if it recorded none."""
    clock = run.get("train_seconds")
    return clock[max(clock, key=int)] if clock else None


def gate_share(run: dict[str, Any]) -> float | None:
    """The share of a run's training clock its gate took (0 for plain OPD)."""
    total = train_clock(run)
    return run["gate_seconds"] / total if total else None


def reached(run: dict[str, Any], targets: dict[str, float],
            fractions: Iterable[float] = FRACTIONS) -> dict[str, Any]:
    """Steps and seconds (its clock at that step) to each fraction of the gain; None: not
    reached within the run."""
    from lookahead_opd.demo.compare import steps_to_target

    out: dict[str, Any] = {}
    for f in fractions:
        s = steps_to_target(run["evals"], targets[f"{f:g}"])
        out[f"steps_{f:g}"] = s
        out[f"seconds_{f:g}"] = None if s is None else run["train_seconds"].get(str(s), 0.0)
    return out


def degraded(run: dict[str, Any]) -> bool:
    """The run broke: a crash (NaN), or a final accuracy below its start."""
    if run.get("crashed") or run["final_accuracy"] is None or math.isnan(run["final_accuracy"]):
        return True
    return run["final_accuracy"] < run["evals"][0][1]


def rank_key(runs: list[dict[str, Any]], targets: dict[str, float],
             fractions: Sequence[float] = FRACTIONS) -> tuple[float, float, float]:
    """Smaller is better: the highest fraction reached on every run, then mean steps to it,
    then minus the mean final accuracy."""
    finals = [r["final_accuracy"] or 0.0 for r in runs]
    for i, f in enumerate(reversed(fractions)):
        steps = [reached(r, targets, (f,))[f"steps_{f:g}"] for r in runs]
        if all(s is not None for s in steps):
            return (float(i), statistics.fmean(steps), -statistics.fmean(finals))
    return (float(len(fractions)), 0.0, -statistics.fmean(finals))


def made_by(results: dict[str, Any], *, threads: bool = True) -> str:
    """A report's provenance: the commands that made its runs, the last commit, the machine."""
    m = results["machine"]
    return ("Made by " + ", then ".join(f"`{c}`" for c in results.get("commands") or [])
            + f", last at {m.get('git_commit')}, on {m.get('cpu_model')} (torch {m.get('torch')}"
            + (f", {m.get('torch_threads')} thread" if threads else "") + ")")



# --------------------------------------------------------------------------- figures


def pyplot() -> Any:
    """matplotlib's pyplot on the Agg backend: the studies write files and need no display."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


@contextlib.contextmanager
def figure(path: str | Path, cols: int = 1, rows: int = 1, *, panel: tuple[float, float] = (4.2, 4),
           dpi: int = 110, **subplots: Any) -> Iterator[tuple[Any, Any]]:
    """``(fig, axes)``: a ``rows`` × ``cols`` grid (``axes[row][col]``) of ``panel``-sized
    panels, laid out and saved to ``path`` when the block ends, and closed even if it fails."""
    plt = pyplot()
    fig, axes = plt.subplots(rows, cols, figsize=(panel[0] * cols, panel[1] * rows),
                             squeeze=False, **subplots)
    try:
        yield fig, axes
        fig.tight_layout()
        fig.savefig(path, dpi=dpi)
    finally:
        plt.close(fig)
