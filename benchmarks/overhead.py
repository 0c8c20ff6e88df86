"""What lookahead-opd costs, measured side by side in one run on a ~50M-parameter GPT.

1. Wrapper overhead on a step that does not search: bare AdamW vs ``ExtrapolatingOptimizer``
   around the same AdamW (schedule that never fires), in interleaved A/B pairs on the same
   model and batch. Reported as the median of the per-pair ratios, with p10-p90.
2. Cost of one candidate (``Extrapolator.apply(c)`` + ``restore``) and of a whole search
   with a free eval_fn that rejects the first candidate, as a fraction of one optimizer step
   (forward + backward + AdamW step), for snapshot="full" and snapshot="lowrank".
3. Anchor-store memory, full vs low-rank at several ranks, on the model and on a synthetic set
   of 4096x4096 matrices; compression time per capture; and the low-rank anchor's relative
   error after a few real training steps (next to the best possible rank-r error).

    python -m benchmarks.overhead                 # full run (~3-6 min on 2 CPU cores)
    python -m benchmarks.overhead --quick         # smoke run, small model, < 1 min
    python -m benchmarks.overhead --device cuda   # writes overhead_cuda.{json,md}

Results go to benchmarks/results/overhead<suffix>.{json,md}; the table is also printed.
"""

from __future__ import annotations

import argparse
import math
import os
import time
from functools import partial
from typing import Any

import torch

from benchmarks.common import (
    TinyGPT,
    machine_info,
    markdown_table,
    markov_batches,
    mib,
    stats,
    sync,
    timed,
    write_results,
)
from lookahead_opd import ExtrapolatingOptimizer, Extrapolator, FullSnapshot, LowRankSnapshot

NEVER = [10**9]  # a schedule that does not fire during the benchmark


def free_eval() -> float:
    """A gate that costs nothing. Every candidate scores 0.0, which does not beat the
    starting score 0.0, so each search rejects its first candidate and restores ``W_t``."""
    return 0.0


# --------------------------------------------------------------------------- arguments


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--quick", action="store_true", help="smoke run: 2-layer model, few repeats")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    p.add_argument("--seed", type=int, default=0)
    m = p.add_argument_group("model (defaults: 49.4M params)")
    m.add_argument("--layers", type=int, default=None, help="default 13 (2 with --quick)")
    m.add_argument("--d-model", type=int, default=512)
    m.add_argument("--heads", type=int, default=8)
    m.add_argument("--vocab", type=int, default=8192)
    m.add_argument("--seq-len", type=int, default=128)
    m.add_argument("--batch", type=int, default=4)
    m.add_argument("--lr", type=float, default=3e-4)
    r = p.add_argument_group("repeats (defaults depend on --quick and --device)")
    r.add_argument("--warmup", type=int, default=None, help="untimed steps per side")
    r.add_argument("--pairs", type=int, default=None, help="A/B pairs of fwd+bwd+step")
    r.add_argument("--step-pairs", type=int, default=None, help="A/B pairs of opt.step() alone")
    r.add_argument("--rounds", type=int, default=None, help="rounds of the candidate benchmark")
    r.add_argument("--acc-steps", type=int, default=None, help="training steps for accuracy")
    s = p.add_argument_group("snapshots")
    s.add_argument("--ranks", default="4,8,16,32", help="low-rank ranks for memory/accuracy")
    s.add_argument("--candidate-rank", type=int, default=16, help="rank for section 2")
    s.add_argument("--synthetic-size", type=int, default=None, help="default 4096 (1024 quick)")
    s.add_argument("--synthetic-matrices", type=int, default=3)
    s.add_argument("--synthetic-vectors", type=int, default=4)
    o = p.add_argument_group("output")
    o.add_argument(
        "--output-dir",
        default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"),
    )
    o.add_argument(
        "--suffix",
        default=None,
        help="file name suffix: overhead<suffix>.json (default '', '_cuda' on a GPU, "
        "'_quick' added with --quick)",
    )
    o.add_argument("--no-write", action="store_true", help="print only, write no files")
    args = p.parse_args()

    cuda = args.device.startswith("cuda")
    # (quick, cpu full, cuda full): a GPU step is ~100x faster, so it affords more repeats.
    defaults = {
        "layers": (2, 13, 13),
        "warmup": (1, 3, 10),
        "pairs": (4, 120, 300),
        "step_pairs": (6, 100, 400),
        "rounds": (2, 9, 30),
        "acc_steps": (4, 16, 16),
        "synthetic_size": (1024, 4096, 4096),
    }
    col = 0 if args.quick else (2 if cuda else 1)
    for key, values in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, values[col])
    if args.suffix is None:
        args.suffix = ("_cuda" if cuda else "") + ("_quick" if args.quick else "")
    args.ranks = [int(x) for x in args.ranks.split(",") if x.strip()]
    return args


