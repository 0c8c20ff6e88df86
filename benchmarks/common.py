"""Small helpers shared by the benchmarks: a GPT-style test model, synthetic data, timing,
summary statistics, machine info and result files. Depends on torch, numpy and the stdlib."""

from __future__ import annotations

import datetime
import json
import os
import platform
import shlex
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

# --------------------------------------------------------------------------- model


class Block(nn.Module):
    """Pre-norm transformer decoder block: causal self-attention + 4x GELU MLP."""

    def __init__(self, d_model: int, n_heads: int) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.ln1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.ln2 = nn.LayerNorm(d_model)
        self.fc = nn.Linear(d_model, 4 * d_model)
        self.out = nn.Linear(4 * d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        qkv = self.qkv(self.ln1(x)).view(b, t, 3, self.n_heads, d // self.n_heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class TinyGPT(nn.Module):
    """GPT-style decoder: token + learned position embeddings, ``n_layers`` blocks, final
    LayerNorm and an untied LM head. d_model 512, 13 layers, vocab 8192 is 49.4M params."""

    def __init__(
        self,
        vocab: int = 8192,
        d_model: int = 512,
        n_layers: int = 13,
        n_heads: int = 8,
        seq_len: int = 128,
    ) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d_model)
        self.pos = nn.Embedding(seq_len, d_model)
        self.blocks = nn.ModuleList(Block(d_model, n_heads) for _ in range(n_layers))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok(idx) + self.pos(pos)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))

    def loss(self, batch: torch.Tensor) -> torch.Tensor:
        logits = self(batch[:, :-1])
        return F.cross_entropy(logits.flatten(0, 1).float(), batch[:, 1:].flatten())


def markov_batches(
    n_batches: int,
    batch: int,
    seq_len: int,
    vocab: int,
    *,
    branching: int = 4,
    seed: int = 0,
    device: str | torch.device = "cpu",
) -> list[torch.Tensor]:
    """Token batches (``batch × (seq_len+1)``) from a fixed random Markov chain in which every
    token has ``branching`` possible successors: learnable structure, so gradients are
    those of real training rather than of pure noise."""
    g = torch.Generator().manual_seed(seed)
    successors = torch.randint(0, vocab, (vocab, branching), generator=g)
    out = []
    for _ in range(n_batches):
        tok = torch.randint(0, vocab, (batch,), generator=g)
        seq = [tok]
        for _ in range(seq_len):
            choice = torch.randint(0, branching, (batch,), generator=g)
            tok = successors[tok, choice]
            seq.append(tok)
        out.append(torch.stack(seq, dim=1).to(device))
    return out


# --------------------------------------------------------------------------- timing


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], Any], device: torch.device) -> tuple[float, Any]:
    """Wall seconds of ``fn()`` (device work included), and its result."""
    sync(device)
    t0 = time.perf_counter()
    out = fn()
    sync(device)
    return time.perf_counter() - t0, out


def stats(values: Sequence[float], ci: bool = False) -> dict[str, float]:
    """Median, 10th/90th percentiles, min and count of a sample; with ``ci``, also a 95%
    bootstrap confidence interval of the median (``ci_lo``, ``ci_hi``)."""
    a = np.asarray(values, dtype=np.float64)
    if a.size == 0:
        return {"n": 0}
    out = {
        "n": int(a.size),
        "median": float(np.median(a)),
        "p10": float(np.percentile(a, 10)),
        "p90": float(np.percentile(a, 90)),
        "min": float(a.min()),
    }
    if ci:
        rng = np.random.default_rng(0)
        medians = np.median(rng.choice(a, size=(2000, a.size), replace=True), axis=1)
        out["ci_lo"], out["ci_hi"] = (float(x) for x in np.percentile(medians, [2.5, 97.5]))
    return out


# --------------------------------------------------------------------------- reporting


def git_commit(cwd: str | None = None) -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:
        return None
    commit = out.stdout.strip()
    dirty = subprocess.run(
        ["git", "status", "--porcelain", "--untracked-files=no"],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=10,
    )
    return commit + ("+dirty" if dirty.stdout.strip() else "")


def cpu_model() -> str | None:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def command_line() -> str:
    """The command that is running, as a reader in the repo root would type it: the benchmarks
    run as modules (``python -m benchmarks.<name>``), whatever path started them."""
    script, *args = sys.argv
    path = Path(script)
    if path.suffix == ".py" and path.parent.name == "benchmarks":
        head = ["-m", f"benchmarks.{path.stem}"]
    else:
        head = [script]
    return "python " + " ".join(shlex.quote(a) for a in head + args)


def machine_info(device: torch.device) -> dict[str, Any]:
    info: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": command_line(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "numpy": np.__version__,
        "torch_threads": torch.get_num_threads(),
        "torch_interop_threads": torch.get_num_interop_threads(),
        "cpu_count": os.cpu_count(),
        "cpu_model": cpu_model(),
        "device": str(device),
        "git_commit": git_commit(os.path.dirname(os.path.abspath(__file__))),
    }
    try:
        info["loadavg_at_start"] = os.getloadavg()
    except OSError:
        pass
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
        info["cuda"] = torch.version.cuda
    return info


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def previous_results(out_dir: str | Path, stem: str, *, fresh: bool = False) -> dict[str, Any] | None:
    """The ``<stem>.json`` an earlier run left under ``out_dir`` (created if missing), so a
    rerun resumes from it; ``None`` when there is none or ``fresh`` asks to start over."""
    path = Path(out_dir) / f"{stem}.json"
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    if fresh or not path.exists():
        return None
    return json.loads(path.read_text())


def write_results(out_dir: str, stem: str, data: dict[str, Any], markdown: str) -> list[str]:
    """Write ``<stem>.json`` and ``<stem>.md`` under ``out_dir``; return the paths."""
    os.makedirs(out_dir, exist_ok=True)
    json_path = os.path.join(out_dir, stem + ".json")
    md_path = os.path.join(out_dir, stem + ".md")
    with open(json_path, "w") as f:
        json.dump(data, f, indent=1)
        f.write("\n")
    with open(md_path, "w") as f:
        f.write(markdown.rstrip() + "\n")
    return [json_path, md_path]


def mib(nbytes: float) -> str:
    return f"{nbytes / 2**20:.2f} MiB"
