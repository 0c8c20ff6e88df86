"""OPD step time and the share of it spent waiting for the teacher: in process vs served by
``vllm serve`` at two concurrency levels (``--teacher_max_inflight``), side by side in one run.

One student, one teacher, one batch layout: each condition is its own ``OPDTrainer`` (same
seed, same prompts) whose teacher is wrapped in a timer; the conditions take turns step by step
(rotating order), so load drift hits all alike. "teacher wait" is the wall time inside
``Teacher.score`` (the in-process forward, or the HTTP requests until the last answer).

    /work/venvs/vllm-cpu/bin/python -m benchmarks.teacher_server           # a few minutes
    /work/venvs/vllm-cpu/bin/python -m benchmarks.teacher_server --quick   # smoke run
    /work/venvs/vllm-cpu/bin/python -m benchmarks.teacher_server --parity  # ~20 minutes

``--parity``: does a run with the served teacher train the student to the accuracy the
in-process teacher does? A same-base pair of the zoo's ``small`` shapes (one model pretrained
on the task: its checkpoint at ``--student-steps`` is the student, at ``--teacher-steps`` the
teacher), then ``lookahead-opd train`` with ``--teacher DIR`` and with ``--teacher_url`` from
the same seed, for each of ``--seeds``. Results: teacher_server_parity<suffix>.{json,md},
written after every run; a rerun resumes (``--fresh`` starts over).

Needs vLLM (on CPU: the vllm-cpu venv, .ci/vllm-cpu). Models: a student and a teacher of the
zoo's ``small`` shapes (4 heads of 32, which vLLM's CPU attention accepts), randomly
initialised with different seeds (step time does not depend on what they learned; random
completions run to the length limit, so every step scores the same number of tokens), or
``--student DIR --teacher DIR``. The server runs on the same machine: on CPU it competes with
the trainer for the cores, so this measures the protocol's cost on one box, not a GPU node.
Results: benchmarks/results/teacher_server<suffix>.{json,md}.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse  # noqa: E402
import json  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402

from benchmarks.common import (  # noqa: E402
    QuickParser,
    machine_info,
    previous_results,
    stats,
    write_results,
)


def parse_args() -> argparse.Namespace:
    p = QuickParser(__doc__, "smoke run: few steps")
    p.add_argument("--student", default=None, help="a saved student directory")
    p.add_argument("--teacher", default=None, help="a saved teacher directory (served too)")
    p.add_argument("--batch", type=int, default=32, help="prompts per OPD step")
    p.quick_option("--steps", 20, 3, "timed steps per condition")
    p.add_argument("--inflight", type=int, nargs=2, default=[1, 8],
                   help="the two --teacher_max_inflight levels")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--parity", action="store_true", help="the accuracy study (see above)")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="--parity: OPD seeds")
    p.add_argument("--opd-steps", type=int, default=100, help="--parity: OPD steps per run")
    p.add_argument("--lr", default="1e-4", help="--parity: OPD learning rate (100-step pilots "
                   "from seed 0, student 50%%: 1e-4 → 73%%, 3e-4 → 69%%, 1e-3 → 31.5%%)")
    p.add_argument("--student-steps", type=int, default=500, help="--parity: pretraining steps")
    p.add_argument("--teacher-steps", type=int, default=1000, help="--parity: pretraining steps")
    p.add_argument("--pair-dir", default=None, help="--parity: where the pair is kept (reused)")
    p.add_argument("--fresh", action="store_true", help="--parity: ignore earlier results")
    p.add_output_args()
    return p.parse_args()


def save_models(workdir: Path, seed: int) -> tuple[Path, Path, dict[str, Any]]:
    """A student (``seed``) and a teacher (``seed + 1``) of the zoo's ``small`` shapes."""
    from lookahead_opd.integrations.opd import zoo
    from lookahead_opd.integrations.opd.tokenizer import char_tokenizer

    tokenizer = char_tokenizer()
    paths = []
    for role, s in (("student", seed), ("teacher", seed + 1)):
        model = zoo.make_model(tokenizer, "small", s)
        model.save_pretrained(workdir / role)
        tokenizer.save_pretrained(workdir / role)
        paths.append(workdir / role)
    shape = zoo.ZOO_SIZES["small"]
    params = sum(p.numel() for p in model.parameters())
    return paths[0], paths[1], {"source": "zoo 'small' shapes, random init", "config": shape,
                                "parameters": params}


