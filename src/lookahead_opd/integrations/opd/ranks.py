"""Rank slicing and reductions of the OPD loop under ``torch.distributed`` (torchrun).

Every rank takes its slice of each step's prompts, of the gate set and of the eval set;
gradients, token counts, metric sums and eval counts are summed over ranks, and the gate's
scores are averaged by ``ExtrapolatingOptimizer`` (``reduce="mean"``), so every rank takes
the same decision and the weights stay identical. With one process every call is a no-op.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["Ranks"]

T = TypeVar("T")


@dataclass(frozen=True)
class Ranks:
    """This process's ``rank`` among ``world`` processes."""

    rank: int = 0
    world: int = 1

    @classmethod
    def current(cls) -> Ranks:
        """The initialised process group's rank and size, else a single process."""
        if dist.is_available() and dist.is_initialized():
            return cls(dist.get_rank(), dist.get_world_size())
        return cls()

    @property
    def is_main(self) -> bool:
        """Rank 0: the one that writes files."""
        return self.rank == 0

    def shard(self, items: Sequence[T]) -> list[T]:
        """This rank's slice of ``items`` (every ``world``-th, starting at ``rank``)."""
        return list(items[self.rank::self.world])

    def sum(self, values: Sequence[float]) -> list[float]:
        """``values`` summed element-wise over ranks (float64, so counts stay exact)."""
        if self.world == 1:
            return [float(v) for v in values]
        t = torch.tensor([float(v) for v in values], dtype=torch.float64)
        dist.all_reduce(t)
        return t.tolist()

    def sum_grads(self, params: Iterable[nn.Parameter]) -> None:
        """Sum gradients over ranks in one flat all-reduce: each rank's loss is already divided
        by the step's global token count, so the sum is the gradient of the global mean."""
        grads = [p.grad for p in params if p.grad is not None]
        if self.world == 1 or not grads:
            return
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat)
        offset = 0
        for g in grads:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()

    def broadcast_weights(self, module: nn.Module) -> None:
        """Give every rank rank 0's weights, whatever each rank loaded."""
        if self.world == 1:
            return
        tensors = list(module.state_dict().values())
        group = None
        if dist.get_backend() == "nccl" and any(t.device.type == "cpu" for t in tensors):
            # A model loaded to be sharded (fsdp) is still on the CPU; NCCL moves CUDA only.
            group = dist.new_group(backend="gloo")
        with torch.no_grad():
            for t in tensors:
                dist.broadcast(t, 0, group=group)

    def barrier(self) -> None:
        if self.world > 1:
            dist.barrier()