# --------------------------------------------------------------------------- one training step


def train_step(
    model: TinyGPT, opt: torch.optim.Optimizer, batch: torch.Tensor, device
) -> tuple[float, float]:
    """One forward + backward + ``opt.step()``; returns (total seconds, step-call seconds)."""
    sync(device)
    t0 = time.perf_counter()
    opt.zero_grad(set_to_none=True)
    model.loss(batch).backward()
    sync(device)
    t1 = time.perf_counter()
    opt.step()
    sync(device)
    t2 = time.perf_counter()
    return t2 - t0, t2 - t1


def ratios(num: list[float], den: list[float]) -> list[float]:
    return [a / b for a, b in zip(num, den, strict=True)]


# --------------------------------------------------------------------------- 1. wrapper overhead


def bench_wrapper(model, base, batches, device, args) -> dict[str, Any]:
    """Bare AdamW vs the same AdamW inside ExtrapolatingOptimizer, on steps that don't search."""
    wrapped = ExtrapolatingOptimizer(base, free_eval, schedule=NEVER)
    sides = {"bare": base, "wrapped": wrapped}
    for _ in range(args.warmup):
        for opt in sides.values():
            train_step(model, opt, batches[0], device)

    total = {k: [] for k in sides}
    step = {k: [] for k in sides}
    for k in range(args.pairs):
        order = ["bare", "wrapped"] if k % 2 == 0 else ["wrapped", "bare"]  # ABBA against drift
        for name in order:
            t_total, t_step = train_step(model, sides[name], batches[k % len(batches)], device)
            total[name].append(t_total)
            step[name].append(t_step)

    # opt.step() alone, re-using the last gradients: isolates what the wrapper adds to step().
    alone = {k: [] for k in sides}
    for k in range(args.step_pairs):
        for name in ["bare", "wrapped"] if k % 2 == 0 else ["wrapped", "bare"]:
            alone[name].append(timed(sides[name].step, device)[0])

    # The wrapper's own bookkeeping, called directly (count the step, ask the schedule).
    ex = wrapped.extrapolator
    n_calls = 2000 if args.quick else 20000
    t_after = timed(lambda: [ex.after_step() for _ in range(n_calls)], device)[0] / n_calls
    assert not ex.history, "the schedule fired during the overhead benchmark"

    out: dict[str, Any] = {"pairs": args.pairs, "step_pairs": args.step_pairs}
    for label, d in (("fwd_bwd_step", total), ("step_in_loop", step), ("step_alone", alone)):
        out[label] = {
            "bare_s": d["bare"],
            "wrapped_s": d["wrapped"],
            "bare": stats(d["bare"]),
            "wrapped": stats(d["wrapped"]),
            "ratio": stats(ratios(d["wrapped"], d["bare"]), ci=True),
            "ratio_of_medians": stats(d["wrapped"])["median"] / stats(d["bare"])["median"],
        }
    out["after_step_s"] = t_after
    out["after_step_fraction_of_step"] = t_after / out["fwd_bwd_step"]["bare"]["median"]
    return out


# --------------------------------------------------------------------------- 2. candidate cost


