"""Rollout engines: ``HFEngine`` (default, the live module) and ``VLLMEngine`` (vLLM in process)."""

from __future__ import annotations

from typing import Any

from .base import Engine, Rollout, build_rollout, tokenize_prompts
from .hf import HFEngine
from .vllm import VLLMEngine

__all__ = ["Rollout", "Engine", "HFEngine", "VLLMEngine", "make_engine", "build_rollout",
           "tokenize_prompts"]


def make_engine(name: str, model: Any, tokenizer: Any, **kwargs: Any) -> Engine:
    """``"hf"``: ``HFEngine(model, tokenizer)``; ``"vllm"``: ``VLLMEngine(model_path)``."""
    if name == "hf":
        return HFEngine(model, tokenizer, **kwargs)
    if name == "vllm":
        return VLLMEngine(model, tokenizer=tokenizer, **kwargs)
    raise ValueError(f"engine must be hf or vllm, got {name!r}")
