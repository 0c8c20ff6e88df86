"""What the wrapper costs on a step that does not search, and what a candidate costs: sections
1 and 2 of the overhead study (``benchmarks/overhead.py`` runs them), on a ~50M-parameter GPT.

1. Wrapper overhead on a step that does not search: bare AdamW vs ``ExtrapolatingOptimizer``
   around the same AdamW (schedule that never fires), in interleaved A/B pairs on the same
   model and batch. Reported as the median of the per-pair ratios, with p10-p90.
2. Cost of one candidate (``Extrapolator.apply(c)`` + ``restore``) and of a whole search
   with a free eval_fn that rejects the first candidate, as a fraction of one optimizer step
   (forward + backward + AdamW step), for snapshot="full" and snapshot="lowrank".
"""

from __future__ import annotations

import argparse
import time
from functools import partial
from typing import Any

import torch

from benchmarks.common import TinyGPT, markdown_table, markov_batches, mib, stats, sync, timed
from lookahead_opd import ExtrapolatingOptimizer

NEVER = [10**9]  # a schedule that does not fire during the benchmark
# A bare Extrapolator as these timings ran it: no optimizer state to reset after a kept jump,
# and searching never stopped by patience (the defaults before issue 38).
BARE = dict(on_jump="keep", patience=None)


def free_eval() -> float:
    """A gate that costs nothing. Every candidate scores 0.0, which does not beat the
    starting score 0.0, so each search rejects its first candidate and restores ``W_t``."""
    return 0.0


def options(p: argparse.ArgumentParser) -> None:
    m = p.add_argument_group("model of sections 1-3 (defaults: 49.4M params)")
    m.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    m.add_argument("--seed", type=int, default=0)
    m.add_argument("--layers", type=int, default=None, help="default 13 (2 with --smoke)")
    m.add_argument("--d-model", type=int, default=512)
    m.add_argument("--heads", type=int, default=8)
    m.add_argument("--vocab", type=int, default=8192)
    m.add_argument("--seq-len", type=int, default=128)
    m.add_argument("--batch", type=int, default=4)
    m.add_argument("--lr", type=float, default=3e-4)
    r = p.add_argument_group("repeats (defaults depend on --smoke and --device)")
    r.add_argument("--warmup", type=int, default=None, help="untimed steps per side")
    r.add_argument("--pairs", type=int, default=None, help="A/B pairs of fwd+bwd+step")
    r.add_argument("--step-pairs", type=int, default=None, help="A/B pairs of opt.step() alone")
    r.add_argument("--rounds", type=int, default=None, help="rounds of the candidate benchmark")
    p.add_argument("--candidate-rank", type=int, default=16, help="low-rank rank of section 2")


def gpt(args: argparse.Namespace, device: torch.device) -> tuple[Any, Any, list[torch.Tensor]]:
    """Sections 1-3's model, its AdamW and a few batches of a Markov chain."""
    model = TinyGPT(args.vocab, args.d_model, args.layers, args.heads, args.seq_len)
    model = model.to(device=device, dtype=getattr(torch, args.dtype))
    print(f"model: {sum(p.numel() for p in model.parameters()):,} parameters ({args.layers} "
          f"layers, d_model {args.d_model}), device {device}, {torch.get_num_threads()} threads",
          flush=True)
    batches = markov_batches(8, args.batch, args.seq_len, args.vocab, seed=args.seed,
                             device=device)
    return model, torch.optim.AdamW(model.parameters(), lr=args.lr), batches


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


def fmt_ratio(s: dict[str, float]) -> str:
    text = f"{s['median']:.3f}× [{s['p10']:.3f}–{s['p90']:.3f}]"
    if "ci_lo" in s:
        text += f", median 95% CI {s['ci_lo']:.3f}–{s['ci_hi']:.3f}"
    return text


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
    n_calls = 2000 if args.smoke else 20000
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


def _candidate_fns(name: str, wrappers: dict[str, Any], params: list[torch.Tensor],
                   floor_anchor: list[torch.Tensor], backup: list[torch.Tensor]) -> tuple[Any, Any]:
    """apply and restore of one store (or of the floor: one fused lerp from a dense fp32 anchor
    straight into each parameter, and one copy back; not library code)."""
    if name != "floor":
        ex = wrappers[name].extrapolator
        return partial(ex.apply, 1.0, backup), partial(ex.restore, backup)

    @torch.no_grad()
    def floor_apply(c: float = 1.0) -> None:
        for p, a, b in zip(params, floor_anchor, backup, strict=True):
            if p.dtype == torch.float32:
                torch.lerp(a, b, 1.0 + c, out=p)
            else:
                p.copy_(torch.lerp(a, b.float(), 1.0 + c))

    @torch.no_grad()
    def restore() -> None:
        for p, b in zip(params, backup, strict=True):
            p.copy_(b)

    return floor_apply, restore


