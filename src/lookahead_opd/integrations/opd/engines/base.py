"""What an engine returns (``Rollout``) and what every engine does (``Engine``)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any

import torch

__all__ = ["Rollout", "Engine", "build_rollout", "tokenize_prompts", "check_generate_args"]


@dataclass
class Rollout:
    """Sampled completions in one padded layout shared by every engine.

    ``sequences[b] = [pad … pad, prompt, completion, pad …]``: prompts left-padded to a common
    ``prompt_length`` P, completions right-padded. ``completion_mask`` is 1 on generated tokens
    up to and including the first EOS. ``logprobs[b, t]`` is the sampler's log-probability of
    ``sequences[b, t]`` given what precedes it (at the sampling temperature), 0 outside the
    completion. With ``num_samples = k`` rows are prompt-major: prompt i is rows i·k … i·k+k−1.
    """

    sequences: torch.Tensor
    attention_mask: torch.Tensor
    completion_mask: torch.Tensor
    logprobs: torch.Tensor
    texts: list[str]
    prompt_length: int

    @property
    def num_tokens(self) -> int:
        """Generated tokens (EOS included) over the whole batch."""
        return int(self.completion_mask.sum())

    def to(self, device: str | torch.device) -> Rollout:
        moved = {f.name: getattr(self, f.name) for f in fields(self)}
        for k, v in moved.items():
            if isinstance(v, torch.Tensor):
                moved[k] = v.to(device)
        return Rollout(**moved)


def check_generate_args(prompts: Sequence[str], max_new_tokens: int, temperature: float,
                        top_p: float, num_samples: int) -> None:
    if isinstance(prompts, str) or len(prompts) == 0:
        raise ValueError("prompts must be a non-empty list of strings")
    if max_new_tokens <= 0:
        raise ValueError(f"max_new_tokens must be > 0, got {max_new_tokens}")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0 (0 = greedy), got {temperature}")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if num_samples < 1:
        raise ValueError(f"num_samples must be >= 1, got {num_samples}")


def tokenize_prompts(tokenizer: Any, prompts: Sequence[str]) -> list[list[int]]:
    """Token ids of each prompt; BOS is prepended when the tokenizer has one and did not add it
    (the char tokenizer adds nothing itself; HF chat models without a BOS get none)."""
    bos = getattr(tokenizer, "bos_token_id", None)
    ids = [tokenizer(p, add_special_tokens=True)["input_ids"] for p in prompts]
    if bos is not None:
        ids = [x if x[:1] == [bos] else [bos, *x] for x in ids]
    return ids


def build_rollout(prompt_ids: Sequence[Sequence[int]], completion_ids: Sequence[Sequence[int]],
                  completion_logprobs: Sequence[Sequence[float]], *, pad_id: int,
                  eos_id: int | None, tokenizer: Any) -> Rollout:
    """The shared layout from per-row prompt tokens, completion tokens and their logprobs.
    Completions are cut after their first EOS."""
    cut_ids, cut_lps = [], []
    for ids, lps in zip(completion_ids, completion_logprobs, strict=True):
        ids, lps = list(ids), list(lps)
        if eos_id is not None and eos_id in ids:
            end = ids.index(eos_id) + 1
            ids, lps = ids[:end], lps[:end]
        cut_ids.append(ids)
        cut_lps.append(lps)
    p_len = max(len(p) for p in prompt_ids)
    c_len = max(1, max(len(c) for c in cut_ids))
    rows = len(prompt_ids)
    seq = torch.full((rows, p_len + c_len), pad_id, dtype=torch.long)
    attn = torch.zeros_like(seq)
    cmask = torch.zeros_like(seq)
    logprobs = torch.zeros(seq.shape, dtype=torch.float32)
    for b, (p, c, lp) in enumerate(zip(prompt_ids, cut_ids, cut_lps, strict=True)):
        seq[b, p_len - len(p):p_len] = torch.tensor(p, dtype=torch.long)
        attn[b, p_len - len(p):p_len + len(c)] = 1
        if c:
            seq[b, p_len:p_len + len(c)] = torch.tensor(c, dtype=torch.long)
            cmask[b, p_len:p_len + len(c)] = 1
            logprobs[b, p_len:p_len + len(c)] = torch.tensor(lp, dtype=torch.float32)
    texts = tokenizer.batch_decode(cut_ids, skip_special_tokens=True)
    return Rollout(seq, attn, cmask, logprobs, texts, p_len)


class Engine(ABC):
    """Generates the student's rollouts. ``push_weights`` gives it the student's current weights
    (``OPDTrainer`` pushes before every generation: rollouts, gate candidates, evaluations)."""

    tokenizer: Any

    @abstractmethod
    def generate(self, prompts: Sequence[str], *, max_new_tokens: int, temperature: float = 1.0,
                 top_p: float = 1.0, seed: int | None = None, num_samples: int = 1) -> Rollout:
        """Sample completions (``temperature=0``: greedy)."""

    def push_weights(self, model_or_state_dict: Any) -> None:  # noqa: B027 - optional hook
        """Load the student's current weights (no-op for engines over the live module)."""

    def sleep(self) -> None:  # noqa: B027
        """Release generation memory between rollouts (where supported)."""

    def wake_up(self) -> None:  # noqa: B027
        """Undo ``sleep``."""

    def close(self) -> None:  # noqa: B027
        """Free the engine's resources."""

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
