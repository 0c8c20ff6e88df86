"""Shared setup for the two-process gloo tests: launching, the tiny problem, the workers.

``launch(worker, tmp_path, *args)`` runs ``worker(rank, *args)`` in ``WORLD_SIZE`` spawned
processes joined by a gloo group (a ``FileStore`` in ``tmp_path``, so no port can clash).
Each worker returns a dict of plain data; it is saved to ``tmp_path`` and handed back to the
parent, which does the asserting. A failing child makes ``mp.spawn(join=True)`` raise in the
parent (and terminate the other child), so nothing hangs silently.

The problem: a 4-7-1 tanh MLP (7 rows shard unevenly over two ranks under FSDP2, and the last
layer's rows leave rank 1 with empty shards), a regression target, one global batch of 16 per
step of which each rank takes its half, and a gate set of 32 of which each rank scores its half.
"""

from __future__ import annotations

import math
import os
import warnings
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

from lookahead_opd import PAPER_RULE, ExtrapolatingOptimizer
from lookahead_opd.distributed import resharding

WORLD_SIZE = 2
STEPS = 16  # searches after steps 1, 2, 4, 8, 16
GLOBAL_BATCH = 16
GATE_SIZE = 32
LR = 0.05
NOISE = 0.02  # size of the rank-dependent score offsets


# ---------------------------------------------------------------------- launching
def launch(worker, tmp_path: Path, *args) -> list[dict]:
    """Run ``worker(rank, *args)`` on every rank; return what each rank returned."""
    mp.spawn(_entry, args=(worker, str(tmp_path), args), nprocs=WORLD_SIZE, join=True)
    return [torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD_SIZE)]


def _entry(rank: int, worker, tmp: str, args: tuple) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{tmp}/store",
        rank=rank,
        world_size=WORLD_SIZE,
        timeout=timedelta(seconds=30),
    )
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            result = worker(rank, *args)
        result["warnings"] = [(w.category.__name__, str(w.message)) for w in caught]
        torch.save(result, f"{tmp}/rank{rank}.pt")
        # Both ranks finished every collective before either leaves.
        dist.barrier()
    except BaseException:
        dist.destroy_process_group()
        raise
    # Leave without tearing gloo down: even after the barrier, destroying the group (or the
    # interpreter's exit) now and then aborted a child in gloo's thread destructors ("terminate
    # called without an active exception", SIGABRT; seen twice in CI). The result is saved and
    # every collective is done, so nothing is lost by skipping them.
    os._exit(0)


# ---------------------------------------------------------------------- the problem
def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 7), nn.Tanh(), nn.Linear(7, 1))


def _target(x: torch.Tensor) -> torch.Tensor:
    return torch.sin(x.sum(dim=-1, keepdim=True))


def _data() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(STEPS, GLOBAL_BATCH, 4, generator=g)
    gx = torch.randn(GATE_SIZE, 4, generator=g)
    return x, _target(x), gx, _target(gx)


TRAIN_X, TRAIN_Y, GATE_X, GATE_Y = _data()


def part(t: torch.Tensor, rank: int | None, dim: int = 0) -> torch.Tensor:
    """Rank ``rank``'s equal slice of ``t`` along ``dim``; all of it for ``rank=None``."""
    return t if rank is None else t.chunk(WORLD_SIZE, dim=dim)[rank]


def gate_score(model: nn.Module, rank: int | None) -> float:
    """Minus the gate MSE on rank ``rank``'s half of the gate set (``None``: the mean of the
    two halves' scores, what ``reduce="mean"`` computes across two ranks)."""
    if rank is None:
        return sum(gate_score(model, r) for r in range(WORLD_SIZE)) / WORLD_SIZE
    with torch.no_grad():
        return -float(F.mse_loss(model(part(GATE_X, rank)), part(GATE_Y, rank)))


def train(model: nn.Module, opt: torch.optim.Optimizer, rank: int | None, after_step=None) -> None:
    """``STEPS`` steps on rank ``rank``'s half of each global batch (``None``: all of it);
    ``after_step(step)`` is called after each, with steps counted from 1."""
    for step in range(STEPS):
        loss = F.mse_loss(model(part(TRAIN_X[step], rank)), part(TRAIN_Y[step], rank))
        loss.backward()
        opt.step()
        opt.zero_grad()
        if after_step is not None:
            after_step(step + 1)


