"""A torch-only example: the same small regression trained with and without the wrapper.

Run it with ``lookahead-opd toy``. A two-layer MLP learns a random linear-plus-tanh target with
small-lr SGD, the regime where consecutive updates point the same way, so the gated jumps
(scored on a held-out validation loss) are accepted; both loss curves are printed side by side.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lookahead_opd.optimizer import ExtrapolatingOptimizer

__all__ = ["ToyResult", "run_toy", "format_result", "main"]


@dataclass
class ToyResult:
    """Validation losses after each step (index 0 = before training) and the searches."""

    plain: list[float]
    wrapped: list[float]
    jumps: list  # JumpRecord, one per search of the wrapped run


def _data(seed: int, dim: int) -> tuple[torch.Tensor, ...]:
    """Noisy training pairs and clean validation pairs from one random target."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(dim, 1, generator=g) / dim**0.5
    x_train, x_val = torch.randn(4096, dim, generator=g), torch.randn(512, dim, generator=g)
    y_train = torch.tanh(x_train @ w) + 0.05 * torch.randn(4096, 1, generator=g)
    return x_train, y_train, x_val, torch.tanh(x_val @ w)


def _model(seed: int, dim: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(dim, 64), nn.Tanh(), nn.Linear(64, 1))


def run_toy(steps: int = 256, *, lr: float = 0.005, seed: int = 0, dim: int = 16,
            **options: Any) -> ToyResult:
    """Train the same initial model twice on the same batches: plain SGD, then wrapped (with
    ``ExtrapolatingOptimizer``'s keyword ``options``)."""
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    x_train, y_train, x_val, y_val = _data(seed, dim)
    loss_fn = nn.MSELoss()

    def curve(wrap: bool) -> tuple[list[float], list]:
        model = _model(seed, dim)

        def val_loss() -> float:
            with torch.no_grad():
                return loss_fn(model(x_val), y_val).item()

        opt: torch.optim.Optimizer = torch.optim.SGD(model.parameters(), lr=lr)
        if wrap:
            opt = ExtrapolatingOptimizer(opt, eval_fn=val_loss, mode="min", **options)
        batches = torch.Generator().manual_seed(seed + 2)
        losses = [val_loss()]
        for _ in range(steps):
            idx = torch.randint(0, len(x_train), (64,), generator=batches)
            loss = loss_fn(model(x_train[idx]), y_train[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(val_loss())
        return losses, (opt.history if wrap else [])

    plain, _ = curve(False)
    wrapped, jumps = curve(True)
    return ToyResult(plain, wrapped, jumps)


def _first_at_or_below(curve: list[float], target: float) -> int | None:
    return next((step for step, v in enumerate(curve) if v <= target), None)


def format_result(result: ToyResult) -> str:
    """Both curves at steps 0, 1, 2, 4, … and the last step, then one line per search."""
    steps = len(result.plain) - 1
    marks = sorted({0, steps, *(2**k for k in range(steps.bit_length()) if 2**k <= steps)})
    lines = ["step   plain val loss   wrapped val loss   ratio"]
    for s in marks:
        p, w = result.plain[s], result.wrapped[s]
        lines.append(f"{s:>4}   {p:>14.5f}   {w:>16.5f}   {w / p:>5.2f}")
    target = 1.1 * result.plain[-1]
    reach = [_first_at_or_below(c, target) for c in (result.plain, result.wrapped)]
    shown = ["never" if r is None else str(r) for r in reach]
    lines.append(f"steps to val loss <= {target:.5f} (1.1 x plain final): "
                 f"plain {shown[0]}, wrapped {shown[1]}")
    lines.append("")
    lines.append("searches (step: score before -> accepted coefficient, evals)")
    for r in result.jumps:
        acc = "rejected" if r.accepted is None else f"c={r.accepted:g} -> {r.best_score:.5f}"
        lines.append(f"  {r.step:>4}: {r.score_before:.5f} -> {acc}  ({r.n_evals} evals)")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    from lookahead_opd.integrations.cli import ArgumentParser

    parser = ArgumentParser(prog="lookahead-opd toy", description=__doc__)
    parser.add_argument("--steps", type=int, default=256, help="SGD steps of each run")
    parser.add_argument("--lr", type=float, default=0.005, help="SGD learning rate")
    parser.add_argument("--seed", type=int, default=0, help="seed of the data, init and batches")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (one was faster than torch's default on a shared "
                             "2-core machine: benchmarks/results/threads.md)")
    try:  # bad input: one clear line and status 2
        args = parser.parse_args(argv)
        for name in ("steps", "threads"):
            if getattr(args, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(args, name)}")
        if not args.lr > 0:
            raise ValueError(f"lr must be > 0, got {args.lr}")
    except ValueError as err:
        print(f"lookahead-opd toy: {err}", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    print(format_result(run_toy(args.steps, lr=args.lr, seed=args.seed)))
    return 0
