"""What the OPD loop needs from FSDP2 (``--fsdp`` under ``torchrun``), in one place.

- ``shard``: ``fully_shard`` on every decoder block (the classes a Hugging Face model names in
  ``_no_split_modules``) and then at the root, which takes the rest (embeddings, final norm,
  ``lm_head``). For the student the gradients are *summed* over ranks, not averaged: the loss
  is already divided by the step's token count over all ranks, as on the replicated path.
- ``reshard``: free every all-gathered copy, so the next forward gathers the shards again
  (after weights were written into the shards outside of FSDP: a gate candidate, a load).
- ``gathered_weights``: the full weights, one block at a time, for an engine that holds its own
  copy of the model (vLLM); a rank never holds more than one block of gathered weights.
- ``save_state`` / ``load_state``: the student and the base optimizer through
  ``torch.distributed.checkpoint`` (each rank writes its shards; reloadable at any world size).
- ``resident_nbytes``: what a rank keeps between steps (parameter, optimizer and anchor shards).

Sharded parameters are ``DTensor``s; the extrapolator works on their local shards
(``lookahead_opd.distributed.local_tensor``).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

__all__ = ["require_process_group", "decoder_blocks", "train_top_blocks", "shard", "is_sharded", "reshard",
           "gathered_weights", "save_state", "load_state", "resident_nbytes"]



def require_process_group() -> None:
    """Raise a one-line ``ValueError`` unless a ``torch.distributed`` group is initialised."""
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError("fsdp needs a torch.distributed process group: run under torchrun "
                         "(torchrun --nproc-per-node N -m lookahead_opd.integrations.cli train --fsdp ...)")


def decoder_blocks(model: nn.Module) -> list[nn.Module]:
    """The modules sharded one by one: those whose class the model lists in
    ``_no_split_modules`` (Hugging Face's name for its decoder layer), outermost only."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    blocks: list[nn.Module] = []
    for m in model.modules():
        # fully_shard swaps in a subclass (FSDPQwen2DecoderLayer): match the class's ancestry.
        if names & {c.__name__ for c in type(m).__mro__} and not any(_contains(b, m) for b in blocks):
            blocks.append(m)
    if not blocks:
        raise ValueError(f"{type(model).__name__} names no decoder block class in "
                         f"_no_split_modules (got {sorted(names)}); --fsdp shards one block at a time")
    return blocks


def train_top_blocks(model: nn.Module, k: int) -> list[str]:
    """Freeze every weight of ``model`` except those of its top ``k`` decoder blocks (the last
    ``k`` of ``decoder_blocks``); embeddings, the final norm and ``lm_head`` stay frozen.
    Returns the names left trainable. Simpler than LoRA: the trained weights are ordinary
    weights, so the gated jump extrapolates them directly (no adapter product to keep), and a
    delta of those blocks alone rebuilds the model."""
    blocks = decoder_blocks(model)
    if not 1 <= k <= len(blocks):
        raise ValueError(f"train_top_blocks must be in 1..{len(blocks)} for "
                         f"{type(model).__name__} ({len(blocks)} decoder blocks), got {k}")
    model.requires_grad_(False)
    for block in blocks[-k:]:
        block.requires_grad_(True)
    return [n for n, p in model.named_parameters() if p.requires_grad]


def _contains(outer: nn.Module, inner: nn.Module) -> bool:
    return any(m is inner for m in outer.modules())


def _fsdp_module_type() -> type:
    from torch.distributed.fsdp import FSDPModule

    return FSDPModule


def is_sharded(model: nn.Module) -> bool:
    """Whether ``fully_shard`` was applied to ``model`` (at its root)."""
    return isinstance(model, _fsdp_module_type())


def shard(model: nn.Module, *, train: bool, mixed_precision: str = "none",
          device: str | torch.device | None = None, mesh: Any = None) -> nn.Module:
    """``fully_shard`` every decoder block, then the root, over ``mesh`` (default: all ranks
    of the default group on ``device``'s type, default the parameters' device). A model on
    the CPU is moved to ``device`` one block at a time, as each is sharded. ``train``: gradients
    are summed over ranks. ``mixed_precision`` (``bfloat16``/``float16``): the dtype the
    gathered weights compute in; gradients are reduced in float32 and the shards (and so the
    optimizer state) keep their own dtype. Every module reshards after its forward (the root included), so
    between steps a rank holds only its shards. Returns ``model`` (now an ``FSDPModule``)."""
    require_process_group()
    if mixed_precision not in ("none", "bfloat16", "float16"):
        raise ValueError(f"mixed_precision must be none, bfloat16 or float16; got {mixed_precision!r}")
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if mesh is None:
        device_type = torch.device(device).type if device is not None else next(
            model.parameters()).device.type
        mesh = init_device_mesh(device_type, (dist.get_world_size(),))
    policy = MixedPrecisionPolicy() if mixed_precision == "none" else MixedPrecisionPolicy(
        param_dtype=getattr(torch, mixed_precision), reduce_dtype=torch.float32)
    for block in decoder_blocks(model):
        fully_shard(block, mesh=mesh, mp_policy=policy, reshard_after_forward=True)
    fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=True)
    if train:
        for m in _fsdp_modules(model):
            # Sum, as the replicated path's all_reduce does. Forcing SUM (divided by 1.0 after)
            # also keeps gloo, which has no PREMUL_SUM, on a reduction it supports.
            m.set_gradient_divide_factor(1.0)
            m.set_force_sum_reduction_for_comms(True)
    return model


