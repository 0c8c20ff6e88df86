"""Does the training-free diagnostic know something a teacher's accuracy does not?

On the embedded arithmetic task (2-digit addition), one student — the zoo's ``tiny`` same-base
base — and teachers chosen so that accuracy could mislead (the protocol, fixed before the first
diagnostic run, is in ``docs/diagnostic.md`` → "The ranking protocol"):

``teacher``      the zoo teacher: the student trained further to ≥ 95% (same base);
``path-N``       checkpoints of that same SFT run N steps from the student (several distances);
``independent``  the zoo teacher of another initialisation (``teacher_regime="independent"``);
``sharp``        ``teacher`` with its logits scaled ×``sharpen`` (lm_head weights): the same
                 greedy answers, near one-hot;
``zeropad``      the student trained to ≥ 95% on zero-padded answers (``082``): accurate under
                 the task's checker, another solution format;
``minus``        the student trained on subtraction instead (skilled elsewhere);
``self:solution`` the student reading the worked solution first; ``copy`` the student itself.

1. the diagnostic (``diagnose``) scores every teacher, once per diagnostic seed;
2. one fixed-length OPD run (``OPDTrainer``, full-vocabulary reverse KL) per teacher and seed, all
   from the same student, appended to the results after every run (resumable: rerun the command);
3. Spearman ρ across teachers between each score and the realised gain, with a bootstrap over
   teachers and seeds; the regret of picking each score's top teacher; a paired bootstrap of
   ρ(diagnostic) − ρ(teacher accuracy); the diagnostic's cost as a fraction of the OPD runs.

    python -m benchmarks.teacher_ranking            # the committed results (~40 min, one thread)
    python -m benchmarks.teacher_ranking --smoke    # smoke test (~1 min), results not committed

Writes ``benchmarks/results/teacher_ranking.{json,md,png}`` (``teacher_ranking-smoke.*`` with
``--smoke``). Teachers are cached under ``$LOOKAHEAD_OPD_CACHE`` (see ``demo/zoo.py``).
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import math
import os
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from benchmarks import harness
from benchmarks.common import markdown_table

FULL = dict(
    # teachers
    path_steps=(25, 100, 400), sharpen=10.0, minus_steps=300, zeropad_max_steps=6000,
    teacher_min=0.95, quick_build=None,
    # diagnostic
    questions=64, samples_per_question=2, budget=8_000, top_k=4, continuations=8,
    diagnostic_seeds=(0, 1, 2),
    # OPD
    loss="reverse_kl", opd_steps=100, opd_seeds=(0, 1, 2), batch_size=256, learning_rate=1e-3,
    warmup_steps=4, eval_size=400,
    # analysis
    resamples=2000)
QUICK = dict(
    path_steps=(2, 4, 6), sharpen=10.0, minus_steps=4, zeropad_max_steps=4, teacher_min=0.0,
    quick_build=dict(base_steps=20, teacher_steps=10),
    questions=6, samples_per_question=2, budget=400, top_k=3, continuations=4,
    diagnostic_seeds=(0, 1),
    loss="reverse_kl", opd_steps=2, opd_seeds=(0, 1), batch_size=16, learning_rate=1e-3,
    warmup_steps=1, eval_size=40,
    resamples=200)
SCORES = ("alignment", "alignment_incorrect", "alignment_correct", "advantage", "reverse_kl",
          "js", "topk_overlap", "teacher_mass_topk")
ACCURACY = "teacher_accuracy"  # the baseline: what a leaderboard says
DIAGNOSTIC = ("alignment", "advantage")  # the diagnostic's own scores, compared with ACCURACY


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


def top_regret(scores: list[float], gains: list[float]) -> float:
    """Best gain − the gain of the top-scored teacher (ties: the mean over the tied ones, the
    expected regret of picking one of them at random)."""
    s = np.asarray(scores, dtype=np.float64)
    g = np.asarray(gains, dtype=np.float64)
    return float(g.max() - g[s == s.max()].mean())


# ---------------------------------------------------------------------------------------------
# teachers


def _save(model: torch.nn.Module, tok: Any, out: Path) -> None:
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    if out.exists():  # another process built it meanwhile
        shutil.rmtree(tmp, ignore_errors=True)
        return
    os.replace(tmp, out)


def _load(path: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _padded_task():
    """Addition whose worked answers are zero-padded to three digits (``5+3=008``): the task's
    checker reads the leading integer, so such answers count as correct."""
    from lookahead_opd.integrations.opd.tasks import ArithmeticTask

    class PaddedAddition(ArithmeticTask):
        def sft_text(self, problem):
            return problem.prompt + problem.answer.zfill(3)

    return PaddedAddition()


def _zoo_pairs(c: dict[str, Any], root: Path, seed: int) -> dict[str, Any]:
    """The zoo pairs the teachers come from: ``build_pair`` (same-base and independent);
    with ``--smoke`` a few-step stand-in of each, so the smoke test builds in seconds."""
    from lookahead_opd.demo.zoo import ZooPair, build_pair, make_model, pretrain

    if c["quick_build"] is None:
        return {"same-base": build_pair(seed=seed, progress=False),
                "independent": build_pair(teacher_regime="independent", seed=seed,
                                          progress=False)}
    from lookahead_opd.integrations.opd.tasks import ArithmeticTask
    from lookahead_opd.integrations.opd.tokenizer import char_tokenizer

    q, tok, task = c["quick_build"], char_tokenizer(), ArithmeticTask()
    out: dict[str, Any] = {}
    for kind, size, steps, fresh in (("same-base", "tiny", q["teacher_steps"], False),
                                     ("independent", "tiny", q["teacher_steps"], True)):
        base_path, teacher_path = root / f"quick-{kind}-student", root / f"quick-{kind}-teacher"
        if not (teacher_path / "config.json").is_file():
            base = make_model(tok, size, seed)
            pretrain(base, tok, task, steps=q["base_steps"], seed=seed, progress=False)
            _save(base, tok, base_path)
            teacher = make_model(tok, size, seed + 1000) if fresh else base
            pretrain(teacher, tok, task, steps=steps, seed=seed + 1, progress=False)
            _save(teacher, tok, teacher_path)
        out[kind] = ZooPair(base_path, teacher_path, {})
    return out


def _path_teachers(c: dict[str, Any], root: Path, tok: Any, student_path: Path, seed: int
                   ) -> dict[str, Path]:
    """path-N: the zoo teacher's own SFT run (same start, same data seed) stopped at N steps."""
    from lookahead_opd.demo.zoo import pretrain
    from lookahead_opd.integrations.opd.tasks import ArithmeticTask

    every = math.gcd(*c["path_steps"])
    model, step = _load(student_path).train(), [0]

    def keep(m: torch.nn.Module) -> bool:
        step[0] += every
        if step[0] in c["path_steps"]:
            _save(m, tok, root / f"path-{step[0]}")
        return step[0] >= max(c["path_steps"])

    pretrain(model, tok, ArithmeticTask(), steps=max(c["path_steps"]), seed=seed + 1,
             eval_every=every, stop=keep, progress=False)
    return {f"path-{n}": root / f"path-{n}" for n in c["path_steps"]}


