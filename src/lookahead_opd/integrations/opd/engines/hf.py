"""``HFEngine``: rollouts with Hugging Face ``generate`` on the live student module."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .base import Engine, Rollout, build_rollout, check_generate_args, tokenize_prompts

__all__ = ["HFEngine"]


class HFEngine(Engine):
    """Batched ``generate`` with KV cache over ``model`` itself, so weights never need pushing.

    Logprobs are those of the distribution actually sampled from: ``log_softmax`` of the scores
    after temperature and top-p (top-k is off), i.e. the model's own logprobs at temperature 1
    without top-p, and exactly the model's for greedy decoding. ``seed`` makes sampling
    reproducible without touching the caller's global RNG.
    """

    def __init__(self, model: nn.Module, tokenizer: Any, *, batch_size: int = 64,
                 synced_gpus: bool | None = None) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if tokenizer.pad_token_id is None:
            raise ValueError("the tokenizer needs a pad token (set tokenizer.pad_token)")
        self.model, self.tokenizer, self.batch_size = model, tokenizer, batch_size
        self.synced_gpus = synced_gpus

    @property
    def synced(self) -> bool:
        """Whether the ranks generate in step: ``synced_gpus``, or by default whether the model
        is sharded with FSDP2. Every forward of a sharded model all-gathers, so every rank must
        run as many forwards as the others: ``generate(synced_gpus=True)`` keeps a finished
        rank stepping until all are done, and every rank runs as many batches (a rank with
        fewer runs a discarded one)."""
        if self.synced_gpus is not None:
            return self.synced_gpus
        from ..sharding import is_sharded

        return is_sharded(self.model)

    def generate(self, prompts: Sequence[str], *, max_new_tokens: int, temperature: float = 1.0,
                 top_p: float = 1.0, seed: int | None = None, num_samples: int = 1) -> Rollout:
        check_generate_args(prompts, max_new_tokens, temperature, top_p, num_samples)
        rows = [p for p in tokenize_prompts(self.tokenizer, prompts) for _ in range(num_samples)]
        completions: list[list[int]] = []
        logprobs: list[list[float]] = []
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.random.fork_rng(devices=[]), torch.no_grad():
                if seed is not None:
                    torch.manual_seed(seed)
                batches = [rows[s:s + self.batch_size] for s in range(0, len(rows), self.batch_size)]
                for i in range(self._batches_in_step(len(batches))):
                    c, lp = self._generate_batch(batches[min(i, len(batches) - 1)],
                                                 max_new_tokens, temperature, top_p)
                    if i < len(batches):
                        completions += c
                        logprobs += lp
        finally:
            self.model.train(was_training)
        return build_rollout(rows, completions, logprobs, pad_id=self.tokenizer.pad_token_id,
                             eos_id=self.tokenizer.eos_token_id, tokenizer=self.tokenizer)

    def _batches_in_step(self, n: int) -> int:
        """``n``, or the most batches any rank has when the ranks generate in step."""
        if not self.synced or not dist.is_initialized():
            return n
        t = torch.tensor([n], dtype=torch.int64, device=next(self.model.parameters()).device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return int(t)

    def _generate_batch(self, rows: list[list[int]], max_new_tokens: int, temperature: float,
                        top_p: float) -> tuple[list[list[int]], list[list[float]]]:
        device = next(self.model.parameters()).device
        p_len = max(len(r) for r in rows)
        pad = self.tokenizer.pad_token_id
        ids = torch.tensor([[pad] * (p_len - len(r)) + r for r in rows], device=device)
        attn = torch.tensor([[0] * (p_len - len(r)) + [1] * len(r) for r in rows], device=device)
        sampling = temperature > 0
        kwargs: dict[str, Any] = dict(do_sample=sampling, top_k=0, top_p=top_p, temperature=temperature
                                      ) if sampling else dict(do_sample=False, top_k=None, top_p=None,
                                                              temperature=None)
        out = self.model.generate(
            input_ids=ids, attention_mask=attn, max_new_tokens=max_new_tokens,
            pad_token_id=pad, eos_token_id=self.tokenizer.eos_token_id, use_cache=True,
            synced_gpus=self.synced,
            output_scores=True, return_dict_in_generate=True, **kwargs)
        new = out.sequences[:, p_len:]
        # scores[t] are the processed logits of step t: temperature and top-p applied.
        scores = torch.stack(out.scores, dim=1).float().log_softmax(-1)
        lps = scores.gather(-1, new[:, : scores.shape[1]].unsqueeze(-1)).squeeze(-1)
        return new.tolist(), lps.tolist()
