"""Model deltas: the tensors in which a trained model differs from its base, as one
safetensors file tied to the base by a digest of its weights, and the model rebuilt from the two.

A model trained in a few blocks (``train_top_blocks``) ships as those blocks (``write_delta``),
one trained through LoRA adapters as the adapters' two factors (``write_lora_delta``): a rank-16
adapter on every block of SmolLM2-135M is ~20 MB in float32 where the merged weights are 538 MB.
``apply_delta`` rebuilds the model and refuses a base whose weights are not the delta's. Every
function here takes model *folders*; a named source (``model_sources``) is resolved to its
folder first: ``apply_delta(resolve_model("smollm2-135m-gguf"), delta, out)``.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

__all__ = ["weights_digest", "write_delta", "write_lora_delta", "apply_delta", "DIGEST_NAME"]

DIGEST_NAME = "source.json"  # a named source's record in its folder: not copied into a rebuild


def weights_digest(folder: str | os.PathLike) -> str:
    """sha256 over ``model.safetensors``' tensors in name order (name, dtype, shape, bytes):
    the weights themselves, whatever header layout the writer chose."""
    import torch
    from safetensors import safe_open

    h = hashlib.sha256()
    with safe_open(str(Path(folder) / "model.safetensors"), framework="pt") as f:
        for name in sorted(f.keys()):
            t = f.get_tensor(name).contiguous()
            h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
            h.update(t.view(-1).view(dtype=torch.uint8).numpy().tobytes())
    return h.hexdigest()


def write_delta(folder: str | os.PathLike, base: str | os.PathLike,
                path: str | os.PathLike) -> list[str]:
    """Save the tensors of the model in ``folder`` that differ from the model in ``base`` to
    the safetensors file ``path``, tied to the base by its weights digest in
    the file's metadata: a model trained in a few blocks (``train_top_blocks``) ships as those
    blocks alone. Returns the names saved."""
    from safetensors import safe_open

    base_folder = Path(base)
    changed = {}
    with safe_open(str(Path(folder) / "model.safetensors"), framework="pt") as mine, \
            safe_open(str(base_folder / "model.safetensors"), framework="pt") as theirs:
        if set(mine.keys()) != set(theirs.keys()):
            raise ValueError(f"{folder} and {base} hold different tensor names: not one model")
        for name in sorted(mine.keys()):
            t = mine.get_tensor(name)
            if not (t.shape == theirs.get_tensor(name).shape
                    and t.equal(theirs.get_tensor(name))):
                changed[name] = t.contiguous()
    _save_delta(changed, base_folder, path)
    return sorted(changed)


def write_lora_delta(model: Any, base: str | os.PathLike, path: str | os.PathLike) -> list[str]:
    """Save the LoRA adapters of ``model`` (``opd.lora.add_lora``, trained from ``base``: a
    folder) to the safetensors file ``path`` as two factors per adapted
    weight, ``<name>.lora_up`` (out × r) and ``<name>.lora_down`` (r × in), whose product
    ``apply_delta`` adds to the base's weight: a rank-16 adapter on every block of SmolLM2-135M
    is ~20 MB in float32, where the merged weights would be the whole model. Returns the
    adapted weights' names."""
    from .opd.lora import lora_deltas

    deltas = lora_deltas(model)
    if not deltas:
        raise ValueError("the model has no LoRA adapters (add_lora) to save")
    factors = {}
    for name, (up, down) in deltas.items():
        factors[f"{name}{_UP}"], factors[f"{name}{_DOWN}"] = up, down
    _save_delta(factors, Path(base), path)
    return sorted(deltas)


_UP, _DOWN = ".lora_up", ".lora_down"  # a low-rank delta: base weight += up @ down


def _save_delta(tensors: dict[str, Any], base: Path, path: str | os.PathLike) -> None:
    """``tensors`` to ``path`` atomically, tied to the base by its weights digest (and named
    by its source when the base is a named source's folder)."""
    from safetensors.torch import save_file

    record = base / DIGEST_NAME
    name = json.loads(record.read_text())["source"] if record.is_file() else base.name
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(f"{path}.tmp")
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp), metadata={
        "base": name, "base_weights_sha256": weights_digest(base)})
    os.replace(tmp, path)


def apply_delta(base: str | os.PathLike, delta: str | os.PathLike,
                out: str | os.PathLike) -> Path:
    """Rebuild a model written by ``write_delta`` or ``write_lora_delta``: the folder ``base``
    (config, tokenizer) with the delta's tensors in place of the base's (a low-rank pair added
    to the base's weight), saved to ``out`` atomically. Refuses a base
    whose weights digest is not the one the delta was made from."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    base_folder = Path(base)
    with safe_open(str(delta), framework="pt") as f:
        meta = f.metadata() or {}
    want, got = meta.get("base_weights_sha256"), weights_digest(base_folder)
    if want != got:
        raise ValueError(f"delta {delta} was made from weights {str(want)[:12]}…, but {base} "
                         f"holds {got[:12]}…")
    weights = load_file(str(base_folder / "model.safetensors"))
    update = load_file(str(delta))
    low_rank = {k[: -len(_UP)] for k in update if k.endswith(_UP)}
    unknown = sorted({k for k in update if not k.endswith((_UP, _DOWN))} - set(weights)
                     | {k for k in low_rank if k not in weights or f"{k}{_DOWN}" not in update})
    if unknown:
        raise ValueError(f"delta {delta} has tensors {unknown[:3]} that {base} does not")
    for name in low_rank:  # in float32 whatever the stored dtype, then back to the base's
        w = weights[name]
        w = w.float() + update.pop(f"{name}{_UP}").float() @ update.pop(f"{name}{_DOWN}").float()
        weights[name] = w.to(weights[name].dtype)
    weights.update(update)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}-"))
    try:
        for item in base_folder.iterdir():
            if item.name not in ("model.safetensors", DIGEST_NAME) and item.is_file():
                shutil.copy2(item, tmp / item.name)
        save_file(weights, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out
