"""EffOPD's gated extrapolation in a plain PyTorch loop (torch only, a few seconds on a CPU).

    python examples/raw_loop.py                 # train, print the searches and the gate loss
    python examples/raw_loop.py --json          # one JSON line instead (what the tests read)
    python examples/raw_loop.py --save-at 12 --checkpoint ckpt.pt   # save mid-run, then
    python examples/raw_loop.py --resume ckpt.pt                    # continue from it

A small MLP learns a smooth target with AdamW under a cosine LR schedule and gradient
accumulation. The only changes to an ordinary loop are the two marked ``# EffOPD`` lines:
wrap the optimizer, and give it a gate score (minus the loss on a held-out gate set, so that
higher is better). The wrapper searches after optimizer steps 1, 2, 4, 8, ... and keeps a jump
``W + c*(W - anchor)`` only while the gate score improves. Its ``state_dict()`` carries the
schedule, the anchor and the history, so a resumed run continues exactly where it stopped.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from lookahead_opd import ExtrapolatingOptimizer

DIM = 8


def make_data(seed: int, n_train: int = 2048, n_gate: int = 256) -> tuple[torch.Tensor, ...]:
    """Noisy training pairs and clean gate pairs from one random smooth target."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(DIM, 1, generator=g) / DIM**0.5
    x, x_gate = torch.randn(n_train, DIM, generator=g), torch.randn(n_gate, DIM, generator=g)
    y = torch.tanh(x @ w) + 0.05 * torch.randn(n_train, 1, generator=g)
    return x, y, x_gate, torch.tanh(x_gate @ w)


def make_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(DIM, 64), nn.Tanh(), nn.Linear(64, 1))


def train(
    steps: int = 32,
    *,
    lr: float = 3e-3,
    accumulate: int = 2,
    micro_batch: int = 16,
    seed: int = 0,
    extrapolate: bool = True,
    save_at: int | None = None,
    checkpoint: str | None = None,
    resume: str | None = None,
) -> dict:
    """Train for ``steps`` optimizer steps (each of ``accumulate`` micro-batches) and return a
    summary: the gate loss before and after, the searches, and a checksum of the weights."""
    x, y, x_gate, y_gate = make_data(seed)
    model = make_model(seed)

    def gate_score() -> float:
        """Minus the gate loss: the extrapolator maximises it."""
        with torch.no_grad():
            return -F.mse_loss(model(x_gate), y_gate).item()

    opt: torch.optim.Optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    if extrapolate:
        opt = ExtrapolatingOptimizer(opt, eval_fn=gate_score)  # EffOPD: the one wrapper
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=steps)
    start = 0
    if resume is not None:
        ckpt = torch.load(resume, weights_only=True)
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["optimizer"])  # EffOPD: schedule, anchor and history too
        sched.load_state_dict(ckpt["scheduler"])
        start = ckpt["step"]
    initial = -gate_score()
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed + 1))
    per_step = accumulate * micro_batch
    for step in range(start, steps):
        batch = order[(step * per_step) % len(x) :][:per_step]
        for micro in batch.split(micro_batch):
            loss = F.mse_loss(model(x[micro]), y[micro]) / accumulate
            loss.backward()
        opt.step()  # a search runs in here after steps 1, 2, 4, 8, ...
        sched.step()
        opt.zero_grad()
        if save_at is not None and step + 1 == save_at and checkpoint is not None:
            state = {"model": model.state_dict(), "optimizer": opt.state_dict()}
            torch.save({**state, "scheduler": sched.state_dict(), "step": step + 1}, checkpoint)
    history = opt.history if isinstance(opt, ExtrapolatingOptimizer) else []
    return {
        "gate_loss_before": initial,
        "gate_loss_after": -gate_score(),
        "searches": [r.step for r in history],
        "accepted": [r.accepted for r in history],
        "evals": sum(r.n_evals for r in history),
        "lr": sched.get_last_lr()[0],
        "checksum": float(sum(p.detach().double().sum() for p in model.parameters())),
    }


def main(argv: Sequence[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--accumulate", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-extrapolation", action="store_true", help="the plain baseline")
    parser.add_argument("--save-at", type=int, default=None)
    parser.add_argument("--checkpoint", default=None)
    parser.add_argument("--resume", default=None)
    parser.add_argument("--json", action="store_true", help="print one JSON line")
    a = parser.parse_args(argv)
    result = train(
        a.steps,
        lr=a.lr,
        accumulate=a.accumulate,
        seed=a.seed,
        extrapolate=not a.no_extrapolation,
        save_at=a.save_at,
        checkpoint=a.checkpoint,
        resume=a.resume,
    )
    if a.json:
        print(json.dumps(result))
    else:
        print(f"gate loss {result['gate_loss_before']:.4f} -> {result['gate_loss_after']:.4f}")
        for s, c in zip(result["searches"], result["accepted"], strict=True):
            print(f"  search after step {s:3d}: " + (f"jumped c={c:g}" if c else "no jump"))
    return result


if __name__ == "__main__":
    main()
