"""Peak memory and time of one full-vocabulary loss forward + backward: the dense loss (both
models' logits materialised), the chunked one (``--loss_chunk_size``: final hidden states and
the ``lm_head`` projected a chunk of completion rows at a time, recomputed in the backward) and
TRL's ``_chunked_divergence_loss`` (trl is a dependency of the ``trl`` extra).

The loss is the reverse KL (TRL's ``beta=1``) of a student ``lm_head`` (trainable, its gradient
included) against a teacher ``lm_head`` on ``N`` completion tokens of random final hidden states,
at SmolLM2's shape (hidden 576, vocab 49,152) and Qwen2.5-0.5B's (hidden 896, vocab 151,936).
Each configuration runs in its own process, since a process's peak RSS only grows: "loss peak"
is the peak RSS during the loss minus the RSS before it (inputs and weights allocated). A
method is only run where its expected peak (``_expected_bytes``, from its smaller sizes) stays
under ``--max_gib``, so this benchmark never takes a shared machine's
memory; elsewhere its expected peak is reported, marked as not measured. Then, where all three
methods were measured, each is timed ``--repeats`` more times, alternating, each run in a fresh
process (the median is reported: the machine is shared). Last, an OPD run on the zoo pair
(``build_pair()``: arithmetic, tiny, same-base; fp32, same seed) with and without chunking:
its per-step metrics and gate decisions side by side.

    OMP_NUM_THREADS=1 python -m benchmarks.loss_memory          # ~45 min on one CPU thread
    python -m benchmarks.loss_memory --smoke --out /tmp/lm        # small sizes, no zoo run

Results go to benchmarks/results/loss_memory.{json,md}, rewritten after every run; a rerun
continues where the last one stopped (``--fresh`` starts over).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks import harness
from benchmarks.common import markdown_table

ROOT = Path(__file__).resolve().parents[1]  # the children run from the repo root
SHAPES = {"smollm2": (576, 49152), "qwen2.5": (896, 151936)}
METHODS = ("dense", "chunked", "trl")
GIB = 2**30


def _rss_peak_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def _loss(method: str, hs: torch.Tensor, ht: torch.Tensor, ws: torch.Tensor, wt: torch.Tensor,
          chunk: int) -> torch.Tensor:
    from lookahead_opd.integrations.opd.logits import NextTokenLogits, OutputHead
    from lookahead_opd.integrations.opd.losses import reverse_kl_loss

    n, vocab = hs.shape[0], ws.shape[0]
    mask = torch.ones(1, n, dtype=torch.bool)
    if method == "dense":
        with torch.no_grad():
            teacher = (ht @ wt.T)[None]
        return reverse_kl_loss((hs @ ws.T)[None], teacher, mask).loss
    if method == "chunked":
        student = NextTokenLogits(hs[None], OutputHead(ws, vocab_size=vocab), chunk)
        teacher = NextTokenLogits(ht[None], OutputHead(wt, vocab_size=vocab), chunk)
        return reverse_kl_loss(student, teacher, mask).loss
    from trl.trainer.distillation_trainer import _chunked_divergence_loss

    return _chunked_divergence_loss(hs[None], ht[None], ws, wt, mask, beta=1.0)[0]


def run_one(method: str, shape: str, tokens: int, chunk: int) -> dict[str, Any]:
    """One loss forward + backward in this process: its peak memory, time and value."""
    hidden, vocab = SHAPES[shape]
    g = torch.Generator().manual_seed(0)
    # Scaled as trained heads are (logits of a few units), so the softmaxes are not one-hot.
    hs = (torch.randn(tokens, hidden, generator=g) / hidden**0.5).requires_grad_(True)
    ht = torch.randn(tokens, hidden, generator=g) / hidden**0.5
    ws = torch.randn(vocab, hidden, generator=g).requires_grad_(True)
    wt = torch.randn(vocab, hidden, generator=g)
    if method == "trl":
        import trl.trainer.distillation_trainer  # noqa: F401 - imported before the baseline
    before = _rss_peak_bytes()
    t0 = time.perf_counter()
    loss = _loss(method, hs, ht, ws, wt, chunk)
    loss.backward()
    seconds = time.perf_counter() - t0
    return {"method": method, "shape": shape, "hidden": hidden, "vocab": vocab, "tokens": tokens,
            "chunk": chunk if method == "chunked" else None, "seconds": seconds,
            "loss_peak_bytes": _rss_peak_bytes() - before, "rss_peak_bytes": _rss_peak_bytes(),
            "loss": float(loss.detach()), "grad_hidden_norm": float(hs.grad.norm()),
            "grad_weight_norm": float(ws.grad.norm()), "measured": True}


def _key(r: dict[str, Any]) -> str:
    return f"{r['shape']}/{r['tokens']}/{r['method']}"


def _bytes_per_logit(done: dict[str, dict[str, Any]], method: str) -> float | None:
    """A method's measured peak per logit (the largest over measured sizes)."""
    per = [r["loss_peak_bytes"] / (r["tokens"] * r["vocab"]) for r in done.values()
           if r["method"] == method and r["measured"]]
    return max(per) if per else None


