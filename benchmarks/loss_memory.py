"""Peak memory and time of one full-vocabulary loss forward + backward: the dense loss (both
models' logits materialised), the chunked one (``--loss_chunk_size``: final hidden states and
the ``lm_head`` projected a chunk of completion rows at a time, recomputed in the backward) and
TRL's ``_chunked_divergence_loss`` (trl is a dependency of the ``trl`` extra).

The loss is the reverse KL (TRL's ``beta=1``) of a student ``lm_head`` (trainable, its gradient
included) against a teacher ``lm_head`` on ``N`` completion tokens of random final hidden states,
at SmolLM2's shape (hidden 576, vocab 49,152) and Qwen2.5-0.5B's (hidden 896, vocab 151,936).
Each configuration runs in its own process, since a process's peak RSS only grows: "loss peak"
is the peak RSS during the loss minus the RSS before it (inputs and weights allocated). The
dense loss is only run where its expected peak (its measured bytes per logit at a smaller size
× N × V) stays under ``--max_gib``, so this benchmark never takes a shared machine's memory;
elsewhere its expected peak is reported, marked as not measured.

    OMP_NUM_THREADS=1 python -m benchmarks.loss_memory          # ~30 min on one CPU thread

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
import time
from typing import Any

import torch

try:  # python -m benchmarks.loss_memory
    from benchmarks.common import machine_info, markdown_table, previous_results, write_results
except ImportError:  # python benchmarks/loss_memory.py
    from common import (  # type: ignore[no-redef]
        machine_info,
        markdown_table,
        previous_results,
        write_results,
    )

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
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
    torch.set_num_threads(1)
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
            "loss": float(loss), "grad_hidden_norm": float(hs.grad.norm()),
            "grad_weight_norm": float(ws.grad.norm()), "measured": True}


def _key(r: dict[str, Any]) -> str:
    return f"{r['shape']}/{r['tokens']}/{r['method']}"


def _bytes_per_logit(done: dict[str, dict[str, Any]]) -> float | None:
    """The dense loss's measured peak per logit (the largest over measured sizes)."""
    per = [r["loss_peak_bytes"] / (r["tokens"] * r["vocab"]) for r in done.values()
           if r["method"] == "dense" and r["measured"]]
    return max(per) if per else None


def _markdown(data: dict[str, Any]) -> str:
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
                         + ("" if dense["measured"] else " (vs expected)")
                         if dense and method != "dense" else "")
                time_ratio = (f"{r['seconds'] / dense['seconds']:.2f}×"
                              if dense and dense["measured"] and r["measured"]
                              and method != "dense" else "")
                fits = ("no" if r["loss_peak_bytes"] + r.get("inputs_bytes", 0) > 24 * GIB
                        else "yes")
                rows.append([shape, f"{SHAPES[shape][0]} / {SHAPES[shape][1]}", tokens, method,
                             peak_s, ratio, f"{r['seconds']:.1f}" if r["measured"] else "—",
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
        "Reverse KL of a trainable student `lm_head` against a teacher `lm_head` on N completion "
        "tokens (random final hidden states; the student head's weight gradient included). "
        "*loss peak* = peak RSS during the loss minus the RSS before it; each row is its own "
        "process. *chunked* is `--loss_chunk_size "
        f"{data['chunk']}` (`NextTokenLogits` + `OutputHead`, activation checkpointing); *trl* "
        "is `trl.trainer.distillation_trainer._chunked_divergence_loss(beta=1)` "
        f"(trl {data.get('trl_version')}). Dense rows marked *expected* were not run: their peak "
        f"is the dense loss's largest measured bytes per logit ({data.get('bytes_per_logit')}) × "
        f"N × V, over this benchmark's {data['max_gib']} GiB limit. *fits 24 GiB*: the loss "
        "peak plus its inputs (hidden states, both heads and the weight gradient).",
        "",
        markdown_table(head, rows),
        "",
        "Timings are single runs on a machine shared with other jobs; the loss values of the "
        "three methods agree (same inputs, same seed).",
    ])


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    p.add_argument("--chunk", type=int, default=256, help="chunked: rows per projection")
    p.add_argument("--max_gib", type=float, default=8.0,
                   help="run the dense loss only where its expected peak is below this")
    p.add_argument("--stem", default="loss_memory")
    p.add_argument("--fresh", action="store_true")
    p.add_argument("--one", nargs=3, metavar=("METHOD", "SHAPE", "TOKENS"),
                   help=argparse.SUPPRESS)  # the child process: one configuration
    args = p.parse_args(argv)
    if args.one:
        method, shape, tokens = args.one
        print(json.dumps(run_one(method, shape, int(tokens), args.chunk)))
        return

    import trl

    data = previous_results(RESULTS, args.stem, fresh=args.fresh) or {"runs": {}}
    data.update({"machine": machine_info(torch.device("cpu")), "tokens": args.tokens,
                 "chunk": args.chunk, "max_gib": args.max_gib, "trl_version": trl.__version__})
    runs = data["runs"]
    for shape in args.shapes:
        hidden, vocab = SHAPES[shape]
        for tokens in args.tokens:
            for method in args.methods:
                key = f"{shape}/{tokens}/{method}"
                if key in runs and runs[key]["measured"]:
                    continue
                inputs = 4 * (2 * tokens * hidden + 3 * vocab * hidden)
                per_logit = _bytes_per_logit(runs)
                if method == "dense" and per_logit is not None and \
                        per_logit * tokens * vocab > args.max_gib * GIB:
                    runs[key] = {"method": method, "shape": shape, "hidden": hidden,
                                 "vocab": vocab, "tokens": tokens, "measured": False,
                                 "loss_peak_bytes": per_logit * tokens * vocab,
                                 "inputs_bytes": inputs}
                    print(f"{key}: not run, expected {per_logit * tokens * vocab / GIB:.1f} GiB",
                          flush=True)
                    continue
                cmd = [sys.executable, "-m", "benchmarks.loss_memory", "--chunk", str(args.chunk),
                       "--one", method, shape, str(tokens)]
                env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
                out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env,
                                     cwd=os.path.dirname(os.path.dirname(RESULTS)))
                runs[key] = {**json.loads(out.stdout.strip().splitlines()[-1]),
                             "inputs_bytes": inputs}
                r = runs[key]
                print(f"{key}: {r['loss_peak_bytes'] / GIB:.3f} GiB, {r['seconds']:.1f} s, "
                      f"loss {r['loss']:.6f}", flush=True)
                data["bytes_per_logit"] = _bytes_per_logit(runs)
                write_results(RESULTS, args.stem, data, _markdown(data))
    data["bytes_per_logit"] = _bytes_per_logit(runs)
    write_results(RESULTS, args.stem, data, _markdown(data))


if __name__ == "__main__":
    main()