def bench_candidate(model, base, batches, device, args) -> dict[str, Any]:
    """One candidate (apply W_t + c·Δ, then restore W_t) and one whole search (free eval,
    reject at the first candidate), next to one fwd+bwd+AdamW step measured in the same round."""
    r = args.candidate_rank
    wrappers = {
        "full": ExtrapolatingOptimizer(base, free_eval, snapshot="full", schedule=NEVER),
        f"lowrank_r{r}": ExtrapolatingOptimizer(
            base, free_eval, snapshot="lowrank", rank=r, schedule=NEVER
        ),
    }
    params = [p for p in model.parameters()]
    # The floor for comparison (not library code): one fused lerp from a dense fp32 anchor
    # straight into each parameter, and one copy back.
    floor_anchor = [p.detach().float().clone() for p in params]

    @torch.no_grad()
    def floor_apply(backup, c=1.0):
        for p, a, b in zip(params, floor_anchor, backup, strict=True):
            if p.dtype == torch.float32:
                torch.lerp(a, b, 1.0 + c, out=p)
            else:
                p.copy_(torch.lerp(a, b.float(), 1.0 + c))

    @torch.no_grad()
    def restore(backup):
        for p, b in zip(params, backup, strict=True):
            p.copy_(b)

    for i in range(2):  # move the weights off the anchors so Δ is a real (one-step) direction
        train_step(model, base, batches[i % len(batches)], device)

    names = list(wrappers) + ["floor"]
    raw: dict[str, dict[str, list[float]]] = {
        n: {"apply_s": [], "restore_s": [], "search_s": [], "search_peak_extra_bytes": []}
        for n in names
    }
    step_s: list[float] = []
    for k in range(-1, args.rounds):  # round -1 warms up allocators and caches, not recorded
        t_step = train_step(model, base, batches[k % len(batches)], device)[0]
        if k >= 0:
            step_s.append(t_step)
        for name in names if k % 2 == 0 else names[::-1]:
            backup = [p.detach().clone() for p in params]
            if name == "floor":
                apply_fn, restore_fn = partial(floor_apply, backup), partial(restore, backup)
            else:
                ex = wrappers[name].extrapolator
                apply_fn, restore_fn = (
                    partial(ex.apply, 1.0, backup),
                    partial(ex.restore, backup),
                )
            t_apply = timed(apply_fn, device)[0]
            t_restore = timed(restore_fn, device)[0]
            exact = all(torch.equal(p, b) for p, b in zip(params, backup, strict=True))
            assert exact, "restore did not bring back W_t exactly"
            backup = apply_fn = restore_fn = None  # free the copy before the search
            if name == "floor":
                if k >= 0:
                    raw[name]["apply_s"].append(t_apply)
                    raw[name]["restore_s"].append(t_restore)
                continue
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
                before = torch.cuda.memory_allocated(device)
            t_search, record = timed(wrappers[name].extrapolator.search, device)
            assert record.accepted is None and record.n_evals == 2, record
            if k < 0:
                continue
            raw[name]["apply_s"].append(t_apply)
            raw[name]["restore_s"].append(t_restore)
            raw[name]["search_s"].append(t_search)
            if device.type == "cuda":
                peak = torch.cuda.max_memory_allocated(device) - before
                raw[name]["search_peak_extra_bytes"].append(peak)

    out: dict[str, Any] = {"rounds": args.rounds, "step_s": step_s, "step": stats(step_s)}
    for name in names:
        d = raw[name]
        cand = [a + b for a, b in zip(d["apply_s"], d["restore_s"], strict=True)]
        out[name] = {
            **d,
            "apply": stats(d["apply_s"]),
            "restore": stats(d["restore_s"]),
            "candidate": stats(cand),
            "candidate_over_step": stats(ratios(cand, step_s)),
        }
        if d["search_s"]:
            out[name]["search"] = stats(d["search_s"])
            out[name]["search_over_step"] = stats(ratios(d["search_s"], step_s))
        if not d["search_peak_extra_bytes"]:
            del out[name]["search_peak_extra_bytes"]
    return out


# --------------------------------------------------------------------------- 3. snapshot memory


@torch.no_grad()
def anchor_error(store, params, reference) -> float:
    """‖anchor − W‖ / ‖W − reference‖ over all tensors together."""
    num = den = 0.0
    for i, p in enumerate(params):
        w = p.detach().float()
        num += float(torch.sub(store.anchor(i, p.device), w).double().square().sum())
        den += float(torch.sub(w, reference[i]).double().square().sum())
    return math.sqrt(num / den) if den > 0 else 0.0


@torch.no_grad()
def direction_error(store, params, previous) -> float:
    """‖Δ̂ − Δ‖ / ‖Δ‖ for the search direction Δ = W − W_prev, where ``store`` holds the
    (approximate) anchor of ``previous`` = the weights at the last capture."""
    num = den = 0.0
    for i, p in enumerate(params):
        w = p.detach().float()
        num += float(torch.sub(store.anchor(i, p.device), previous[i]).double().square().sum())
        den += float(torch.sub(w, previous[i]).double().square().sum())
    return math.sqrt(num / den) if den > 0 else 0.0


