"""The zoo's teacher regimes on tiny budgets: metadata, acceptance rule, cache keys, bad input.

Accuracies are not asserted (a few steps train nothing); the builds run with ``strict=False`` so
their failed checks are recorded rather than raised, and the record is what is tested.
"""

from __future__ import annotations

import pytest
import torch

from lookahead_opd.demo import zoo
from lookahead_opd.integrations.opd.tasks import load_task
from lookahead_opd.integrations.opd.tokenizer import char_tokenizer


@pytest.mark.slow
def test_context_is_64_for_short_tasks_and_grows_for_long_ones_without_changing_weights():
    for spec in ("arithmetic", "arithmetic:ops=+-*", "longadd:digits=4"):
        assert zoo.context_length(load_task(spec)) == 64
    assert zoo.context_length(load_task("longadd:digits=7,count=200")) == 128
    tok = char_tokenizer()
    short, long = zoo.make_model(tok, "tiny", 0), zoo.make_model(tok, "tiny", 0, context=128)
    assert long.config.max_position_embeddings == 128
    assert zoo.weight_distance(long, short) == 0.0
    with pytest.raises(ValueError, match="context must be >= 1"):
        zoo.make_model(tok, "tiny", 0, context=0)


def test_cache_key_of_the_original_regimes_is_unchanged():
    # The key of the default pair built before the rl/retention regimes existed: their cached
    # builds must stay valid.
    assert zoo._key(task="arithmetic", size="tiny", regime="same-base", seed=0,
                    max_steps=6000) == "f7a3095e9cf4"


def test_weight_distance():
    tok = char_tokenizer()
    a, b = zoo.make_model(tok, "tiny", 0), zoo.make_model(tok, "tiny", 0)
    with torch.no_grad():
        for p in a.parameters():
            p.mul_(1.5)
    assert zoo.weight_distance(a, b) == pytest.approx(0.5)
    assert zoo.weight_distance(b, b) == 0.0
    with pytest.raises(ValueError, match="models differ"):
        zoo.weight_distance(a, zoo.make_model(char_tokenizer("0123"), "tiny", 0))


def test_rl_acceptance_rule():
    assert zoo.rl_rejections(0.40, 0.65, 0.01, 0.05) == []
    assert zoo.rl_rejections(0.40, 0.60, 0.025, 0.05) == []  # both exactly at the bar
    (gain,) = zoo.rl_rejections(0.40, 0.55, 0.01, 0.05)
    assert "gain" in gain
    (far,) = zoo.rl_rejections(0.40, 0.70, 0.03, 0.05)
    assert "‖T−B‖/‖B‖" in far
    assert len(zoo.rl_rejections(0.40, 0.41, 0.06, 0.05)) == 2


@pytest.mark.slow
def test_rl_regime_records_both_attempts_and_the_rule(tmp_path):
    pair = zoo.build_pair(tmp_path, "arithmetic:digits=1", teacher_regime="rl", progress=False,
                          max_steps=2, strict=False)
    meta = pair.meta
    assert pair.student_path.is_dir() and pair.teacher_path.is_dir()
    # Two steps gain nothing: Dr. GRPO is rejected, RFT tried, and both rejections recorded.
    assert [a["method"] for a in meta["attempts"]] == ["drgrpo", "rft"]
    assert meta["teacher_method"] == "rft" and meta["failed_checks"]
    for a in meta["attempts"]:
        assert a["rejections"] == zoo.rl_rejections(meta["accuracies"]["student"], a["accuracy"],
                                                    a["distance"], a["sft_reference"]["distance"])
        assert {"accuracy", "distance", "steps"} <= set(a["sft_reference"])
    assert meta["distance_ratio"] == pytest.approx(
        meta["teacher_distance"] / meta["sft_reference"]["distance"])
    assert meta["teacher_regime"] == "rl" and meta["rl_settings"] == zoo.RL_SETTINGS
    assert meta["build_seconds"] > 0 and "drgrpo" in meta["seconds"] and meta["device"] == "cpu"
    assert pair.retention_tasks() == {}
    # Cached: the same call loads the same build, whatever device is asked for (it is not in
    # the key); strict and non-strict builds are apart.
    assert zoo.build_pair(tmp_path, "arithmetic:digits=1", teacher_regime="rl", progress=False,
                          max_steps=2, strict=False, device=torch.device("cpu")).meta == meta
    with pytest.raises(RuntimeError, match="gain"):
        zoo.build_pair(tmp_path, "arithmetic:digits=1", teacher_regime="rl", progress=False,
                       max_steps=2)