def _expected_bytes(done: dict[str, dict[str, Any]], method: str, shape: str,
                    tokens: int) -> float | None:
    """A method's expected loss peak at ``tokens``: the line through its two largest measured
    sizes at this shape (a chunked loss's peak hardly grows with the tokens), else its largest
    measured bytes per logit (at this shape if measured there) × N × V (the dense losses grow
    with N × V)."""
    points = sorted((r["tokens"], r["loss_peak_bytes"]) for r in done.values()
                    if r["method"] == method and r["shape"] == shape and r["measured"])
    if len(points) >= 2:
        (n0, b0), (n1, b1) = points[-2:]
        return b1 + max(0.0, (b1 - b0) / (n1 - n0)) * (tokens - n1)
    same_shape = {k: r for k, r in done.items() if r["shape"] == shape}
    per_logit = _bytes_per_logit(same_shape, method) or _bytes_per_logit(done, method)
    return None if per_logit is None else per_logit * tokens * SHAPES[shape][1]


def _child(method: str, shape: str, tokens: int, chunk: int) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "benchmarks.loss_memory", "--chunk", str(chunk),
           "--one", method, shape, str(tokens)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env, cwd=ROOT)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _median(values: list[float]) -> float:
    v = sorted(values)
    return v[len(v) // 2] if len(v) % 2 else (v[len(v) // 2 - 1] + v[len(v) // 2]) / 2


def _seconds(r: dict[str, Any]) -> float:
    """The median of the run's timings (the memory run and the timing repeats)."""
    return _median([r["seconds"], *r.get("repeat_seconds", [])])


def zoo_comparison(steps: int, chunk: int) -> dict[str, Any]:
    """An OPD run on the zoo pair with and without chunking (fp32, same seed): the per-step
    metrics, the evaluations and the gate's decisions of both."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from lookahead_opd.demo.zoo import build_pair
    from lookahead_opd.integrations.opd.config import OPDConfig
    from lookahead_opd.integrations.opd.engines import HFEngine
    from lookahead_opd.integrations.opd.tasks import load_task
    from lookahead_opd.integrations.opd.trainer import OPDTrainer

    pair = build_pair(progress=False)
    runs, scratch = {}, tempfile.mkdtemp(prefix="loss-memory-")
    for size in (0, chunk):
        tok = AutoTokenizer.from_pretrained(pair.student_path)
        student = AutoModelForCausalLM.from_pretrained(pair.student_path).float()
        teacher = AutoModelForCausalLM.from_pretrained(pair.teacher_path).float()
        config = OPDConfig(output_dir=scratch,
                           overwrite_output_dir=True, max_steps=steps, batch_size=64,
                           learning_rate=1e-3, loss="reverse_kl", extrapolate=True,
                           gate="neg_kl", gate_size=50, eval_every=steps // 2, eval_size=200,
                           progress=False, seed=0, loss_chunk_size=size, **harness.AS_RUN)
        engine = HFEngine(student, tok, batch_size=256)
        t0 = time.perf_counter()
        result = OPDTrainer(config, student, teacher, load_task("arithmetic"), engine,
                            tokenizer=tok).train()
        runs[size] = {"seconds": time.perf_counter() - t0, "evals": result.evals,
                      "metrics": [{k: m.get(k) for k in ("step", "loss", "reverse_kl",
                                                         "grad_norm", "reward", "num_tokens")}
                                  for m in result.metrics if "loss" in m],
                      "jumps": [{k: j[k] for k in ("step", "coefficients", "scores", "accepted")}
                                for j in result.jumps]}
    import shutil

    shutil.rmtree(scratch, ignore_errors=True)
    dense, chunked = runs[0], runs[chunk]
    rel = max(abs(c[k] - d[k]) / max(abs(d[k]), 1e-12)
              for d, c in zip(dense["metrics"], chunked["metrics"], strict=True)
              for k in ("loss", "reverse_kl", "grad_norm") if d[k] is not None)
    return {"pair": str(pair.student_path.parent), "steps": steps, "chunk": chunk,
            "dense": dense, "chunked": chunked, "max_rel_diff": rel,
            "same_evals": dense["evals"] == chunked["evals"],
            "same_decisions": [j["accepted"] for j in dense["jumps"]]
            == [j["accepted"] for j in chunked["jumps"]]}


def _seconds_cell(r: dict[str, Any]) -> str:
    if not r["measured"]:
        return "—"
    runs = [r["seconds"], *r.get("repeat_seconds", [])]
    return f"{_seconds(r):.1f}" + (f" (median of {len(runs)})" if len(runs) > 1 else "")


def _zoo_markdown(z: dict[str, Any]) -> list[str]:
    rows = [[d["step"], f"{d['loss']:.6f}", f"{c['loss']:.6f}", f"{d['reverse_kl']:.6f}",
             f"{c['reverse_kl']:.6f}"]
            for d, c in zip(z["dense"]["metrics"], z["chunked"]["metrics"], strict=True)]
    return [
        "", "## An OPD run on the zoo pair, with and without chunking", "",
        f"`{z['pair']}`: `OPDTrainer`, loss reverse_kl, EffOPD with the -KL gate, batch 64, "
        f"lr 1e-3, {z['steps']} steps, fp32, seed 0; `--loss_chunk_size 0` vs "
        f"`{z['chunk']}`. Largest relative difference of a step's loss, reverse KL or gradient "
        f"norm: **{z['max_rel_diff']:.1e}**; evaluations identical: **{z['same_evals']}** "
        f"({z['dense']['evals']} vs {z['chunked']['evals']}); gate decisions identical: "
        f"**{z['same_decisions']}** (accepted {[j['accepted'] for j in z['dense']['jumps']]} "
        f"vs {[j['accepted'] for j in z['chunked']['jumps']]}). Seconds: "
        f"{z['dense']['seconds']:.0f} dense, {z['chunked']['seconds']:.0f} chunked.", "",
        markdown_table(["step", "loss (dense)", "loss (chunked)", "reverse KL (dense)",
                        "reverse KL (chunked)"], rows)]


def _markdown(a: argparse.Namespace, data: dict[str, Any]) -> str:
    rows, by = [], data["runs"]
    for shape in SHAPES:
        for tokens in data["tokens"]:
            dense = by.get(f"{shape}/{tokens}/dense")
            for method in METHODS:
                r = by.get(f"{shape}/{tokens}/{method}")
                if r is None:
                    continue
                peak = r["loss_peak_bytes"] / GIB
                peak_s = f"{peak:.3f}" if r["measured"] else f"~{peak:.1f} (expected, not measured)"
                ratio = (f"{dense['loss_peak_bytes'] / r['loss_peak_bytes']:.1f}×"
                         + ("" if dense["measured"] and r["measured"] else " (expected)")
                         if dense and method != "dense" else "")
                time_ratio = (f"{_seconds(r) / _seconds(dense):.2f}×"
                              if dense and dense["measured"] and r["measured"]
                              and method != "dense" else "")
                fits = ("no" if r["loss_peak_bytes"] + r.get("inputs_bytes", 0) > 24 * GIB
                        else "yes")
                rows.append([shape, f"{SHAPES[shape][0]} / {SHAPES[shape][1]}", tokens, method,
                             peak_s, ratio, _seconds_cell(r),
                             time_ratio, fits,
                             f"{r['loss']:.6f}" if r["measured"] else "—"])
    head = ["shape", "hidden / vocab", "tokens", "method", "loss peak GiB", "dense / this",
            "seconds", "this / dense time", "fits 24 GiB", "loss value"]
    info = data["machine"]
    return "\n".join([
        "# Peak memory of one full-vocabulary loss (forward + backward)",
        "",
        f"Command: `{info['command']}` (OMP_NUM_THREADS=1, one torch thread)  ",
        f"Machine: {info.get('cpu_model')}, {info.get('cpu_count')} cores (shared), torch "
        f"{info['torch']}, commit {info.get('git_commit')}, {info['date']}",
        "",
        *_headline(data),
        "Reverse KL of a trainable student `lm_head` against a teacher `lm_head` on N completion "
        "tokens (random final hidden states; the student head's weight gradient included). "
        "*loss peak* = peak RSS during the loss minus the RSS before it; each row is its own "
        "process. *chunked* is `--loss_chunk_size "
        f"{data['chunk']}` (`NextTokenLogits` + `OutputHead`: the completion rows projected "
        f"{data['chunk']} at a time, each chunk's gradient taken in its forward, so the backward "
        "recomputes nothing); *trl* is "
        "`trl.trainer.distillation_trainer._chunked_divergence_loss(beta=1)` "
        f"(trl {data.get('trl_version')}; on CPU it projects every position in tiles of 4096 "
        "tokens × 32768 vocabulary, its compact path being Triton's). Rows marked *expected* "
        "were not run: their peak is the line through the method's two largest measured sizes "
        "at that shape, or, with one, its largest measured bytes per logit (at that shape if "
        f"measured there) × N × V ({_per_logit_text(data)}), over this benchmark's "
        f"{data['max_gib']} GiB limit. *fits 24 GiB*: the loss peak plus its inputs (hidden "
        "states, both heads and the weight gradient). *seconds*: the median over fresh "
        "processes, alternating the methods. RSS counts what the allocator keeps: glibc may serve "
        "blocks under 32 MiB from its heap (its dynamic mmap threshold), so at vocab 49,152 (a "
        "128-row chunk is 24 MiB) the "
        "chunked peak includes retained heap.",
        "",
        markdown_table(head, rows),
        "",
        "The machine is shared with other jobs, so single timings vary; the loss values of "
        "the three methods agree (same inputs, same seed).",
        *(_zoo_markdown(data["zoo"]) if data.get("zoo") else []),
    ])


def _headline(data: dict[str, Any]) -> list[str]:
    """The issue's question at 4k tokens × 152k vocabulary, when those rows exist."""
    by = data["runs"]
    dense, chunked, trl = (by.get(f"qwen2.5/4096/{m}") for m in METHODS)
    if not (dense and chunked and chunked["measured"]):
        return []
    line = (f"**At 4,096 tokens × 151,936 vocabulary:** chunked "
            f"{chunked['loss_peak_bytes'] / GIB:.2f} GiB measured, dense "
            f"{'~' if not dense['measured'] else ''}{dense['loss_peak_bytes'] / GIB:.1f} GiB "
            f"{'expected (not measured)' if not dense['measured'] else 'measured'}: "
            f"**{dense['loss_peak_bytes'] / chunked['loss_peak_bytes']:.0f}× less**")
    if trl:
        line += (f"; TRL {'~' if not trl['measured'] else ''}{trl['loss_peak_bytes'] / GIB:.2f} "
                 f"GiB{'' if trl['measured'] else ' expected'}")
    return [line + ".", ""]


def _per_logit_text(data: dict[str, Any]) -> str:
    per = {m: _bytes_per_logit(data["runs"], m) for m in METHODS}
    return ", ".join(f"{m} {v:.1f} B" for m, v in per.items() if v is not None)


# --------------------------------------------------------------------------- the study


def options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tokens", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    p.add_argument("--chunk", type=int, default=128, help="chunked: rows per projection")
    p.add_argument("--max_gib", type=float, default=8.0,
                   help="run the dense loss only where its expected peak is below this")
    p.add_argument("--repeats", type=int, default=2,
                   help="timing runs per method where all three were measured")
    p.add_argument("--zoo_steps", type=int, default=20, help="0: no zoo OPD comparison")


def prepare(a: argparse.Namespace, store: harness.Store) -> None:
    """The settings into the json; configurations only expected so far are decided again."""
    import trl

    store.data.update({"tokens": a.tokens, "chunk": a.chunk, "max_gib": a.max_gib,
                       "trl_version": trl.__version__})
    store.data.pop("bytes_per_logit", None)  # an earlier version's summary
    for key in [k for k, r in store.runs.items() if not r["measured"]]:
        del store.runs[key]


def jobs(a: argparse.Namespace, store: harness.Store, ctx: Any) -> list[tuple[str, Any]]:
    return [(f"{shape}/{tokens}/{method}", (store.runs, method, shape, tokens))
            for shape in a.shapes for tokens in a.tokens for method in a.methods]


def run(a: argparse.Namespace, ctx: Any, job: tuple[Any, str, str, int]) -> dict[str, Any]:
    """One configuration in a fresh process, or its expected peak where that is over the limit."""
    runs, method, shape, tokens = job
    hidden, vocab = SHAPES[shape]
    inputs = 4 * (2 * tokens * hidden + 3 * vocab * hidden)
    expected = _expected_bytes(runs, method, shape, tokens)
    if expected is not None and expected > a.max_gib * GIB:
        return {"method": method, "shape": shape, "hidden": hidden, "vocab": vocab,
                "tokens": tokens, "measured": False, "loss_peak_bytes": expected,
                "inputs_bytes": inputs}
    return {**_child(method, shape, tokens, a.chunk), "inputs_bytes": inputs}


def describe(key: str, r: dict[str, Any]) -> str:
    if not r["measured"]:
        return f"{key}: not run, expected {r['loss_peak_bytes'] / GIB:.1f} GiB"
    return (f"{key}: {r['loss_peak_bytes'] / GIB:.3f} GiB, {r['seconds']:.1f} s, "
            f"loss {r['loss']:.6f}")


def measure(a: argparse.Namespace, store: harness.Store, ctx: Any) -> None:
    """Timing repeats where all three methods were measured (fresh processes, the methods
    alternating), then the zoo OPD run with and without chunking."""
    runs = store.runs
    for shape in a.shapes:
        for tokens in a.tokens:
            keys = [f"{shape}/{tokens}/{m}" for m in METHODS]
            if not all(k in runs and runs[k]["measured"] for k in keys):
                continue
            for i in range(a.repeats):
                for method in METHODS if i % 2 else METHODS[::-1]:
                    r = runs[f"{shape}/{tokens}/{method}"]
                    if len(r.get("repeat_seconds", [])) > i:
                        continue
                    r.setdefault("repeat_seconds", []).append(
                        _child(method, shape, tokens, a.chunk)["seconds"])
                    print(f"{shape}/{tokens}/{method}: timed {r['repeat_seconds'][-1]:.1f} s",
                          flush=True)
                    STUDY.save(a, store)
    if a.zoo_steps and not store.data.get("zoo"):
        store.data["zoo"] = zoo_comparison(a.zoo_steps, chunk=16)
        print(f"zoo: max rel diff {store.data['zoo']['max_rel_diff']:.1e}", flush=True)


STUDY = harness.Study(
    "loss_memory", __doc__, _markdown, options=options,
    smoke=dict(tokens=[64, 128], shapes=["smollm2"], repeats=1, zoo_steps=0),
    prepare=prepare, jobs=jobs, run=run, describe=describe, measure=measure)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--one" in argv:  # the child process: one configuration, its record on stdout
        i = argv.index("--one")
        method, shape, tokens = argv[i + 1:i + 4]
        chunk = int(argv[argv.index("--chunk") + 1]) if "--chunk" in argv else 128
        torch.set_num_threads(1)
        print(json.dumps(run_one(method, shape, int(tokens), chunk)))
        return 0
    return STUDY.main(argv)


if __name__ == "__main__":
    raise SystemExit(main())
