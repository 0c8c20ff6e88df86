"""``lr_follow`` (experimental): a kept jump carries into the base optimizer's learning rate,
inside ``step()`` only, so schedulers neither erase nor compound it; it backs off on refusals,
freezes when ``patience`` stops the searches, and resumes exactly from ``state_dict``."""

from __future__ import annotations

import pytest
import torch
from conftest import batches, make_mlp, params_equal, train

from lookahead_opd import PAPER_RULE, ExtrapolatingOptimizer, Extrapolator
from lookahead_opd.options import ExtrapolationOptions


class Gate:
    """One candidate per search (``max_candidates=1``): kept at the searches numbered in
    ``kept`` (1-based), refused at the others."""

    def __init__(self, kept: set[int]) -> None:
        self.kept, self.calls, self.search = kept, 0, 0

    def __call__(self) -> float:
        self.calls += 1
        if self.calls % 2 == 1:  # the score before the candidate
            self.search += 1
            return 0.0
        return 1.0 if self.search in self.kept else -1.0


def _opt(model, kept, *, lr=0.05, **options):
    return ExtrapolatingOptimizer(torch.optim.SGD(model.parameters(), lr=lr), eval_fn=Gate(kept),
                                  max_candidates=1, **{**PAPER_RULE, **options})


@pytest.mark.parametrize("bad", [1, 0.5, float("inf"), float("nan"), True, "2"])
def test_lr_follow_must_be_a_cap_above_one(bad):
    with pytest.raises(ValueError, match="lr_follow must be None or a finite number > 1"):
        ExtrapolationOptions(lr_follow=bad)
    with pytest.raises(ValueError, match="lr_follow must be None"):
        _opt(make_mlp(0), set(), lr_follow=bad)


@pytest.mark.slow
def test_only_the_optimizer_can_follow():
    model = make_mlp(0)
    with pytest.raises(ValueError, match="inside ExtrapolatingOptimizer.step"):
        Extrapolator(list(model.parameters()), lambda: 0.0, lr_follow=4.0, **PAPER_RULE)
    pytest.importorskip("transformers")
    from lookahead_opd.integrations.hf_trainer import ExtrapolationCallback

    with pytest.raises(ValueError, match="Trainer\\(optimizers="):
        ExtrapolationCallback(lambda: 0.0, lr_follow=4.0, **PAPER_RULE)


@pytest.mark.parametrize("kept, scales", [
    (set(), [1.0] * 6),                               # refusals never go below 1
    ({1, 2, 3, 4, 5, 6}, [2.0, 4.0, 8.0, 8.0, 8.0, 8.0]),  # ×(1 + c), c = 1, capped at 8
    ({1, 2, 3}, [2.0, 4.0, 8.0, 4.0, 2.0, 1.0]),      # then halved by each refusal
])
def test_the_scale_follows_the_searches(kept, scales):
    model = make_mlp(0)
    opt = _opt(model, kept, lr_follow=8.0)
    seen = []
    data = batches(1, 40)
    for i in range(len(data)):
        searches = len(opt.history)
        train(model, opt, data, start=i, stop=i + 1)
        if len(opt.history) > searches:
            seen.append(opt.lr_scale)
    assert seen == scales
    # A function of the searches' decisions alone (the same on every rank): replayed, equal.
    replay = 1.0
    for record in opt.history:
        replay = opt.followed_scale(replay, record)
    assert replay == opt.lr_scale


def test_off_is_the_plain_optimizer_bit_for_bit():
    data = batches(2, 20)
    a, b = make_mlp(0), make_mlp(0)
    train(a, _opt(a, {1, 2}), data)
    opt = _opt(b, {1, 2}, lr_follow=None)
    train(b, opt, data)
    assert params_equal(a, b) and opt.lr_scale == 1.0


@pytest.mark.parametrize("scheduler", ["lambda", "exponential"])
def test_the_step_uses_the_scaled_lr_and_the_group_keeps_the_schedulers(scheduler):
    """After a kept jump (×2), SGD's step is ``2·lr·g``; LambdaLR rewrites ``lr`` every step,
    ExponentialLR multiplies it: each sees its own values, neither erased nor compounded."""
    model = make_mlp(0)
    opt = _opt(model, {1}, lr=0.1, lr_follow=4.0, schedule="1")
    if scheduler == "lambda":
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
        expected = [0.1 / (1 + n) for n in range(5)]
    else:
        sched = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.5)
        expected = [0.1 * 0.5**n for n in range(5)]
    data = batches(3, 4)
    train(model, opt, data, stop=1)
    sched.step()
    assert opt.lr_scale == 2.0
    for i in range(1, 4):
        lr = opt.param_groups[0]["lr"]
        assert lr == pytest.approx(expected[i])
        x, y = data[i]
        before = [p.detach().clone() for p in model.parameters()]
        (model(x) - y).pow(2).mean().backward()
        grads = [p.grad.clone() for p in model.parameters()]
        opt.step()
        opt.zero_grad()
        for p, p0, g in zip(model.parameters(), before, grads, strict=True):
            torch.testing.assert_close(p.detach(), p0 - 2.0 * lr * g, rtol=1e-5, atol=1e-7)
        assert opt.param_groups[0]["lr"] == lr  # restored after the step
        sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(expected[4])


def test_patience_freezes_the_scale_where_the_last_search_left_it():
    model = make_mlp(0)
    opt = _opt(model, {1, 2}, lr_follow=8.0, patience=2)
    train(model, opt, batches(1, 40))
    assert [r.step for r in opt.history] == [1, 2, 4, 8] and opt.summary().stopped_after == 8
    assert opt.lr_scale == 1.0  # 1 → 2 → 4, then two refusals → 2 → 1, and no search after


def test_resume_is_exact():
    data = batches(4, 30)
    full, part = make_mlp(0), make_mlp(0)
    opt = _opt(full, {1, 2, 3}, lr_follow=8.0)
    train(full, opt, data)
    first = _opt(part, {1, 2, 3}, lr_follow=8.0)
    train(part, first, data, stop=5)  # searches 1, 2, 4 kept: scale 8
    state = first.state_dict()
    assert state["lr_follow_scale"] == 8.0
    again = _opt(part, set(), lr_follow=8.0)
    again.extrapolator.eval_fn = first.extrapolator.eval_fn  # the same gate, mid-run
    again.load_state_dict(state)
    assert again.lr_scale == 8.0
    train(part, again, data, start=5)
    assert params_equal(full, part) and again.lr_scale == opt.lr_scale
    # A state saved without lr_follow resumes at 1; one with it loads into a plain optimizer.
    plain = _opt(make_mlp(0), set(), lr_follow=8.0)
    plain.load_state_dict(_opt(make_mlp(0), set()).state_dict())
    assert plain.lr_scale == 1.0
    off = _opt(make_mlp(0), set())
    off.load_state_dict(state)
    assert off.lr_scale == 1.0 and "lr_follow_scale" not in off.state_dict()


def test_opd_config_carries_the_option():
    pytest.importorskip("transformers")
    from lookahead_opd.integrations.opd.config import OPDConfig

    config = OPDConfig(task="arithmetic", lr_follow=4.0, extrapolate=True)
    assert config.extrapolation_options()["lr_follow"] == 4.0
    with pytest.raises(ValueError, match="lr_follow"):
        OPDConfig(task="arithmetic", lr_follow=0.5).validate()
