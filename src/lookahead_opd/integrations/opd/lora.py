"""LoRA adapters on a Hugging Face model, as plain modules the rest of the loop already handles.

``add_lora(model, rank)`` injects peft's LoRA layers into every linear layer of the decoder
blocks, in place (``peft.inject_adapter_in_model``: no ``PeftModel`` wrapper), and freezes every
other weight. The model stays the same class, so the trainer, its engines and its checkpoints
(which save and load the whole ``state_dict``, adapters included) need nothing new; only the
optimizer sees fewer weights. ``lora_deltas(model)`` reads each adapted weight's update
``ΔW = up @ down`` (``up = B · scaling``, ``down = A``), which ``model_sources.write_delta``
stores as two small factors per weight.

Used to build the real model's RL-near teacher (``benchmarks/builders/real_teacher.py``): full training
of SmolLM2-135M moves it far in a few steps, its top blocks alone barely, and a LoRA on every
block keeps the teacher's delta at a few MB. The gated jump (``--extrapolate``) is not offered
on adapters: extrapolating ``A`` and ``B`` separately scales ``ΔW = BA`` by ``c²``, not ``c``.
"""

from __future__ import annotations

import torch
from torch import nn

from .sharding import decoder_blocks

__all__ = ["add_lora", "lora_deltas"]

ADAPTER = "default"  # peft's name for the one adapter


def add_lora(model: nn.Module, rank: int, alpha: float | None = None) -> list[str]:
    """Inject rank-``rank`` LoRA adapters (scaling ``alpha / rank``, default ``alpha = 2·rank``)
    into every ``nn.Linear`` of ``model``'s decoder blocks and freeze every other weight;
    ``B`` starts at zero, so the model computes what it did. Returns the names of the adapted
    weights (``...q_proj.weight``), as ``model_sources.write_delta`` names them."""
    try:
        from peft import LoraConfig, inject_adapter_in_model
    except ImportError as e:
        raise ImportError("LoRA needs the 'real' extra: pip install 'lookahead-opd[real]'") from e
    if rank < 1:
        raise ValueError(f"LoRA rank must be >= 1, got {rank}")
    blocks = {id(b) for b in decoder_blocks(model)}
    targets = sorted({name for prefix, block in model.named_modules() if id(block) in blocks
                      for name, m in _linears(block, prefix)})
    config = LoraConfig(r=rank, lora_alpha=2 * rank if alpha is None else alpha, lora_dropout=0.0,
                        target_modules=targets, bias="none")
    inject_adapter_in_model(config, model, adapter_name=ADAPTER)
    for name, p in model.named_parameters():
        p.requires_grad_(".lora_" in name)
    return [f"{t}.weight" for t in targets]


def lora_deltas(model: nn.Module) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """``weight name -> (up, down)`` with ``up @ down`` the adapter's update of that weight
    (``up``: out × r, ``B`` times the scaling; ``down``: r × in, ``A``)."""
    out = {}
    for prefix, m in model.named_modules():
        if hasattr(m, "lora_A") and ADAPTER in getattr(m, "lora_A", {}):
            down = m.lora_A[ADAPTER].weight.detach()
            up = m.lora_B[ADAPTER].weight.detach() * m.scaling[ADAPTER]
            out[f"{prefix}.weight"] = (up.contiguous(), down.contiguous())
    return out


def _linears(block: nn.Module, prefix: str):
    for name, m in block.named_modules():
        if isinstance(m, nn.Linear):
            yield f"{prefix}.{name}", m