@torch.no_grad()
def best_rank_error(params, reference, ranks) -> dict[int, float]:
    """The smallest possible error of a rank-r anchor (truncated SVD of each W − reference,
    dense tensors exact), for comparison with the store's one-power-iteration compressor."""
    den = 0.0
    tail = dict.fromkeys(ranks, 0.0)
    stores = {r: LowRankSnapshot(r) for r in ranks}  # only asked which tensors they compress
    for p, ref in zip(params, reference, strict=True):
        d = p.detach().float() - ref
        den += float(d.double().square().sum())
        if not any(stores[r].compresses(p.shape) for r in ranks):
            continue
        sq = torch.linalg.svdvals(d.reshape(d.shape[0], -1)).double().square()
        for r in ranks:
            if stores[r].compresses(p.shape):
                tail[r] += float(sq[r:].sum())
    return {r: math.sqrt(tail[r] / den) if den > 0 else 0.0 for r in ranks}


def bench_model_snapshots(model, base, batches, device, args) -> dict[str, Any]:
    """Anchor bytes of every store on the model, then a short real training run with captures
    after steps 1, 2, 4, 8, … (as the powers-of-two schedule does), timing each capture and
    measuring the low-rank anchors' error against the true weights."""
    named = list(model.named_parameters())
    params = [p for _, p in named]
    reference = [p.detach().float().clone() for p in params]  # what the stores copy now
    extrapolators = {"full": Extrapolator(named, free_eval, snapshot="full", schedule=NEVER)}
    for r in args.ranks:
        extrapolators[f"lowrank_r{r}"] = Extrapolator(
            named, free_eval, snapshot="lowrank", rank=r, schedule=NEVER
        )
    memory = {}
    for name, ex in extrapolators.items():
        ref_bytes = getattr(ex.store, "reference_nbytes", lambda: 0)()
        memory[name] = {"anchor_bytes": ex.nbytes()["anchor"], "reference_bytes": ref_bytes}
    full_bytes = memory["full"]["anchor_bytes"]
    for m in memory.values():
        m["anchor_over_full"] = m["anchor_bytes"] / full_bytes

    names = list(extrapolators)
    capture_s: dict[str, list[float]] = {n: [] for n in names}
    errors: dict[str, list[float]] = {n: [] for n in names}
    dir_errors: dict[str, list[float]] = {n: [] for n in names}
    previous = reference  # the weights the stores' anchors stand for
    capture_steps, step_s = [], []
    for s in range(1, args.acc_steps + 1):
        step_s.append(train_step(model, base, batches[s % len(batches)], device)[0])
        if s & (s - 1):
            continue
        capture_steps.append(s)
        # The direction a search at step s would use, from each store's anchor.
        for name in names:
            dir_errors[name].append(direction_error(extrapolators[name].store, params, previous))
        previous = [p.detach().float().clone() for p in params]
        for name in names if len(capture_steps) % 2 else names[::-1]:
            store = extrapolators[name].store

            @torch.no_grad()
            def capture_all(store=store):
                for i, p in enumerate(params):
                    store.capture(i, p.detach())

            capture_s[name].append(timed(capture_all, device)[0])
        for name in names:
            errors[name].append(anchor_error(extrapolators[name].store, params, reference))
    best = best_rank_error(params, reference, args.ranks)

    step = stats(step_s)
    out: dict[str, Any] = {
        "n_params": sum(p.numel() for p in params),
        "acc_steps": args.acc_steps,
        "capture_steps": capture_steps,
        "step_s": step_s,
        "step": step,
    }
    for name in names:
        out[name] = {
            **memory[name],
            "capture_s": capture_s[name],
            "capture": stats(capture_s[name]),
            "capture_over_step": stats(capture_s[name])["median"] / step["median"],
            "rel_error_by_capture": errors[name],
            "rel_error": errors[name][-1],
            "direction_error_by_search": dir_errors[name],
            "direction_error": dir_errors[name][-1],
        }
        if name.startswith("lowrank_r"):
            out[name]["best_rank_r_error"] = best[int(name[len("lowrank_r") :])]
    return out


