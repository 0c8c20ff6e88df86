"""One decision on every rank.

Under ``torch.distributed`` each rank scores a candidate on its own slice of the gate set;
the scores are averaged (``reduce="mean"``) or rank 0's is broadcast (``reduce="rank0"``) so
that every rank accepts or rejects the same candidates and DDP replicas stay identical.
FSDP2 parameters are DTensors: the extrapolator works on their local shards. FSDP2 keeps
the root module (and any module built with ``reshard_after_forward=False``) unsharded after a
no-grad forward, so an ``eval_fn`` that only runs forwards would leave the model computing with
a stale all-gathered copy, blind to the candidates written into the shards. Wrap it:
``eval_fn=resharding(model, eval_fn)``.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch
import torch.distributed as dist
from torch import Tensor, nn

T = TypeVar("T")

__all__ = [
    "REDUCTIONS",
    "ShardLayout",
    "is_distributed",
    "rank_and_size",
    "reduce_score",
    "all_reduce_sum",
    "local_tensor",
    "shard_layout",
    "square_sum",
    "resharding",
]

REDUCTIONS = ("mean", "rank0")


def is_distributed(group: object | None = None) -> bool:
    """True when a process group is initialised and has more than one rank."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1


def rank_and_size(group: object | None = None) -> tuple[int, int]:
    """This process's rank in ``group`` and the group's size; ``(0, 1)`` when not distributed."""
    if not is_distributed(group):
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def _score_device(group: object | None) -> torch.device:
    # NCCL only moves CUDA tensors; gloo and the rest take CPU ones.
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def reduce_score(score: float, how: str = "mean", group: object | None = None) -> float:
    """The score every rank acts on: the mean over ranks, or rank 0's. A no-op when not
    distributed. A NaN on any rank makes the mean NaN, so all ranks reject together."""
    if how not in REDUCTIONS:
        raise ValueError(f"reduce must be one of {REDUCTIONS}, got {how!r}")
    if not is_distributed(group):
        return score
    t = torch.tensor([score], dtype=torch.float64, device=_score_device(group))
    if how == "mean":
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
        t /= dist.get_world_size(group)
    else:
        src = dist.get_global_rank(group, 0) if group is not None else 0
        dist.broadcast(t, src=src, group=group)
    return float(t.item())


def all_reduce_sum(t: Tensor, group: object | None = None) -> Tensor:
    """``t`` summed over the ranks of ``group`` (on ``t``'s device); ``t`` itself when not
    distributed. Every rank gets the same bits."""
    if not is_distributed(group):
        return t
    buf = t.to(_score_device(group))
    dist.all_reduce(buf, op=dist.ReduceOp.SUM, group=group)
    return buf.to(t.device)


@dataclass(frozen=True)
class ShardLayout:
    """Where a DTensor's local shard sits in the global tensor: the global shape, the local
    shard's offset along each dim, and how many ranks hold this same shard (replicated mesh
    dims)."""

    global_shape: tuple[int, ...]
    offset: tuple[int, ...]
    replicas: int


def shard_layout(param: Tensor) -> ShardLayout | None:
    """The layout of a DTensor's local shard, ``None`` for a plain tensor (every rank holds
    all of it, as under DDP)."""
    if type(param).__name__ != "DTensor":
        return None
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    mesh, placements = param.device_mesh, param.placements
    _, offset = compute_local_shape_and_global_offset(param.shape, mesh, placements)
    replicas = math.prod(mesh.size(d) for d, pl in enumerate(placements) if pl.is_replicate())
    return ShardLayout(tuple(param.shape), tuple(offset), replicas)


def local_tensor(param: Tensor) -> Tensor:
    """The tensor the extrapolator reads and writes: a DTensor's local shard, else itself."""
    to_local = getattr(param, "to_local", None)
    if to_local is not None and type(param).__name__ == "DTensor":
        return to_local()
    return param


def square_sum(params: Sequence[Tensor], local: Sequence[float]) -> float:
    """``Σ local[i]`` where ``local[i]`` is a sum of squares over ``params[i]``'s local tensor,
    made whole: the sums of a DTensor sharded over some mesh dimensions are added up over
    those dimensions' ranks (collective: every rank calls it with the same parameters);
    replicated tensors count once. Without DTensors, the plain sum."""
    total = 0.0
    sharded: dict[tuple[int, tuple[int, ...]], list] = {}
    for p, v in zip(params, local, strict=True):
        dims = tuple(d for d, pl in enumerate(getattr(p, "placements", ())) if pl.is_shard())
        if type(p).__name__ != "DTensor" or not dims:
            total += v
            continue
        entry = sharded.setdefault((id(p.device_mesh), dims), [p.device_mesh, 0.0])
        entry[1] += v
    for (_, dims), (mesh, v) in sharded.items():  # in parameter order: the same on every rank
        t = torch.tensor([v], dtype=torch.float64, device=_mesh_device(mesh))
        for d in dims:
            dist.all_reduce(t, group=mesh.get_group(d))
        total += float(t.item())
    return total


def _mesh_device(mesh: object) -> torch.device:
    if getattr(mesh, "device_type", "cpu") == "cpu":
        return torch.device("cpu")
    return torch.device(mesh.device_type, torch.cuda.current_device())  # type: ignore[attr-defined]


def _fsdp_module_type() -> type | None:
    try:
        from torch.distributed.fsdp import FSDPModule  # torch >= 2.6
    except ImportError:
        try:
            from torch.distributed._composable.fsdp import FSDPModule
        except ImportError:
            return None
    return FSDPModule


def resharding(module: nn.Module, eval_fn: Callable[[], T]) -> Callable[[], T]:
    """``eval_fn`` followed by ``reshard()`` of every FSDP2 module in ``module``, so the next
    forward all-gathers the shards the extrapolator wrote. Harmless without FSDP2."""
    fsdp_type = _fsdp_module_type()

    @functools.wraps(eval_fn)
    def wrapped() -> T:
        try:
            return eval_fn()
        finally:
            if fsdp_type is not None:
                for m in module.modules():
                    if isinstance(m, fsdp_type):
                        m.reshard()

    return wrapped
