"""Atomic checkpoints of the OPD loop: ``checkpoint-<step>`` directories and ``latest``.

A checkpoint is written under a temporary name and renamed, then ``latest`` (a one-line file
naming the newest) is replaced atomically; a kill at any moment leaves the previous checkpoint
loadable. Two are kept: the one just written and the newest before it. On resume a checkpoint
whose files do not load (a truncated write, a bad disk) is renamed ``corrupt-checkpoint-<step>``,
out of the pruning's way, and the newest one that loads is used instead. The student's weights
are ``save_pretrained`` safetensors (loadable by any Hugging Face tool); the trainer's state is
one ``torch.save`` file beside them.

A sharded student (``fsdp``) is written by every rank at once: the student and the optimizer
through ``torch.distributed.checkpoint`` (each rank its shards, under ``dcp/``), plus one
``rank<r>.pt`` per rank for what is that rank's own (EffOPD's anchor shards, its gate rollouts,
its RNG). Rank 0 then renames the directory, so the same atomicity holds.
"""

from __future__ import annotations

import logging
import os
import pickle
import shutil
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .tokenizer import save_tokenizer

__all__ = ["write_checkpoint", "latest_checkpoint", "read_checkpoint", "read_newest_checkpoint",
           "set_aside", "earlier_run", "clear_earlier_run", "write_sharded_checkpoint",
           "read_sharded_checkpoint"]

logger = logging.getLogger(__name__)

LATEST = "latest"
STATE = "trainer_state.pt"
CONFIG = "opd_config.json"
SHARDS = "dcp"


def write_checkpoint(output_dir: Path, step: int, *, model: nn.Module, tokenizer: Any,
                     state: dict[str, Any], config: Any) -> Path:
    """Write ``output_dir/checkpoint-<step>`` atomically, point ``latest`` at it, drop all
    but it and the newest before it; return its path. ``config`` needs a ``save(path)`` method."""
    final = output_dir / f"checkpoint-{step}"
    output_dir.mkdir(parents=True, exist_ok=True)
    tmp = output_dir / f".tmp-checkpoint-{step}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    model.save_pretrained(tmp)
    if tokenizer is not None and hasattr(tokenizer, "save_pretrained"):
        save_tokenizer(tokenizer, tmp)
    torch.save(state, tmp / STATE)
    config.save(tmp / CONFIG)
    _publish(output_dir, tmp, final)
    return final


def _publish(output_dir: Path, tmp: Path, final: Path) -> None:
    """Rename the complete ``tmp`` to ``final``, point ``latest`` at it, keep it and the newest
    before it."""
    _fsync_dir(tmp)
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    pointer = output_dir / f".{LATEST}.tmp"
    pointer.write_text(final.name + "\n")
    os.replace(pointer, output_dir / LATEST)
    _fsync_dir(output_dir)
    # Keep this one and the newest before it. Never by name order alone: a resumed run can find
    # higher steps of the run it resumed (past a damaged checkpoint), which are not its own.
    older = [p for p in _checkpoints(output_dir) if _step_of(p) < _step_of(final)]
    for old in _checkpoints(output_dir):
        if old != final and old != (older[-1] if older else None):
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
            save_tokenizer(tokenizer, tmp)
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
    them. Raises when the files are missing or damaged (``model`` untouched) or the weights do
    not match the model."""
    sd, state = _read_files(path)
    _load_weights(path, model, sd)
    return state


def _load_weights(path: Path, model: nn.Module, sd: dict[str, torch.Tensor]) -> None:
    missing, unexpected = model.load_state_dict(sd, strict=False)
    # Tied or buffer-only keys may be absent from the file; real parameters may not.
    real_missing = [k for k in missing if not k.endswith("lm_head.weight")
                    or not getattr(getattr(model, "config", None), "tie_word_embeddings", False)]
    if real_missing or unexpected:
        raise RuntimeError(f"checkpoint {path} does not match the student: missing "
                           f"{real_missing[:5]}, unexpected {unexpected[:5]}")


def _read_files(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    from safetensors.torch import load_file

    weights = sorted(path.glob("*.safetensors"))
    if not weights:
        raise FileNotFoundError(f"checkpoint {path} has no safetensors weights")
    sd: dict[str, torch.Tensor] = {}
    for w in weights:
        sd.update(load_file(str(w)))
    return sd, torch.load(path / STATE, weights_only=False)


def _damage_errors() -> tuple[type[BaseException], ...]:
    """What reading a truncated or garbled checkpoint raises: safetensors' header and size
    checks, torch.load's zip reader (RuntimeError) and unpickler, a missing file."""
    from safetensors import SafetensorError

    return (SafetensorError, OSError, RuntimeError, EOFError, pickle.UnpicklingError)