def bench_synthetic(device, args) -> dict[str, Any]:
    """The same stores over S×S fp32 matrices plus a few S-vectors, with a dense random update,
    next to one AdamW step over the same tensors."""
    size, g = args.synthetic_size, torch.Generator().manual_seed(args.seed + 1)
    shapes = [(size, size)] * args.synthetic_matrices + [(size,)] * args.synthetic_vectors
    names = [f"t{i}" for i in range(len(shapes))]
    reference = [torch.randn(s, generator=g).to(device) for s in shapes]
    current = [t + 1e-2 * torch.randn(t.shape, generator=g).to(device) for t in reference]
    stores: dict[str, Any] = {"full": FullSnapshot()}
    stores.update({f"lowrank_r{r}": LowRankSnapshot(r) for r in args.ranks})
    for store in stores.values():
        store.add(names, reference)

    repeats = 2 if args.quick else 3
    capture_s: dict[str, list[float]] = {n: [] for n in stores}
    for k in range(repeats):
        for name in list(stores) if k % 2 == 0 else list(stores)[::-1]:
            store = stores[name]

            def capture_all(store=store):
                for i, t in enumerate(current):
                    store.capture(i, t)

            capture_s[name].append(timed(capture_all, device)[0])

    weights = [t.clone().requires_grad_(True) for t in current]
    for w in weights:
        w.grad = torch.randn(w.shape, generator=g).to(device)
    adamw = torch.optim.AdamW(weights, lr=1e-3)
    adamw.step()  # allocate the state
    adamw_s = [timed(adamw.step, device)[0] for _ in range(repeats)]

    full_bytes = stores["full"].nbytes()
    out: dict[str, Any] = {
        "shapes": [list(s) for s in shapes],
        "n_elements": sum(math.prod(s) for s in shapes),
        "adamw_step_s": adamw_s,
        "adamw_step": stats(adamw_s),
    }
    for name, store in stores.items():
        ref_bytes = store.reference_nbytes() if isinstance(store, LowRankSnapshot) else 0
        out[name] = {
            "anchor_bytes": store.nbytes(),
            "reference_bytes": ref_bytes,
            "anchor_over_full": store.nbytes() / full_bytes,
            "capture_s": capture_s[name],
            "capture": stats(capture_s[name]),
            "capture_over_adamw_step": stats(capture_s[name])["median"] / stats(adamw_s)["median"],
        }
    return out


# --------------------------------------------------------------------------- report


def fmt_ratio(s: dict[str, float]) -> str:
    text = f"{s['median']:.3f}× [{s['p10']:.3f}–{s['p90']:.3f}]"
    if "ci_lo" in s:
        text += f", median 95% CI {s['ci_lo']:.3f}–{s['ci_hi']:.3f}"
    return text


def store_row(name: str, d: dict[str, Any], per_step: str, fmt: str) -> list[str]:
    """An anchor store's sizes and capture time, as the two store tables start their rows."""
    return [
        name.replace("lowrank_r", "lowrank r="),
        mib(d["anchor_bytes"]),
        f"{d['anchor_over_full']:.2%}",
        mib(d["reference_bytes"]),
        f"{d['capture']['median']:.4f}",
        fmt.format(d[per_step]),
    ]