# ---------------------------------------------------------------------- score offsets
def alternating(rank: int, k: int) -> float:
    """±NOISE, opposite on the two ranks and flipping with every evaluation ``k``: the mean
    of the offsets is ~0, but each rank alone sees a biased comparison."""
    return NOISE * (-1.0) ** (rank + k)


def nan_on_rank1_first_candidate(rank: int, k: int) -> float:
    """NaN on rank 1's second evaluation (the first candidate of the first search)."""
    return math.nan if (rank, k) == (1, 1) else 0.0


# ---------------------------------------------------------------------- workers
def _params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def ddp_worker(rank: int, reduce: str, offset, options: dict | None = None) -> dict:
    """DDP training whose gate is this rank's gate half plus ``offset(rank, k)`` at the
    ``k``-th evaluation (``options``: more ``ExtrapolatingOptimizer`` options). Records the raw
    scores, the weights each evaluation saw, and ``lr_scale`` after each step."""
    model = make_model()
    ddp = nn.parallel.DistributedDataParallel(model)
    raw: list[float] = []
    seen: list[dict[str, torch.Tensor]] = []

    def eval_fn() -> float:
        seen.append(_params(model))
        raw.append(gate_score(ddp, rank) + offset(rank, len(raw)))
        return raw[-1]

    opt = ExtrapolatingOptimizer(torch.optim.SGD(ddp.parameters(), lr=LR), eval_fn, reduce=reduce,
                                 **{**PAPER_RULE, **(options or {})})
    after: dict[int, dict[str, torch.Tensor]] = {}
    scales: list[float] = []

    def record(step: int) -> None:
        after[step] = _params(model)
        scales.append(opt.lr_scale)

    train(ddp, opt, rank, record)
    return {
        "scales": scales,
        "history": [r.to_dict() for r in opt.history],
        "raw": raw,
        "seen": seen,
        "after": after,
        "params": _params(model),
        "anchors": _anchors(opt),
    }


def _anchors(opt: ExtrapolatingOptimizer) -> list[torch.Tensor]:
    """This rank's anchors (its local shards under FSDP), as the store rebuilds them."""
    ex = opt.extrapolator
    return [ex.store.anchor(i, torch.device("cpu")) for i in range(len(ex.params))]


def fsdp_worker(rank: int, options: dict | None = None) -> dict:
    """FSDP2 training with AdamW: ``fully_shard`` on the first layer and on the root (which
    then owns the last layer's params, as a root owns embeddings in real models). Returns the
    history, the local shard shapes and the gathered full parameters."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = make_model()
    mesh = init_device_mesh("cpu", (WORLD_SIZE,))
    fully_shard(model[0], mesh=mesh)
    fully_shard(model, mesh=mesh)
    # Without resharding, the root would keep its stale all-gathered params after the gate's
    # no-grad forwards and never see a candidate.
    eval_fn = resharding(model, lambda: gate_score(model, rank))
    opt = ExtrapolatingOptimizer(torch.optim.AdamW(model.parameters(), lr=LR), eval_fn,
                                 **{**PAPER_RULE, **(options or {})})
    train(model, opt, rank)
    return {
        "anchors": _anchors(opt),
        "history": [r.to_dict() for r in opt.history],
        "local_shapes": [tuple(p.to_local().shape) for p in model.parameters()],
        "params": {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()},
    }


def sketch_worker(rank: int) -> dict:
    """The secant sketch of one direction held three ways: replicated on both ranks (large
    enough to span several chunks), as DTensor row shards and as DTensor column shards."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from lookahead_opd.distributed import local_tensor, shard_layout
    from lookahead_opd.sketch import SecantSketch

    mesh = init_device_mesh("cpu", (WORLD_SIZE,))
    big, w = sketch_inputs()
    sketch = SecantSketch(big.numel() + w.numel())
    out = {"replicated": sketch.measure([(0, big, None), (1, w, None)])}
    for name, dim in (("rows", 0), ("cols", 1)):
        d = distribute_tensor(w, mesh, [Shard(dim)])
        out[name] = sketch.measure([(0, big, None), (1, local_tensor(d), shard_layout(d))])
    return out


def sketch_inputs() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return torch.randn(700_000, generator=g), torch.randn(7, 301, generator=g)


def reference_run() -> dict:
    """The FSDP run without FSDP: one process, the whole global batch, the mean gate."""
    model = make_model()
    opt = ExtrapolatingOptimizer(
        torch.optim.AdamW(model.parameters(), lr=LR), lambda: gate_score(model, None), **PAPER_RULE
    )
    train(model, opt, None)
    return {"history": [r.to_dict() for r in opt.history], "params": _params(model)}