def _other_teachers(c: dict[str, Any], root: Path, tok: Any, student_path: Path, teacher: Path,
                    seed: int, built: dict[str, Any]) -> dict[str, Path]:
    """sharp, zeropad and minus (``built`` gets zeropad's steps)."""
    from lookahead_opd.demo.zoo import pretrain
    from lookahead_opd.integrations.opd.scoring import model_accuracy as greedy_accuracy
    from lookahead_opd.integrations.opd.tasks import ArithmeticTask

    task = ArithmeticTask()
    probe = task.problems("test", 200, seed=seed)
    # sharp: the same teacher, logits × sharpen (Qwen2's lm_head has no bias)
    sharp = _load(teacher)
    with torch.no_grad():
        sharp.lm_head.weight.mul_(c["sharpen"])
    _save(sharp, tok, root / "sharp")
    # zeropad: the student trained on another answer format until the checker says >= 95%
    model = _load(student_path).train()
    built["zeropad_steps"] = pretrain(
        model, tok, _padded_task(), steps=c["zeropad_max_steps"], seed=seed + 2,
        eval_every=100 if c["quick_build"] is None else 2, progress=False,
        stop=lambda m: greedy_accuracy(m, tok, task, probe) >= c["teacher_min"])
    _save(model, tok, root / "zeropad")
    # minus: the student trained on subtraction instead
    model = _load(student_path).train()
    pretrain(model, tok, ArithmeticTask(ops="-"), steps=c["minus_steps"], seed=seed + 7,
             progress=False)
    _save(model, tok, root / "minus")
    return {"sharp": root / "sharp", "zeropad": root / "zeropad", "minus": root / "minus"}


