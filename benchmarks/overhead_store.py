"""What the anchor store holds and how exact it is: section 3 of the overhead study
(``benchmarks/overhead.py`` runs it).

3. Anchor-store memory, full vs low-rank at several ranks, on the model and on a synthetic set
   of 4096x4096 matrices; compression time per capture; and the low-rank anchor's relative
   error after a few real training steps (next to the best possible rank-r error).
"""

from __future__ import annotations

import argparse
import math
from typing import Any

import torch

from benchmarks.common import markdown_table, mib, stats, timed
from benchmarks.overhead_step import BARE, NEVER, free_eval, train_step
from lookahead_opd import Extrapolator, FullSnapshot, LowRankSnapshot


def options(p: argparse.ArgumentParser) -> None:
    s = p.add_argument_group("snapshots")
    s.add_argument("--ranks", default="4,8,16,32", help="low-rank ranks for memory/accuracy")
    s.add_argument("--acc-steps", type=int, default=None, help="training steps for accuracy")
    s.add_argument("--synthetic-size", type=int, default=None, help="default 4096 (1024 smoke)")
    s.add_argument("--synthetic-matrices", type=int, default=3)
    s.add_argument("--synthetic-vectors", type=int, default=4)


def anchor_error(store, params, reference) -> float:
    """‖anchor − W‖ / ‖W − reference‖ over all tensors together."""
    num = den = 0.0
    for i, p in enumerate(params):
        w = p.detach().float()
        num += float(torch.sub(store.anchor(i, p.device), w).double().square().sum())
        den += float(torch.sub(w, reference[i]).double().square().sum())
    return math.sqrt(num / den) if den > 0 else 0.0


def direction_error(store, params, previous) -> float:
    """‖Δ̂ − Δ‖ / ‖Δ‖ for the search direction Δ = W − W_prev, where ``store`` holds the
    (approximate) anchor of ``previous`` = the weights at the last capture."""
    num = den = 0.0
    for i, p in enumerate(params):
        w = p.detach().float()
        num += float(torch.sub(store.anchor(i, p.device), previous[i]).double().square().sum())
        den += float(torch.sub(w, previous[i]).double().square().sum())
    return math.sqrt(num / den) if den > 0 else 0.0


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


def _memory(extrapolators: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Each store's anchor bytes (and its CPU reference's), and the share of the full one."""
    memory = {}
    for name, ex in extrapolators.items():
        ref_bytes = getattr(ex.store, "reference_nbytes", lambda: 0)()
        memory[name] = {"anchor_bytes": ex.nbytes()["anchor"], "reference_bytes": ref_bytes}
    for m in memory.values():
        m["anchor_over_full"] = m["anchor_bytes"] / memory["full"]["anchor_bytes"]
    return memory


def _capture_all(store: Any, params: list[torch.Tensor], device: torch.device) -> float:
    @torch.no_grad()
    def capture() -> None:
        for i, p in enumerate(params):
            store.capture(i, p.detach())
    return timed(capture, device)[0]


def bench_model_snapshots(model, base, batches, device, args) -> dict[str, Any]:
    """Anchor bytes of every store on the model, then a short real training run with captures
    after steps 1, 2, 4, 8, … (as the powers-of-two schedule does), timing each capture and
    measuring the low-rank anchors' error against the true weights."""
    named = list(model.named_parameters())
    params = [p for _, p in named]
    reference = [p.detach().float().clone() for p in params]  # what the stores copy now
    extrapolators = {"full": Extrapolator(named, free_eval, snapshot="full", schedule=NEVER,
                                              **BARE)}
    for r in args.ranks:
        extrapolators[f"lowrank_r{r}"] = Extrapolator(
            named, free_eval, snapshot="lowrank", rank=r, schedule=NEVER, **BARE
        )
    memory = _memory(extrapolators)
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
            capture_s[name].append(_capture_all(extrapolators[name].store, params, device))
        for name in names:
            errors[name].append(anchor_error(extrapolators[name].store, params, reference))
    best = best_rank_error(params, reference, args.ranks)
    step = stats(step_s)
    out: dict[str, Any] = {"n_params": sum(p.numel() for p in params), "acc_steps": args.acc_steps,
                           "capture_steps": capture_steps, "step_s": step_s, "step": step}
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

    repeats = 2 if args.smoke else 3
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


def render_model_snapshots(ms: dict[str, Any], ranks: list[int]) -> list[str]:
    rows = [
        store_row(name, ms[name], "capture_over_step", "{:.3f}")
        + [f"{ms[name]['rel_error']:.3f}",
           f"{ms[name]['best_rank_r_error']:.3f}" if "best_rank_r_error" in ms[name] else "0",
           f"{ms[name]['direction_error']:.3f}"]
        for name in ["full"] + [f"lowrank_r{r}" for r in ranks]
    ]
    headers = ["store", "anchor", "/ full", "CPU reference", "capture (s)", "capture / step",
               "anchor rel. error", "best rank-r error", "Δ rel. error (last search)"]
    return [f"## 3a. Anchor store on the model ({ms['n_params']:,} params; captures after steps "
            f"{ms['capture_steps']} of real training, step median {ms['step']['median']:.3f} s)",
            "", markdown_table(headers, rows), ""]


def render_synthetic(syn: dict[str, Any], args: argparse.Namespace) -> list[str]:
    size = args.synthetic_size
    rows = [store_row(name, syn[name], "capture_over_adamw_step", "{:.2f}")
            for name in ["full"] + [f"lowrank_r{r}" for r in args.ranks]]
    headers = ["store", "anchor", "/ full", "CPU reference", "capture (s)", "capture / AdamW step"]
    return [f"## 3b. Synthetic: {args.synthetic_matrices}× {size}×{size} + "
            f"{args.synthetic_vectors}× {size} fp32 ({syn['n_elements']:,} elements; AdamW step "
            f"on them {syn['adamw_step']['median']:.4f} s)", "", markdown_table(headers, rows), ""]


def store_lines(ms: dict[str, Any], syn: dict[str, Any], args: argparse.Namespace) -> list[str]:
    """What section 3 means."""
    s16 = "lowrank_r16" if 16 in args.ranks else f"lowrank_r{args.ranks[-1]}"
    errs = ", ".join(
        f"r={k}: {ms[f'lowrank_r{k}']['rel_error']:.2f} "
        f"(best {ms[f'lowrank_r{k}']['best_rank_r_error']:.2f}, "
        f"Δ {ms[f'lowrank_r{k}']['direction_error']:.2f})"
        for k in args.ranks
    )
    return [
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
