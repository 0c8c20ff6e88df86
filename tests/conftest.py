"""Shared fixtures: tiny deterministic models and problems for the core tests."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import settings

settings.register_profile("ci", max_examples=25, deadline=None, derandomize=True)
settings.register_profile("dev", max_examples=50, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

torch.set_num_threads(1)


class LeastSquares:
    """A linear regression whose SGD path is nearly straight at a small learning rate."""

    def __init__(self, seed: int = 0, n: int = 128, d: int = 8) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, d, generator=g)
        self.y = self.x @ torch.randn(d, 1, generator=g)
        torch.manual_seed(seed)
        self.model = torch.nn.Linear(d, 1)

    def loss(self) -> torch.Tensor:
        return (self.model(self.x) - self.y).pow(2).mean()

    def score(self) -> float:
        with torch.no_grad():
            return -float(self.loss())


def make_mlp(seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16), torch.nn.Tanh(),
        torch.nn.Linear(16, 3),
    ).to(dtype)


TARGET = torch.randn(6, 3, generator=torch.Generator().manual_seed(1234))


def target(x: torch.Tensor) -> torch.Tensor:
    """The function the tiny MLPs learn: learnable, so a gate on fresh inputs can improve."""
    return torch.tanh(x.float() @ TARGET).to(x.dtype)


def batches(seed: int, steps: int, dtype: torch.dtype = torch.float32) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randn(8, 6, generator=g).to(dtype) for _ in range(steps)]
    return [(x, target(x)) for x in xs]


def train(model: torch.nn.Module, opt: torch.optim.Optimizer, data, start: int = 0, stop: int | None = None) -> None:
    for x, y in data[start:stop]:
        loss = (model(x) - y).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()


def params_equal(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    return all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))


@pytest.fixture
def least_squares() -> LeastSquares:
    return LeastSquares()


def tiny_qwen2(vocab_size: int, seed: int = 0, *, tokenizer=None, max_position_embeddings: int = 64):
    """The tests' tiny causal LM: a 2-layer Qwen2 (hidden 32, 4 heads, 2 KV heads), untied,
    seeded; with ``tokenizer``, its pad/bos/eos ids go into the config."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    special = {} if tokenizer is None else dict(
        pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id)
    config = Qwen2Config(vocab_size=vocab_size, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=max_position_embeddings,
                         tie_word_embeddings=False, **special)
    return Qwen2ForCausalLM(config).float()
