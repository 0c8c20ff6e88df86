"""What lookahead-opd costs, measured side by side in one run: the overhead study. Its sections
live by what they measure, each in its own file:

1-2. ``overhead_step.py``: the wrapper on a step that does not search, and one candidate and
     one search, against an optimizer step of a ~50M-parameter GPT;
3.   ``overhead_store.py``: the anchor store's memory, capture time and accuracy, full and
     low-rank, on that model and on large synthetic matrices;
4.   ``overhead_search.py``: one search on SmolLM2-135M part by part, beside an older copy of
     the library (``--baseline``).

    python -m benchmarks.overhead                 # full run (~10 min on 2 shared CPU cores)
    python -m benchmarks.overhead --smoke         # small models, few repeats, < 1 min
    python -m benchmarks.overhead --device cuda   # writes overhead_cuda.{json,md}
    python -m benchmarks.overhead --report-only   # rewrite overhead.md from overhead.json

    # "before" next to "after": a copy of the library at an older commit, loaded under
    # another name in the same process
    git archive 8e63bed src/lookahead_opd | tar -x -C /tmp/before
    python -m benchmarks.overhead --baseline /tmp/before/src/lookahead_opd \\
        --baseline-commit 8e63bed

Results go to benchmarks/results/<stem>.{json,md}. ``--sections`` runs some sections only
(``--stem`` then names their own report, so the full one is not overwritten).
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import torch

from benchmarks import harness, overhead_search, overhead_step, overhead_store

SECTIONS = ("wrapper", "candidate", "model_snapshots", "synthetic", "search")
# Defaults that depend on the run: (smoke, cpu full, cuda full); a GPU step is ~100x faster,
# so it affords more repeats.
DEFAULTS = {"layers": (2, 13, 13), "warmup": (1, 3, 10), "pairs": (4, 120, 300),
            "step_pairs": (6, 100, 400), "rounds": (2, 9, 30), "acc_steps": (4, 16, 16),
            "synthetic_size": (1024, 4096, 4096), "search_rounds": (2, 5, 10),
            "opd_steps": (0, 3, 3)}


def options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sections", default=",".join(SECTIONS),
                   help=f"comma list of {', '.join(SECTIONS)}; a subset needs --stem")
    for section in (overhead_step, overhead_store, overhead_search):
        section.options(p)


def configure(a: argparse.Namespace, p: argparse.ArgumentParser) -> None:
    cuda = a.device.startswith("cuda")
    col = 0 if a.smoke else (2 if cuda else 1)
    for key, values in DEFAULTS.items():
        if getattr(a, key) is None:
            setattr(a, key, values[col])
    if cuda and not a.smoke:
        a.stem = "overhead_cuda"
    if isinstance(a.ranks, str):
        a.ranks = [int(x) for x in a.ranks.split(",") if x.strip()]
    if isinstance(a.sections, str):
        a.sections = [x.strip() for x in a.sections.split(",") if x.strip()]
    unknown = sorted(set(a.sections) - set(SECTIONS))
    if unknown:
        p.error(f"unknown sections {unknown}; choose from {', '.join(SECTIONS)}")
    if set(a.sections) != set(SECTIONS) and not a.report_only and not a.stem_given:
        p.error("a subset of --sections would overwrite the full results: add --stem")
    overhead_search.check(a, p)


def measure(a: argparse.Namespace, store: harness.Store, ctx: Any) -> None:
    """Each section asked for, in order; the GPT goes before section 4 needs the memory."""
    t_start, device = time.perf_counter(), torch.device(a.device)
    torch.manual_seed(a.seed)
    res, gpt = store.data, None
    if set(a.sections) & set(SECTIONS[:4]):
        gpt = overhead_step.gpt(a, device)
    res["config"]["n_params"] = sum(p.numel() for p in gpt[0].parameters()) if gpt else 0
    sections = {
        "wrapper": ("1. wrapper overhead", lambda: overhead_step.bench_wrapper(*gpt, device, a)),
        "candidate": ("2. candidate cost", lambda: overhead_step.bench_candidate(*gpt, device, a)),
        "model_snapshots": ("3a. model snapshots",
                            lambda: overhead_store.bench_model_snapshots(*gpt, device, a)),
        "synthetic": ("3b. synthetic snapshots", lambda: overhead_store.bench_synthetic(device, a)),
        "search": ("4. one search, part by part", lambda: overhead_search.bench_search(device, a)),
    }
    for key in (k for k in SECTIONS if k in a.sections):
        title, fn = sections[key]
        if key == "search":  # the 135M model needs the memory: let the GPT go first
            gpt = None
            sections.clear()
            if device.type == "cuda":
                torch.cuda.empty_cache()
        t0 = time.perf_counter()
        res[key] = fn()
        res[key]["section_s"] = time.perf_counter() - t0
        print(f"{title}: {res[key]['section_s']:.1f} s", flush=True)
    if device.type == "cuda":
        res["cuda_max_memory_allocated_bytes"] = torch.cuda.max_memory_allocated(device)
    res["runtime_s"] = time.perf_counter() - t_start
    store.data = json.loads(json.dumps(res))  # as --report-only will read it back


# --------------------------------------------------------------------------- report


def render(res: dict[str, Any], args: argparse.Namespace) -> list[str]:
    """The tables: the machine, then each section that ran."""
    cfg, machine = res["config"], res["machine"]
    out = [
        f"# lookahead-opd overhead ({machine['device']})",
        "",
        f"torch {machine['torch']}, {machine['torch_threads']} threads, "
        f"{machine.get('gpu') or machine['cpu_model']}, load average at the start "
        f"{', '.join(f'{x:.1f}' for x in machine.get('loadavg_at_start', []))}. Runtime "
        f"{res['runtime_s']:.0f} s. Ratios are medians of per-pair (or per-round) ratios, "
        "[p10–p90].",
        "",
    ]
    if cfg.get("n_params"):
        out += [f"Sections 1–3, model: GPT decoder, {cfg['n_params']:,} params, {cfg['layers']} "
                f"layers, d_model {cfg['d_model']}, vocab {cfg['vocab']}, seq {cfg['seq_len']}, "
                f"batch {cfg['batch']}, {cfg['dtype']}, AdamW.", ""]
    if "wrapper" in res:
        out += overhead_step.render_wrapper(res["wrapper"])
    if "candidate" in res:
        out += overhead_step.render_candidate(res["candidate"],
                                              machine["device"].startswith("cuda"))
    if "model_snapshots" in res:
        out += overhead_store.render_model_snapshots(res["model_snapshots"], args.ranks)
    if "synthetic" in res:
        out += overhead_store.render_synthetic(res["synthetic"], args)
    if "search" in res:
        out += overhead_search.render_search(res["search"])
    return out


def summary_lines(res: dict[str, Any], args: argparse.Namespace) -> list[str]:
    """What the sections mean (sections 1-3 once all of them ran)."""
    lines = [] if "search" not in res else overhead_search.search_lines(res["search"])
    if not all(k in res for k in SECTIONS[:4]):
        return lines
    return (lines + overhead_step.step_lines(res["wrapper"], res["candidate"], args.candidate_rank)
            + overhead_store.store_lines(res["model_snapshots"], res["synthetic"], args))


def report(a: argparse.Namespace, res: dict[str, Any]) -> str:
    """The markdown report of ``res`` (tables, what they mean, how to reproduce), read with the
    options its json records."""
    cfg = res["config"]
    args = argparse.Namespace(**cfg)
    reproduce = (f"Reproduce: `{res['machine']['command']}` (repo root; {res['runtime_s']:.0f} s "
                 "here)")
    if cfg.get("baseline"):
        reproduce += (", with the 'before' library extracted first: `git archive "
                      f"{cfg.get('baseline_commit', '5179b80')} src/lookahead_opd | tar -x -C "
                      "/tmp/before`")
    return "\n".join([*render(res, args), "## What this means", "", *summary_lines(res, args), "",
                      reproduce + "."])


STUDY = harness.Study("overhead", __doc__, report, options=options, devices=("cpu", "cuda"),
                      configure=configure, measure=measure)
main = STUDY.main

if __name__ == "__main__":
    raise SystemExit(main())
