"""Which parameters to extrapolate.

By default every trainable parameter of the wrapped optimizer is extrapolated. The EffOPD
code extrapolates only the attention and MLP weights of the transformer blocks (embeddings,
``lm_head`` and the final norm stay put); ``transformer_blocks`` reproduces that filter.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from torch import Tensor, nn

__all__ = ["ATTENTION_KEYWORDS", "MLP_KEYWORDS", "BLOCK_KEYWORDS", "is_block_param",
           "transformer_blocks", "trainable", "PARAM_SELECTORS"]

# The substrings the paper's ``_should_modify_param`` matches (EffOPD fsdp_workers.py), the
# attention ones and the MLP ones. Note that ``post_attention_layernorm`` matches through
# "attention", as it does there.
ATTENTION_KEYWORDS: tuple[str, ...] = (
    "attn",
    "self_attn",
    "attention",
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
)
MLP_KEYWORDS: tuple[str, ...] = ("mlp", "ffn", "gate_proj", "up_proj", "down_proj")
BLOCK_KEYWORDS: tuple[str, ...] = ATTENTION_KEYWORDS + MLP_KEYWORDS


def is_block_param(name: str, keywords: Iterable[str] = BLOCK_KEYWORDS) -> bool:
    """Whether the parameter called ``name`` belongs to an attention or MLP block, by name
    (the rule ``transformer_blocks`` selects with)."""
    return any(k in name for k in keywords)


def transformer_blocks(
    model: nn.Module, keywords: Iterable[str] = BLOCK_KEYWORDS
) -> list[tuple[str, Tensor]]:
    """``(name, parameter)`` pairs of the trainable attention/MLP weights of ``model``,
    selected by name as the EffOPD code does. Raises if nothing matches, since extrapolating
    nothing is never what the caller meant."""
    keys = tuple(keywords)
    chosen = [
        (name, p)
        for name, p in model.named_parameters()
        if p.requires_grad and is_block_param(name, keys)
    ]
    if not chosen:
        names = [n for n, _ in model.named_parameters()][:8]
        raise ValueError(
            f"no parameter name contains any of {keys}; first names are {names}: "
            "pass params= explicitly"
        )
    return chosen


def trainable(model: nn.Module) -> list[tuple[str, Tensor]]:
    """``(name, parameter)`` pairs of every parameter of ``model`` that requires grad."""
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


# The names a caller may give for which parameters jump, one per rule: the callbacks' ``params=``
# and the OPD loop's ``--extrapolate_params`` both take these.
PARAM_SELECTORS: dict[str, Callable[[nn.Module], list[tuple[str, Tensor]]]] = {
    "trainable": trainable,
    "transformer_blocks": transformer_blocks,
}
