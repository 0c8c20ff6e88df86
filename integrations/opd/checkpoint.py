"""Atomic checkpoints of the OPD loop: ``checkpoint-<step>`` directories and ``latest``.

A checkpoint is written under a temporary name and renamed, then ``latest`` (a one-line file
naming the newest) is replaced atomically; a kill at any moment leaves the previous checkpoint
loadable. The newest two are kept. The student's weights are ``save_pretrained`` safetensors
(loadable by any Hugging Face tool); the trainer's state is one ``torch.save`` file beside them.

A sharded student (``fsdp``) is written by every rank at once: the student and the optimizer
through ``torch.distributed.checkpoint`` (each rank its shards, under ``dcp/``), plus one
``rank<r>.pt`` per rank for what is that rank's own (EffOPD's anchor shards, its gate rollouts,
its RNG). Rank 0 then renames the directory, so the same atomicity holds.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import torch
from torch import nn

__all__ = ["write_checkpoint", "latest_checkpoint", "read_checkpoint",
           "write_sharded_checkpoint", "read_sharded_checkpoint"]

LATEST = "latest"
STATE = "trainer_state.pt"
CONFIG = "opd_config.json"
SHARDS = "dcp"


def write_checkpoint(output_dir: Path, step: int, *, model: nn.Module, tokenizer: Any,
                     state: dict[str, Any], config: Any) -> Path:
    """Write ``output_dir/checkpoint-<step>`` atomically, point ``latest`` at it, drop all
    but the newest two; return its path. ``config`` needs a ``save(path)`` method."""
    final = output_dir / f"checkpoint-{step}"
    output_dir.mkdir(parents=True, exist_ok=True)
    tmp = output_dir / f".tmp-checkpoint-{step}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    model.save_pretrained(tmp)
    if tokenizer is not None and hasattr(tokenizer, "save_pretrained"):
        tokenizer.save_pretrained(tmp)
    torch.save(state, tmp / STATE)
    config.save(tmp / CONFIG)
    _publish(output_dir, tmp, final)
    return final


def _publish(output_dir: Path, tmp: Path, final: Path) -> None:
    """Rename the complete ``tmp`` to ``final``, point ``latest`` at it, keep the newest two."""
    _fsync_dir(tmp)
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    pointer = output_dir / f".{LATEST}.tmp"
    pointer.write_text(final.name + "\n")
    os.replace(pointer, output_dir / LATEST)
    _fsync_dir(output_dir)
    # Keep the newest two: the one just written and the one before it.
    for old in sorted(output_dir.glob("checkpoint-*"), key=_step_of)[:-2]:
        shutil.rmtree(old, ignore_errors=True)


def write_sharded_checkpoint(output_dir: Path, step: int, *, model: nn.Module,
                             optimizer: torch.optim.Optimizer, state: dict[str, Any],
                             rank_state: dict[str, Any], ranks: Any, tokenizer: Any,
                             config: Any) -> Path:
    """``write_checkpoint`` for a sharded student; collective (every rank calls it). ``state``
    is the same on every rank (rank 0 writes it), ``rank_state`` is each rank's own;
    ``optimizer`` is the base ``torch.optim`` optimizer."""
    from .sharding import save_state

    final = output_dir / f"checkpoint-{step}"
    tmp = output_dir / f".tmp-checkpoint-{step}"  # one name for all ranks
    if ranks.is_main:
        output_dir.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)  # a killed run's leftovers
        tmp.mkdir()
    ranks.barrier()
    save_state(tmp / SHARDS, model, optimizer)
    _save_synced(rank_state, tmp / f"rank{ranks.rank}.pt")
    ranks.barrier()
    if ranks.is_main:
        if tokenizer is not None and hasattr(tokenizer, "save_pretrained"):
            tokenizer.save_pretrained(tmp)
        _save_synced({**state, "world": ranks.world}, tmp / STATE)
        config.save(tmp / CONFIG)
        _publish(output_dir, tmp, final)
    ranks.barrier()
    return final


def read_sharded_checkpoint(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer,
                            ranks: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """Load a sharded checkpoint's student and optimizer shards (collective); return the
    shared state and this rank's own. The per-rank state (EffOPD's anchor shards) fits only
    the world size it was written with."""
    from .sharding import load_state

    if not (path / SHARDS).is_dir():
        raise FileNotFoundError(f"checkpoint {path} has no {SHARDS}/ (not written with fsdp)")
    state = torch.load(path / STATE, weights_only=False)
    if state["world"] != ranks.world:
        raise ValueError(f"checkpoint {path} was written by {state['world']} ranks; resume it "
                         f"with as many (this run has {ranks.world})")
    load_state(path / SHARDS, model, optimizer)
    return state, torch.load(path / f"rank{ranks.rank}.pt", weights_only=False)


def _save_synced(obj: Any, path: Path) -> None:
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def latest_checkpoint(output_dir: Path) -> Path | None:
    """The checkpoint ``latest`` names, or None when there is none."""
    pointer = output_dir / LATEST
    if not pointer.is_file():
        return None
    return output_dir / pointer.read_text().strip()


def read_checkpoint(path: Path, model: nn.Module) -> dict[str, Any]:
    """Load the checkpoint's weights into ``model`` and return the trainer state saved with
    them. Raises when the weights are missing or do not match the model."""
    from safetensors.torch import load_file

    weights = sorted(path.glob("*.safetensors"))
    if not weights:
        raise FileNotFoundError(f"checkpoint {path} has no safetensors weights")
    sd: dict[str, torch.Tensor] = {}
    for w in weights:
        sd.update(load_file(str(w)))
    missing, unexpected = model.load_state_dict(sd, strict=False)
    # Tied or buffer-only keys may be absent from the file; real parameters may not.
    real_missing = [k for k in missing if not k.endswith("lm_head.weight")
                    or not getattr(getattr(model, "config", None), "tie_word_embeddings", False)]
    if real_missing or unexpected:
        raise RuntimeError(f"checkpoint {path} does not match the student: missing "
                           f"{real_missing[:5]}, unexpected {unexpected[:5]}")
    return torch.load(path / STATE, weights_only=False)


def _step_of(p: Path) -> int:
    try:
        return int(p.name.rsplit("-", 1)[1])
    except (IndexError, ValueError):
        return -1


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
