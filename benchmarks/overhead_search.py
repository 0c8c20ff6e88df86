"""What one search costs on a real model, part by part: section 4 of the overhead study
(``benchmarks/overhead.py`` runs it), with an older copy of the library beside this checkout's.

4. One search on the real SmolLM2-135M-Instruct (the named source ``smollm2-135m-gguf``; a
   random-init stand-in of its shapes when the ``real`` extra is missing), part by part (backup
   of W_t, Δ, sketch, candidate, restore, new anchor / low-rank compression), as a fraction of
   one bare AdamW step and of one OPD step of the loop's trainer on that model measured in the
   same run, full and low-rank; with ``--baseline`` the same for an older copy of the library,
   in the same rounds (side by side):

    git archive 8e63bed src/lookahead_opd | tar -x -C /tmp/before
    python -m benchmarks.overhead --sections search --stem overhead_search \
        --baseline /tmp/before/src/lookahead_opd --baseline-commit 8e63bed
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import time
from collections import defaultdict
from types import ModuleType
from typing import Any

import torch

from benchmarks.common import markdown_table, mib, stats, sync, timed
from benchmarks.overhead_step import BARE, NEVER, free_eval, ratios

# SmolLM2-135M's architecture (LlamaForCausalLM): 134,515,008 parameters.
SMOLLM2_135M = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                    num_attention_heads=9, num_key_value_heads=3, vocab_size=49152,
                    tie_word_embeddings=True, max_position_embeddings=2048)
SMOKE_LLAMA = dict(SMOLLM2_135M, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, vocab_size=4096)
REAL_MODEL = "smollm2-135m-gguf"  # section 4's model (src/lookahead_opd/integrations/model_sources.py)
# One plain OPD step of the loop's trainer on the real model, as section 4 measures it: every
# weight trained (no train_top_blocks), the CLI's defaults otherwise.
OPD_STEP = dict(task="wordproblems", batch_size=4, max_new_tokens=48)
# Without the real model: one OPD step on SmolLM2-135M-Instruct through `lookahead-opd train`
# (batch 4, 48-token completions, fp32, CPU, one thread) and one bare AdamW step on it, as
# issue 27 measured them on one machine. An OPD step is their ratio in bare AdamW steps, which
# survives a machine slowed by other work better than seconds do.
OPD_STEP_S, ISSUE_ADAMW_STEP_S = 14.0, 0.55
BASELINE_COMMIT = "8e63bed"  # the 'before' of the committed report (--baseline-commit)


def options(p: argparse.ArgumentParser) -> None:
    b = p.add_argument_group("4. one search, part by part")
    b.add_argument("--baseline", default=None,
                   help="a copy of an older lookahead_opd package directory, timed side by side")
    b.add_argument("--baseline-commit", default=BASELINE_COMMIT,
                   help="the commit --baseline was extracted from (the report names it)")
    b.add_argument("--opd-steps", type=int, default=None,
                   help="timed OPD steps on the real model (default 3; 0 with --smoke)")
    b.add_argument("--search-rounds", type=int, default=None, help="default 5 (2 with --smoke)")
    b.add_argument("--search-rank", type=int, default=16, help="the low-rank store's rank")


def check(a: argparse.Namespace, p: argparse.ArgumentParser) -> None:
    if a.baseline is not None and not os.path.isfile(os.path.join(a.baseline, "__init__.py")):
        p.error(f"--baseline {a.baseline!r} is not a package directory (no __init__.py)")


def load_library(path: str, name: str = "lookahead_opd_baseline") -> ModuleType:
    """The lookahead_opd package at ``path`` (e.g. extracted from an older commit), imported
    under ``name`` so it runs beside this checkout's in one process."""
    spec = importlib.util.spec_from_file_location(
        name, os.path.join(path, "__init__.py"), submodule_search_locations=[path]
    )
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    sys.modules[name] = module
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


