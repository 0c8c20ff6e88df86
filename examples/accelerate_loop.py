"""EffOPD's gated extrapolation in an Accelerate loop (one process, or several with
``torchrun`` / ``accelerate launch``); torch and accelerate only, a few seconds on a CPU.

    python examples/accelerate_loop.py --cpu
    torchrun --standalone --nproc-per-node 2 examples/accelerate_loop.py --cpu   # two CPU processes
    accelerate launch --multi_gpu --num_processes 2 examples/accelerate_loop.py   # two GPUs

``accelerator.prepare`` takes the ``ExtrapolatingOptimizer`` like any optimizer: it wraps it
in an ``AcceleratedOptimizer`` whose ``step`` only reaches ours on real optimizer steps (not
on the micro-batches of ``accelerator.accumulate``), so searches fall after optimizer steps
1, 2, 4, 8, ... The prepared LR scheduler drives our ``param_groups``, and
``accelerator.save_state`` / ``load_state`` carry the extrapolator's schedule, anchor and
history inside the optimizer's state dict.

With several processes each one scores its own slice of the gate set; the extrapolator
averages the scores over the processes (``reduce="mean"``), so every process takes the same
decision and the DDP replicas stay identical.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lookahead_opd import ExtrapolatingOptimizer

DIM = 8


def make_data(seed: int, n_train: int = 2048, n_gate: int = 256) -> tuple[torch.Tensor, ...]:
    """Noisy training pairs and clean gate pairs from one random smooth target."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(DIM, 1, generator=g) / DIM**0.5
    x, x_gate = torch.randn(n_train, DIM, generator=g), torch.randn(n_gate, DIM, generator=g)
    y = torch.tanh(x @ w) + 0.05 * torch.randn(n_train, 1, generator=g)
    return x, y, x_gate, torch.tanh(x_gate @ w)


def train(
    steps: int = 32,
    *,
    lr: float = 3e-3,
    accumulate: int = 2,
    micro_batch: int = 16,
    seed: int = 0,
    cpu: bool = False,
    extrapolate: bool = True,
    save_dir: str | None = None,
) -> dict:
    """Train for ``steps`` optimizer steps and return this process's summary."""
    accelerator = Accelerator(cpu=cpu, gradient_accumulation_steps=accumulate)
    set_seed(seed)
    x, y, x_gate, y_gate = make_data(seed)
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Linear(DIM, 64), nn.Tanh(), nn.Linear(64, 1))
    # This process's slice of the gate set; the extrapolator averages the slices' scores.
    my_x = x_gate.chunk(accelerator.num_processes)[accelerator.process_index]
    my_y = y_gate.chunk(accelerator.num_processes)[accelerator.process_index]

    def gate_score() -> float:
        """Minus the gate loss on this process's slice (higher is better)."""
        with torch.no_grad():
            dev = accelerator.device
            return -F.mse_loss(net(my_x.to(dev)), my_y.to(dev)).item()

    opt: torch.optim.Optimizer = torch.optim.AdamW(net.parameters(), lr=lr)
    if extrapolate:
        opt = ExtrapolatingOptimizer(opt, eval_fn=gate_score)
    xopt = opt  # keep our handle; prepare() returns Accelerate's wrapper around it
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=steps)
    # Each process gets micro_batch examples per micro-batch.
    loader = DataLoader(
        TensorDataset(x, y),
        batch_size=micro_batch,
        shuffle=True,
        generator=torch.Generator().manual_seed(seed),
    )
    model, opt, loader, sched = accelerator.prepare(net, opt, loader, sched)
    initial = -accelerator.reduce(torch.tensor(gate_score(), device=accelerator.device), "mean")
    done = 0
    while done < steps:
        for xb, yb in loader:
            with accelerator.accumulate(model):
                loss = F.mse_loss(model(xb), yb)
                accelerator.backward(loss)
                opt.step()  # reaches ours (and its search) only when gradients sync
                sched.step()
                opt.zero_grad()
            if accelerator.sync_gradients:
                done += 1
                if done == steps:
                    break
    if save_dir is not None:
        accelerator.save_state(save_dir)  # optimizer.bin holds the extrapolator's state
    final = -accelerator.reduce(torch.tensor(gate_score(), device=accelerator.device), "mean")
    history = xopt.history if isinstance(xopt, ExtrapolatingOptimizer) else []
    result = {
        "process": accelerator.process_index,
        "processes": accelerator.num_processes,
        "wrapped": type(opt).__name__ + "(" + type(opt.optimizer).__name__ + ")",
        "gate_loss_before": float(initial),
        "gate_loss_after": float(final),
        "searches": [r.step for r in history],
        "accepted": [r.accepted for r in history],
        "scores": [[r.score_before, *r.scores] for r in history],
        "lr": sched.get_last_lr()[0],
        "params": [p.detach().cpu().flatten().tolist() for p in net.parameters()],
    }
    # Tear down together: a rank that destroys its process group while its peer still talks
    # to it can abort at exit (seen once in CI: SIGABRT in gloo's teardown).
    accelerator.wait_for_everyone()
    accelerator.end_training()
    return result


def main(argv: Sequence[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--accumulate", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cpu", action="store_true", help="force the CPU")
    parser.add_argument("--no-extrapolation", action="store_true", help="the plain baseline")
    parser.add_argument("--save-dir", default=None, help="accelerator.save_state here at the end")
    parser.add_argument("--json", action="store_true", help="print one JSON line per process")
    parser.add_argument("--out", default=None, help="write result-<process>.json into this dir")
    a = parser.parse_args(argv)
    result = train(
        a.steps,
        lr=a.lr,
        accumulate=a.accumulate,
        seed=a.seed,
        cpu=a.cpu,
        extrapolate=not a.no_extrapolation,
        save_dir=a.save_dir,
    )
    if a.out is not None:  # one file per process: their stdout lines could interleave
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, f"result-{result['process']}.json"), "w") as f:
            json.dump(result, f)
    if a.json:
        print(json.dumps(result), flush=True)
    elif result["process"] == 0:
        print(f"{result['wrapped']} on {result['processes']} process(es)")
        print(f"gate loss {result['gate_loss_before']:.4f} -> {result['gate_loss_after']:.4f}")
        for s, c in zip(result["searches"], result["accepted"], strict=True):
            print(f"  search after step {s:3d}: " + (f"jumped c={c:g}" if c else "no jump"))
    return result


if __name__ == "__main__":
    main()