def build_teachers(c: dict[str, Any], seed: int) -> tuple[Path, dict[str, Any], dict[str, Any]]:
    """Build (or load from the cache) every model teacher. Returns the student's path,
    name → model path (or ``None`` for ``self:solution`` and ``copy``, which are built around the
    student when used) and what was built (steps, accuracies on the way)."""
    from transformers import AutoTokenizer

    from lookahead_opd.integrations.model_sources import cache_root

    key = hashlib.sha256(json.dumps(
        {k: c[k] for k in ("path_steps", "sharpen", "minus_steps", "zeropad_max_steps",
                           "teacher_min", "quick_build")} | {"seed": seed},
        sort_keys=True).encode()).hexdigest()[:10]
    root = cache_root() / "teacher-ranking-v2" / key
    root.mkdir(parents=True, exist_ok=True)
    meta_path = root / "teachers.json"
    if meta_path.is_file():
        meta = json.loads(meta_path.read_text())
        return Path(meta["student"]), {k: v and Path(v) for k, v in meta["paths"].items()}, meta
    pairs = _zoo_pairs(c, root, seed)
    student_path = Path(pairs["same-base"].student_path)
    tok = AutoTokenizer.from_pretrained(student_path)
    built: dict[str, Any] = {"zoo": {k: {"student": str(p.student_path),
                                         "teacher": str(p.teacher_path),
                                         "accuracies": p.accuracies} for k, p in pairs.items()}}
    paths: dict[str, Path | None] = {"teacher": Path(pairs["same-base"].teacher_path)}
    paths.update(_path_teachers(c, root, tok, student_path, seed))
    paths["independent"] = Path(pairs["independent"].teacher_path)
    paths.update(_other_teachers(c, root, tok, student_path, paths["teacher"], seed, built))
    paths["self:solution"] = paths["copy"] = None
    meta = {"student": str(student_path), "paths": {k: v and str(v) for k, v in paths.items()},
            **built}
    meta_path.write_text(json.dumps(meta, indent=1))
    return student_path, paths, meta


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


# ---------------------------------------------------------------------------------------------
# the measurements (each appended to the results as soon as it exists)


def _protocol(c: dict[str, Any], seed: int) -> str:
    return hashlib.sha256(json.dumps({**c, "seed": seed}, sort_keys=True,
                                     default=str).encode()).hexdigest()[:12]


def _diagnostic_scores(report: Any, names: list[str]) -> dict[str, list[float | None]]:
    out: dict[str, list[float | None]] = {}
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
        out[score] = vals
    return out


class Teachers:
    """The student's path, the teachers' paths, and each teacher as a model (``self:solution``
    and ``copy`` built around a student)."""

    def __init__(self, c: dict[str, Any], seed: int) -> None:
        from transformers import AutoTokenizer

        from lookahead_opd.integrations.opd.tasks import SPLITS, ArithmeticTask

        self.student_path, self.paths, self.built = build_teachers(c, seed)
        self.tok = AutoTokenizer.from_pretrained(self.student_path)
        self.task = ArithmeticTask()
        self.problems = [p for s in SPLITS for p in self.task.all_problems(s)]
        self.names = list(self.paths)

    def student(self) -> torch.nn.Module:
        return _load(self.student_path)

    def teacher(self, name: str, student: torch.nn.Module) -> torch.nn.Module:
        from lookahead_opd.diagnostic import ContextTeacher

        if self.paths[name] is not None:
            return _load(self.paths[name])
        frozen = copy.deepcopy(student).eval()  # OPDTrainer freezes its teacher
        if name == "copy":
            return frozen
        return ContextTeacher.for_task(frozen, self.tok, self.task, self.problems, "solution")


def setup(a: argparse.Namespace, store: Any, t: Teachers, protocol: str) -> None:
    """What every run is measured against, once: the student's and every teacher's accuracy."""
    c, data = a.protocol_config, store.data
    probe = t.task.problems("test", c["eval_size"], seed=a.seed + 1)
    student = t.student()
    data.update({
        "quick": a.smoke, "protocol": protocol, "config": c, "seed": a.seed,
        "teachers": t.names, "built": t.built, "build_seconds": time.perf_counter() - a.start,
        "student_accuracy": _greedy_accuracy(student, t.tok, t.task, probe, t.task.max_new_tokens),
        ACCURACY: {n: _greedy_accuracy(t.teacher(n, student), t.tok, t.task, probe,
                                       t.task.max_new_tokens) for n in t.names}})
    print("student accuracy:", data["student_accuracy"], "teacher accuracy:",
          {k: round(v, 3) for k, v in data[ACCURACY].items()}, flush=True)


