"""OPDTrainer on tiny random Qwen2 models: it distills, resumes exactly, checkpoints safely."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from conftest import tiny_qwen2

pytest.importorskip("transformers")

from transformers import Qwen2ForCausalLM  # noqa: E402

from lookahead_opd.integrations.opd.config import OPDConfig  # noqa: E402
from lookahead_opd.integrations.opd.engines import HFEngine  # noqa: E402
from lookahead_opd.integrations.opd.tasks import ArithmeticTask  # noqa: E402
from lookahead_opd.integrations.opd.tokenizer import char_tokenizer  # noqa: E402
from lookahead_opd.integrations.opd.trainer import OPDTrainer  # noqa: E402


def _model(tokenizer, seed: int) -> Qwen2ForCausalLM:
    return tiny_qwen2(len(tokenizer), seed, tokenizer=tokenizer)


@pytest.fixture(scope="module")
def tokenizer():
    return char_tokenizer()


def _trainer(tmp_path, tokenizer, *, teacher_seed: int | None = 1, prepare=None,
             **options) -> OPDTrainer:
    student = _model(tokenizer, 0)
    if prepare is not None:  # e.g. adapters, before the teacher copies the student
        prepare(student)
    if teacher_seed is None:
        teacher = copy.deepcopy(student)
    else:  # a confident teacher, far from the near-uniform random student
        teacher = _model(tokenizer, teacher_seed)
        with torch.no_grad():
            teacher.lm_head.weight.mul_(30.0)
    defaults = dict(output_dir=str(tmp_path), batch_size=8, max_steps=4, learning_rate=1e-2,
                    max_new_tokens=4, eval_every=0, eval_size=16, gate_size=8, progress=False,
                    max_grad_norm=None)
    config = OPDConfig(**{**defaults, **options})
    config.validate()  # as build_trainer does before it builds one
    engine = HFEngine(student, tokenizer, batch_size=64)
    return OPDTrainer(config, student, teacher, ArithmeticTask(), engine, tokenizer=tokenizer)


@pytest.mark.slow
@pytest.mark.parametrize("loss", ["reverse_kl_pg", "reverse_kl", "jsd"])
def test_a_few_steps_lower_reverse_kl(tmp_path, tokenizer, loss):
    t = _trainer(tmp_path, tokenizer, loss=loss, max_steps=15, batch_size=32)
    before = t.gate_reverse_kl()
    t.train()
    after = t.gate_reverse_kl()
    assert after < 0.9 * before, (before, after)


def test_teacher_equal_to_student_gives_no_update(tmp_path, tokenizer):
    t = _trainer(tmp_path, tokenizer, teacher_seed=None, extrapolate=True, gate="neg_kl")
    start = {k: v.clone() for k, v in t.student.state_dict().items()}
    result = t.train()
    losses = [m["loss"] for m in result.metrics if "loss" in m]
    assert losses and max(abs(x) for x in losses) < 1e-6
    assert all(m["reverse_kl"] == pytest.approx(0.0, abs=1e-6) for m in result.metrics if "reverse_kl" in m)
    for k, v in t.student.state_dict().items():
        assert torch.equal(v, start[k]), k
    # ... so every search saw a zero direction and left the weights alone.
    assert all(j["direction_norm"] == 0.0 for j in result.jumps)


def test_metrics_and_jumps_are_logged(tmp_path, tokenizer):
    t = _trainer(tmp_path, tokenizer, extrapolate=True, gate="neg_kl", eval_every=2)
    result = t.train()
    assert result.summary is not None and result.summary.searches == len(result.jumps) == 3
    assert result.summary.gate_evals == t.gate_evals
    assert [j["secant_cosine"] is None for j in result.jumps] == [True, False, False]
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [0, 1, 2, 3, 4]
    assert {"loss", "reverse_kl", "rollout_tokens_per_s", "seconds_rollout", "seconds_gate"} <= set(lines[1])
    assert "eval_accuracy" in lines[2] and "eval_accuracy" in lines[4]
    assert [m["jump"]["step"] for m in lines if "jump" in m] == [1, 2, 4]
    assert lines[-1]["gate_evals_total"] == t.gate_evals >= 3


@pytest.mark.parametrize("extrapolate", [False, True])
def test_resume_equals_uninterrupted(tmp_path, tokenizer, extrapolate):
    opts = dict(extrapolate=extrapolate, gate="neg_kl", save_every=2, max_steps=5)
    full = _trainer(tmp_path / "full", tokenizer, **opts)
    full_result = full.train()

    first = _trainer(tmp_path / "split", tokenizer, **{**opts, "max_steps": 3})
    first.train()  # checkpoints at 2 and 3
    resumed = _trainer(tmp_path / "split", tokenizer, **{**opts, "resume": True})
    # Resume from step 2, as a run killed during step 3 would.
    (tmp_path / "split" / "latest").write_text("checkpoint-2\n")
    resumed_result = resumed.train()

    for (k, a), b in zip(full.student.state_dict().items(), resumed.student.state_dict().values(), strict=True):
        assert torch.equal(a, b), k
    tail = [m["loss"] for m in full_result.metrics if m["step"] > 2]
    assert [m["loss"] for m in resumed_result.metrics] == tail
    steps = [json.loads(x)["step"] for x in (tmp_path / "split" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [0, 1, 2, 3, 4, 5]  # no duplicated lines after the resume


def test_kill_during_checkpoint_keeps_previous(tmp_path, tokenizer, monkeypatch):
    t = _trainer(tmp_path, tokenizer, max_steps=2)
    t.train_step()
    first = t.save_checkpoint()
    t.train_step()
    real_save = torch.save

    def dying_save(obj, f, *a, **k):
        real_save(obj, f, *a, **k)
        raise KeyboardInterrupt("killed mid-checkpoint")

    monkeypatch.setattr(torch, "save", dying_save)
    with pytest.raises(KeyboardInterrupt):
        t.save_checkpoint()
    monkeypatch.setattr(torch, "save", real_save)
    assert (tmp_path / "latest").read_text().strip() == first.name
    fresh = _trainer(tmp_path, tokenizer, max_steps=2)
    assert fresh.load_checkpoint() and fresh.step == 1


def test_bad_input(tmp_path, tokenizer):
    with pytest.raises(ValueError, match="exceeds"):
        _trainer(tmp_path, tokenizer, batch_size=10**7)
    with pytest.raises(ValueError, match="max_new_tokens"):
        _trainer(tmp_path, tokenizer, max_new_tokens=0)


def test_ungated_fixed_jump_is_exactly_w_plus_alpha_delta(tmp_path, tokenizer):
    # gate="none", one coefficient, one scheduled step: the ExPO-style fixed jump, no evals.
    t = _trainer(tmp_path, tokenizer, extrapolate=True, gate="none", coefficients="2",
                 max_candidates=1, schedule="2", max_steps=2)
    w0 = {k: v.clone() for k, v in t.student.state_dict().items()}
    t.train_step()
    w1 = {k: v.clone() for k, v in t.student.state_dict().items()}
    m = t.train_step()
    assert m["jump"]["accepted"] == 2.0 and t.gate_evals == 0
    assert [j.step for j in t.optimizer.history] == [2]
    # W_2 (after the step) + 2·(W_2 − W_0): recover W_2 from the jump's definition.
    for k, w in t.student.state_dict().items():
        w2 = (w + 2 * w0[k]) / 3
        assert not torch.allclose(w2, w1[k])  # the step moved it
        torch.testing.assert_close(w, w2 + 2 * (w2 - w0[k]), rtol=1e-5, atol=1e-6)


def test_blocks_only_leaves_embeddings_and_head_out_of_jumps(tmp_path, tokenizer):
    t = _trainer(tmp_path, tokenizer, extrapolate=True, gate="none", coefficients="1",
                 max_candidates=1, extrapolate_params="transformer_blocks")
    names = set(t.optimizer.extrapolator._names)
    assert names and all(("mlp" in n or "attn" in n or "attention" in n) for n in names)
    assert not any("embed" in n or "lm_head" in n for n in names)


def test_ema_is_evaluated_but_training_is_unchanged(tmp_path, tokenizer):
    plain = _trainer(tmp_path / "a", tokenizer)
    plain.train()
    ema = _trainer(tmp_path / "b", tokenizer, ema_decay=0.5, eval_every=2)
    ema.train()
    for a, b in zip(plain.student.state_dict().values(), ema.student.state_dict().values(), strict=True):
        assert torch.equal(a, b)  # the EMA never feeds back into training
    avg = ema.ema.module.state_dict()
    assert any(not torch.equal(avg[k], v) for k, v in ema.student.state_dict().items())
    # evaluate() scores the EMA weights and puts the live weights back.
    before = {k: v.clone() for k, v in ema.student.state_dict().items()}
    ema.evaluate()
    assert all(torch.equal(v, before[k]) for k, v in ema.student.state_dict().items())


def test_drgrpo_moves_only_on_reward_differences(tmp_path, tokenizer):
    with pytest.raises(ValueError, match="num_samples >= 2"):
        _trainer(tmp_path, tokenizer, loss="drgrpo")
    # Equal rewards in every group: zero advantages, so the weights must not move at all.
    t = _trainer(tmp_path / "a", tokenizer, loss="drgrpo", num_samples=4, batch_size=8, max_steps=2)
    t.task.reward = lambda completion, problem: 1.0
    start = {k: v.clone() for k, v in t.student.state_dict().items()}
    result = t.train()
    assert {"reward", "reverse_kl", "advantage"} <= set(result.metrics[1])
    assert all(torch.equal(v, start[k]) for k, v in t.student.state_dict().items())
    # A reward that differs within groups moves them.
    t = _trainer(tmp_path / "b", tokenizer, loss="drgrpo", num_samples=4, batch_size=8, max_steps=2)
    t.task.reward = lambda completion, problem: float(completion[:1] == "1")
    t.train()
    assert any(not torch.equal(v, start[k]) for k, v in t.student.state_dict().items())


def test_train_top_blocks_trains_and_jumps_only_the_top_blocks(tmp_path, tokenizer):
    t = _trainer(tmp_path, tokenizer, train_top_blocks=1, extrapolate=True, gate="none",
                 max_steps=2)
    start = {k: v.clone() for k, v in t.student.state_dict().items()}
    t.train()
    changed = {k for k, v in t.student.state_dict().items() if not torch.equal(v, start[k])}
    assert changed and all(k.startswith("model.layers.1.") for k in changed), changed
    trained = {id(p) for g in t.optimizer.param_groups for p in g["params"]}
    assert trained == {id(p) for p in t.student.model.layers[1].parameters()}


def test_a_lora_student_trains_only_its_adapters_and_resumes_exactly(tmp_path, tokenizer):
    pytest.importorskip("peft")
    from lookahead_opd.integrations.opd.lora import add_lora

    opts = dict(prepare=lambda m: add_lora(m, rank=2), save_every=1, max_steps=3)
    full = _trainer(tmp_path / "full", tokenizer, **opts)
    start = {k: v.clone() for k, v in full.student.state_dict().items()}
    full.train()
    changed = {k for k, v in full.student.state_dict().items() if not torch.equal(v, start[k])}
    assert changed and all(".lora_" in k for k in changed), changed
    first = _trainer(tmp_path / "split", tokenizer, **{**opts, "max_steps": 2})
    first.train()
    resumed = _trainer(tmp_path / "split", tokenizer, **{**opts, "resume": True})
    resumed.train()
    for (k, a), b in zip(full.student.state_dict().items(), resumed.student.state_dict().values(),
                         strict=True):
        assert torch.equal(a, b), k


def test_train_top_blocks_bad_values(tmp_path, tokenizer):
    with pytest.raises(ValueError, match=r"train_top_blocks must be in 1\.\.2"):
        _trainer(tmp_path, tokenizer, train_top_blocks=3)
    with pytest.raises(ValueError, match="train_top_blocks"):
        OPDConfig(train_top_blocks=-1).validate()
    with pytest.raises(ValueError, match="not supported with fsdp"):
        OPDConfig(train_top_blocks=1, fsdp=True).validate()


def test_a_plain_run_needs_no_gate_split(tmp_path, tokenizer):
    """20 GSM8K-format problems hash into train and test only: a plain run trains on them, and
    an EffOPD run, which needs a gate set, stops in one line naming the fix."""
    pytest.importorskip("datasets")
    from lookahead_opd.integrations.opd.tasks import load_task

    path = tmp_path / "mini.jsonl"
    path.write_text("".join(json.dumps({"question": f"What is {i} + {i}?",
                                        "answer": f"{i} + {i} = {2 * i}\n#### {2 * i}"}) + "\n"
                            for i in range(20)))
    task = load_task(f"gsm8k:path={path}")
    assert not task.all_problems("gate") and task.all_problems("test")

    def trainer(**options) -> OPDTrainer:
        student = tiny_qwen2(len(tokenizer), 0, tokenizer=tokenizer, max_position_embeddings=128)
        teacher = tiny_qwen2(len(tokenizer), 1, tokenizer=tokenizer, max_position_embeddings=128)
        defaults = dict(output_dir=str(tmp_path / "run"), batch_size=4, max_steps=2,
                        learning_rate=1e-2, max_new_tokens=4, eval_every=0,
                        eval_size=len(task.all_problems("test")), progress=False)
        config = OPDConfig(**{**defaults, **options})
        return OPDTrainer(config, student, teacher, task, HFEngine(student, tokenizer),
                          tokenizer=tokenizer)

    t = trainer()  # --gate_size keeps its default, 50
    assert len(t.train().metrics) == 3  # step 0's eval and 2 steps
    no_gate = "no gate problems for --gate_size 50; give the task more problems or --gate none"
    for gate in ("accuracy", "neg_kl"):
        with pytest.raises(ValueError, match=no_gate) as err:
            trainer(extrapolate=True, gate=gate)
        assert "\n" not in str(err.value)
    trainer(extrapolate=True, gate="none").train()  # the ungated jump: no gate set either
    with pytest.raises(ValueError, match=no_gate):  # a KL probe of the plain run asks for one
        t.gate_reverse_kl()
    with pytest.raises(ValueError, match=r"--eval_size 200 exceeds the \d+ test problems"):
        trainer(eval_size=200)


@pytest.mark.parametrize("gate", ["neg_kl", "accuracy"])
def test_a_margin_gates_on_one_score_per_gate_problem_with_the_same_mean(tmp_path, tokenizer,
                                                                           gate):
    """With ``margin`` the gate gives one score per gate problem, whose mean is the plain
    gate's score (each rollout's share of the token-mean KL; each problem's 0/1), and the run
    trains with it."""
    t = _trainer(tmp_path, tokenizer, extrapolate=True, gate=gate, margin=1.0)
    per = t.gate_score()
    assert per.shape == (len(t.gate_problems),) and per.dtype == torch.float64
    t.config.margin = 0.0
    assert float(per.mean()) == pytest.approx(t.gate_score(), rel=1e-5, abs=1e-9)
    if gate == "neg_kl":
        assert len(set(per.tolist())) > 1  # rollouts differ: the margin has noise to read
    t.config.margin = 1.0
    result = t.train()
    assert len(result.jumps) >= 2 and all(j["score_before"] is not None for j in result.jumps)
    t.world = 2  # the per-problem scores are this rank's only: refused before step 0
    with pytest.raises(ValueError, match="--margin needs one process"):
        t._build_optimizer()