def test_retention_regime_measures_the_retained_tasks(tmp_path):
    keep = "arithmetic:ops=+,digits=1"
    pair = zoo.build_pair(tmp_path, "arithmetic:ops=-,digits=1", teacher_regime="retention",
                          retain=[keep], progress=False, max_steps=2, strict=False)
    assert pair.meta["retain"] == [keep] and set(pair.meta["retention"][keep]) == {"student", "teacher"}
    assert pair.meta["teacher_method"] == "sft-mix" and pair.meta["teacher_distance"] > 0
    assert any(keep in f for f in pair.meta["failed_checks"])  # two steps: not competent on +
    (task,) = pair.retention_tasks().values()
    assert task.ops == "+"


def test_a_shipped_pair_loads_without_a_build_and_a_cached_build_wins(tmp_path):
    """``build_pair`` loads a pair shipped with the package (the demo's) when the cache lacks it,
    writing nothing; the cache's own build of the same key comes first."""
    shipped = sorted(p for p in zoo.SHIPPED_PAIRS.iterdir() if (p / "build.json").is_file())
    assert shipped, "no pair shipped with the package"
    pair = zoo.build_pair(tmp_path / "cache", teacher_regime="rl", progress=False)
    assert pair.student_path.parent.parent == zoo.SHIPPED_PAIRS
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").iterdir())
    assert (pair.student_path / "model.safetensors").is_file() and pair.meta["teacher_regime"] == "rl"
    own = tmp_path / "cache" / pair.student_path.parent.name
    own.mkdir(parents=True)
    (own / "build.json").write_text('{"accuracies": {"student": 0.5, "teacher": 0.75}}')
    mine = zoo.build_pair(tmp_path / "cache", teacher_regime="rl", progress=False)
    assert mine.student_path == own / "student" and mine.accuracies["teacher"] == 0.75


def test_bad_regimes():
    with pytest.raises(ValueError, match="teacher_regime must be one of"):
        zoo.build_pair(teacher_regime="rlhf")
    with pytest.raises(ValueError, match="retain="):
        zoo.build_pair(teacher_regime="retention")
    with pytest.raises(ValueError, match="retain="):
        zoo.build_pair(teacher_regime="same-base", retain=["arithmetic"])
    with pytest.raises(ValueError, match="max_steps"):
        zoo.build_pair(max_steps=0)
    with pytest.raises(ValueError, match="device must be a torch device"):
        zoo.build_pair(device="cud4")


def test_a_base_that_jumps_past_the_range_is_retrained_from_the_last_probe(tmp_path, monkeypatch):
    """On a curve steep enough that one 25-step probe interval jumps from under the target to
    past the ceiling, ``base`` goes back to the last probe under the target and retrains with
    a probe every 5 steps, landing inside the range; a curve that lands inside is untouched."""

    def curve(step):  # accuracy vs steps: flat, then 0.1 -> 0.6 over steps 425-450
        return 0.0 if step < 425 else min(0.6, 0.1 + (step - 425) * 0.02)

    def fake_train(self, phase, model, task, stop, *, seed, eval_every):
        # "Training" moves one weight by 1 per step, so a model's step count is in its weights.
        weight = next(model.parameters())
        for step in range(1, 1001):
            with torch.no_grad():
                weight.view(-1)[0] += 1.0
            if step % eval_every == 0 and stop(model):
                return step
        return 1000

    def fake_acc(self, model, task, problems=None):
        return curve(round(float(next(model.parameters()).detach().view(-1)[0]) - start))

    monkeypatch.setattr(zoo._Builder, "train", fake_train)
    monkeypatch.setattr(zoo._Builder, "acc", fake_acc)
    builder = zoo._Builder(tmp_path, load_task("arithmetic"), "arithmetic", "tiny", 0, False, 10)
    model = zoo.make_model(builder.tokenizer, "tiny", 0)
    start = float(next(model.parameters()).detach().view(-1)[0])
    coarse = zoo.make_model(builder.tokenizer, "tiny", 0)
    _, coarse_steps, _ = builder.base(0.25, init=coarse)  # no ceiling: the overshoot is kept
    assert coarse_steps == 450 and builder.acc(coarse, None) == pytest.approx(0.6)
    _, steps, _ = builder.base(0.25, init=model, ceiling=0.40)
    # Back to step 425 (the last probe under 0.25), then probes at 430, 435: 0.2, 0.3.
    assert steps == 435 and builder.acc(model, None) == pytest.approx(0.3)


def test_saved_tokenizer_names_a_class_every_transformers_loads(tmp_path):
    """transformers 5 writes ``TokenizersBackend``, which 4.x cannot load; the zoo, the real
    model's cache and checkpoints write ``PreTrainedTokenizerFast`` (the same class in 5.x)."""
    import json

    from transformers import AutoTokenizer

    from lookahead_opd.integrations.opd.tokenizer import char_tokenizer, save_tokenizer

    tok = char_tokenizer()
    save_tokenizer(tok, tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast"
    back = AutoTokenizer.from_pretrained(tmp_path)
    assert back("12+3=15")["input_ids"] == tok("12+3=15")["input_ids"]
    assert "token_type_ids" not in back("1+1")