def diagnostic(a: argparse.Namespace, t: Teachers, ds: int) -> dict[str, Any]:
    """The diagnostic over every teacher, with diagnostic seed ``ds``."""
    from lookahead_opd.diagnostic import diagnose

    c, student = a.protocol_config, t.student()
    teachers = {n: t.teacher(n, student) for n in t.names}
    t1 = time.perf_counter()
    report = diagnose(student, teachers, t.task, tokenizer=t.tok, budget=c["budget"],
                      questions=c["questions"], samples_per_question=c["samples_per_question"],
                      top_k=c["top_k"], continuations=c["continuations"], seed=a.seed + ds,
                      split="train", loss=c["loss"], progress=False)
    seconds = time.perf_counter() - t1
    print(report.table(), flush=True)
    return {"seconds": seconds, "stages": report.seconds, "counts": report.counts,
            "rollouts_used": report.rollouts_used, "scores": _diagnostic_scores(report, t.names),
            "alignment_ci": {n: [report.summary[n]["alignment"]["ci_lo"],
                                 report.summary[n]["alignment"]["ci_hi"]] for n in t.names}}


def prepare(a: argparse.Namespace, store: Any) -> Teachers:
    """The teachers (built or cached), the accuracies, then the diagnostic once per diagnostic
    seed; an earlier json's measurements are kept when made under this protocol."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    a.start, a.protocol_config = time.perf_counter(), QUICK if a.smoke else FULL
    protocol = _protocol(a.protocol_config, a.seed)
    if store.old is not None and store.old.get("protocol") != protocol:
        raise SystemExit(f"{a.stem}: the json's measurements were made under another protocol; "
                         "write elsewhere with --out, or start over with --fresh")
    for key in ("quick", "protocol", "seed", "teachers", "built", "build_seconds",
                "student_accuracy", ACCURACY):
        if store.old is not None:
            store.data[key] = store.old[key]
    store.data["config"] = a.protocol_config
    t = Teachers(a.protocol_config, a.seed)
    if store.old is None:
        setup(a, store, t, protocol)
        STUDY.save(a, store)
    for ds in a.protocol_config["diagnostic_seeds"]:
        if str(ds) not in store.data["diagnostic"]:
            store.data["diagnostic"][str(ds)] = diagnostic(a, t, ds)
            STUDY.save(a, store)
    return t


def jobs(a: argparse.Namespace, store: Any, t: Teachers) -> list[tuple[str, Any]]:
    """OPD runs, seed-major: every teacher gets seed 0 before any gets seed 1."""
    return [(f"{n}|{a.seed + s}", (n, a.seed + s)) for s in a.protocol_config["opd_seeds"]
            for n in t.names]


def run(a: argparse.Namespace, t: Teachers, job: tuple[str, int]) -> dict[str, Any]:
    """One fixed-length OPD run with teacher ``name`` from the student: its gain."""
    from lookahead_opd.integrations.opd.engines import HFEngine
    from lookahead_opd.integrations.opd.trainer import OPDTrainer

    name, seed = job
    c, student = a.protocol_config, t.student()
    cfg = harness.opd_config(
        "teacher_ranking", f"{name.replace(':', '_')}-{seed}", loss=c["loss"],
        batch_size=c["batch_size"], max_steps=c["opd_steps"], learning_rate=c["learning_rate"],
        warmup_steps=c["warmup_steps"], eval_every=0, eval_size=c["eval_size"], seed=seed,
        device=a.device)
    trainer = OPDTrainer(cfg, student, t.teacher(name, student), t.task,
                         HFEngine(student, t.tok, batch_size=256), tokenizer=t.tok)
    t2 = time.perf_counter()
    result = trainer.train()
    wall = time.perf_counter() - t2
    before, after = result.evals[0][1], result.evals[-1][1]
    return {"teacher": name, "seed": seed, "accuracy_before": before,
            "accuracy_after": after, "gain": after - before,
            "train_seconds": trainer.train_seconds, "wall_seconds": wall}


# ---------------------------------------------------------------------------------------------
# analysis


def _score_table(data: dict[str, Any]) -> tuple[list[str], dict[str, np.ndarray]]:
    """Score name → [diagnostic seed, teacher] values (NaN where undefined); accuracy has one
    row. Proxies keep their sign: a negative ρ is reported as such."""
    names = data["teachers"]
    diag = [data["diagnostic"][k]["scores"] for k in sorted(data["diagnostic"])]
    table = {s: np.array([[np.nan if v is None else v for v in d[s]] for d in diag],
                         dtype=np.float64).reshape(len(diag), len(names)) for s in SCORES}
    table[ACCURACY] = np.array([[data[ACCURACY][n] for n in names]], dtype=np.float64)
    return names, table


def _nanmean_rows(a: np.ndarray) -> np.ndarray:
    """Column means over the rows that are known; NaN where none is."""
    known = ~np.isnan(a)
    count = known.sum(0)
    total = np.where(known, a, 0.0).sum(0)
    return np.where(count > 0, total / np.maximum(count, 1), np.nan)


def _rho(scores: np.ndarray, gains: np.ndarray) -> float:
    ok = ~np.isnan(scores)
    r = spearman(list(scores[ok]), list(gains[ok]))
    return np.nan if r is None else r


def runs_of(data: dict[str, Any]) -> list[dict[str, Any]]:
    """The OPD runs in the order they ran (a json before the harness's store kept a list)."""
    runs = data["runs"]
    return list(runs.values()) if isinstance(runs, dict) else runs


def _interval(x: np.ndarray) -> list[float] | None:
    """The 95% percentile interval of the resamples that are defined (None: under 10)."""
    x = x[~np.isnan(x)]
    return None if len(x) < 10 else [float(np.percentile(x, 2.5)), float(np.percentile(x, 97.5))]


def _bootstrap(data: dict[str, Any], table: dict[str, np.ndarray], have: list[int],
               gains: dict[str, np.ndarray], names_h: list[str]) -> tuple[dict, dict]:
    """ρ and the top pick's regret of every score on resamples of the teachers (with
    replacement) and, within each drawn teacher, of its OPD seeds and the diagnostic seeds."""
    rng = np.random.default_rng(data["seed"])
    B = data["config"]["resamples"]
    rhos = {s: np.full(B, np.nan) for s in table}
    regrets = {s: np.full(B, np.nan) for s in table}
    n = len(names_h)
    for b in range(B):
        pick = rng.integers(n, size=n)
        g = np.array([rng.choice(gains[names_h[i]], size=len(gains[names_h[i]])).mean()
                      for i in pick])
        for s, tab in table.items():
            rows = rng.integers(tab.shape[0], size=(tab.shape[0], n))
            v = _nanmean_rows(tab[rows, np.asarray(have)[pick]])
            rhos[s][b] = _rho(v, g)
            ok = ~np.isnan(v)
            if ok.any():
                regrets[s][b] = top_regret(list(v[ok]), list(g[ok]))
    return rhos, regrets


def _paired(scores_out: dict[str, Any], rhos: dict[str, np.ndarray]) -> dict[str, Any]:
    """ρ(diagnostic score) − ρ(accuracy) on the same resamples."""
    paired = {}
    for s in DIAGNOSTIC:
        if s not in rhos:
            continue
        d = rhos[s] - rhos[ACCURACY]
        both = ~np.isnan(d)
        interval = _interval(d)
        rho_d, rho_a = scores_out[s]["rho"], scores_out[ACCURACY]["rho"]
        paired[s] = {"difference": None if rho_d is None or rho_a is None else rho_d - rho_a,
                     "ci": interval, "resamples_used": int(both.sum()),
                     "p_le_0": float((d[both] <= 0).mean()) if both.any() else None,
                     "beats": bool(interval is not None and interval[0] > 0),
                     "loses": bool(interval is not None and interval[1] < 0)}
    return paired


def _cost(data: dict[str, Any], names_h: list[str]) -> dict[str, float]:
    """One diagnostic run against the OPD runs it replaces (one per teacher, one seed)."""
    diag_s = float(np.mean([d["seconds"] for d in data["diagnostic"].values()]))
    train = {n: np.mean([r["train_seconds"] for r in runs_of(data) if r["teacher"] == n])
             for n in names_h}
    wall = {n: np.mean([r["wall_seconds"] for r in runs_of(data) if r["teacher"] == n])
            for n in names_h}
    return {"diagnostic_seconds": diag_s, "opd_train_seconds": float(sum(train.values())),
            "opd_wall_seconds": float(sum(wall.values())),
            "fraction_of_train": diag_s / float(sum(train.values())),
            "fraction_of_wall": diag_s / float(sum(wall.values()))}


def _score_stats(point: dict[str, np.ndarray], table: dict[str, np.ndarray],
                 names_h: list[str], mean_gain: np.ndarray) -> dict[str, Any]:
    """Per score: its values, ρ with the mean gain, and the top and bottom picks' regrets (a
    score undefined for every teacher is dropped from ``point`` and ``table``)."""
    scores_out: dict[str, Any] = {}
    for s, v in list(point.items()):
        ok = ~np.isnan(v)
        if not ok.any():  # e.g. alignment on correct rollouts when none was correct
            del point[s], table[s]
            continue
        hi = [names_h[i] for i in np.flatnonzero(ok & (v == np.nanmax(v)))]
        lo = [names_h[i] for i in np.flatnonzero(ok & (v == np.nanmin(v)))]
        scores_out[s] = {
            "values": {n: (None if np.isnan(x) else float(x)) for n, x in zip(names_h, v,
                                                                             strict=True)},
            "rho": None if np.isnan(_rho(v, mean_gain)) else _rho(v, mean_gain),
            "top": hi, "top_regret": top_regret(list(v[ok]), list(mean_gain[ok])),
            "bottom": lo, "bottom_regret": top_regret(list(-v[ok]), list(mean_gain[ok]))}
    return scores_out


def analyse(data: dict[str, Any]) -> dict[str, Any]:
    """Gains per teacher (mean ± s.e.m. over seeds), Spearman ρ of every score with a bootstrap
    95% interval, the regret of each score's top pick, and the paired bootstrap of
    ρ(diagnostic) − ρ(accuracy). The bootstrap resamples teachers (with replacement) and, within
    each drawn teacher, its OPD seeds and the diagnostic seeds."""
    names, table = _score_table(data)
    if not runs_of(data) or not data["diagnostic"]:
        return {}
    per: dict[str, list[float]] = {n: [] for n in names}
    for r in runs_of(data):
        per[r["teacher"]].append(r["gain"])
    have = [i for i, n in enumerate(names) if per[n]]
    if len(have) < 3:
        return {}
    names_h = [names[i] for i in have]
    gains = {n: np.array(per[n]) for n in names_h}
    mean_gain = np.array([gains[n].mean() for n in names_h])
    out: dict[str, Any] = {
        "teachers": names_h,
        "gain": {n: {"mean": float(gains[n].mean()), "seeds": len(gains[n]),
                     "sem": float(gains[n].std(ddof=1) / math.sqrt(len(gains[n])))
                     if len(gains[n]) > 1 else None} for n in names_h}}
    point = {s: _nanmean_rows(table[s][:, have]) for s in table}
    out["best_teacher"] = names_h[int(np.argmax(mean_gain))]
    scores_out = _score_stats(point, table, names_h, mean_gain)
    rhos, regrets = _bootstrap(data, table, have, gains, names_h)
    for s in table:
        scores_out[s]["rho_ci"] = _interval(rhos[s])
        scores_out[s]["top_regret_ci"] = _interval(regrets[s])
    out["scores"] = scores_out
    out["paired"] = _paired(scores_out, rhos)
    out["cost"] = _cost(data, names_h)
    out["verdict"] = _verdict(out)
    return out


def _verdict(a: dict[str, Any]) -> str:
    if "alignment" not in a["paired"]:
        return "The diagnostic's alignment is undefined for every teacher: no verdict."
    p, s = a["paired"]["alignment"], a["scores"]
    acc, al = s[ACCURACY], s["alignment"]

    def r(x: dict[str, Any]) -> str:
        return _fmt(x["rho"], 2) + ("" if x["rho_ci"] is None else " " + _ci(x["rho_ci"]))

    diff = "—" if p["difference"] is None else f"{p['difference']:+.2f}"
    ci_ = "" if p["ci"] is None else f", paired 95% interval [{p['ci'][0]:+.2f}, {p['ci'][1]:+.2f}]"
    word = ("beats" if p["beats"] else "is beaten by" if p["loses"]
            else "does not beat")
    return (f"The diagnostic (alignment) {word} teacher accuracy at ranking these "
            f"{len(a['teachers'])} teachers: Spearman ρ with the realised gain {r(al)} against "
            f"{r(acc)} for accuracy, difference {diff}{ci_}.")


# ---------------------------------------------------------------------------------------------
# report


def _fmt(v: Any, digits: int = 3) -> str:
    return "—" if v is None else f"{v:+.{digits}f}" if isinstance(v, float) else str(v)


def _ci(v: list[float] | None, digits: int = 2) -> str:
    return "—" if v is None else f"[{v[0]:+.{digits}f}, {v[1]:+.{digits}f}]"


ABOUT = {
    "teacher": "the zoo teacher: the student's own base trained further (same-base)",
    "independent": "zoo teacher of another initialisation (trained from scratch)",
    "sharp": "`teacher` with logits ×{sharpen}: same greedy answers, near one-hot",
    "zeropad": "the student trained on zero-padded answers (`082`) to ≥ {teacher_min:.0%}",
    "minus": "the student trained {minus_steps} steps on subtraction instead",
    "self:solution": "the student reading the worked solution before the prompt",
    "copy": "the student itself (zero distillation gradient)",
}


def _about(name: str, c: dict[str, Any]) -> str:
    if name.startswith("path-"):
        return (f"the zoo teacher's SFT run stopped {name[5:]} steps from the student "
                "(same data order)")
    return ABOUT[name].format(**c)


def _teacher_table(d: dict[str, Any]) -> list[str]:
    c, a = d["config"], d.get("analysis") or {}
    g, sc, rows = a.get("gain", {}), a.get("scores", {}), []
    for n in d["teachers"]:
        gi = g.get(n)
        gain = "—" if gi is None else _fmt(gi["mean"]) + (
            "" if gi["sem"] is None else f" ± {gi['sem']:.3f}") + f" (n={gi['seeds']})"
        rows.append([f"`{n}`", _about(n, c), f"{d[ACCURACY][n]:.3f}", gain]
                    + [_fmt(sc[s]["values"].get(n)) if s in sc else "—"
                       for s in ("alignment", "advantage", "reverse_kl", "teacher_mass_topk")])
    return ["## Teachers and realised gains", "",
            markdown_table(["teacher", "what it is", "teacher acc", "OPD gain (± s.e.m.)",
                            "alignment", "advantage", "reverse_kl", "teacher_mass_topk"],
                           rows), ""]


def _analysis_lines(d: dict[str, Any], plot: str) -> list[str]:
    """Which score predicts the gain, the paired comparison, the cost (once analysed)."""
    c, a = d["config"], d.get("analysis") or {}
    sc = a.get("scores", {})
    if not sc:
        return []
    co = a["cost"]
    return [
        "## Which score predicts the gain?", "",
        f"Spearman ρ across the {len(a['teachers'])} teachers between each score and the "
        "mean gain; 95% interval from a bootstrap over teachers (with replacement) and, "
        "within each, its OPD seeds and diagnostic seeds "
        f"({c['resamples']} resamples). Regret = best mean gain (`{a['best_teacher']}`) − "
        "the gain of the top-scored teacher (ties: their mean); proxies have no agreed "
        "direction, so the lowest-scored pick is shown too.", "",
        markdown_table(
            ["score", "ρ vs gain", "95% interval", "top-scored (regret)",
             "regret 95% interval", "lowest-scored (regret)"],
            [[s + (" (baseline)" if s == ACCURACY else ""), _fmt(v["rho"], 2),
              _ci(v["rho_ci"]), f"{', '.join(v['top'])} ({v['top_regret']:.3f})",
              _ci(v["top_regret_ci"], 3),
              f"{', '.join(v['bottom'])} ({v['bottom_regret']:.3f})"]
             for s, v in sc.items()]), "",
        "## Paired comparison with teacher accuracy", "",
        "ρ(score) − ρ(teacher accuracy) on the same bootstrap resamples; the diagnostic "
        "\"beats\" accuracy only if the 95% interval excludes 0.", "",
        markdown_table(["score", "ρ difference", "95% interval", "share of resamples ≤ 0",
                        "verdict"],
                       [[s, _fmt(p["difference"], 2), _ci(p["ci"]),
                         "—" if p["p_le_0"] is None else f"{p['p_le_0']:.3f}",
                         "beats" if p["beats"] else "loses" if p["loses"]
                         else "no difference shown"] for s, p in a["paired"].items()]), "",
        "## Cost", "",
        f"One diagnostic run over all {len(d['teachers'])} teachers: "
        f"{co['diagnostic_seconds']:.1f} s (mean of {len(d['diagnostic'])} runs) = "
        f"**{co['fraction_of_train']:.3f}** of the training time of the OPD runs it replaces "
        f"(one per teacher, {co['opd_train_seconds']:.0f} s; {co['fraction_of_wall']:.3f} of "
        "their wall-clock with evaluation).", "",
        f"![gain against alignment and against teacher accuracy]({plot})", ""]


def report(a_: argparse.Namespace, d: dict[str, Any]) -> str:
    c, m = d["config"], d["machine"]
    a = d.get("analysis") or {}
    lines = ["# Teacher ranking: does the diagnostic know something teacher accuracy does not?"
             + (" (quick)" if d["quick"] else ""), ""]
    if a.get("verdict"):
        lines += [f"**{a['verdict']}**", ""]
    lines += [
        f"Student: the zoo `tiny` same-base base (greedy accuracy {d['student_accuracy']:.3f} "
        f"on {c['eval_size']} held-out problems). Protocol fixed before the first diagnostic run "
        "(docs/diagnostic.md, \"The ranking protocol\"): OPD with the full-vocabulary "
        f"`{c['loss']}` loss, {c['opd_steps']} steps × batch {c['batch_size']}, lr "
        f"{c['learning_rate']} (warmup {c['warmup_steps']}), from the same student for every "
        f"teacher, seeds {list(c['opd_seeds'])}; gain = greedy accuracy after − before on "
        f"{c['eval_size']} held-out problems. Diagnostic: {c['questions']} questions × "
        f"{c['samples_per_question']} rollouts, top-{c['top_k']} + sampled candidates, "
        f"{c['continuations']} continuations each, budget {c['budget']}, run once per "
        f"diagnostic seed {list(c['diagnostic_seeds'])}; scores are the mean over them. "
        f"Teacher accuracy (the baseline): greedy exact match on the same {c['eval_size']} "
        "problems.", "",
        *_teacher_table(d), *_analysis_lines(d, f"{a_.stem}.png"),
        f"{len(runs_of(d))} OPD runs recorded; per-run numbers in the JSON. Command: "
        f"`python -m benchmarks.teacher_ranking{' --smoke' if d['quick'] else ''}` "
        "(rerun it to resume).", "",
        f"Machine: {m.get('cpu_model')}, {m.get('torch_threads')} torch thread(s), shared "
        f"with other jobs; torch {m['torch']}; commit {m['git_commit']}."]
    return "\n".join(lines)


def plot(a_: argparse.Namespace, d: dict[str, Any]) -> None:
    """Mean gain (± s.e.m.) against alignment and against teacher accuracy, one point per
    teacher: where the two panels differ is what the diagnostic adds."""
    if not d.get("analysis"):
        return
    a = d["analysis"]
    names = a["teachers"]
    gain = [a["gain"][n]["mean"] for n in names]
    err = [a["gain"][n]["sem"] or 0.0 for n in names]
    with harness.figure(Path(a_.out) / f"{a_.stem}.png", 2, panel=(5, 4.2), dpi=120,
                        sharey=True) as (fig, axes):
        for ax, score in zip(axes[0], ("alignment", ACCURACY), strict=True):
            if score not in a["scores"]:
                continue
            x = [np.nan if (v := a["scores"][score]["values"][n]) is None else v for n in names]
            ax.errorbar(x, gain, yerr=err, fmt="o", capsize=3)
            for xi, yi, n in zip(x, gain, names, strict=True):
                ax.annotate(n, (xi, yi), textcoords="offset points", xytext=(4, 4), fontsize=8)
            v = a["scores"][score]
            ax.set_xlabel(f"{score} (ρ = {_fmt(v['rho'], 2)}, 95% {_ci(v['rho_ci'])})")
            ax.axhline(0, color="grey", lw=0.5)
            ax.grid(alpha=0.3)
        axes[0][0].set_ylabel("OPD gain in greedy accuracy (mean ± s.e.m.)")
        fig.suptitle("Realised OPD gain per teacher: the diagnostic vs the teacher's own accuracy")


STUDY = harness.Study(
    "teacher_ranking", __doc__, report,
    options=lambda p: p.add_argument("--seed", type=int, default=0),
    uses=("threads", "budget"), fields=dict(diagnostic=dict), prepare=prepare, jobs=jobs,
    run=run, summarize=lambda a, data: analyse(data), summary_key="analysis", plot=plot)
main = STUDY.main

if __name__ == "__main__":
    raise SystemExit(main())