def _fsdp_modules(model: nn.Module) -> list[nn.Module]:
    fsdp = _fsdp_module_type()
    return [m for m in model.modules() if isinstance(m, fsdp)]


def reshard(model: nn.Module) -> None:
    """Drop every all-gathered parameter of ``model``; the next forward gathers the shards."""
    for m in _fsdp_modules(model):
        m.reshard()


def _is_dtensor(t: Tensor) -> bool:
    return type(t).__name__ == "DTensor"


def _owner(model: nn.Module, blocks: list[nn.Module]) -> dict[int, int]:
    """Parameter id -> index of the block holding it (absent: the root's)."""
    out: dict[int, int] = {}
    for i, b in enumerate(blocks):
        for p in b.parameters():
            out[id(p)] = i
    return out


def gathered_weights(model: nn.Module) -> Iterator[tuple[str, Tensor]]:
    """``(name, full tensor)`` for every parameter of ``model`` (a tied one once, under its
    first name), gathered one block at a time: the root's leading parameters (embeddings), each
    decoder block, the root's trailing ones (final norm, ``lm_head``). A block's gathered
    tensors are released before the next block is gathered, so a consumer that copies each
    tensor into its own model (vLLM's ``load_weights``) never makes a rank hold a second full
    copy of the model. Every rank must consume the iterator to the end, in step: each block is
    an all-gather. Unsharded parameters are yielded as they are (detached)."""
    blocks = decoder_blocks(model) if is_sharded(model) else []
    owner = _owner(model, blocks)
    groups: list[list[tuple[str, Tensor]]] = []
    last: object = object()
    for name, p in model.named_parameters():
        key = owner.get(id(p), "root")
        if key != last:
            groups.append([])
            last = key
        groups[-1].append((name, p))
    with torch.no_grad():
        for group in groups:
            block = [(n, p.full_tensor() if _is_dtensor(p) else p.detach()) for n, p in group]
            yield from block
            del block


def save_state(path: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Write ``model``'s and ``optimizer``'s sharded state to the directory ``path`` with
    ``torch.distributed.checkpoint`` (every rank writes its shards; collective)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=str(path))


def load_state(path: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Load what ``save_state`` wrote into ``model`` and ``optimizer`` (collective). The
    optimizer must be the base ``torch.optim`` optimizer over ``model``'s parameters."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizer)  # the targets, in this rank's layout
    state = {"model": model_sd, "optimizer": optim_sd}
    dcp.load(state, checkpoint_id=str(path))
    set_state_dict(model, optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optimizer"])
    reshard(model)


def _local(t: Tensor) -> Tensor:
    return t.to_local() if _is_dtensor(t) else t


def _storage_nbytes(tensors: Iterable[Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (a shard's padding included)."""
    seen: dict[int, int] = {}
    for t in tensors:
        s = _local(t).untyped_storage()
        seen[s.data_ptr()] = max(seen.get(s.data_ptr(), 0), s.nbytes())
    return sum(seen.values())


def resident_nbytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """What this rank keeps between steps: parameter storages, optimizer-state tensors and,
    for an ``ExtrapolatingOptimizer``, the extrapolator's anchor (and running average), which
    are sharded, and its secant sketch, which every rank holds whole."""
    base = getattr(optimizer, "base", optimizer)
    state = [v for s in base.state.values() for v in s.values() if isinstance(v, Tensor)]
    extrapolator = getattr(optimizer, "extrapolator", None)
    held = extrapolator.nbytes() if extrapolator is not None else {}
    return {"parameters": _storage_nbytes(model.parameters()),
            "optimizer": _storage_nbytes(state),
            "anchor": sum(v for k, v in held.items() if k != "sketch"),
            "sketch": held.get("sketch", 0)}
