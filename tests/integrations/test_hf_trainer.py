"""ExtrapolationCallback in transformers.Trainer (and TRL), and ExtrapolatingOptimizer handed
to Trainer(optimizers=...). Tiny Qwen2 models on CPU, eight optimizer steps of two
micro-batches each, so searches happen after optimizer steps 1, 2, 4 and 8."""

from __future__ import annotations

import itertools
import os
import shutil

import pytest
import torch
from conftest import tiny_qwen2

transformers = pytest.importorskip("transformers")

from transformers import (  # noqa: E402
    Qwen2ForCausalLM,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)

from lookahead_opd import PAPER_RULE, ExtrapolatingOptimizer  # noqa: E402
from lookahead_opd.integrations.hf_trainer import (  # noqa: E402
    STATE_NAME,
    ExtrapolationCallback,
    add_extrapolation,
    gate_score,
)

VOCAB = 50
SEQ = 8
STEPS = 8
SEARCH_STEPS = [1, 2, 4, 8]


# ---------------------------------------------------------------------- tiny problem
class Counting(torch.utils.data.Dataset):
    """Sequences ``s, s+1, s+2, …`` (mod VOCAB): learnable in a few steps."""

    def __init__(self, n: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        start = torch.randint(0, VOCAB, (n, 1), generator=g)
        self.ids = (start + torch.arange(SEQ)) % VOCAB

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def tiny_model(seed: int = 0) -> Qwen2ForCausalLM:
    return tiny_qwen2(VOCAB, seed, max_position_embeddings=32)


def training_args(tmp_path, **overrides) -> TrainingArguments:
    options = dict(
        output_dir=str(tmp_path / "out"),
        max_steps=STEPS,
        per_device_train_batch_size=4,
        per_device_eval_batch_size=16,
        gradient_accumulation_steps=2,
        learning_rate=1e-2,
        lr_scheduler_type="linear",
        logging_steps=100,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        seed=0,
    )
    options.update(overrides)
    return TrainingArguments(**options)


TRAIN = Counting(64, seed=1)
GATE = Counting(16, seed=2)


def neg_gate_loss(model: torch.nn.Module):
    """An eval_fn: minus the LM loss on a fixed gate batch (improves as the model learns)."""
    ids = GATE.ids

    def score() -> float:
        model.eval()
        with torch.no_grad():
            return -float(model(input_ids=ids, labels=ids).loss)

    return score


def next_token_accuracy(pred) -> dict[str, float]:
    preds, labels = pred.predictions, pred.label_ids
    return {"accuracy": float((preds[:, :-1] == labels[:, 1:]).mean())}


def argmax_logits(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return logits.argmax(-1)


def params_of(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def assert_same_params(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


def decisions(history) -> list[tuple]:
    """A history without its timings, comparable across runs."""
    return [
        (r.step, r.score_before, r.coefficients, r.scores, r.accepted, r.n_evals) for r in history
    ]


class StepsOfEvals(TrainerCallback):
    """Records, for the test, the optimizer step at each eval_fn call and every on_log."""

    def __init__(self) -> None:
        self.logs: list[dict] = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.logs.append(dict(logs))


# ---------------------------------------------------------------------- the callback
@pytest.mark.slow
def test_searches_after_optimizer_steps_not_micro_batches(tmp_path):
    model = tiny_model()
    seen: list[int] = []
    micro = []

    class CountMicro(TrainerCallback):
        def on_substep_end(self, args, state, control, **kwargs):
            micro.append(state.global_step)

    trainer = Trainer(model=model, args=training_args(tmp_path), train_dataset=TRAIN)
    score = neg_gate_loss(model)

    def eval_fn() -> float:
        seen.append(trainer.state.global_step)
        return score()

    cb = ExtrapolationCallback(eval_fn, **PAPER_RULE)
    trainer.add_callback(cb)
    trainer.add_callback(CountMicro())
    trainer.train()
    assert len(micro) == STEPS  # one non-final micro-batch per optimizer step
    assert [r.step for r in cb.history] == SEARCH_STEPS
    assert sorted(set(seen)) == SEARCH_STEPS
    assert len(seen) == sum(r.n_evals for r in cb.history)
    assert trainer.callback_handler.callbacks[0] is cb  # found the Trainer, runs first
    assert any(r.accepted is not None for r in cb.history)


@pytest.mark.slow
def test_never_improving_gate_leaves_training_bit_identical(tmp_path):
    plain = tiny_model()
    Trainer(model=plain, args=training_args(tmp_path / "a"), train_dataset=TRAIN).train()

    model = tiny_model()
    forward = neg_gate_loss(model)
    calls = []

    def never_better() -> float:
        calls.append(forward())  # a real forward in eval mode, then a constant score
        return 0.0

    trainer = Trainer(model=model, args=training_args(tmp_path / "b"), train_dataset=TRAIN)
    cb = ExtrapolationCallback(never_better, **PAPER_RULE)
    trainer.add_callback(cb)
    trainer.train()
    assert [r.step for r in cb.history] == SEARCH_STEPS
    assert all(r.accepted is None and r.coefficients == [1.0] for r in cb.history)
    assert len(calls) == 2 * len(SEARCH_STEPS)
    assert_same_params(params_of(plain), params_of(model))


def test_jump_keys_reach_log_history_and_reporters(tmp_path):
    model = tiny_model()
    recorder = StepsOfEvals()  # registered before the callback, like TensorBoard/W&B
    trainer = Trainer(
        model=model, args=training_args(tmp_path), train_dataset=TRAIN, callbacks=[recorder]
    )
    cb = ExtrapolationCallback(neg_gate_loss(model), **PAPER_RULE)
    trainer.add_callback(cb)
    trainer.train()
    logged = [h for h in trainer.state.log_history if "extrapolation/accepted" in h]
    assert [h["step"] for h in logged] == SEARCH_STEPS
    for h, r in zip(logged, cb.history, strict=True):
        assert "loss" in h  # merged into the training log of that step
        assert h["extrapolation/accepted"] == float(r.accepted is not None)
        assert h["extrapolation/coefficient"] == (r.accepted or 0.0)
        assert h["extrapolation/score_before"] == r.score_before
        assert h["extrapolation/best_score"] == r.best_score
        assert h["extrapolation/n_evals"] == r.n_evals
    assert logged[-1]["extrapolation/searches"] == len(SEARCH_STEPS)
    assert logged[-1]["extrapolation/evals"] == sum(r.n_evals for r in cb.history)
    assert "extrapolation/secant_cosine" not in logged[0]  # no previous direction yet
    assert [h["extrapolation/secant_cosine"] for h in logged[1:]] == [
        r.secant_cosine for r in cb.history[1:]
    ]
    seen = [log for log in recorder.logs if "extrapolation/accepted" in log]
    assert len(seen) == len(SEARCH_STEPS)
    # The end of the run logs what the searches bought.
    (summary,) = [h for h in trainer.state.log_history if "extrapolation/summary/searches" in h]
    assert summary["extrapolation/summary/searches"] == len(SEARCH_STEPS)
    assert summary["extrapolation/summary/gate_evals"] == sum(r.n_evals for r in cb.history)
    assert summary["extrapolation/summary/kept_jumps"] == sum(
        r.accepted is not None for r in cb.history
    )


def test_gate_dataset_scores_with_trainer_evaluate(tmp_path):
    model = tiny_model()
    trainer = Trainer(
        model=model,
        args=training_args(tmp_path, eval_strategy="steps", eval_steps=4),
        train_dataset=TRAIN,
        eval_dataset=Counting(16, seed=3),
        compute_metrics=next_token_accuracy,
        preprocess_logits_for_metrics=argmax_logits,
    )
    cb = add_extrapolation(trainer, gate_dataset=GATE, metric="eval_loss", **PAPER_RULE)
    assert cb.options["mode"] == "min"  # a loss is minimised
    trainer.train()
    assert [r.step for r in cb.history] == SEARCH_STEPS
    assert any(r.accepted is not None for r in cb.history)
    gate_logs = [h for h in trainer.state.log_history if "gate_loss" in h]
    assert len(gate_logs) == sum(r.n_evals for r in cb.history)
    # The gate evaluations do not cancel the regular ones scheduled at steps 4 and 8.
    assert [h["step"] for h in trainer.state.log_history if "eval_loss" in h] == [4, 8]
    # The recorded scores are the gate's own numbers.
    s = gate_score(trainer, GATE, "accuracy")
    assert 0.0 <= s <= 1.0
    assert gate_score(trainer, GATE, "eval_loss") == pytest.approx(cb.history[-1].best_score)


def test_gate_accuracy_metric_names(tmp_path):
    model = tiny_model()
    trainer = Trainer(
        model=model,
        args=training_args(tmp_path, max_steps=2),
        train_dataset=TRAIN,
        compute_metrics=next_token_accuracy,
        preprocess_logits_for_metrics=argmax_logits,
    )
    cb = ExtrapolationCallback(gate_dataset=GATE, metric="accuracy", max_candidates=2, **PAPER_RULE)
    assert cb.options["mode"] == "max"
    trainer.add_callback(cb)
    trainer.train()
    assert [r.step for r in cb.history] == [1, 2]
    assert all(0.0 <= s <= 1.0 for r in cb.history for s in [r.score_before, *r.scores])
    for name in ("accuracy", "eval_accuracy", "gate_accuracy"):
        assert gate_score(trainer, GATE, name) == gate_score(trainer, GATE, "accuracy")


def test_missing_metric_names_it_and_the_available_ones(tmp_path):
    model = tiny_model()
    before = params_of(model)
    trainer = Trainer(model=model, args=training_args(tmp_path), train_dataset=TRAIN)
    trainer.add_callback(ExtrapolationCallback(gate_dataset=GATE, metric="eval_accuracy", **PAPER_RULE))
    with pytest.raises(ValueError, match=r"'eval_accuracy'.*gate_loss") as info:
        trainer.train()
    assert "compute_metrics" in str(info.value)
    assert not all(torch.equal(before[n], p) for n, p in model.named_parameters())  # it trained


def test_misuse_is_rejected_early():
    with pytest.raises(ValueError, match="exactly one of eval_fn= .* or gate_dataset=.*neither"):
        ExtrapolationCallback(**PAPER_RULE)
    with pytest.raises(ValueError, match="both"):
        ExtrapolationCallback(lambda: 0.0, gate_dataset=GATE, **PAPER_RULE)
    with pytest.raises(TypeError, match="callable"):
        ExtrapolationCallback(1.0, **PAPER_RULE)
    with pytest.raises(TypeError, match="unknown Extrapolator options.*'shedule'"):
        ExtrapolationCallback(lambda: 0.0, shedule="powers_of_two", **PAPER_RULE)
    with pytest.raises(TypeError, match="set by ExtrapolationCallback"):
        ExtrapolationCallback(lambda: 0.0, optimizer=None, **PAPER_RULE)
    with pytest.raises(ValueError, match="mode must be one of"):
        ExtrapolationCallback(lambda: 0.0, mode="up", **PAPER_RULE)
    with pytest.raises(ValueError, match="params must be one of"):
        ExtrapolationCallback(lambda: 0.0, params="everything", **PAPER_RULE)


def test_callback_and_extrapolating_optimizer_together_is_rejected(tmp_path):
    model = tiny_model()
    opt = ExtrapolatingOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), lambda: 0.0, **PAPER_RULE)
    trainer = Trainer(
        model=model, args=training_args(tmp_path), train_dataset=TRAIN, optimizers=(opt, None)
    )
    trainer.add_callback(ExtrapolationCallback(lambda: 0.0, **PAPER_RULE))
    with pytest.raises(ValueError, match="already an ExtrapolatingOptimizer"):
        trainer.train()


def test_deepspeed_zero3_placeholders_are_rejected(tmp_path):
    """ZeRO-3 replaces each parameter by an empty placeholder carrying ``ds_id``; extrapolating
    those would silently do nothing, so the callback refuses (DeepSpeed itself is not needed
    to check the guard: the marker is what DeepSpeed sets)."""
    model = tiny_model()
    model.model.embed_tokens.weight.ds_id = 0
    trainer = Trainer(model=model, args=training_args(tmp_path, max_steps=1), train_dataset=TRAIN)
    trainer.add_callback(ExtrapolationCallback(lambda: 0.0, **PAPER_RULE))
    with pytest.raises(ValueError, match=r"ZeRO-3.*embed_tokens.*ZeRO stage 1 or 2, or FSDP2"):
        trainer.train()


def test_transformer_blocks_selection(tmp_path):
    model = tiny_model()
    trainer = Trainer(model=model, args=training_args(tmp_path, max_steps=1), train_dataset=TRAIN)
    cb = add_extrapolation(trainer, neg_gate_loss(model), params="transformer_blocks")
    trainer.train()
    names = cb.extrapolator.names
    assert names and all(".layers." in n for n in names)
    assert not any("embed_tokens" in n for n in names)


def _run_with_checkpoints(tmp_path, resume_from: str | bool | None = None, make_opt: bool = False):
    """Eight steps with saves every 3 (and at the end); with ``resume_from``, a fresh model,
    callback and Trainer continue from that checkpoint."""
    model = tiny_model(seed=0 if resume_from is None else 123)
    args = training_args(tmp_path, save_strategy="steps", save_steps=3, logging_steps=1)
    score = neg_gate_loss(model)
    if make_opt:
        opt = ExtrapolatingOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), score, **PAPER_RULE)
        trainer = Trainer(model=model, args=args, train_dataset=TRAIN, optimizers=(opt, None))
        holder = opt
    else:
        trainer = Trainer(model=model, args=args, train_dataset=TRAIN)
        holder = ExtrapolationCallback(score, **PAPER_RULE)
        trainer.add_callback(holder)
    trainer.train(resume_from_checkpoint=resume_from)
    return model, holder, trainer


