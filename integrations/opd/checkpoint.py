"""Atomic checkpoints of the OPD loop: ``checkpoint-<step>`` directories and ``latest``.

A checkpoint is written under a temporary name and renamed, then ``latest`` (a one-line file
naming the newest) is replaced atomically; a kill at any moment leaves the previous checkpoint
loadable. The newest two are kept. The student's weights are ``save_pretrained`` safetensors
(loadable by any Hugging Face tool); the trainer's state is one ``torch.save`` file beside them.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import torch
from torch import nn

__all__ = ["write_checkpoint", "latest_checkpoint", "read_checkpoint"]

LATEST = "latest"
STATE = "trainer_state.pt"
CONFIG = "opd_config.json"


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
    return final


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