def render(res: dict[str, Any], args) -> str:
    cfg, w, c, ms, syn = (
        res["config"],
        res["wrapper"],
        res["candidate"],
        res["model_snapshots"],
        res["synthetic"],
    )
    rank_names = [f"lowrank_r{r}" for r in args.ranks]
    out = [
        f"# lookahead-opd overhead ({res['machine']['device']}, {cfg['n_params']:,} params)",
        "",
        f"Model: GPT decoder, {cfg['layers']} layers, d_model {cfg['d_model']}, vocab {cfg['vocab']}, "
        f"seq {cfg['seq_len']}, batch {cfg['batch']}, {cfg['dtype']}, AdamW; "
        f"torch {res['machine']['torch']}, {res['machine']['torch_threads']} threads, "
        f"{res['machine'].get('gpu') or res['machine']['cpu_model']}. Runtime {res['runtime_s']:.0f} s. "
        "Ratios are medians of per-pair (or per-round) ratios, [p10–p90].",
        "",
        f"## 1. Wrapper overhead on a non-search step ({w['pairs']} interleaved pairs; "
        f"step alone: {w['step_pairs']} pairs)",
        "",
    ]
    rows = []
    for label, key in (
        ("fwd+bwd+step", "fwd_bwd_step"),
        ("opt.step() inside that loop", "step_in_loop"),
        ("opt.step() alone (same grads)", "step_alone"),
    ):
        d = w[key]
        rows.append(
            [
                label,
                f"{d['bare']['median']:.4f}",
                f"{d['wrapped']['median']:.4f}",
                fmt_ratio(d["ratio"]),
            ]
        )
    rows.append(
        [
            "extrapolator.after_step() alone",
            "—",
            f"{w['after_step_s'] * 1e6:.2f} µs",
            f"{w['after_step_fraction_of_step']:.2e} of a step",
        ]
    )
    out += [
        markdown_table(["measure", "bare AdamW (s)", "wrapped (s)", "wrapped / bare"], rows),
        "",
    ]

    out += [
        f"## 2. One candidate and one search vs one optimizer step "
        f"(fwd+bwd+step median {c['step']['median']:.3f} s, {c['rounds']} rounds)",
        "",
    ]
    rows = []
    for name in [k for k in c if k.startswith(("full", "lowrank"))] + ["floor"]:
        d = c[name]
        label = {"full": "full"}.get(name, name.replace("lowrank_r", "lowrank r="))
        if name == "floor":
            label = "floor: fused in-place lerp + copy (not library code)"
        row = [
            label,
            f"{d['apply']['median']:.4f}",
            f"{d['restore']['median']:.4f}",
            fmt_ratio(d["candidate_over_step"]),
            fmt_ratio(d["search_over_step"]) if "search" in d else "—",
        ]
        if res["machine"]["device"].startswith("cuda"):
            peak = d.get("search_peak_extra_bytes")
            row.append(mib(max(peak)) if peak else "—")
        rows.append(row)
    headers = ["snapshot", "apply (s)", "restore (s)", "candidate / step", "search(1 cand.) / step"]
    if res["machine"]["device"].startswith("cuda"):
        headers.append("search peak extra GPU mem")
    out += [markdown_table(headers, rows), ""]

    out += [
        f"## 3a. Anchor store on the model ({ms['n_params']:,} params; captures after steps "
        f"{ms['capture_steps']} of real training, step median {ms['step']['median']:.3f} s)",
        "",
    ]
    rows = [
        store_row(name, ms[name], "capture_over_step", "{:.3f}")
        + [
            f"{ms[name]['rel_error']:.3f}",
            f"{ms[name]['best_rank_r_error']:.3f}" if "best_rank_r_error" in ms[name] else "0",
            f"{ms[name]['direction_error']:.3f}",
        ]
        for name in ["full"] + rank_names
    ]
    headers = [
        "store",
        "anchor",
        "/ full",
        "CPU reference",
        "capture (s)",
        "capture / step",
        "anchor rel. error",
        "best rank-r error",
        "Δ rel. error (last search)",
    ]
    out += [markdown_table(headers, rows), ""]

    size = args.synthetic_size
    out += [
        f"## 3b. Synthetic: {args.synthetic_matrices}× {size}×{size} + {args.synthetic_vectors}× "
        f"{size} fp32 ({syn['n_elements']:,} elements; AdamW step on them "
        f"{syn['adamw_step']['median']:.4f} s)",
        "",
    ]
    rows = [
        store_row(name, syn[name], "capture_over_adamw_step", "{:.2f}")
        for name in ["full"] + rank_names
    ]
    headers = ["store", "anchor", "/ full", "CPU reference", "capture (s)", "capture / AdamW step"]
    out += [markdown_table(headers, rows), ""]
    return "\n".join(out)