@pytest.mark.slow
def test_resume_continues_schedule_anchor_and_history(tmp_path):
    model, cb, _ = _run_with_checkpoints(tmp_path)
    ckpt = os.path.join(tmp_path, "out", "checkpoint-3")
    assert os.path.isfile(os.path.join(ckpt, STATE_NAME))
    saved = torch.load(os.path.join(ckpt, STATE_NAME), weights_only=True)
    assert saved["step_count"] == 3 and [r["step"] for r in saved["history"]] == [1, 2]
    assert any(r.accepted is not None for r in cb.history[:2])  # the anchor matters
    resumed_model, resumed, trainer = _run_with_checkpoints(tmp_path, resume_from=ckpt)
    assert decisions(resumed.history) == decisions(cb.history)
    assert [r.step for r in resumed.history] == SEARCH_STEPS
    assert resumed.extrapolator.step_count == STEPS
    assert_same_params(params_of(model), params_of(resumed_model))
    # A checkpoint taken after a search (the jump at step 4 is in checkpoint-6's anchor), found
    # with resume_from_checkpoint=True once the last one is gone.
    shutil.rmtree(os.path.join(tmp_path, "out", "checkpoint-8"))
    last_model, last, trainer = _run_with_checkpoints(tmp_path, resume_from=True)
    assert trainer.state.global_step == STEPS
    assert decisions(last.history) == decisions(cb.history)
    assert_same_params(params_of(model), params_of(last_model))


