"""Does the training-free diagnostic predict which teacher distills best?

On the embedded arithmetic task (2-digit addition, the zoo's tiny Qwen2 base as the student):

1. teachers of clearly different quality, all sharing the student's tokenizer:
   ``long`` (the zoo teacher, the base trained to ≥ 95%), ``mid`` and ``short`` (the same base
   trained for fewer steps), ``minus`` (the base trained on subtraction instead: skilled on a
   different operation), ``self:solution`` (the student itself with the worked solution in
   context) and ``copy`` (the student itself: the null teacher, whose gradient is zero);
2. one diagnostic run scoring all of them (``diagnose``);
3. one fixed-length OPD run (``OPDTrainer``) per teacher from the same student, same seed;
4. the Spearman correlation, across teachers, between each diagnostic score and the realised
   accuracy gain, and the diagnostic's wall-clock as a fraction of the OPD runs.

    python -m benchmarks.teacher_ranking            # the committed results (~10 min on 2 cores)
    python -m benchmarks.teacher_ranking --quick    # smoke test (~1 min), results not committed

Writes ``benchmarks/results/teacher_ranking.{json,md}`` (``teacher_ranking_quick.*`` with
``--quick``). Extra teachers are cached under ``$LOOKAHEAD_OPD_CACHE`` (see ``opd/zoo.py``).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from benchmarks.common import machine_info, markdown_table, write_results

FULL = dict(questions=64, samples_per_question=2, budget=8_000, top_k=4, continuations=8,
            thresholds=dict(student=0.2, short=0.5, mid=0.8, long=0.95), every=50,
            max_pretrain_steps=5000, minus_steps=300,
            opd_steps=100, opd_seeds=(0, 1, 2), batch_size=64,
            learning_rate=3e-4, eval_size=400)
QUICK = dict(questions=8, samples_per_question=2, budget=600, top_k=3, continuations=4,
             thresholds=dict(student=0.0, short=0.01, mid=0.02, long=0.03), every=20,
             max_pretrain_steps=100, minus_steps=10, opd_steps=3, opd_seeds=(0,),
             batch_size=16,
             learning_rate=3e-4, eval_size=50)
SCORES = ("alignment", "alignment_incorrect", "alignment_correct", "advantage", "reverse_kl",
          "js", "topk_overlap", "teacher_mass_topk")


def spearman(x: list[float | None], y: list[float]) -> float | None:
    """Spearman's rank correlation (average ranks for ties) over pairs where ``x`` is known;
    ``None`` with fewer than 3 pairs or a constant side."""
    pairs = [(a, b) for a, b in zip(x, y, strict=True) if a is not None]
    if len(pairs) < 3:
        return None
    ranks = [_ranks([p[i] for p in pairs]) for i in (0, 1)]
    if np.std(ranks[0]) == 0 or np.std(ranks[1]) == 0:
        return None
    return float(np.corrcoef(ranks[0], ranks[1])[0, 1])


def _ranks(v: list[float]) -> np.ndarray:
    a = np.asarray(v, dtype=np.float64)
    order = a.argsort(kind="stable")
    r = np.empty(len(a))
    r[order] = np.arange(len(a), dtype=np.float64)
    for value in np.unique(a):  # ties share their average rank
        r[a == value] = r[a == value].mean()
    return r


def _save(model: torch.nn.Module, tok: Any, out: Path) -> None:
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    os.replace(tmp, out)


# The zoo's first "tiny" Qwen2 shape (zoo v1). Its addition run rises sharply and reproducibly
# (8% → 97% greedy accuracy between ~1000 and ~3000 steps), so checkpoints of one run give
# teachers of clearly different quality. Registered under its own name: the zoo's "tiny" may change.
SIZE = "ranking-tiny"


def _trajectory(root: Path, thresholds: dict[str, float], *, every: int, max_steps: int,
                probe_size: int, seed: int) -> dict[str, dict[str, Any]]:
    """One from-scratch training run on addition (``zoo.pretrain``); the first checkpoint whose
    greedy probe accuracy reaches each threshold is saved. Thresholds not reached by
    ``max_steps`` get the final model (``reached: False``). Cached under ``root``."""
    from lookahead_opd.integrations.opd.tasks import ArithmeticTask
    from lookahead_opd.integrations.opd.tokenizer import char_tokenizer
    from lookahead_opd.integrations.opd.zoo import ZOO_SIZES, greedy_accuracy, make_model, pretrain

    ZOO_SIZES.setdefault(SIZE, dict(hidden_size=64, intermediate_size=256, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2))
    key = "-".join(f"{k}{v:g}" for k, v in thresholds.items())
    meta_path = root / f"trajectory-seed{seed}-{key}-{every}-{max_steps}.json"
    if meta_path.is_file():
        return json.loads(meta_path.read_text())
    tok = char_tokenizer()
    task = ArithmeticTask()
    probe = task.problems("test", probe_size, seed=seed)
    model = make_model(tok, SIZE, seed)
    state: dict[str, Any] = {"step": 0, "curve": []}
    found: dict[str, dict[str, Any]] = {}

    def save(name: str, m: torch.nn.Module, acc: float, reached: bool) -> None:
        path = root / f"{meta_path.stem}-{name}"
        _save(m, tok, path)
        found[name] = {"path": str(path), "step": state["step"], "probe_accuracy": acc,
                       "reached": reached}

    def checkpoint(m: torch.nn.Module) -> bool:
        state["step"] += every
        acc = greedy_accuracy(m, tok, task, probe)
        state["curve"].append((state["step"], acc))
        for name, threshold in thresholds.items():
            if name not in found and acc >= threshold:
                save(name, m, acc, True)
        return len(found) == len(thresholds)

    pretrain(model, tok, task, steps=max_steps, seed=seed, stop=checkpoint, eval_every=every,
             progress=False)
    last = state["curve"][-1][1] if state["curve"] else 0.0
    for name in thresholds:
        if name not in found:
            save(name, model, last, False)
    meta = {**found, "curve": state["curve"]}
    meta_path.write_text(json.dumps(meta))
    return meta


def _other_op(root: Path, base: Path, ops: str, steps: int, seed: int) -> Path:
    """``base`` trained ``steps`` more on ``ops`` arithmetic instead (skilled elsewhere)."""
    from lookahead_opd.integrations.opd.tasks import ArithmeticTask
    from lookahead_opd.integrations.opd.zoo import pretrain
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = root / f"{base.name}-{ops}-{steps}-seed{seed}"
    if not (out / "config.json").is_file():
        tok = AutoTokenizer.from_pretrained(base)
        model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
        pretrain(model, tok, ArithmeticTask(ops=ops), steps=steps, seed=seed + 7, progress=False)
        _save(model, tok, out)
    return out


def _load(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _greedy_accuracy(model: torch.nn.Module, tok: Any, task: Any, problems: list,
                     max_new: int) -> float:
    """Greedy exact match by repeated full forwards (works for ``ContextTeacher`` too)."""
    from lookahead_opd.integrations.opd.engines import tokenize_prompts
    from lookahead_opd.integrations.opd.scoring import sequence_logits

    rows = tokenize_prompts(tok, [p.prompt for p in problems])
    done = [False] * len(rows)
    outs: list[list[int]] = [[] for _ in rows]
    with torch.no_grad():
        for _ in range(max_new):
            width = max(len(r) for r in rows)
            ids = torch.tensor([[tok.pad_token_id] * (width - len(r)) + r for r in rows])
            attn = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
            nxt = sequence_logits(model, sequences=ids, attention_mask=attn)[:, -1].argmax(-1)
            for i, t in enumerate(nxt.tolist()):
                if not done[i]:
                    outs[i].append(t)
                    done[i] = t == tok.eos_token_id
                rows[i] = rows[i] + [t]
    texts = tok.batch_decode(outs, skip_special_tokens=True)
    return sum(task.is_correct(t, p) for t, p in zip(texts, problems, strict=True)) / len(problems)


def run(quick: bool, out_dir: str, seed: int) -> dict[str, Any]:
    from lookahead_opd.integrations.opd.config import OPDConfig
    from lookahead_opd.integrations.opd.engines import HFEngine
    from lookahead_opd.integrations.opd.tasks import SPLITS, ArithmeticTask
    from lookahead_opd.integrations.opd.trainer import OPDTrainer
    from lookahead_opd.integrations.opd.zoo import cache_root
    from lookahead_opd.integrations.teacher_selection import ContextTeacher, diagnose
    from transformers import AutoTokenizer

    c = QUICK if quick else FULL
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    task = ArithmeticTask()
    t0 = time.perf_counter()
    root = cache_root() / "teacher-ranking"
    root.mkdir(parents=True, exist_ok=True)
    traj = _trajectory(root, c["thresholds"], every=c["every"], max_steps=c["max_pretrain_steps"],
                       probe_size=200, seed=seed)
    student_path = Path(traj["student"]["path"])
    paths = {name: Path(traj[name]["path"]) for name in ("long", "mid", "short")}
    paths["minus"] = _other_op(root, student_path, "-", c["minus_steps"], seed)
    build_seconds = time.perf_counter() - t0
    tok = AutoTokenizer.from_pretrained(student_path)
    all_problems = [p for s in SPLITS for p in task.all_problems(s)]

    names = [*paths, "self:solution", "copy"]

    def make_teacher(name: str, student: torch.nn.Module) -> torch.nn.Module:
        if name in paths:
            return _load(paths[name])
        frozen = copy.deepcopy(student).eval()  # OPDTrainer freezes its teacher
        if name == "copy":
            return frozen
        return ContextTeacher.for_task(frozen, tok, task, all_problems, "solution")

    # Teacher quality on their own (greedy, held-out): context for the reader, not a score.
    probe = task.problems("test", c["eval_size"], seed=seed + 1)
    student = _load(student_path)
    teacher_acc = {k: _greedy_accuracy(make_teacher(k, student), tok, task, probe,
                                       task.max_new_tokens) for k in names}
    student_acc = _greedy_accuracy(student, tok, task, probe, task.max_new_tokens)
    print("student accuracy:", student_acc, "teacher accuracy:",
          {k: round(v, 3) for k, v in teacher_acc.items()}, flush=True)

    # 1. the diagnostic, once, over every teacher
    diag_teachers = {k: make_teacher(k, student) for k in names}
    t1 = time.perf_counter()
    report = diagnose(student, diag_teachers, task, tokenizer=tok, budget=c["budget"],
                      questions=c["questions"], samples_per_question=c["samples_per_question"],
                      top_k=c["top_k"], continuations=c["continuations"], seed=seed,
                      split="train", progress=False)
    diag_seconds = time.perf_counter() - t1
    print(report.table(), flush=True)

    # 2. fixed-length OPD runs per teacher (several seeds: a gain is a noisy number), all from
    #    the same student; seed s uses the same prompts and rollout seeds for every teacher
    runs: dict[str, dict[str, Any]] = {}
    scratch = tempfile.mkdtemp(prefix="teacher-ranking-")  # OPD checkpoints: not kept
    for name in report.teachers:
        per_seed = []
        for s in c["opd_seeds"]:
            student = _load(student_path)
            teacher = make_teacher(name, student)
            cfg = OPDConfig(output_dir=str(Path(scratch) / f"{name.replace(':', '_')}-{s}"),
                            batch_size=c["batch_size"], max_steps=c["opd_steps"],
                            learning_rate=c["learning_rate"], warmup_steps=4, eval_every=0,
                            eval_size=c["eval_size"], seed=seed + s, progress=False)
            trainer = OPDTrainer(cfg, student, teacher, task,
                                 HFEngine(student, tok, batch_size=256), tokenizer=tok)
            t2 = time.perf_counter()
            result = trainer.train()
            wall = time.perf_counter() - t2
            before, after = result.evals[0][1], result.evals[-1][1]
            per_seed.append({"seed": seed + s, "accuracy_before": before, "accuracy_after": after,
                             "gain": after - before, "train_seconds": trainer.train_seconds,
                             "wall_seconds": wall})
            print(f"OPD with {name} (seed {seed + s}): {before:.3f} -> {after:.3f} "
                  f"in {wall:.1f}s", flush=True)
        gains_ = [r["gain"] for r in per_seed]
        runs[name] = {
            "accuracy_before": float(np.mean([r["accuracy_before"] for r in per_seed])),
            "accuracy_after": float(np.mean([r["accuracy_after"] for r in per_seed])),
            "gain": float(np.mean(gains_)),
            "gain_sem": float(np.std(gains_, ddof=1) / np.sqrt(len(gains_))) if len(gains_) > 1
            else None,
            "train_seconds": per_seed[0]["train_seconds"],
            "wall_seconds": per_seed[0]["wall_seconds"],
            "seeds": per_seed}
    shutil.rmtree(scratch, ignore_errors=True)

    # 3. correlations across teachers
    names = report.teachers
    gains = [runs[n]["gain"] for n in names]
    score_values: dict[str, list[float | None]] = {}
    for score in SCORES:
        if score.startswith("alignment_"):
            outcome = score.split("_", 1)[1]
            vals = [report.summary[n]["by_outcome"][outcome]["alignment"]["mean"] for n in names]
        else:
            vals = [report.summary[n][score]["mean"] for n in names]
        if score.startswith("alignment"):
            # A teacher whose gradient is zero at every node (the copy) moves nothing: its
            # alignment is undefined (None in the report); for ranking it counts as 0.
            vals = [0.0 if v is None and report.summary[n]["zero_gradient_nodes"] else v
                    for n, v in zip(names, vals, strict=True)]
        score_values[score] = vals
    baseline = "teacher_accuracy (baseline, not a diagnostic score)"
    score_values[baseline] = [teacher_acc[n] for n in names]
    corr = {s: spearman(v, gains) for s, v in score_values.items()}
    # The practical question: does the top-scored teacher give the best OPD run? (For proxies
    # with no agreed direction, both ends are shown: highest-scored and lowest-scored.)
    best_gain = max(gains)
    picks: dict[str, dict[str, Any]] = {}
    for s_name, vals in score_values.items():
        known = [(v, n) for v, n in zip(vals, names, strict=True) if v is not None]
        if not known:
            continue
        hi, lo = max(known)[1], min(known)[1]
        picks[s_name] = {"highest": hi, "highest_regret": best_gain - runs[hi]["gain"],
                         "lowest": lo, "lowest_regret": best_gain - runs[lo]["gain"]}
    opd_train = sum(r["train_seconds"] for r in runs.values())
    opd_wall = sum(r["wall_seconds"] for r in runs.values())
    data = {
        "quick": quick, "config": c, "seed": seed, "machine": machine_info(torch.device("cpu")),
        "student_accuracy": student_acc, "build_seconds": build_seconds,
        "trajectory": traj,
        "teacher_accuracy": teacher_acc, "runs": runs,
        "diagnostic": {"seconds": diag_seconds, "stages": report.seconds, "counts": report.counts,
                       "rollouts_used": report.rollouts_used, "ranking": report.ranking(),
                       "summary": {n: {k: v for k, v in report.summary[n].items()
                                       if k != "per_question_alignment"} for n in names}},
        "scores": score_values, "spearman": corr, "picks": picks,
        "best_teacher_by_gain": names[int(np.argmax(gains))],
        "diagnostic_fraction_of_opd_train_seconds": diag_seconds / opd_train if opd_train else None,
        "diagnostic_fraction_of_opd_wall_seconds": diag_seconds / opd_wall if opd_wall else None,
    }
    stem = "teacher_ranking_quick" if quick else "teacher_ranking"
    clean = json.loads(json.dumps(data, default=float))
    for p in write_results(out_dir, stem, clean, _markdown(data)):
        print("wrote", p)
    return data


def _fmt(v: Any, digits: int = 3) -> str:
    return "—" if v is None else f"{v:+.{digits}f}" if isinstance(v, float) else str(v)


def _gain(r: dict[str, Any]) -> str:
    return _fmt(r["gain"]) + ("" if r.get("gain_sem") is None else f" ± {r['gain_sem']:.3f}")


def _ck(d: dict[str, Any], name: str) -> str:
    t = d["trajectory"][name]
    note = "" if t["reached"] else ", threshold not reached"
    return f"step {t['step']}, probe {t['probe_accuracy']:.2f}{note}"


def _markdown(d: dict[str, Any]) -> str:
    names = list(d["runs"])
    rows = [[n, f"{d['teacher_accuracy'][n]:.3f}", f"{d['runs'][n]['accuracy_before']:.3f}",
             f"{d['runs'][n]['accuracy_after']:.3f}", _gain(d["runs"][n])]
            + [_fmt(d["scores"][s][i]) for s in SCORES] for i, n in enumerate(names)]
    table = markdown_table(["teacher", "teacher acc", "student before", "after OPD", "gain",
                            *SCORES], rows)
    corr = markdown_table(
        ["score", "Spearman ρ vs gain", "highest-scored teacher (regret)",
         "lowest-scored teacher (regret)"],
        [[s, _fmt(v, 2),
          f"{d['picks'][s]['highest']} ({d['picks'][s]['highest_regret']:.3f})",
          f"{d['picks'][s]['lowest']} ({d['picks'][s]['lowest_regret']:.3f})"]
         for s, v in d["spearman"].items()])
    diag = d["diagnostic"]
    c, m = d["config"], d["machine"]
    return "\n".join([
        "# Teacher ranking: does the diagnostic predict the OPD gain?"
        + (" (quick)" if d["quick"] else ""),
        "",
        f"One training run from scratch on 2-digit addition (Qwen2, hidden 64, 2 layers; "
        f"`zoo.pretrain`), checkpointed the first time its greedy probe accuracy reached each "
        f"threshold: the student ({_ck(d, 'student')}), `short` ({_ck(d, 'short')}), `mid` "
        f"({_ck(d, 'mid')}) and `long` ({_ck(d, 'long')}) — teachers trained for different "
        f"lengths from the same start. `minus`: the student trained {c['minus_steps']} steps on "
        f"subtraction instead; `self:solution`: the student reading the worked solution before "
        f"the prompt; `copy`: the student itself (zero distillation gradient). "
        f"{len(names)} teachers; one diagnostic run "
        f"({c['questions']} questions × {c['samples_per_question']} rollouts, top-{c['top_k']} + "
        f"sampled, {c['continuations']} continuations per candidate, budget {c['budget']}: "
        f"{diag['rollouts_used']} rollouts, {diag['counts']['nodes']} nodes, "
        f"{diag['counts']['informative']} informative); then {c['opd_steps']} OPD steps "
        f"× {len(c['opd_seeds'])} seeds "
        f"(batch {c['batch_size']}, lr {c['learning_rate']}, reverse-KL PG) per teacher, gain = "
        f"held-out greedy accuracy after − before ({c['eval_size']} problems), mean ± s.e.m. "
        "over seeds; the student's own accuracy is measured on a separate probe.",
        "",
        table, "",
        "A teacher whose distillation gradient is zero at every node (`copy`) has no alignment "
        "(the report says `None` and counts zero-gradient nodes); here it counts as 0.", "",
        "Spearman correlation across teachers between each score and the realised gain "
        f"(n = {len(names)} teachers; the two-sided 5% critical value of Spearman's ρ is "
        "0.886 for n = 6 — a rank correlation over so few teachers is a coarse check):", "",
        corr, "",
        f"Best teacher by realised gain: `{d['best_teacher_by_gain']}`. Regret = best gain − "
        "the picked teacher's gain.", "",
        f"Diagnostic wall-clock: {diag['seconds']:.1f} s = "
        f"{d['diagnostic_fraction_of_opd_train_seconds']:.3f} of the OPD runs' training time "
        f"({sum(r['train_seconds'] for r in d['runs'].values()):.1f} s; "
        f"{d['diagnostic_fraction_of_opd_wall_seconds']:.3f} of their wall-clock with evaluation).",
        "",
        f"Machine: {m.get('cpu_model')}, {m.get('torch_threads')} torch threads, shared with "
        f"other jobs; torch {m['torch']}; commit {m['git_commit']}.",
    ])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="smoke test: tiny settings")
    parser.add_argument("--output_dir", default=os.path.join(os.path.dirname(__file__), "results"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (1: fastest for these tiny models on a shared CPU)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    run(args.quick, args.output_dir, args.seed)
    return 0


if __name__ == "__main__":
    sys.exit(main())
