"""``diagnose``: rank teachers for on-policy distillation without training (paper B).

1. Roll the student out on ``questions`` problems (``samples_per_question`` each) and grade them.
2. Score one student forward pass over the rollouts; at exponentially spaced depths of each
   completion take the student's top-K tokens plus the sampled one as a node's candidates.
3. Plan nodes depth-major until the continuation ``budget`` is spent; estimate every
   candidate's ``P_succ`` with ``continuations`` student rollouts from ``prefix + candidate``.
   These rollouts do not depend on the teacher, so every teacher shares them.
4. For each teacher, one forward pass over the same rollouts gives ``q`` at every node; score
   the ideal gradient, the distillation gradient, alignment, teacher advantage and the proxies.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Union

import torch
from torch import nn

from lookahead_opd.integrations.opd.engines import Engine, HFEngine, Rollout, tokenize_prompts
from lookahead_opd.integrations.opd.scoring import sequence_logits
from lookahead_opd.integrations.opd.tasks import Problem, Task
from lookahead_opd.integrations.opd.vocab import align_vocab, check_vocab_compatible
from lookahead_opd.options import check_choice

from . import scores
from .nodes import SPACINGS, Node, candidate_set, node_cost, node_depths, plan_nodes
from .report import METRICS, DiagnosticReport
from .rollouts import SuccessEstimates, completion_ids, estimate_success, prefix_text
from .teachers import ContextTeacher, parse_teacher_spec

__all__ = ["TeacherLike", "diagnose", "resolve_teachers", "check_options", "min_budget"]

logger = logging.getLogger(__name__)

# A teacher: a module sharing the student's tokenizer, ``(module, its tokenizer)``, or a string:
# ``self:solution|answer|example`` or a Hugging Face model id / directory.
TeacherLike = Union[nn.Module, str, tuple]


def min_budget(top_k: int, continuations: int) -> int:
    """Rollouts one node can need: ``continuations`` × (top-K + the sampled token)."""
    return continuations * (top_k + 1)


def check_options(*, budget: int, questions: int, samples_per_question: int, top_k: int,
                  continuations: int, loss: str, jsd_beta: float, temperature: float,
                  spacing: str, rank_by: str) -> None:
    """Raise ``ValueError`` naming the first bad option (nothing is loaded or computed)."""
    for name, value in (("questions", questions), ("samples_per_question", samples_per_question),
                        ("continuations", continuations)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    if top_k < 2:
        raise ValueError(f"top_k must be >= 2 (a node compares candidates), got {top_k}")
    check_choice("loss", loss, scores.DISTILL_LOSSES)
    if not 0.0 <= jsd_beta <= 1.0:
        raise ValueError(f"jsd_beta must be in [0, 1], got {jsd_beta}")
    if not temperature > 0:
        raise ValueError(
            f"temperature must be > 0 (the student's sampling policy), got {temperature}")
    check_choice("spacing", spacing, SPACINGS)
    check_choice("rank_by", rank_by, METRICS)
    need = min_budget(top_k, continuations)
    if budget < need:
        raise ValueError(f"budget {budget} is too small for one node: a node needs up to "
                         f"continuations × (top_k + 1) = {continuations} × {top_k + 1} = {need} "
                         "rollouts; raise --budget or lower --continuations/--top_k")


def _problems(task: Task, split: str, questions: int, seed: int) -> list[Problem]:
    try:
        pool = task.all_problems(split)
    except KeyError:
        raise ValueError(f"task {task.name!r} has no split {split!r}") from None
    if not pool:
        raise ValueError(f"task {task.name!r} has no {split} problems: nothing to diagnose")
    return task.problems(split, min(questions, len(pool)), seed=seed)


def resolve_teachers(teachers: Mapping[str, TeacherLike] | Sequence[TeacherLike],
                     student: nn.Module, tokenizer: Any, task: Task, problems: Sequence[Problem], *,
                     context_separator: str = " ", dtype: torch.dtype | None = None,
                     ) -> tuple[dict[str, nn.Module], int, dict[str, str]]:
    """Name → module for every teacher, the vocabulary size they all share with the student,
    and name → what was given (the spec string, or the module's class name). A model path is
    named by its last component unless two teachers share it. Raises ``ValueError`` for
    unknown specs and tokenizer mismatches; model ids are loaded only after their tokenizer
    has been checked."""
    if isinstance(teachers, Mapping):
        items = list(teachers.items())
    elif isinstance(teachers, str | nn.Module | tuple):
        raise TypeError(
            "teachers must be a list or a name → teacher mapping, not a single teacher")
    else:
        items = [(_display_name(t, teachers) if isinstance(t, str) else f"teacher{i}", t)
                 for i, t in enumerate(teachers)]
    if not items:
        raise ValueError("give at least one teacher")
    names = [n for n, _ in items]
    if len(set(names)) != len(names):
        raise ValueError(f"teacher names must be distinct, got {names}")
    out: dict[str, nn.Module] = {}
    given = {name: t if isinstance(t, str) else type(t[0] if isinstance(t, tuple) else t).__name__
             for name, t in items}
    vocab = None
    for name, t in items:
        t_tok = tokenizer
        if isinstance(t, tuple):
            if len(t) != 2 or not isinstance(t[0], nn.Module):
                raise TypeError(f"teacher {name!r}: a tuple must be (module, tokenizer)")
            t, t_tok = t
        if isinstance(t, str):
            spec = parse_teacher_spec(t)
            if spec.kind == "self":
                examples = task.problems("train") if spec.context == "example" else ()
                t = ContextTeacher.for_task(student, tokenizer, task, problems, spec.context,
                                            separator=context_separator, examples=examples)
            else:
                t, t_tok = _load_teacher(spec.path, tokenizer, dtype, _device(student), name)
        if not isinstance(t, nn.Module):
            raise TypeError(f"teacher {name!r} must be a module, a (module, tokenizer) pair or a "
                            f"string spec, got {type(t).__name__}")
        try:
            size = check_vocab_compatible(student, t, student_tokenizer=tokenizer,
                                          teacher_tokenizer=t_tok)
        except ValueError as err:
            raise ValueError(
                f"teacher {name!r} does not share the student's tokenizer: {err}") from None
        vocab = size if vocab is None else min(vocab, size)
        out[name] = t
    assert vocab is not None
    return out, vocab, given


def _display_name(spec: str, all_specs: Sequence[Any]) -> str:
    """A model path's last component when no other teacher shares it, else the whole spec."""
    if spec.startswith("self:") or "/" not in spec.rstrip("/"):
        return spec
    short = spec.rstrip("/").rsplit("/", 1)[-1]
    others = [s.rstrip("/").rsplit("/", 1)[-1] for s in all_specs
              if isinstance(s, str) and s != spec]
    return spec if short in others else short


def _load_teacher(path: str, tokenizer: Any, dtype: torch.dtype | None, device: torch.device,
                  name: str) -> tuple[nn.Module, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from lookahead_opd.integrations.model_sources import resolve_model

    path = resolve_model(path)
    try:
        t_tok = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as err:
        raise ValueError(
            f"teacher {name!r}: cannot load a tokenizer from {path!r}: {err}") from None
    try:
        check_vocab_compatible(tokenizer, t_tok)
    except ValueError as err:
        raise ValueError(
            f"teacher {name!r} does not share the student's tokenizer: {err}") from None
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype or torch.float32).to(device)
    return model.eval(), t_tok


def _device(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


@torch.no_grad()
def _logprobs_at(model: nn.Module, sequences: torch.Tensor, attention_mask: torch.Tensor,
                 positions: Mapping[int, Sequence[int]], vocab: int, temperature: float = 1.0,
                 rows_per_pass: int = 64) -> dict[int, torch.Tensor]:
    """Next-token log-probs (fp32, ``[n, vocab]``) of ``model`` at ``positions[row]`` (indices of
    the *predicting* position) for every listed row; one batched forward per chunk of rows."""
    rows = sorted(r for r, p in positions.items() if p)
    device = _device(model)
    out: dict[int, torch.Tensor] = {}
    was_training = model.training
    model.eval()
    try:
        for start in range(0, len(rows), rows_per_pass):
            chunk = rows[start:start + rows_per_pass]
            seq, attn = sequences[chunk].to(device), attention_mask[chunk].to(device)
            logits = align_vocab(sequence_logits(model, sequences=seq, attention_mask=attn), vocab)
            for j, r in enumerate(chunk):
                sel = logits[j, list(positions[r])].float() / temperature
                out[r] = sel.log_softmax(-1).cpu()
    finally:
        model.train(was_training)
    return out


def diagnose(student: nn.Module, teachers: Mapping[str, TeacherLike] | Sequence[TeacherLike],
             task: Task, *, budget: int = 20_000, tokenizer: Any = None,
             engine: Engine | None = None, questions: int = 32, split: str = "test",
             samples_per_question: int = 2, top_k: int = 4,
             continuations: int = 8, loss: str = "reverse_kl", jsd_beta: float = 0.5,
             temperature: float = 1.0, max_new_tokens: int | None = None,
             spacing: str = "exponential", context_separator: str = " ", rank_by: str = "alignment",
             seed: int = 0, resamples: int = 1000, progress: bool = False,
             teacher_dtype: torch.dtype | None = None) -> DiagnosticReport:
    """Score each teacher's distillation signal against the student's ideal gradient.

    ``teachers``: a list or a name → teacher mapping; a teacher is a module sharing the
    student's tokenizer, a ``(module, tokenizer)`` pair, ``"self:solution|answer|example"``, or
    a Hugging Face id / directory. ``budget`` caps the continuation rollouts (never exceeded;
    ``report.rollouts_used`` says how many ran). ``engine`` defaults to an ``HFEngine`` over the
    student; ``tokenizer`` to the engine's. ``loss`` is the distillation loss whose gradient is
    scored (``reverse_kl``, ``forward_kl``, ``jsd`` with ``jsd_beta``). Deterministic for a
    fixed ``seed``. Bad input raises ``ValueError`` before any rollout.
    """
    t_start = time.perf_counter()
    check_options(budget=budget, questions=questions, samples_per_question=samples_per_question,
                  top_k=top_k, continuations=continuations, loss=loss, jsd_beta=jsd_beta,
                  temperature=temperature, spacing=spacing, rank_by=rank_by)
    if tokenizer is None:
        if engine is None:
            raise ValueError("give tokenizer= (or an engine that has one)")
        tokenizer = engine.tokenizer
    problems = _problems(task, split, questions, seed)
    models, vocab, given = resolve_teachers(teachers, student, tokenizer, task, problems,
                                     context_separator=context_separator, dtype=teacher_dtype)
    engine = engine if engine is not None else HFEngine(student, tokenizer, batch_size=256)
    run = _Run(task, problems, tokenizer, vocab, budget=budget,
               samples_per_question=samples_per_question, top_k=top_k,
               continuations=continuations, loss=loss, jsd_beta=jsd_beta, temperature=temperature,
               max_new_tokens=max_new_tokens or task.max_new_tokens, spacing=spacing, seed=seed,
               progress=progress)
    seconds: dict[str, float] = {"setup": time.perf_counter() - t_start}

    t0 = time.perf_counter()
    roll = _student_rollouts(run, engine)
    seconds["student_rollouts"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    nodes = _candidate_nodes(run, student, roll)
    seconds["nodes"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    est = _continuations(run, engine, nodes)
    seconds["continuations"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    records = _score_teachers(run, student, models, roll, nodes, est)
    seconds["teachers"] = time.perf_counter() - t0
    seconds["total"] = time.perf_counter() - t_start

    counts = _counts(run, roll, nodes, records)
    config = _config(run, split=split, context_separator=context_separator, teachers=given)
    return DiagnosticReport(
        teachers=list(models), nodes=records, counts=counts, rollouts_used=est.rollouts,
        budget=budget, config=config, seconds=seconds, rank_by=rank_by, resamples=resamples,
        seed=seed, questions=_question_rows(run, roll))


def _counts(run: _Run, roll: _StudentRollouts, nodes: _Nodes, records: Sequence[Mapping[str, Any]]
            ) -> dict[str, int]:
    """The report's counts: questions, rollouts, nodes found / kept / informative / skipped."""
    informative = sum(r["informative"] for r in records)
    return {"questions": len(run.problems), "rollouts": len(roll.completions),
            "correct_rollouts": int(sum(roll.correct)), "candidate_nodes": nodes.candidates,
            "nodes": len(records), "informative": informative,
            "uninformative": len(records) - informative, "skipped_tokenization": nodes.skipped}


def _config(run: _Run, *, split: str, context_separator: str, teachers: dict[str, str]
            ) -> dict[str, Any]:
    """The options the report records (after defaults: ``questions`` is how many ran)."""
    return dict(budget=run.budget, questions=len(run.problems), split=split,
                samples_per_question=run.samples_per_question, top_k=run.top_k,
                continuations=run.continuations, loss=run.loss, jsd_beta=run.jsd_beta,
                temperature=run.temperature, max_new_tokens=run.max_new_tokens,
                spacing=run.spacing, context_separator=context_separator, seed=run.seed,
                task=run.task.name, teachers=teachers)


def _question_rows(run: _Run, roll: _StudentRollouts) -> list[dict[str, Any]]:
    """Each question with its answer and the student's solve rate over its rollouts."""
    k = run.samples_per_question
    solve = [sum(roll.correct[q * k:(q + 1) * k]) / k for q in range(len(run.problems))]
    return [{"index": q, "prompt": p.prompt, "answer": p.answer, "solve_rate": solve[q]}
            for q, p in enumerate(run.problems)]


@dataclass(frozen=True)
class _Run:
    """What every phase of one diagnosis reads: the questions and the (checked) options."""

    task: Task
    problems: list[Problem]
    tokenizer: Any
    vocab: int
    budget: int
    samples_per_question: int
    top_k: int
    continuations: int
    loss: str
    jsd_beta: float
    temperature: float
    max_new_tokens: int
    spacing: str
    seed: int
    progress: bool


@dataclass
class _StudentRollouts:
    rollout: Rollout
    completions: list[list[int]]
    correct: list[bool]


@dataclass
class _Nodes:
    nodes: list[Node]
    planned: int  # continuation rollouts the nodes need
    candidates: int  # nodes found before the budget cut
    skipped: int  # nodes dropped because a candidate does not re-tokenize


def _student_rollouts(run: _Run, engine: Engine) -> _StudentRollouts:
    """1. ``samples_per_question`` student rollouts per question, graded."""
    roll = engine.generate([p.prompt for p in run.problems], max_new_tokens=run.max_new_tokens,
                           temperature=run.temperature, seed=run.seed,
                           num_samples=run.samples_per_question)
    correct = [run.task.is_correct(text, run.problems[b // run.samples_per_question])
               for b, text in enumerate(roll.texts)]
    return _StudentRollouts(roll, completion_ids(roll.sequences, roll.completion_mask,
                                                 roll.prompt_length), correct)


def _candidate_nodes(run: _Run, student: nn.Module, roll: _StudentRollouts) -> _Nodes:
    """2. Candidate nodes from one student forward pass: the top-K tokens plus the sampled one
    at spaced depths, planned depth-major until the budget is spent."""
    P, comps, tokenizer = roll.rollout.prompt_length, roll.completions, run.tokenizer
    depths = {b: node_depths(len(c), run.spacing) for b, c in enumerate(comps)}
    student_lp = _logprobs_at(student, roll.rollout.sequences, roll.rollout.attention_mask,
                              {b: [P + d - 2 for d in ds] for b, ds in depths.items()}, run.vocab,
                              run.temperature)
    prompt_ids = tokenize_prompts(tokenizer, [p.prompt for p in run.problems])
    eos = tokenizer.eos_token_id
    levels: dict[int, list[Node]] = {}
    skipped = 0
    for b, ds in depths.items():
        q = b // run.samples_per_question
        for i, d in enumerate(ds):
            lp = student_lp[b][i]
            prefix, sampled = comps[b][:d - 1], comps[b][d - 1]
            cands = candidate_set(lp, sampled, run.top_k)
            free = [c == eos or d >= run.max_new_tokens for c in cands]
            if not all(f or prefix_text(tokenizer, run.problems[q].prompt, prompt_ids[q],
                                        [*prefix, c]) is not None
                       for c, f in zip(cands, free, strict=True)):
                skipped += 1
                continue
            levels.setdefault(d, []).append(Node(
                row=b, question=q, sample=b % run.samples_per_question, depth=d, prefix=prefix,
                sampled=sampled, candidates=cands, student_probs=lp[cands].exp().tolist(),
                rollout_correct=bool(roll.correct[b]), free=free))
    candidates_total = sum(len(v) for v in levels.values())
    nodes, planned = plan_nodes([levels[d] for d in sorted(levels)], run.budget,
                                run.continuations, run.seed)
    nodes.sort(key=lambda n: (n.row, n.depth))
    if not nodes and candidates_total:
        cheapest = min(node_cost(n, run.continuations) for v in levels.values() for n in v)
        raise ValueError(f"budget {run.budget} does not fit a single node (the cheapest needs "
                         f"{cheapest})")
    return _Nodes(nodes, planned, candidates_total, skipped)


def _continuations(run: _Run, engine: Engine, nodes: _Nodes) -> SuccessEstimates:
    """3. ``P_succ`` of every candidate from targeted student continuations; they do not
    depend on the teacher, so every teacher shares them."""
    bar = _bar(nodes.planned, run.progress, "continuations")
    est = estimate_success(engine, run.task, run.problems, nodes.nodes,
                           continuations=run.continuations, max_new_tokens=run.max_new_tokens,
                           temperature=run.temperature, seed=run.seed + 1, on_progress=bar.update)
    bar.close()
    assert est.rollouts == nodes.planned, (est.rollouts, nodes.planned)
    return est


def _score_teachers(run: _Run, student: nn.Module, models: Mapping[str, nn.Module],
                    roll: _StudentRollouts, nodes: _Nodes, est: SuccessEstimates
                    ) -> list[dict[str, Any]]:
    """4. One forward pass per teacher over the rollouts gives ``q`` at every node; each node's
    record gets every teacher's scores."""
    P = roll.rollout.prompt_length
    seqs, attn = roll.rollout.sequences, roll.rollout.attention_mask
    node_positions: dict[int, list[int]] = {}
    slots = []  # node i's row in its row's teacher log-probs
    for n in nodes.nodes:
        row = node_positions.setdefault(n.row, [])
        slots.append(len(row))
        row.append(P + n.depth - 2)
    # The same forward as the teachers' (same rows, same batches): a teacher identical to the
    # student then gives bit-identical q and an exactly zero distillation gradient.
    student_at = _logprobs_at(student, seqs, attn, node_positions, run.vocab, run.temperature)
    records = [_node_record(n, student_at[n.row][slots[i]], est.p_succ[i], est.counts[i],
                            run.problems, run.tokenizer) for i, n in enumerate(nodes.nodes)]
    for name, model in _progress_items(models, run.progress):
        teacher_at = _logprobs_at(model, seqs, attn, node_positions, run.vocab)
        for i, (n, rec) in enumerate(zip(nodes.nodes, records, strict=True)):
            rec["teachers"][name] = _teacher_scores(
                rec, student_at[n.row][slots[i]], teacher_at[n.row][slots[i]],
                n.candidates, run.top_k, run.loss, run.jsd_beta)
    return records


def _node_record(n: Node, student_lp: torch.Tensor, p_succ: list[float], counts: list[int],
                 problems: Sequence[Problem], tokenizer: Any) -> dict[str, Any]:
    p = scores.renormalise(student_lp[n.candidates].double().exp())
    s = torch.tensor(p_succ, dtype=torch.float64)
    return {
        "question": n.question, "sample": n.sample, "depth": n.depth,
        "rollout_correct": n.rollout_correct, "prompt": problems[n.question].prompt,
        "prefix": tokenizer.decode(n.prefix, skip_special_tokens=False),
        "candidates": n.candidates,
        "candidate_tokens": [tokenizer.decode([c], skip_special_tokens=False)
                             for c in n.candidates],
        "sampled": n.sampled, "student_probs": p.tolist(), "p_succ": p_succ, "counts": counts,
        "value": float((p * s).sum()), "informative": bool(scores.has_signal(s)), "teachers": {},
    }


def _teacher_scores(rec: dict[str, Any], student_lp: torch.Tensor, teacher_lp: torch.Tensor,
                    candidates: list[int], top_k: int, loss: str, beta: float) -> dict[str, Any]:
    p = torch.tensor(rec["student_probs"], dtype=torch.float64)
    q = scores.renormalise(teacher_lp[candidates].double().exp())
    s = torch.tensor(rec["p_succ"], dtype=torch.float64)
    distill = scores.distillation_gradient(p, q, loss, beta=beta)
    align, zero = scores.alignment(scores.ideal_gradient(p, s), distill)
    proxies = scores.proxy_scores(student_lp, teacher_lp, min(top_k, student_lp.shape[-1]))
    out: dict[str, Any] = {
        "alignment": align if rec["informative"] else None,
        "zero_gradient": zero,
        "advantage": float(scores.teacher_advantage(p, q, s)),
        "teacher_probs": q.tolist(),
        **{k: float(v) for k, v in proxies.items()},
    }
    return {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in out.items()}


def _bar(total: int, enabled: bool, desc: str):
    from tqdm.auto import tqdm

    return tqdm(total=total, disable=not enabled, desc=desc, unit="rollout", dynamic_ncols=True)


def _progress_items(models: Mapping[str, nn.Module], enabled: bool):
    from tqdm.auto import tqdm

    return tqdm(list(models.items()), disable=not enabled, desc="teachers", dynamic_ncols=True)