def read_newest_checkpoint(output_dir: Path, model: nn.Module
                           ) -> tuple[Path | None, dict[str, Any] | None, list[tuple[Path, str]]]:
    """Load the newest checkpoint that loads: the one ``latest`` names, then the others from
    the highest step down. Returns its path and state (``None, None`` when none loads) and
    the damaged ones passed over with the reason, for ``set_aside`` (renaming is left to the
    caller, so that under torchrun every rank has read before rank 0 renames)."""
    candidates = _checkpoints(output_dir)[::-1]
    named = latest_checkpoint(output_dir)
    if named is not None and named.is_dir():
        candidates = [named, *(p for p in candidates if p != named)]
    damaged: list[tuple[Path, str]] = []
    for path in candidates:
        try:
            sd, state = _read_files(path)
        except _damage_errors() as err:
            first = str(err).splitlines()[0] if str(err) else ""
            damaged.append((path, f"{type(err).__name__}: {first}"[:200]))
            continue
        _load_weights(path, model, sd)
        return path, state, damaged
    return None, None, damaged


def set_aside(damaged: list[tuple[Path, str]], loaded: Path | None) -> None:
    """Rename damaged checkpoints ``corrupt-checkpoint-<step>`` (kept for a post-mortem, out of
    the pruning's way), say so in one warning line each, and point ``latest`` at the one that
    loaded."""
    for path, reason in damaged:
        target = path.with_name(f"corrupt-{path.name}")
        n = 1
        while target.exists():
            n += 1
            target = path.with_name(f"corrupt-{path.name}.{n}")
        os.replace(path, target)
        logger.warning("resume: %s does not load (%s); kept as %s, resuming from %s", path.name,
                       reason, target.name, loaded.name if loaded else "step 0")
    if damaged and loaded is not None:
        pointer = loaded.parent / f".{LATEST}.tmp"
        pointer.write_text(loaded.name + "\n")
        os.replace(pointer, loaded.parent / LATEST)


def earlier_run(output_dir: Path) -> list[str]:
    """What an earlier run left in ``output_dir`` that a new one would overwrite or prune."""
    if not output_dir.is_dir():
        return []
    found = [p.name for p in (output_dir / "metrics.jsonl", output_dir / LATEST) if p.exists()]
    return found + [p.name for p in _checkpoints(output_dir)]


def clear_earlier_run(output_dir: Path) -> None:
    """Delete an earlier run's metrics and checkpoints (``--overwrite_output_dir``)."""
    if not output_dir.is_dir():
        return
    for name in ("metrics.jsonl", LATEST, f".{LATEST}.tmp"):
        (output_dir / name).unlink(missing_ok=True)
    for pattern in ("checkpoint-*", "corrupt-checkpoint-*", ".tmp-checkpoint-*"):
        for path in output_dir.glob(pattern):
            shutil.rmtree(path) if path.is_dir() else path.unlink()


def _checkpoints(output_dir: Path) -> list[Path]:
    """``checkpoint-<step>`` directories, by step."""
    found = [p for p in output_dir.glob("checkpoint-*") if p.is_dir() and _step_of(p) >= 0]
    return sorted(found, key=_step_of)


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