class PartClock:
    """Exclusive wall seconds of methods patched onto objects (or classes) for one call: a
    part called inside another counts once, in its own label."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self._stack: list[float] = []
        self._patched: list[tuple[Any, str, Any, bool]] = []

    def patch(self, owner: Any, name: str, label: str) -> None:
        if not hasattr(owner, name):
            return
        original, own = getattr(owner, name), name in vars(owner)
        clock = self

        def timed(*a: Any, **kw: Any) -> Any:
            clock.calls[name] += 1
            clock._stack.append(0.0)
            sync(clock.device)
            t0 = time.perf_counter()
            try:
                return original(*a, **kw)
            finally:
                sync(clock.device)
                elapsed = time.perf_counter() - t0
                inner = clock._stack.pop()
                clock.seconds[label] += elapsed - inner
                if clock._stack:
                    clock._stack[-1] += elapsed

        setattr(owner, name, timed)
        self._patched.append((owner, name, original, own or isinstance(owner, type)))

    def unpatch(self) -> None:
        for owner, name, original, own in reversed(self._patched):
            if own:
                setattr(owner, name, original)
            else:
                delattr(owner, name)
        self._patched = []


# The parts of a search, in the order of the table: (label, what it is).
PARTS = [
    ("backup", "backup: a copy of W_t"),
    ("delta", "Δ: read the anchor (low-rank: rebuild reference + U·Vᵀ)"),
    ("sketch", "sketch of Δ (secant cosine)"),
    ("apply", "candidate W_t + c·Δ written"),
    ("pass", "one pass: backup + Δ + candidate 1 (after only)"),
    ("observe", "low-rank, after: Y = U·VᵀQ + Δ·Q and ΔᵀY in the pass (the compression's "
                "products)"),
    ("restore", "restore W_t"),
    ("anchor", "new anchor: copy (full) / compression (low-rank; after: from the pass's products)"),
    ("rest", "the rest (bookkeeping)"),
]


def search_parts(clock: PartClock, ex: Any, library: ModuleType) -> None:
    """Patch the methods a search of ``library``'s ``Extrapolator`` runs, whichever version."""
    for name, label in (("copy_weights", "backup"), ("_prepare", "pass"), ("_direction", "delta"),
                        ("apply", "apply"), ("restore", "restore"), ("_set_anchor", "anchor"),
                        ("_score", "gate")):
        clock.patch(ex, name, label)
    # The anchor's reads: whole runs (before), or the low-rank rebuild inside delta_run (after,
    # whose subtraction is the pass's).
    clock.patch(ex.store, "anchor_run", "delta")
    clock.patch(ex.store, "_rebuilt", "delta")
    clock.patch(ex.store, "observe", "observe")
    clock.patch(ex.store, "_compress", "anchor")  # counted: entries compressed from the weights
    sketch_pass = getattr(sys.modules[library.__name__ + ".sketch"], "SketchPass", None)
    if sketch_pass is not None:
        clock.patch(sketch_pass, "add", "sketch")
    else:
        clock.patch(ex.secant, "measure", "sketch")


def search_model(args) -> tuple[torch.nn.Module, str, dict[str, Any]]:
    """Section 4's model: the real SmolLM2-135M-Instruct (``REAL_MODEL``) when the ``real``
    extra is installed, else a random-init LlamaForCausalLM of its shapes (``--smoke``: a small
    one); returns ``(model, what it is, its config's shape fields)``."""
    try:
        from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM
    except ImportError:
        raise SystemExit("section 'search' builds a LlamaForCausalLM: pip install transformers") from None
    if not args.smoke:
        from lookahead_opd.integrations.model_sources import check_source, resolve_model

        try:
            check_source(REAL_MODEL)
            folder = resolve_model(REAL_MODEL)
        except ValueError as err:
            print(f"section 4: {err}; a random-init stand-in of its shapes instead", flush=True)
        else:
            model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
            shape = {k: getattr(model.config, k) for k in SMOLLM2_135M}
            return model, f"SmolLM2-135M-Instruct (the named source `{REAL_MODEL}`)", shape
    shape = SMOKE_LLAMA if args.smoke else SMOLLM2_135M
    what = ("small LlamaForCausalLM (--smoke)" if args.smoke
            else "LlamaForCausalLM with SmolLM2-135M's shapes, random init")
    return LlamaForCausalLM(LlamaConfig(**shape)), what, shape