@pytest.mark.slow
def test_resume_without_saved_state_continues_the_schedule(tmp_path, caplog):
    model = tiny_model()
    args = training_args(tmp_path, save_strategy="steps", save_steps=3)
    Trainer(model=model, args=args, train_dataset=TRAIN).train()  # no callback
    model = tiny_model()
    trainer = Trainer(model=model, args=args, train_dataset=TRAIN)
    cb = add_extrapolation(trainer, neg_gate_loss(model))
    with caplog.at_level("WARNING"):
        trainer.train(resume_from_checkpoint=os.path.join(tmp_path, "out", "checkpoint-3"))
    assert [r.step for r in cb.history] == [4, 8]
    assert "found no extrapolation_state.pt" in caplog.text


def test_the_default_rule_keeps_a_linear_ladder_and_resets_the_trainers_adam_state(tmp_path):
    """The callback's defaults: a ladder whose gain is linear in c keeps c = 16, and the jump
    restarts the state of the optimizer the Trainer built (Accelerate's wrapper around AdamW),
    which the next step begins again from step 1."""
    model = tiny_model()
    trainer = Trainer(model=model, args=training_args(tmp_path, max_steps=2), train_dataset=TRAIN)
    ladder = itertools.cycle([0.0, 1.0, 2.0, 4.0, 8.0, 16.0])  # W_t, then the score is c
    cb = add_extrapolation(trainer, ladder.__next__, schedule=[2])
    seen = []  # after each step (and its search): how many state entries the optimizer holds

    class Spy(TrainerCallback):
        def on_step_end(self, *args, **kwargs):
            seen.append(sum(len(state) for state in trainer.optimizer.state.values()))

    trainer.add_callback(Spy())
    trainer.train()
    assert [(r.step, r.accepted) for r in cb.history] == [(2, 16.0)]
    assert seen[0] > 0 and seen[1] == 0  # AdamW's moments, then none after the jump