def _candidate_round(name: str, wrappers: dict[str, Any], params: list[torch.Tensor],
                     floor_anchor: list[torch.Tensor], device: torch.device) -> dict[str, Any]:
    """One store's apply, restore (checked exact) and, for the library's stores, a search."""
    backup = [p.detach().clone() for p in params]
    apply_fn, restore_fn = _candidate_fns(name, wrappers, params, floor_anchor, backup)
    out: dict[str, Any] = {"apply_s": timed(apply_fn, device)[0],
                           "restore_s": timed(restore_fn, device)[0]}
    exact = all(torch.equal(p, b) for p, b in zip(params, backup, strict=True))
    assert exact, "restore did not bring back W_t exactly"
    backup = apply_fn = restore_fn = None  # free the copy before the search
    if name == "floor":
        return out
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
    out["search_s"], record = timed(wrappers[name].extrapolator.search, device)
    assert record.accepted is None and record.n_evals == 2, record
    if device.type == "cuda":
        out["search_peak_extra_bytes"] = torch.cuda.max_memory_allocated(device) - before
    return out


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
    floor_anchor = [p.detach().float().clone() for p in params]
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
            got = _candidate_round(name, wrappers, params, floor_anchor, device)
            if k >= 0:
                for key, value in got.items():
                    raw[name][key].append(value)
    return _candidate_stats(raw, step_s, args.rounds)


def _candidate_stats(raw: dict[str, dict[str, list[float]]], step_s: list[float],
                     rounds: int) -> dict[str, Any]:
    out: dict[str, Any] = {"rounds": rounds, "step_s": step_s, "step": stats(step_s)}
    for name, d in raw.items():
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


# --------------------------------------------------------------------------- report


def render_wrapper(w: dict[str, Any]) -> list[str]:
    rows = []
    for label, key in (
        ("fwd+bwd+step", "fwd_bwd_step"),
        ("opt.step() inside that loop", "step_in_loop"),
        ("opt.step() alone (same grads)", "step_alone"),
    ):
        d = w[key]
        rows.append([label, f"{d['bare']['median']:.4f}", f"{d['wrapped']['median']:.4f}",
                     fmt_ratio(d["ratio"])])
    rows.append(["extrapolator.after_step() alone", "—", f"{w['after_step_s'] * 1e6:.2f} µs",
                 f"{w['after_step_fraction_of_step']:.2e} of a step"])
    return [f"## 1. Wrapper overhead on a non-search step ({w['pairs']} interleaved pairs; "
            f"step alone: {w['step_pairs']} pairs)", "",
            markdown_table(["measure", "bare AdamW (s)", "wrapped (s)", "wrapped / bare"], rows),
            ""]


def render_candidate(c: dict[str, Any], cuda: bool) -> list[str]:
    rows = []
    for name in [k for k in c if k.startswith(("full", "lowrank"))] + ["floor"]:
        d = c[name]
        label = {"full": "full"}.get(name, name.replace("lowrank_r", "lowrank r="))
        if name == "floor":
            label = "floor: fused in-place lerp + copy (not library code)"
        row = [label, f"{d['apply']['median']:.4f}", f"{d['restore']['median']:.4f}",
               fmt_ratio(d["candidate_over_step"]),
               fmt_ratio(d["search_over_step"]) if "search" in d else "—"]
        if cuda:
            peak = d.get("search_peak_extra_bytes")
            row.append(mib(max(peak)) if peak else "—")
        rows.append(row)
    headers = ["snapshot", "apply (s)", "restore (s)", "candidate / step", "search(1 cand.) / step"]
    if cuda:
        headers.append("search peak extra GPU mem")
    return [f"## 2. One candidate and one search vs one optimizer step "
            f"(fwd+bwd+step median {c['step']['median']:.3f} s, {c['rounds']} rounds)", "",
            markdown_table(headers, rows), ""]


def step_lines(w: dict[str, Any], c: dict[str, Any], r: int) -> list[str]:
    """What sections 1 and 2 mean (``r``: the candidate's low-rank rank)."""
    lr = f"lowrank_r{r}"
    fb, sa = w["fwd_bwd_step"]["ratio"], w["step_alone"]["ratio"]
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
    ]