def opd_steps(args, device, adamw_step) -> dict[str, Any]:
    """``args.opd_steps`` plain steps of the loop's trainer on the real model (``OPD_STEP``,
    after one untimed), each followed by one bare AdamW step of section 4 (``adamw_step()``
    returns its seconds), so an OPD step is measured in AdamW steps of the same moment."""
    import tempfile

    from lookahead_opd.integrations.opd.config import OPDConfig
    from lookahead_opd.integrations.opd.train import build_trainer

    with tempfile.TemporaryDirectory(prefix="overhead-opd-") as tmp:
        config = OPDConfig(student=REAL_MODEL, teacher=REAL_MODEL, output_dir=tmp,
                           device=str(device), progress=False, seed=args.seed, **OPD_STEP)
        trainer = build_trainer(config)
        step_s, adamw_s = [], []
        for n in range(args.opd_steps + 1):
            t_step = timed(trainer.train_step, device)[0]
            t_adamw = adamw_step()
            if n:
                step_s.append(t_step)
                adamw_s.append(t_adamw)
                print(f"  OPD step {n}: {t_step:.2f} s, AdamW step {t_adamw:.3f} s", flush=True)
        del trainer
    return {"config": {"student": REAL_MODEL, "teacher": REAL_MODEL, "loss": config.loss,
                       "optimizer": config.optimizer, **OPD_STEP},
            "step_s": step_s, "adamw_s": adamw_s, "step": stats(step_s),
            "over_adamw": stats(ratios(step_s, adamw_s))}


class SearchModel:
    """Section 4's model, every weight trainable, its bare AdamW, and gradients for it: a fixed
    drift plus fresh noise, so successive secants are neither equal nor unrelated (both
    versions' cosines are compared; the step's cost does not change)."""

    def __init__(self, args: argparse.Namespace, device: torch.device) -> None:
        torch.manual_seed(args.seed)
        model, self.what, self.shape = search_model(args)
        self.model, self.device = model.to(device), device
        self.named = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
        self.n_params = sum(p.numel() for _, p in self.named)
        self.base = torch.optim.AdamW([p for _, p in self.named], lr=1e-5)
        self.drift = [torch.randn_like(p) for _, p in self.named]
        self.g = torch.Generator().manual_seed(args.seed)

    def adamw_step(self) -> float:
        """New gradients, then one timed bare AdamW step (also moves W_t off every anchor)."""
        for (_, p), d in zip(self.named, self.drift, strict=True):
            p.grad = torch.randn(p.shape, generator=self.g).to(p.device).add_(d).mul_(1e-3)
        return timed(self.base.step, self.device)[0]

    def checksum(self) -> float:
        return sum(float(p.detach().double().sum()) for _, p in self.named)


def one_search(ex: Any, library: ModuleType, device: torch.device) -> tuple[dict, Any, int]:
    """One search, part by part: each part's exclusive seconds ("total" without the gate,
    "gate" and "rest" too), its record, and the entries compressed from the weights."""
    clock = PartClock(device)
    search_parts(clock, ex, library)
    try:
        t_total, record = timed(ex.search, device)
    finally:
        clock.unpatch()
    assert record.accepted is None and record.n_evals == 2, record
    parts = dict(clock.seconds)
    gate = parts.pop("gate", 0.0)
    parts["rest"] = t_total - gate - sum(parts.values())
    parts.update(total=t_total - gate, gate=gate)
    dense = sum(1 for e in getattr(ex.store, "_entries", []) if "dense" in e)
    return parts, record, clock.calls["_compress"] - dense


def search_rounds(args: argparse.Namespace, sm: SearchModel, runs: dict[str, Any],
                  libraries: dict[str, ModuleType]) -> tuple[list[float], dict, dict, dict]:
    """Rounds of a bare AdamW step then every search once (alternating order; round -1 warms
    up and is not recorded)."""
    step_s: list[float] = []
    raw: dict[str, dict[str, list[float]]] = {k: defaultdict(list) for k in runs}
    cosines: dict[str, list[float | None]] = {k: [] for k in runs}
    fallbacks: dict[str, list[int]] = {k: [] for k in runs}  # low-rank after: see search_stats
    names = list(runs)
    for r in range(-1, args.search_rounds):
        t_step = sm.adamw_step()
        checksum = sm.checksum()
        for name in names if r % 2 == 0 else names[::-1]:
            parts, record, fallback = one_search(runs[name], libraries[name.split("/")[0]],
                                                 sm.device)
            if r < 0:
                continue
            for label, sec in parts.items():
                raw[name][label].append(sec)
            cosines[name].append(record.secant_cosine)
            fallbacks[name].append(fallback)
        assert sm.checksum() == checksum, "a refused search did not restore W_t"
        if r >= 0:
            step_s.append(t_step)
            print(f"  round {r}: step {t_step:.3f} s, "
                  + ", ".join(f"{k} {raw[k]['total'][-1]:.3f} s" for k in names), flush=True)
    return step_s, raw, cosines, fallbacks