def summary_lines(res: dict[str, Any], args) -> list[str]:
    w, c, ms, syn = res["wrapper"], res["candidate"], res["model_snapshots"], res["synthetic"]
    r = args.candidate_rank
    lr = f"lowrank_r{r}"
    s16 = "lowrank_r16" if 16 in args.ranks else f"lowrank_r{args.ranks[-1]}"
    fb, sa = w["fwd_bwd_step"]["ratio"], w["step_alone"]["ratio"]
    errs = ", ".join(
        f"r={k}: {ms[f'lowrank_r{k}']['rel_error']:.2f} "
        f"(best {ms[f'lowrank_r{k}']['best_rank_r_error']:.2f}, "
        f"Δ {ms[f'lowrank_r{k}']['direction_error']:.2f})"
        for k in args.ranks
    )
    return [
        f"- **Non-search steps:** the wrapped step takes {fb['median']:.3f}× the bare AdamW step "
        f"(95% CI of the median {fb['ci_lo']:.3f}–{fb['ci_hi']:.3f}, p10–p90 {fb['p10']:.3f}–"
        f"{fb['p90']:.3f}; target ≤ 1.02×); `opt.step()` alone {sa['median']:.3f}× (CI "
        f"{sa['ci_lo']:.3f}–{sa['ci_hi']:.3f}). The wrapper's own work per step is "
        f"{w['after_step_s'] * 1e6:.2f} µs ({w['after_step_fraction_of_step']:.1e} of a step): "
        "what separates the two sides from 1.000 is timing noise on a shared machine.",
        f"- **Candidates:** one candidate (apply + restore, eval not included) costs "
        f"{c['full']['candidate_over_step']['median']:.3f} of a training step with the full "
        f"snapshot and {c[lr]['candidate_over_step']['median']:.3f} with low-rank r={r}; a whole "
        f"1-candidate search (backup, ‖Δ‖, apply, restore, capture) costs "
        f"{c['full']['search_over_step']['median']:.3f} / {c[lr]['search_over_step']['median']:.3f}. "
        f"The library's full-snapshot candidate is "
        f"{c['full']['candidate']['median'] / c['floor']['candidate']['median']:.1f}× the "
        "fused-lerp floor. Real searches add one eval_fn call per candidate on top.",
        f"- **Memory:** at r=16 the low-rank anchor is {ms[s16]['anchor_over_full']:.2%} of the full "
        f"snapshot on the model and {syn[s16]['anchor_over_full']:.2%} on the "
        f"{args.synthetic_size}² set (target ≤ 2%), but the default reference is a full-size CPU "
        f"copy ({mib(ms[s16]['reference_bytes'])} here) unless the user passes one. A capture "
        f"costs {ms[s16]['capture_over_step']:.3f} of a training step at r=16.",
        f"- **Accuracy:** relative anchor error ‖anchor − W‖/‖W − reference‖ after "
        f"{ms['acc_steps']} AdamW steps: {errs}. 'best' is the truncated-SVD optimum (the gap to "
        "it is the one-power-iteration compressor's, the rest is the update's own spectrum); "
        "Δ is the relative error of the secant direction the last search would use, the number "
        "that decides whether low-rank candidates are the same candidates as with the full store.",
    ]


# --------------------------------------------------------------------------- main


def main() -> None:
    args = parse_args()
    t_start = time.perf_counter()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)

    model = TinyGPT(args.vocab, args.d_model, args.layers, args.heads, args.seq_len)
    model = model.to(device=device, dtype=dtype)
    n_params = sum(p.numel() for p in model.parameters())
    print(
        f"model: {n_params:,} parameters ({args.layers} layers, d_model {args.d_model}), "
        f"device {device}, {torch.get_num_threads()} threads",
        flush=True,
    )
    batches = markov_batches(8, args.batch, args.seq_len, args.vocab, seed=args.seed, device=device)
    base = torch.optim.AdamW(model.parameters(), lr=args.lr)

    res: dict[str, Any] = {
        "machine": machine_info(device),
        "config": {**{k: v for k, v in vars(args).items()}, "n_params": n_params},
    }
    sections = (
        (
            "wrapper",
            "1. wrapper overhead",
            lambda: bench_wrapper(model, base, batches, device, args),
        ),
        (
            "candidate",
            "2. candidate cost",
            lambda: bench_candidate(model, base, batches, device, args),
        ),
        (
            "model_snapshots",
            "3a. model snapshots",
            lambda: bench_model_snapshots(model, base, batches, device, args),
        ),
        ("synthetic", "3b. synthetic snapshots", lambda: bench_synthetic(device, args)),
    )
    for key, title, fn in sections:
        t0 = time.perf_counter()
        res[key] = fn()
        res[key]["section_s"] = time.perf_counter() - t0
        print(f"{title}: {res[key]['section_s']:.1f} s", flush=True)
    if device.type == "cuda":
        res["cuda_max_memory_allocated_bytes"] = torch.cuda.max_memory_allocated(device)
    res["runtime_s"] = time.perf_counter() - t_start

    table = render(res, args)
    lines = summary_lines(res, args)
    command = res["machine"]["command"]
    print()
    print(table)
    print("\n".join(lines))
    if not args.no_write:
        md = "\n".join(
            [
                table,
                "## What this means",
                "",
                *lines,
                "",
                f"Reproduce: `{command}` (repo root; {res['runtime_s']:.0f} s here).",
            ]
        )
        paths = write_results(args.output_dir, "overhead" + args.suffix, res, md)
        print("\nwrote " + ", ".join(paths))


if __name__ == "__main__":
    main()