def make_timed(teacher: Any) -> Any:
    """``teacher`` (a ``Teacher``) with the wall seconds of every ``score`` summed in
    ``.seconds``."""
    from lookahead_opd.integrations.opd.teacher import Teacher

    class Timed(Teacher):
        def __init__(self) -> None:
            self.inner, self.vocab_size, self.seconds = teacher, teacher.vocab_size, 0.0

        @property
        def capability(self):
            return self.inner.capability

        def score(self, *args: Any, **kwargs: Any):
            t0 = time.perf_counter()
            try:
                return self.inner.score(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - t0

        def close(self) -> None:
            self.inner.close()

    return Timed()


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    if args.parity:
        return parity(args)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from lookahead_opd.integrations.opd.config import OPDConfig
    from lookahead_opd.integrations.opd.engines import HFEngine
    from lookahead_opd.integrations.opd.served import VLLMServer, connect
    from lookahead_opd.integrations.opd.tasks import load_task
    from lookahead_opd.integrations.opd.teacher import ModelTeacher
    from lookahead_opd.integrations.opd.trainer import OPDTrainer

    work = Path(tempfile.mkdtemp(prefix="teacher-server-"))
    if args.student and args.teacher:
        student_dir, teacher_dir = Path(args.student), Path(args.teacher)
        models = {"source": "given", "student": args.student, "teacher": args.teacher}
    else:
        student_dir, teacher_dir, models = save_models(work, args.seed)
    tokenizer = AutoTokenizer.from_pretrained(student_dir)
    task = load_task("arithmetic")
    max_len = 64
    server_args = ["--dtype", "float32", "--max-model-len", str(max_len), "--enforce-eager",
                   "--kv-cache-memory-bytes", str(256 * 2**20)]
    conditions = ["in-process", *(f"served, inflight {k}" for k in args.inflight)]
    raw: dict[str, dict[str, list[float]]] = {c: {"step_s": [], "wait_s": []} for c in conditions}
    t_start = time.perf_counter()
    with VLLMServer(teacher_dir, args=server_args, log=work / "serve.log") as server:
        trainers = {}
        for i, cond in enumerate(conditions):
            config = OPDConfig(output_dir=str(work / f"run{i}"), batch_size=args.batch,
                               max_steps=10**6, learning_rate=1e-4, eval_every=0, progress=False,
                               seed=args.seed, teacher_max_inflight=args.inflight[max(i - 1, 0)])
            student = AutoModelForCausalLM.from_pretrained(student_dir).float()
            if cond == "in-process":
                model = AutoModelForCausalLM.from_pretrained(teacher_dir).float().eval()
                inner = ModelTeacher(model, len(tokenizer))
            else:
                inner = connect([server.url], config, tokenizer,
                                [p.prompt for p in task.problems("train", seed=args.seed)],
                                config.max_new_tokens or task.max_new_tokens)
            trainers[cond] = OPDTrainer(config, student, make_timed(inner), task,
                                        HFEngine(student, tokenizer), tokenizer=tokenizer)
        for t in trainers.values():  # warm-up step: first-call allocations, vLLM's first batch
            t.train_step()
        for k in range(args.steps):
            order = conditions[k % len(conditions):] + conditions[:k % len(conditions)]
            for cond in order:
                t = trainers[cond]
                before = t.teacher_scorer.seconds
                t0 = time.perf_counter()
                m = t.train_step()
                raw[cond]["step_s"].append(time.perf_counter() - t0)
                raw[cond]["wait_s"].append(t.teacher_scorer.seconds - before)
                raw[cond].setdefault("tokens", []).append(m["num_tokens"])
        for t in trainers.values():
            t.teacher_scorer.close()
    res: dict[str, Any] = {
        "machine": machine_info(torch.device("cpu")), "models": models, "batch": args.batch,
        "steps": args.steps, "inflight": args.inflight, "server_args": server_args,
        "wall_s": time.perf_counter() - t_start, "conditions": {}}
    for cond, d in raw.items():
        share = [w / s for w, s in zip(d["wait_s"], d["step_s"], strict=True)]
        rest = [s - w for w, s in zip(d["wait_s"], d["step_s"], strict=True)]
        res["conditions"][cond] = {**d, "step": stats(d["step_s"], ci=True),
                                   "wait": stats(d["wait_s"]), "share": stats(share),
                                   "rest": stats(rest),
                                   "tokens": stats(d["tokens"])}
    md = render(res)
    print(md)
    if not args.no_write:
        for path in write_results(args.output_dir, f"teacher_server{args.suffix}", res, md):
            print("wrote", path)


def render(res: dict[str, Any]) -> str:
    m, conds = res["machine"], res["conditions"]
    base = conds["in-process"]["step"]["median"]
    rows = []
    for cond, c in conds.items():
        rows.append([cond, f"{c['step']['median']:.3f} ({c['step']['ci_lo']:.3f}-"
                           f"{c['step']['ci_hi']:.3f})",
                     f"{c['wait']['median']:.3f}", f"{c['share']['median']:.0%}",
                     f"{c['rest']['median']:.3f}",
                     f"{c['step']['median'] / base:.2f}x", f"{c['tokens']['median']:.0f}"])
    load = ", ".join(f"{x:.1f}" for x in m.get("loadavg_at_start", ())) or "unknown"
    names = list(conds)
    lo, hi = names[1], names[2]
    findings = "\n".join([
        f"- Served, a step took {conds[lo]['step']['median'] / base:.2f}x the in-process one with "
        f"{res['inflight'][0]} request(s) in flight and {conds[hi]['step']['median'] / base:.2f}x "
        f"with {res['inflight'][1]}: the teacher wait went from "
        f"{conds['in-process']['wait']['median']:.3f} s in process to "
        f"{conds[lo]['wait']['median']:.3f} s and {conds[hi]['wait']['median']:.3f} s.",
        f"- The rest of the step stayed {conds['in-process']['rest']['median']:.3f} / "
        f"{conds[lo]['rest']['median']:.3f} / {conds[hi]['rest']['median']:.3f} s: the "
        f"difference is the wait for the teacher.",
        "- The server runs the same forward as the in-process teacher, so at this size the "
        "served wait is mostly per-request cost (one request per rollout row: HTTP, vLLM's "
        "scheduling), which more requests in flight overlap. A served teacher is for a "
        "teacher that does not fit beside the student, not for speed on a model this small."])
    model = res["models"]
    desc = (f"{model.get('parameters', '?'):,}-parameter Qwen2 student and teacher "
            f"({model['source']})" if model["source"] != "given" else
            f"student {model['student']}, teacher {model['teacher']}")
    return f"""# The teacher in process vs behind `vllm serve`

{m['cpu_count']} CPU cores ({m['cpu_model']}), torch {m['torch']}, 1 torch thread; {desc};
batch {res['batch']} prompts, {res['steps']} timed OPD steps per condition after one warm-up,
the conditions taking turns step by step. Server flags: `{' '.join(res['server_args'])}`.
{m['date']}, commit {m['git_commit']}. Run took {res['wall_s']:.0f} s.

| teacher | seconds / OPD step, median (95% CI) | teacher wait / step | wait share | rest of the step | step vs in-process | completion tokens / step |
|---|---|---|---|---|---|---|
{chr(10).join('| ' + ' | '.join(r) + ' |' for r in rows)}

"teacher wait": wall time inside `Teacher.score` (the forward pass in process; for the served
teacher, from the first request sent to the last answer read: one request per rollout row, at
most `--teacher_max_inflight` in flight). The server shares this machine's CPU cores with the
trainer ("rest of the step": the rollout, the student's forward and backward and the update);
on a GPU node the teacher has its own device (docs/gpu.md). Load average at the start:
{load}.

## What this means

{findings}

Reproduce: `{m['command']}` (repo root, in the vllm-cpu venv).
"""


# --------------------------------------------------------------------------- --parity


def same_base_pair(root: Path, args: argparse.Namespace) -> dict[str, Any]:
    """One ``small`` model pretrained on arithmetic: saved at ``student_steps`` (the student)
    and at ``teacher_steps`` (the teacher); reused when ``root`` holds them."""
    from lookahead_opd.integrations.opd import zoo
    from lookahead_opd.integrations.opd.tasks import load_task
    from lookahead_opd.integrations.opd.tokenizer import char_tokenizer

    info_path = root / "pair.json"
    if info_path.exists():
        return json.loads(info_path.read_text())
    tokenizer, task = char_tokenizer(), load_task("arithmetic")
    model = zoo.make_model(tokenizer, "small", args.seed + 1)
    test = task.problems("test", 200, seed=0)
    info: dict[str, Any] = {"config": zoo.ZOO_SIZES["small"]}
    done = 0
    for role, steps in (("student", args.student_steps), ("teacher", args.teacher_steps)):
        zoo.pretrain(model, tokenizer, task, steps=steps - done, seed=args.seed + done,
                     progress=False)
        done = steps
        model.save_pretrained(root / role)
        tokenizer.save_pretrained(root / role)
        info[role] = {"path": str(root / role), "pretrain_steps": steps,
                      "greedy_test_accuracy": zoo.greedy_accuracy(model, tokenizer, task, test)}
    info_path.write_text(json.dumps(info, indent=1))
    return info


def parity(args: argparse.Namespace) -> None:
    from lookahead_opd.integrations.opd.served import VLLMServer
    from lookahead_opd.integrations.opd.train import main as train

    stem = f"teacher_server_parity{args.suffix}"
    res = previous_results(args.output_dir, stem, fresh=args.fresh) or {"runs": {}}
    root = Path(args.pair_dir or tempfile.mkdtemp(prefix="served-parity-"))
    root.mkdir(parents=True, exist_ok=True)
    pair = same_base_pair(root, args)
    res.update(machine=machine_info(torch.device("cpu")), pair=pair, seeds=args.seeds,
               opd_steps=args.opd_steps)
    flags = ["--task", "arithmetic", "--loss", "reverse_kl_pg", "--learning_rate", args.lr,
             "--batch_size", "64", "--max_steps", str(args.opd_steps), "--eval_every",
             str(max(args.opd_steps // 4, 1)), "--eval_size", "200", "--no_progress"]
    server_args = ["--dtype", "float32", "--max-model-len", "64", "--enforce-eager",
                   "--kv-cache-memory-bytes", str(256 * 2**20)]
    res["flags"], res["server_args"] = flags, server_args
    with VLLMServer(pair["teacher"]["path"], args=server_args, log=root / "serve.log") as server:
        for seed in args.seeds:
            for cond, teacher in (("in-process", ["--teacher", pair["teacher"]["path"]]),
                                  ("served", ["--teacher_url", server.url])):
                key = f"{cond}/seed{seed}"
                if key in res["runs"]:
                    continue
                out = root / key.replace("/", "-")
                t0 = time.perf_counter()
                code = train(["--student", pair["student"]["path"], *teacher, *flags, "--seed",
                              str(seed), "--output_dir", str(out), "--overwrite_output_dir"])
                lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
                res["runs"][key] = {
                    "exit": code, "seconds": time.perf_counter() - t0,
                    "evals": [(m["step"], m["eval_accuracy"]) for m in lines
                              if "eval_accuracy" in m],
                    "loss": [m["loss"] for m in lines if "loss" in m]}
                write_results(args.output_dir, stem, res, render_parity(res))
    print(render_parity(res))


def render_parity(res: dict[str, Any]) -> str:
    m, pair, runs = res["machine"], res["pair"], res["runs"]
    rows, finals = [], {"in-process": [], "served": []}
    for seed in res["seeds"]:
        a, b = runs.get(f"in-process/seed{seed}"), runs.get(f"served/seed{seed}")
        if not (a and b):
            continue
        fa, fb = a["evals"][-1][1], b["evals"][-1][1]
        finals["in-process"].append(fa)
        finals["served"].append(fb)
        apart = next((i + 1 for i, (x, y) in enumerate(zip(a["loss"], b["loss"], strict=True))
                      if abs(x - y) > 1e-4), None)
        curve = " / ".join(f"{x[1]:.0%}→{y[1]:.0%}" for x, y in zip(a["evals"], b["evals"],
                                                                   strict=True))
        rows.append(f"| {seed} | {a['evals'][0][1]:.1%} | {fa:.1%} | {fb:.1%} | "
                    f"{apart or 'never'} | {curve} | {a['seconds']:.0f} / {b['seconds']:.0f} |")
    spread = {k: (f"{min(v):.1%}-{max(v):.1%}" if v else "-") for k, v in finals.items()}
    return f"""# Served vs in-process teacher: the accuracy an OPD run reaches

{m['cpu_count']} CPU cores ({m['cpu_model']}), torch {m['torch']}. A same-base pair of the zoo's `small` shapes (0.99M parameters): one model pretrained on arithmetic, the student its checkpoint at {pair['student']['pretrain_steps']} steps ({pair['student']['greedy_test_accuracy']:.1%} greedy test accuracy), the teacher at {pair['teacher']['pretrain_steps']} steps ({pair['teacher']['greedy_test_accuracy']:.1%}).

Each seed: `lookahead-opd train` with `--teacher DIR` and with `--teacher_url` (the same model behind `vllm serve {' '.join(res['server_args'])}`), flags `{' '.join(res['flags'])}`. {m['date']}, commit {m['git_commit']}.

| seed | accuracy at step 0 | final, in-process | final, served | first step whose losses differ by > 1e-4 | evals (in-process→served) | seconds (in-process / served) |
|---|---|---|---|---|---|---|
{chr(10).join(rows)}

Final accuracy over the seeds: in-process {spread['in-process']}, served {spread['served']}.
The teacher's log-probs agree to ~2e-6 both ways (tests/vllm_engine/test_served_teacher.py), so
the two runs of a seed take the same steps until a sampled token flips on a last-digit
difference; from there on they are two samples of the same run, and the seed spread is the
yardstick.

Reproduce: `{m['command']}` (repo root, in the vllm-cpu venv).
"""


if __name__ == "__main__":
    main()