def search_stats(runs: dict[str, Any], step_s: list[float], raw: dict, cosines: dict,
                 fallbacks: dict, opd_over_step: float) -> dict[str, Any]:
    out = {}
    for name, ex in runs.items():
        d = raw[name]
        out[name] = {
            "seconds": {k: v for k, v in d.items()},
            "median_s": {k: stats(v)["median"] for k, v in d.items()},
            "over_step": {k: stats(ratios(v, step_s))["median"] for k, v in d.items()},
            "total_over_step": stats(ratios(d["total"], step_s)),
            "total_over_opd_step": stats(ratios(d["total"], step_s))["median"] / opd_over_step,
            "secant_cosine": cosines[name],
            # after/low-rank: entries whose new anchor was compressed from the weights (the
            # pass's products were ill-conditioned), of those compressed
            "weight_captures": fallbacks[name],
            "compressed_entries": sum(1 for e in getattr(ex.store, "_entries", []) if "U" in e),
            "anchor_bytes": ex.nbytes()["anchor"],
            "reference_bytes": getattr(ex.store, "reference_nbytes", lambda: 0)(),
        }
    return out


def bench_search(device, args) -> dict[str, Any]:
    """One search with a free gate that refuses its first candidate (backup, Δ, sketch, one
    candidate, restore, new anchor), part by part, on the real SmolLM2-135M (or a stand-in of
    its shapes; ``--smoke``: a small model), next to a bare AdamW step in the same round; for
    this checkout and, with ``--baseline``, an older copy of the library."""
    import lookahead_opd

    sm = SearchModel(args, device)
    real = sm.what.startswith("SmolLM2")
    opd = opd_steps(args, device, sm.adamw_step) if real and args.opd_steps else None
    libraries = {"after": lookahead_opd}
    if args.baseline:
        libraries = {"before": load_library(args.baseline), **libraries}
    stores = {"full": {"snapshot": "full"},
              f"lowrank_r{args.search_rank}": {"snapshot": "lowrank", "rank": args.search_rank}}
    runs = {f"{v}/{s}": lib.Extrapolator(sm.named, free_eval, schedule=NEVER, **BARE, **kw)
            for v, lib in libraries.items() for s, kw in stores.items()}
    print(f"search section: {sm.n_params:,} params, {list(runs)}", flush=True)
    step_s, raw, cosines, fallbacks = search_rounds(args, sm, runs, libraries)
    # One OPD step in bare AdamW steps: measured here, or issue 27's figure without the model.
    opd_over_step = (opd["over_adamw"]["median"] if opd is not None
                     else OPD_STEP_S / ISSUE_ADAMW_STEP_S)
    return {"model": sm.what, "shape": sm.shape, "n_params": sm.n_params,
            "rounds": args.search_rounds, "opd": opd, "opd_over_step": opd_over_step,
            "step_s": step_s, "step": stats(step_s),
            "runs": search_stats(runs, step_s, raw, cosines, fallbacks, opd_over_step)}


# --------------------------------------------------------------------------- report


def _cell(run: dict[str, Any] | None, label: str) -> str:
    if run is None:
        return "—"
    if label not in run["median_s"]:
        inside = label in ("backup", "apply", "delta") and "pass" in run["median_s"]
        return "in the pass" if inside else "—"
    return f"{run['median_s'][label]:.3f} s ({run['over_step'][label]:.2f}×)"


