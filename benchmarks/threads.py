"""How many torch threads the commands want: ``lookahead-opd demo`` (models cached) or ``toy``
timed at 1 and 2 threads.

Each run is the whole CLI in a fresh process, so the time is what a user waits for. The thread counts alternate (1, 2, 2, 1, 1, 2, ...) so that a change in the
machine's load during the benchmark falls on both sides; the load average before each run is
recorded next to its time. Reported: wall-clock per run, the per-pair ratio 2-thread / 1-thread
(min-max), and the demo's own training seconds.

    python benchmarks/threads.py                 # the demo, 3 pairs, ~15-25 min on 2 idle cores
    python benchmarks/threads.py --command toy --pairs 5 --stem threads_toy

Results go to benchmarks/results/<stem>.{json,md}, rewritten after every run; a rerun with the
same options continues where the last one stopped.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from typing import Any

import torch

try:  # python -m benchmarks.threads
    from benchmarks.common import machine_info, markdown_table, write_results
except ImportError:  # python benchmarks/threads.py
    from common import machine_info, markdown_table, write_results  # type: ignore[no-redef]

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def _order(pairs: int) -> list[int]:
    """1, 2 | 2, 1 | 1, 2 | ...: each thread count goes first in every other pair."""
    out: list[int] = []
    for k in range(pairs):
        out += [1, 2] if k % 2 == 0 else [2, 1]
    return out


def _run(command: str, threads: int, extra: list[str], timeout: float | None) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as out:
        cmd = ["lookahead-opd", command, "--threads", str(threads), *extra]
        if command == "demo":
            cmd += ["--output_dir", out, "--no_progress"]
        load = os.getloadavg()
        t0 = time.perf_counter()
        try:
            subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, timeout=timeout)
        except subprocess.TimeoutExpired:  # recorded as "more than this"
            return {"threads": threads, "wall_seconds": time.perf_counter() - t0, "stopped": True,
                    "loadavg_before": list(load), "train_seconds": None,
                    "command": " ".join(shlex.quote(c) for c in cmd)}
        wall = time.perf_counter() - t0
        train = None
        if command == "demo":
            runs = json.loads(open(os.path.join(out, "results.json")).read())["runs"]
            train = {k: max(r["train_seconds"].values()) for k, r in runs.items()}
    return {"threads": threads, "wall_seconds": wall, "loadavg_before": list(load),
            "train_seconds": train, "command": " ".join(shlex.quote(c) for c in cmd)}


def _report(data: dict[str, Any]) -> str:
    runs = data["runs"]
    rows = [[i + 1, r["threads"],
             f"> {r['wall_seconds']:.0f} (stopped)" if r.get("stopped") else f"{r['wall_seconds']:.1f}",
             "—" if r["train_seconds"] is None else
             f"{r['train_seconds']['opd']:.1f} / {r['train_seconds']['effopd']:.1f}",
             f"{r['loadavg_before'][0]:.2f}"] for i, r in enumerate(runs)]
    ratios = [runs[i + 1]["wall_seconds"] / runs[i]["wall_seconds"] if runs[i]["threads"] == 1
              else runs[i]["wall_seconds"] / runs[i + 1]["wall_seconds"]
              for i in range(0, len(runs) - 1, 2)]
    shown = [(">" if runs[2 * k].get("stopped") or runs[2 * k + 1].get("stopped") else "")
             + f"{r:.2f}" for k, r in enumerate(ratios)]
    planned = 2 * data["options"]["pairs"]
    m = data["machine"]
    lines = [
        f"# `lookahead-opd {data['options']['command']}` at 1 and 2 torch threads",
        "",
        f"Command: `{m['command']}` (each run: `{runs[0]['command'] if runs else ''}` with T = "
        f"1 or 2, a fresh process{', models cached' if data['options']['command'] == 'demo' else ''}"
        f"). {m.get('cpu_count')} CPU cores ({m.get('cpu_model')}), torch {m['torch']}, "
        f"{m['date']}.",
        "",
        markdown_table(["run", "threads", "wall-clock s", "train s (OPD / EffOPD)",
                        "load avg before"], rows),
        "",
        *[f"Run {i + 1}: {r['note']}." for i, r in enumerate(runs) if r.get("note")],
        *([f"{len(runs)} of the {planned} runs planned were made.", ""]
          if len(runs) < planned else [""]),
    ]
    if ratios:
        bound = any(r.get("stopped") for r in runs[: 2 * len(ratios)])
        lines.append(f"Wall-clock 2 threads / 1 thread, per adjacent pair: "
                     f"{', '.join(shown)} (min {min(ratios):.2f}, max {max(ratios):.2f})"
                     f"{'; a stopped run makes its ratio a lower bound' if bound else ''}"
                     f"; above 1 means one thread was faster.")
        lines.append("")
    lines.append(
        "Caveat: the machine was shared with other jobs while this ran (the load average is "
        "the column above), so this is not the command alone; alternating the order puts the "
        "background load on both sides, but a 2-thread run is hurt more by a busy second "
        "core than a 1-thread run is.")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--command", default="demo", choices=("demo", "toy"), help="what to time")
    p.add_argument("--pairs", type=int, default=3, help="pairs of runs (1 and 2 threads)")
    p.add_argument("--demo_args", default="", help="extra options of the command, e.g. '--quick'")
    p.add_argument("--stem", default="threads", help="results file name")
    p.add_argument("--timeout", type=float, default=None,
                   help="stop a run after this many seconds and record it as 'more than'")
    p.add_argument("--report", action="store_true", help="rewrite the table from the json only")
    a = p.parse_args(argv)
    extra = shlex.split(a.demo_args)
    path = os.path.join(RESULTS, a.stem + ".json")
    data: dict[str, Any] = {"machine": machine_info(torch.device("cpu")), "runs": []}
    if os.path.exists(path):
        old = json.loads(open(path).read())
        if {**old.get("options", {}), "command": old.get("options", {}).get("command", "demo")} \
                == {"command": a.command, "pairs": a.pairs, "demo_args": a.demo_args}:
            data["runs"] = old["runs"]
    data["options"] = {"command": a.command, "pairs": a.pairs, "demo_args": a.demo_args}
    if a.report:
        data = json.loads(open(path).read())
        write_results(RESULTS, a.stem, data, _report(data))
        print(_report(data))
        return 0
    order = _order(a.pairs)
    for i in range(len(data["runs"]), len(order)):
        r = _run(a.command, order[i], extra, a.timeout)
        data["runs"].append(r)
        print(f"run {i + 1}/{len(order)}: {r['threads']} thread(s) {r['wall_seconds']:.1f} s "
              f"(load {r['loadavg_before'][0]:.2f})", flush=True)
        write_results(RESULTS, a.stem, data, _report(data))
    print(_report(data))
    return 0


if __name__ == "__main__":
    sys.exit(main())