# ---------------------------------------------------------------------- Trainer(optimizers=...)
@pytest.mark.slow
def test_extrapolating_optimizer_as_trainer_optimizer(tmp_path):
    model, opt, trainer = _run_with_checkpoints(tmp_path, make_opt=True)
    assert trainer.optimizer.optimizer is opt  # Accelerate wrapped ours
    assert [r.step for r in opt.history] == SEARCH_STEPS
    lrs = [h["learning_rate"] for h in trainer.state.log_history if "learning_rate" in h]
    assert len(lrs) == STEPS and lrs == sorted(lrs, reverse=True) and lrs[0] > lrs[-1]
    assert opt.param_groups[0]["lr"] == pytest.approx(0.0)  # linear decay to zero
    ckpt = os.path.join(tmp_path, "out", "checkpoint-3")
    state = torch.load(os.path.join(ckpt, "optimizer.pt"), weights_only=True)
    assert state["extrapolator"]["step_count"] == 3
    resumed_model, resumed, _ = _run_with_checkpoints(tmp_path, resume_from=ckpt, make_opt=True)
    assert decisions(resumed.history) == decisions(opt.history)
    assert_same_params(params_of(model), params_of(resumed_model))


def test_gate_score_as_extrapolating_optimizer_eval_fn(tmp_path):
    model = tiny_model()
    trainer = None
    opt = ExtrapolatingOptimizer(
        torch.optim.AdamW(model.parameters(), lr=1e-2),
        lambda: gate_score(trainer, GATE, "eval_loss"),
        mode="min",
        max_candidates=2,
        **PAPER_RULE,
    )
    trainer = Trainer(
        model=model,
        args=training_args(tmp_path, max_steps=2),
        train_dataset=TRAIN,
        optimizers=(opt, None),
    )
    trainer.train()
    assert [r.step for r in opt.history] == [1, 2]
    assert all(r.score_before > 0 for r in opt.history)