def render_search(d: dict[str, Any]) -> list[str]:
    """Section 4: one table, the parts of a search as rows, before/after × full/low-rank as
    columns (seconds, and × one bare AdamW step)."""
    runs = d["runs"]
    names = [k for k in ("before/full", "after/full") if k in runs] + sorted(
        k for k in runs if "lowrank" in k)
    names = sorted(names, key=lambda k: ("lowrank" in k, not k.startswith("before")))
    shape = d["shape"]
    out = [
        f"## 4. One search on a {d['n_params'] / 1e6:.1f}M-parameter model, part by part",
        "",
        f"{d['model']}, fp32: {shape['num_hidden_layers']} layers, hidden {shape['hidden_size']}, "
        f"intermediate {shape['intermediate_size']}, {shape['num_attention_heads']} heads "
        f"({shape['num_key_value_heads']} kv), vocab {shape['vocab_size']}, tied embeddings; "
        f"{d['n_params']:,} parameters. A free gate refuses the first candidate, so each "
        "search is: score W_t, backup, Δ, sketch, one candidate, score it, restore, new anchor. "
        f"Bare AdamW step (random gradients, `opt.step()` alone): median "
        f"{d['step']['median']:.3f} s over {d['rounds']} rounds, each round timing the step and "
        "every search once, in alternating order. Cells: median seconds (median of the per-round "
        "ratios to that round's AdamW step). 'before' is the library at the commit given to "
        "`--baseline`, 'after' this checkout; both run in the same process and rounds. "
        "Where the issue started (this report as committed at 8e63bed, its 'before' = 5179b80, on a random-init "
        "stand-in of the same shapes): 16.6 s = 14.4× a bare AdamW step with the full store, "
        "17.6 s = 15.1× with low-rank r=16, 14.8–15.1 s of it the sketch.",
        "",
    ]
    headers = ["part of a search"] + [k.replace("lowrank_r", "low-rank r=") for k in names]
    rows = [[text] + [_cell(runs[k], label) for k in names] for label, text in PARTS]
    rows.append(["**total without the gate**"] + [
        f"**{runs[k]['median_s']['total']:.3f} s ({runs[k]['total_over_step']['median']:.2f}×)**"
        for k in names])
    rows.append([f"total / one OPD step (= {d['opd_over_step']:.1f} AdamW steps)"] + [
        f"{runs[k]['total_over_opd_step']:.3f}" for k in names])
    rows.append(["gate: 2 calls of a free eval_fn"] + [
        f"{runs[k]['median_s']['gate'] * 1e3:.2f} ms" for k in names])
    rows.append(["anchor held between searches (+ CPU reference)"] + [
        mib(runs[k]["anchor_bytes"]) + (f" (+ {mib(runs[k]['reference_bytes'])})"
                                        if runs[k]["reference_bytes"] else "") for k in names])
    return out + [markdown_table(headers, rows), ""]


def search_lines(d: dict[str, Any]) -> list[str]:
    runs = d["runs"]
    ratio = {k: runs[k]["total_over_step"] for k in runs}
    after = [k for k in runs if k.startswith("after/")]
    before = [k for k in runs if k.startswith("before/")]

    def say(keys: list[str]) -> str:
        return ", ".join(f"{k.split('/')[1].replace('lowrank_r', 'low-rank r=')} "
                         f"{ratio[k]['median']:.2f}× [{ratio[k]['p10']:.2f}–{ratio[k]['p90']:.2f}]"
                         for k in keys)

    line = (f"- **One search on the {d['n_params'] / 1e6:.0f}M model:** without the gate, a "
            f"one-candidate search costs {say(after)} of a bare AdamW step (target ≤ 2×)")
    if before:
        line += f"; before: {say(before)}"
    opd = d.get("opd")
    if opd is not None:
        c = opd["config"]
        source = (f"one plain step of the loop's trainer measured here: {c['batch_size']} "
                  f"{c['task']} prompts × {c['max_new_tokens']} new tokens, loss {c['loss']}, "
                  f"{c['optimizer']} on every weight, the model as its own teacher; median "
                  f"{opd['step']['median']:.1f} s over {len(opd['step_s'])} steps, "
                  f"{d['opd_over_step']:.1f}× the bare AdamW step timed after each")
    else:
        source = (f"issue 27 measured {OPD_STEP_S:.0f} s, {d['opd_over_step']:.1f}× its "
                  f"{ISSUE_ADAMW_STEP_S} s bare AdamW step; not measured here")
    line += (f". As a share of one OPD step on this model ({source}): " + ", ".join(
        f"{k} {runs[k]['total_over_opd_step']:.1%}" for k in runs) + ".")
    low = [k for k in after if "lowrank" in k and runs[k].get("compressed_entries")]
    for k in low:
        line += (f" The {k} store built its new anchor from the pass's products for all but "
                 f"{max(runs[k]['weight_captures'])} of its {runs[k]['compressed_entries']} "
                 "compressed matrices in every search (the rest, ill-conditioned, from the "
                 "weights).")
    cos = {k: [c for c in runs[k]["secant_cosine"] if c is not None] for k in runs}
    if all(cos.values()) and before:
        line += (" The secant cosines the two versions report for the same searches: "
                 + "; ".join(f"{k}: {', '.join(f'{c:.3f}' for c in cos[k])}" for k in runs) + ".")
    return [line]
