"""ExtrapolatingOptimizer: exactness, gating, and compatibility with the torch optimizer API."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from conftest import LeastSquares, batches, make_mlp, params_equal, train
from hypothesis import given
from hypothesis import strategies as st

from lookahead_opd import PAPER_RULE, ExtrapolatingOptimizer, Extrapolator, Steps

OPTIMIZERS = {
    "sgd": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9),
    "adam": lambda p: torch.optim.Adam(p, lr=1e-2),
    "adamw": lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1),
}


class WorseAndWorse:
    """A gate that gets worse on every call: every candidate is rejected."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self) -> float:
        self.calls += 1
        return -float(self.calls)


# ---------------------------------------------------------------- 1. never improving = bare


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("gate", ["constant", "worse"])
@pytest.mark.parametrize("snapshot", ["full", "lowrank"])
def test_never_improving_gate_is_bit_identical_to_bare(name, dtype, gate, snapshot):
    data = batches(1, 40, dtype)
    bare, wrapped = make_mlp(0, dtype), make_mlp(0, dtype)
    eval_fn = (lambda: 1.0) if gate == "constant" else WorseAndWorse()
    opt = ExtrapolatingOptimizer(
        OPTIMIZERS[name](wrapped.parameters()),
        eval_fn=eval_fn,
        snapshot=snapshot,
        rank=2 if snapshot == "lowrank" else None,
        **PAPER_RULE,
    )
    train(bare, OPTIMIZERS[name](bare.parameters()), data)
    train(wrapped, opt, data)
    assert [r.step for r in opt.history] == [1, 2, 4, 8, 16, 32]
    assert all(r.accepted is None and r.n_evals == 2 for r in opt.history)
    assert params_equal(bare, wrapped)


@pytest.mark.parametrize("direction", ["secant", "averaged"])
def test_never_improving_is_bit_identical_for_both_directions(direction):
    data = batches(2, 20)
    bare, wrapped = make_mlp(3), make_mlp(3)
    opt = ExtrapolatingOptimizer(
        torch.optim.AdamW(wrapped.parameters(), lr=1e-2), eval_fn=WorseAndWorse(), direction=direction, **PAPER_RULE
    )
    train(bare, torch.optim.AdamW(bare.parameters(), lr=1e-2), data)
    train(wrapped, opt, data)
    assert params_equal(bare, wrapped)


# ---------------------------------------------------------------- 2. exact rejection, errors


def test_rejected_candidate_leaves_weights_bit_exact():
    model = make_mlp(0)
    scores = iter([0.0, -1.0])  # s0, then the first candidate is worse
    opt = ExtrapolatingOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), eval_fn=lambda: next(scores), schedule=[1], **PAPER_RULE
    )
    x, y = batches(0, 1)[0]
    (model(x) - y).pow(2).mean().backward()
    seen = {}

    def record_then_step():
        opt.base.step()
        seen.update({n: p.detach().clone() for n, p in model.named_parameters()})

    # Capture W_t by stepping the base, then let the extrapolator search.
    record_then_step()
    opt.extrapolator.after_step()
    assert opt.history[0].accepted is None and opt.history[0].scores == [-1.0]
    for n, p in model.named_parameters():
        assert torch.equal(p, seen[n]), n


def test_partial_acceptance_keeps_the_best_candidate_exactly():
    model = torch.nn.Linear(3, 2)
    with torch.no_grad():
        w0 = model.weight.clone()
    scores = iter([0.0, 1.0, 2.0, 1.5])  # accept c=1 and c=2, reject c=4
    opt = ExtrapolatingOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), eval_fn=lambda: next(scores), schedule=[1], **PAPER_RULE
    )
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    w1 = w0 - 0.1 * model.weight.grad  # W_1, the SGD step before the search
    rec = opt.history[0]
    assert rec.accepted == 2.0 and rec.coefficients == [1.0, 2.0, 4.0] and rec.n_evals == 4
    assert torch.allclose(model.weight, w1 + 2 * (w1 - w0), atol=1e-6)
    # the kept candidate is recomputed bit-exactly as it was when scored
    assert torch.equal(model.weight, torch.lerp(w0, w0.sub(model.weight.grad, alpha=0.1), 3.0))


@pytest.mark.parametrize("snapshot", ["full", "lowrank"])
def test_the_kept_candidate_is_the_one_scored_bit_for_bit(snapshot):
    """The first candidate is written by the search's pass (runs cut at the sketch's blocks),
    a kept one is re-written by ``apply`` (other runs) after a refused larger one: the weights
    left in place are the bits the gate scored."""
    model = torch.nn.Linear(600, 300)
    seen = []

    def gate() -> float:
        seen.append(model.weight.detach().clone())
        return [0.0, 1.0, 0.5][len(seen) - 1]  # keep c=1, refuse c=2

    opt = ExtrapolatingOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), eval_fn=gate,
                                 schedule=[2], snapshot=snapshot, rank=2 if snapshot == "lowrank" else None, **PAPER_RULE)
    for _ in range(2):
        model(torch.randn(4, 600)).square().sum().backward()
        opt.step()
        opt.zero_grad()
    assert opt.history[0].accepted == 1.0 and opt.history[0].coefficients == [1.0, 2.0]
    assert torch.equal(model.weight.detach(), seen[1]) and not torch.equal(seen[1], seen[2])


def test_eval_fn_that_raises_restores_weights_and_reraises():
    model = make_mlp(0)
    calls = {"n": 0}

    def flaky():
        calls["n"] += 1
        if calls["n"] == 2:  # while the first candidate is in place
            raise RuntimeError("gate crashed")
        return 0.0

    opt = ExtrapolatingOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), eval_fn=flaky, **PAPER_RULE)
    x, y = batches(0, 1)[0]
    (model(x) - y).pow(2).mean().backward()
    before_search = {}
    orig = opt.extrapolator.search

    def spy():
        before_search.update({n: p.detach().clone() for n, p in model.named_parameters()})
        return orig()

    opt.extrapolator.search = spy
    with pytest.raises(RuntimeError, match="gate crashed"):
        opt.step()
    for n, p in model.named_parameters():
        assert torch.equal(p, before_search[n]), n
    assert opt.history == []


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_scores_are_rejections_with_a_warning(bad):
    model = make_mlp(0)
    scores = iter([0.0, bad])
    opt = ExtrapolatingOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), eval_fn=lambda: next(scores), schedule=[1], **PAPER_RULE
    )
    x, y = batches(0, 1)[0]
    (model(x) - y).pow(2).mean().backward()
    opt.base.step()
    w_t = [p.detach().clone() for p in model.parameters()]
    with pytest.warns(RuntimeWarning, match="non-finite"):
        opt.extrapolator.after_step()
    assert opt.history[0].accepted is None
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), w_t, strict=False))


def test_non_finite_score_before_skips_the_candidates():
    model = make_mlp(0)
    opt = ExtrapolatingOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), eval_fn=lambda: math.nan, schedule=[1], **PAPER_RULE
    )
    x, y = batches(0, 1)[0]
    (model(x) - y).pow(2).mean().backward()
    with pytest.warns(RuntimeWarning):
        opt.step()
    assert opt.history[0].n_evals == 1 and opt.history[0].coefficients == []


@pytest.mark.parametrize("bad", ["0.5", None, [], ["a"], (1.0, True), torch.ones(2, 2), True])
def test_non_numeric_score_is_a_type_error(bad):
    model = make_mlp(0)
    opt = ExtrapolatingOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), eval_fn=lambda: bad, **PAPER_RULE)
    x, y = batches(0, 1)[0]
    (model(x) - y).pow(2).mean().backward()
    with pytest.raises(TypeError, match="eval_fn must return"):
        opt.step()


def test_numeric_scores_of_other_types_are_accepted():
    import numpy as np

    for value in (np.float32(0.5), np.int64(2), torch.tensor(0.25), torch.tensor([0.5]), 3):
        model = make_mlp(0)
        opt = ExtrapolatingOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1), eval_fn=lambda v=value: v, schedule=[1], **PAPER_RULE
        )
        model(torch.zeros(1, 6)).sum().backward()
        opt.step()
        assert opt.history[0].score_before == pytest.approx(float(value))


# ---------------------------------------------------------------- 3. a straight path gains


@pytest.mark.parametrize("coefficients", ["geometric", "linear"])
@pytest.mark.parametrize("snapshot", ["full", "lowrank"])
def test_straight_path_jumps_are_accepted_and_lower_the_loss(coefficients, snapshot):
    plain, jumped = LeastSquares(), LeastSquares()
    opt_plain = torch.optim.SGD(plain.model.parameters(), lr=0.01)
    opt = ExtrapolatingOptimizer(
        torch.optim.SGD(jumped.model.parameters(), lr=0.01),
        eval_fn=jumped.score,
        coefficients=coefficients,
        snapshot=snapshot,
        rank=1 if snapshot == "lowrank" else None,
        **PAPER_RULE,
    )
    for problem, o in ((plain, opt_plain), (jumped, opt)):
        for _ in range(40):
            problem.loss().backward()
            o.step()
            o.zero_grad()
    accepted = [r for r in opt.history if r.accepted is not None]
    assert len(accepted) >= 3
    assert jumped.loss().item() < 0.5 * plain.loss().item()


def test_mode_min_minimises():
    problem = LeastSquares()
    opt = ExtrapolatingOptimizer(
        torch.optim.SGD(problem.model.parameters(), lr=0.01),
        eval_fn=lambda: -problem.score(),
        mode="min",
        **PAPER_RULE,
    )
    for _ in range(16):
        problem.loss().backward()
        opt.step()
        opt.zero_grad()
    assert any(r.accepted for r in opt.history)
    assert all(r.best_score <= r.score_before for r in opt.history)


def test_min_improvement_is_a_margin():
    def run(margin):
        model = torch.nn.Linear(2, 1)
        scores = iter([0.0, 0.05, 0.2, 0.3, 0.25])
        opt = ExtrapolatingOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1),
            eval_fn=lambda: next(scores),
            schedule=[1],
            min_improvement=margin,
            **PAPER_RULE,
        )
        model(torch.ones(1, 2)).sum().backward()
        opt.step()
        return opt.history[0].accepted

    assert run(0.0) == 4.0
    assert run(0.1) is None  # 0.05 does not beat 0.0 by more than 0.1


def _search_once(eval_fn, **options):
    """One search at step 1 of a tiny model, ``eval_fn`` its gate; the search's record."""
    model = torch.nn.Linear(2, 1)
    opt = ExtrapolatingOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), eval_fn=eval_fn,
                                 schedule=[1], **{**PAPER_RULE, **options})
    model(torch.ones(1, 2)).sum().backward()
    opt.step()
    return opt.history[0]


def test_per_example_scores_are_averaged_and_a_margin_refuses_a_gain_within_their_noise():
    base = torch.tensor([0.0, 1.0, 0.0, 1.0, 0.0, 1.0, 0.0, 1.0])
    # candidate 1: +0.125 on average, one example of 8 flipped (paired SE 0.125); candidate 2:
    # +0.25 on every example (SE 0)
    answers = [base, base + torch.tensor([1.0, 0, 0, 0, 0, 0, 0, 0]), base + 0.25, base]

    def gate(answers=answers):
        it = iter(answers)
        return lambda: next(it)

    plain = _search_once(gate())
    assert plain.score_before == 0.5 and plain.scores[:2] == [0.625, 0.75]
    assert plain.accepted == 2.0  # both beat the best so far
    # the first candidate's gain is one standard error: a margin of 2 refuses it
    assert _search_once(gate(), margin=2.0).accepted is None
    assert _search_once(gate(), margin=0.5).accepted == 2.0
    # a gain of the same size on every example clears any margin
    steady = [base, base + 0.125, base + 0.25, base]
    assert _search_once(gate(steady), margin=50.0).accepted == 2.0
    # lists work as tensors do, and min="min" mirrors max
    assert _search_once(gate([x.tolist() for x in steady]), margin=50.0).accepted == 2.0
    down = [-x for x in answers]
    assert _search_once(gate(down), mode="min", margin=2.0).accepted is None
    assert _search_once(gate(down), mode="min").accepted == 2.0


def test_back_off_keeps_the_candidate_before_the_best_once_the_score_turns():
    def search(scores, **options):
        it = iter(scores)
        return _search_once(lambda: next(it), **options)

    turned = [0.0, 0.05, 0.2, 0.3, 0.25]  # c = 1, 2, 4 better and better; 8 worse
    assert search(turned).accepted == 4.0
    assert search(turned, back_off=1).accepted == 2.0
    # every candidate improved: no edge was seen, the best stays
    rising = [0.0, 0.1, 0.2, 0.3, 0.4, 0.5]
    assert search(rising, back_off=1).accepted == 16.0
    # the first candidate was the best: back to W_t; the first refused: W_t as without it
    assert search([0.0, 0.1, 0.05], back_off=1).accepted is None
    assert search([0.0, -0.1], back_off=1).accepted is None
    # a non-finite score is a turn too
    assert search([0.0, 0.1, 0.2, math.nan], back_off=1).accepted == 1.0
    # k candidates back; more than there are: W_t, so a jump stays only from a ladder that
    # never turned
    assert search(turned, back_off=2).accepted == 1.0
    assert search(turned, back_off=9).accepted is None
    assert search(rising, back_off=9).accepted == 16.0
    with pytest.raises(ValueError, match="back_off must be"):
        search(turned, back_off=True)


def test_linearity_keeps_a_jump_only_from_a_ladder_that_has_not_bent():
    def search(scores, **options):
        it = iter(scores)
        return _search_once(lambda: next(it), **options)

    # The gate's step-1 ladders of benchmarks/results/no_harm.json (seed 0; W_t's score, then
    # c = 1, 2, 4, 8, 16): every candidate improved at both lrs, but at 3e-6 the last rung
    # gained 0.18x per unit of c what the rung before did, at 1e-6 0.77x.
    too_small = [-0.1611, -0.1549, -0.1490, -0.1380, -0.1186, -0.0886]  # lr 1e-6
    tuned = [-0.1787, -0.1595, -0.1426, -0.1142, -0.0761, -0.0620]  # lr 3e-6
    assert search(too_small).accepted == search(tuned).accepted == 16.0
    assert search(too_small, linearity=0.5).accepted == 16.0
    assert search(tuned, linearity=0.5).accepted is None
    assert search(too_small, linearity=0.9).accepted is None
    # a ladder that stopped keeps nothing, back_off or not; one rung cannot show a bend
    turned = [0.0, 0.05, 0.2, 0.3, 0.25]
    assert search(turned, linearity=0.5).accepted is None
    assert search(turned, linearity=0.5, back_off=1).accepted is None
    assert search([0.0, 0.1], linearity=0.5, max_candidates=1).accepted is None
    # a straight ladder passes any linearity up to 1; "min" mirrors "max"
    straight = [0.0, 0.1, 0.2, 0.4, 0.8, 1.6]
    assert search(straight, linearity=1.0).accepted == 16.0
    assert search([-x for x in straight], mode="min", linearity=1.0).accepted == 16.0
    assert search([-x for x in tuned], mode="min", linearity=0.5).accepted is None
    for bad in (-0.5, math.inf, True, "0.5"):
        with pytest.raises((ValueError, TypeError), match="linearity"):
            search(straight, linearity=bad)


def test_margin_needs_the_same_examples_at_every_call_and_says_so_in_one_line():
    with pytest.raises(TypeError, match="margin > 0 needs eval_fn to return one score per ex"):
        _search_once(lambda: 0.5, margin=1.0)
    sizes = iter([torch.zeros(4), torch.ones(5)])
    with pytest.raises(ValueError, match="scored 5 examples, and 4 before"):
        _search_once(lambda: next(sizes), margin=1.0)
    with pytest.raises(ValueError, match="margin must be >= 0"):
        _search_once(lambda: 0.5, margin=-1.0)
    with pytest.raises(TypeError, match="one real number per example"):
        _search_once(lambda: ["a"])
    # one score per example is a score with margin=0 too: their mean
    assert _search_once(lambda: [0.25, 0.75], max_candidates=1).score_before == 0.5


# ---------------------------------------------------------------- 3b. patience


class KeptAt:
    """A gate whose first candidate beats the score before exactly at the searches ``kept``
    (1-based); every other candidate is worse."""

    def __init__(self, kept: set[int]) -> None:
        self.kept, self.search, self.calls = kept, 0, 0

    def __call__(self) -> float:
        self.calls += 1
        if self.calls % 2 == 1:  # the score before the candidates (one candidate per search)
            self.search += 1
            return 0.0
        return 1.0 if self.search in self.kept else -1.0


@pytest.mark.parametrize("kept, patience, searched", [
    (set(), 2, [1, 2]),
    (set(), 3, [1, 2, 4]),
    ({2}, 2, [1, 2, 4, 8]),           # a kept jump starts the count over
    ({1, 3}, 1, [1, 2]),
    ({1, 2, 3, 4, 5, 6}, 1, [1, 2, 4, 8, 16, 32]),
])
def test_patience_stops_searching_after_that_many_refused_searches(kept, patience, searched):
    data = batches(1, 40)
    bare, wrapped = make_mlp(0), make_mlp(0)
    opt = ExtrapolatingOptimizer(torch.optim.SGD(wrapped.parameters(), lr=0.05),
                                 eval_fn=KeptAt(kept), max_candidates=1,
                                 **{**PAPER_RULE, "patience": patience})
    train(wrapped, opt, data)
    assert [r.step for r in opt.history] == searched
    stopped = len(searched) < 6
    assert opt.summary().stopped_after == (searched[-1] if stopped else None)
    assert ("searching stopped after step" in str(opt.summary())) == stopped
    if not kept:  # nothing kept: the stop costs nothing, the weights are the bare run's
        train(bare, torch.optim.SGD(bare.parameters(), lr=0.05), data)
        assert params_equal(bare, wrapped)


def test_patience_skips_only_searches_that_would_have_been_refused():
    """Where no search after the stop would have kept a jump, stopping is exact: the same
    weights as searching at every scheduled step, with fewer gate evaluations."""
    data = batches(3, 40)
    runs = {}
    for patience in (None, 2):
        model = make_mlp(0)
        opt = ExtrapolatingOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                     eval_fn=KeptAt({1}), max_candidates=1,
                                     **{**PAPER_RULE, "patience": patience})
        train(model, opt, data)
        runs[patience] = (model, opt.summary())
    (full, s_full), (stopped, s_stopped) = runs[None], runs[2]
    assert params_equal(full, stopped) and s_full.kept_jumps == s_stopped.kept_jumps == 1
    assert s_stopped.stopped_after == 4 and s_full.stopped_after is None
    assert s_stopped.gate_evals == 6 < s_full.gate_evals == 12


@pytest.mark.parametrize("snapshot, direction", [("full", "secant"), ("lowrank", "secant"),
                                                  ("full", "averaged")])
def test_patience_frees_the_anchor_once_searching_stops(snapshot, direction):
    model = make_mlp(0)
    opt = ExtrapolatingOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                 eval_fn=WorseAndWorse(), **{**PAPER_RULE, "patience": 2},
                                 snapshot=snapshot,
                                 rank=2 if snapshot == "lowrank" else None, direction=direction)
    data = batches(1, 6)
    train(model, opt, data, stop=1)
    held = opt.extrapolator.nbytes()
    assert held["anchor"] > 0 and (held["average"] > 0) == (direction == "averaged")
    train(model, opt, data, start=1)  # the search at step 2 is the second refused one
    assert opt.extrapolator.nbytes() == {"anchor": 0, "average": 0, "sketch": held["sketch"]}
    with pytest.raises(RuntimeError, match="searching stopped after step 2"):
        opt.extrapolator.search()
    opt.add_param_group({"params": [torch.nn.Parameter(torch.ones(3))]})  # nothing to anchor
    assert opt.extrapolator.nbytes()["anchor"] == 0


def test_patience_survives_a_resume():
    data = batches(1, 40)
    model = make_mlp(0)
    opt = ExtrapolatingOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                 eval_fn=WorseAndWorse(), **{**PAPER_RULE, "patience": 2})
    train(model, opt, data, stop=10)
    state = opt.state_dict()
    again = ExtrapolatingOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                   eval_fn=WorseAndWorse(), **{**PAPER_RULE, "patience": 2})
    again.load_state_dict(state)
    train(model, again, data, start=10)
    assert [r.step for r in again.history] == [1, 2] and again.summary().stopped_after == 2
    assert again.extrapolator.nbytes()["anchor"] == 0  # the saved state held no anchor either
    # A stopped run's state needs the same patience: without it the next search has no anchor.
    searching = ExtrapolatingOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                       eval_fn=WorseAndWorse(), **PAPER_RULE)
    with pytest.raises(ValueError, match="same patience"):
        searching.load_state_dict(state)
    assert searching.history == []


# ---------------------------------------------------------------- 4. monotone gate


@given(st.lists(st.floats(-10, 10, allow_nan=False), min_size=6, max_size=6), st.sampled_from(["max", "min"]))
def test_gate_score_never_gets_worse_across_a_search(scores, mode):
    model = torch.nn.Linear(2, 2)
    it = iter(scores)
    opt = ExtrapolatingOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), eval_fn=lambda: next(it), schedule=[1], mode=mode, **PAPER_RULE
    )
    model(torch.ones(1, 2)).sum().backward()
    opt.step()
    rec = opt.history[0]
    sign = 1 if mode == "max" else -1
    assert sign * rec.best_score >= sign * rec.score_before
    kept = [rec.score_before] + rec.scores[: len(rec.scores) - (rec.accepted != rec.coefficients[-1])]
    assert all(sign * b > sign * a for a, b in zip(kept, kept[1:], strict=False))
    # the search stops at the first failure, and only then
    failures = [i for i, s in enumerate(rec.scores) if not sign * s > sign * ([rec.score_before] + rec.scores)[i]]
    assert len(rec.scores) == (failures[0] + 1 if failures else 5)


# ---------------------------------------------------------------- averaged direction


def test_averaged_direction_c0_is_the_window_average():
    model = torch.nn.Linear(3, 1, bias=False)
    scores = iter([0.0, 1.0, 0.5])  # W_t, then c=0 accepted, then c=1 rejected
    opt = ExtrapolatingOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1),
        eval_fn=lambda: next(scores),
        direction="averaged",
        schedule=[4],
        **PAPER_RULE,
    )
    seen = []  # the weights after each base step, before any search
    opt.base.register_step_post_hook(lambda *_: seen.append(model.weight.detach().clone()))
    g = torch.Generator().manual_seed(0)
    for _ in range(4):
        model(torch.randn(2, 3, generator=g)).sum().backward()
        opt.step()
        opt.zero_grad()
    assert opt.history[0].coefficients == [0.0, 1.0] and opt.history[0].accepted == 0.0
    assert torch.allclose(model.weight, torch.stack(seen).mean(0), atol=1e-7)
    assert not torch.equal(model.weight, seen[-1])


def test_averaged_direction_skips_c0_in_a_one_step_window():
    model = torch.nn.Linear(3, 1)
    opt = ExtrapolatingOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), eval_fn=lambda: 0.0, direction="averaged", **PAPER_RULE
    )
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    assert opt.history[0].coefficients == [1.0]


# ---------------------------------------------------------------- 6. the optimizer API


def test_lr_scheduler_on_the_wrapper_steps_the_base_lr():
    model = make_mlp(0)
    opt = ExtrapolatingOptimizer(torch.optim.SGD(model.parameters(), lr=1.0), eval_fn=lambda: 0.0, **PAPER_RULE)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5**s)
    data = batches(0, 3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "scheduler.step() before optimizer.step()" warning
        for x, y in data:
            (model(x) - y).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            sched.step()
    assert opt.base.param_groups[0]["lr"] == pytest.approx(0.125)
    assert opt.param_groups is opt.base.param_groups


def test_grad_scaler_skips_steps_with_inf_grads_and_counts_only_real_steps():
    model = make_mlp(0)
    opt = ExtrapolatingOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), eval_fn=lambda: 0.0, **PAPER_RULE)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**4)
    x, y = batches(0, 1)[0]
    scaler.scale((model(x) - y).pow(2).mean()).backward()
    scaler.step(opt)
    scaler.update()
    opt.zero_grad()
    assert opt.step_count == 1
    scaler.scale((model(x) - y).pow(2).mean()).backward()
    next(model.parameters()).grad[0, 0] = math.inf
    before = [p.detach().clone() for p in model.parameters()]
    scaler.step(opt)  # skipped: inf grads
    scaler.update()
    assert opt.step_count == 1
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before, strict=False))


def test_param_groups_none_grads_and_frozen_params():
    model = make_mlp(0)
    first, second, last = model[0], model[2], model[4]
    last.weight.requires_grad_(False)
    base = torch.optim.SGD(
        [{"params": first.parameters(), "lr": 0.1}, {"params": list(second.parameters()) + [last.bias], "lr": 0.01}]
    )
    opt = ExtrapolatingOptimizer(base, eval_fn=lambda: 0.0, **PAPER_RULE)
    names = opt.extrapolator.names
    assert names == ["param_groups.0.0", "param_groups.0.1", "param_groups.1.0", "param_groups.1.1", "param_groups.1.2"]
    frozen = last.weight.detach().clone()
    x, _ = batches(0, 1)[0]
    first(x).sum().backward()  # only the first layer gets grads; the rest stay None
    assert second.weight.grad is None
    w2 = second.weight.detach().clone()
    opt.step()
    assert torch.equal(second.weight, w2) and torch.equal(last.weight, frozen)


def test_jumps_leave_params_without_grads_and_frozen_params_alone():
    model = make_mlp(0)
    model[4].weight.requires_grad_(False)
    untouched = {n: p.detach().clone() for n, p in model.named_parameters() if n.startswith(("2.", "4."))}
    opt = ExtrapolatingOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), eval_fn=iter(range(100)).__next__, **PAPER_RULE
    )
    for _ in range(4):
        model[0](torch.randn(4, 6)).sum().backward()
        opt.step()
        opt.zero_grad()
    assert all(r.accepted is not None for r in opt.history)
    for n, p in model.named_parameters():
        if n in untouched:
            assert torch.equal(p, untouched[n]), n


def test_add_param_group_extends_the_extrapolated_set():
    a, b = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    opt = ExtrapolatingOptimizer(torch.optim.SGD(a.parameters(), lr=0.1), eval_fn=iter(range(100)).__next__, **PAPER_RULE)
    assert len(opt.extrapolator.params) == 2
    opt.add_param_group({"params": b.parameters(), "lr": 0.2})
    assert len(opt.extrapolator.params) == 4 and len(opt.param_groups) == 2
    b0 = b.weight.detach().clone()
    (a(torch.ones(1, 2)) + b(torch.ones(1, 2))).sum().backward()
    opt.step()
    w1 = b0 - 0.2 * b.weight.grad
    assert opt.history[0].accepted == 16.0
    assert torch.allclose(b.weight, w1 + 16 * (w1 - b0), atol=1e-5)


def test_step_closure_is_passed_to_the_base():
    problem = LeastSquares()
    opt = ExtrapolatingOptimizer(torch.optim.LBFGS(problem.model.parameters(), lr=0.5), eval_fn=lambda: 0.0, **PAPER_RULE)

    def closure():
        opt.zero_grad()
        loss = problem.loss()
        loss.backward()
        return loss

    first = opt.step(closure)
    assert isinstance(first, torch.Tensor) and opt.step_count == 1
    assert problem.loss().item() < first.item()


def test_on_jump_reset_clears_the_base_state_of_jumped_params():
    model = torch.nn.Linear(2, 1)
    opt = ExtrapolatingOptimizer(
        torch.optim.Adam(model.parameters(), lr=0.1),
        eval_fn=iter([0.0, 1.0, 0.0] * 10).__next__,
        schedule=[2],
        **{**PAPER_RULE, "on_jump": "reset"},
    )
    for _ in range(2):
        model(torch.ones(1, 2)).sum().backward()
        opt.step()
        opt.zero_grad()
    assert opt.history[0].accepted == 1.0
    assert all(len(opt.state[p]) == 0 for p in model.parameters())
    keep = ExtrapolatingOptimizer(
        torch.optim.Adam(model.parameters(), lr=0.1), eval_fn=iter([0.0, 1.0, 0.0]).__next__,
        schedule=[1], **PAPER_RULE)
    model(torch.ones(1, 2)).sum().backward()
    keep.step()
    assert all(int(keep.state[p]["step"]) == 1 for p in model.parameters())


def test_transformer_blocks_selection_matches_the_paper_filter():
    from lookahead_opd.selection import transformer_blocks

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.self_attn = torch.nn.Linear(4, 4)
            self.mlp = torch.nn.Linear(4, 4)
            self.input_layernorm = torch.nn.LayerNorm(4)
            self.post_attention_layernorm = torch.nn.LayerNorm(4)

    class Tiny(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed_tokens = torch.nn.Embedding(10, 4)
            self.layers = torch.nn.ModuleList([Block()])
            self.norm = torch.nn.LayerNorm(4)
            self.lm_head = torch.nn.Linear(4, 10)

    names = [n for n, _ in transformer_blocks(Tiny())]
    assert names == [
        "layers.0.self_attn.weight",
        "layers.0.self_attn.bias",
        "layers.0.mlp.weight",
        "layers.0.mlp.bias",
        "layers.0.post_attention_layernorm.weight",
        "layers.0.post_attention_layernorm.bias",
    ]
    model = Tiny()
    opt = ExtrapolatingOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), eval_fn=lambda: 0.0, params=transformer_blocks(model), **PAPER_RULE
    )
    assert opt.extrapolator.names == names
    with pytest.raises(ValueError, match="no parameter name"):
        transformer_blocks(torch.nn.Linear(2, 2))


def test_isinstance_and_hooks():
    model = make_mlp(0)
    opt = ExtrapolatingOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), eval_fn=lambda: 0.0, **PAPER_RULE)
    assert isinstance(opt, torch.optim.Optimizer)
    fired = []
    opt.register_step_post_hook(lambda o, a, k: fired.append(o.step_count))
    model(torch.zeros(1, 6)).sum().backward()
    opt.step()
    assert fired == [1]


# ---------------------------------------------------------------- 7. bad input


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"coefficients": []}, ValueError, "empty"),
        ({"coefficients": [0, 1]}, ValueError, "positive"),
        ({"coefficients": [-2]}, ValueError, "positive"),
        ({"snapshot": "lowrank", "rank": 0}, ValueError, "rank"),
        ({"snapshot": "lowrank"}, ValueError, "rank"),
        ({"snapshot": "full", "rank": 4}, ValueError, "lowrank"),
        ({"snapshot": "zip"}, ValueError, "snapshot"),
        ({"mode": "maximize"}, ValueError, "mode"),
        ({"direction": "momentum"}, ValueError, "direction"),
        ({"on_jump": "drop"}, ValueError, "on_jump"),
        ({"reduce": "sum"}, ValueError, "reduce"),
        ({"offload": "disk"}, ValueError, "offload"),
        ({"min_improvement": -1}, ValueError, "min_improvement"),
        ({"schedule": "sometimes"}, ValueError, "schedule"),
        ({"patience": 0}, ValueError, "patience"),
        ({"patience": True}, ValueError, "patience"),
        ({"patience": 1.5}, ValueError, "patience"),
        ({"colour": "red"}, TypeError, "colour"),
    ],
)
def test_bad_options_are_clear_errors(kwargs, error, match):
    model = make_mlp(0)
    with pytest.raises(error, match=match):
        ExtrapolatingOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), eval_fn=lambda: 0.0, **kwargs)


def test_bad_base_and_eval_fn():
    model = make_mlp(0)
    with pytest.raises(TypeError, match="torch.optim.Optimizer"):
        ExtrapolatingOptimizer(model, eval_fn=lambda: 0.0, **PAPER_RULE)
    with pytest.raises(TypeError, match="callable"):
        ExtrapolatingOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), eval_fn=0.5, **PAPER_RULE)
    inner = ExtrapolatingOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), eval_fn=lambda: 0.0, **PAPER_RULE)
    with pytest.raises(TypeError, match="already"):
        ExtrapolatingOptimizer(inner, eval_fn=lambda: 0.0, **PAPER_RULE)
    with pytest.raises(ValueError, match="no parameters"):
        Extrapolator([], lambda: 0.0, **PAPER_RULE)
    with pytest.raises(TypeError, match="floating-point"):
        Extrapolator([torch.zeros(2, dtype=torch.long)], lambda: 0.0, **PAPER_RULE)
    # The default on_jump="reset" clears a kept jump's optimizer state: it needs the optimizer.
    with pytest.raises(ValueError, match="pass optimizer=, or on_jump='keep'"):
        Extrapolator(model.parameters(), lambda: 0.0)
    assert Extrapolator(model.parameters(), lambda: 0.0, on_jump="keep").on_jump == "keep"


def test_extrapolator_alone_from_a_raw_loop():
    problem = LeastSquares()  # at this lr the gate's gain stays near linear up to c = 16
    opt = torch.optim.SGD(problem.model.parameters(), lr=0.003)
    ex = Extrapolator(problem.model.named_parameters(), problem.score, optimizer=opt,
                      schedule=Steps([2, 4]))
    records = []
    for _ in range(4):
        problem.loss().backward()
        opt.step()
        opt.zero_grad()
        records.append(ex.after_step())
    assert [r is None for r in records] == [True, False, True, False]
    assert ex.names == ["weight", "bias"]
    assert records[1].accepted == 16.0 and records[1].best_score > records[1].score_before


def test_direction_rank_jumps_along_the_top_singular_subspace() -> None:
    # One 6x5 matrix and a bias; the gate accepts the first candidate (c = 1) only.
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(6, 5))
    b = torch.nn.Parameter(torch.randn(5))
    scores = iter([0.0, 1.0, 0.5])
    opt = ExtrapolatingOptimizer(torch.optim.SGD([w, b], lr=0.1), lambda: next(scores),
                                 direction_rank=2, max_candidates=2, **PAPER_RULE)
    w0, b0 = w.detach().clone(), b.detach().clone()
    w.grad, b.grad = torch.randn(6, 5), torch.randn(5)
    opt.step()  # search at step 1: W_1 + 1·Δ_r kept, c = 2 rejected
    w1 = w0 - 0.1 * w.grad
    b1 = b0 - 0.1 * b.grad
    u, s, vh = torch.linalg.svd(w1 - w0)
    expected = w1 + (u[:, :2] * s[:2]) @ vh[:2]
    assert opt.history[0].accepted == 1.0
    torch.testing.assert_close(w.detach(), expected)
    torch.testing.assert_close(b.detach(), b1 + (b1 - b0))  # 1-D: the full direction
    assert torch.linalg.matrix_rank(w.detach() - w1) == 2
    with pytest.raises(ValueError, match="direction_rank"):
        ExtrapolatingOptimizer(torch.optim.SGD([w], lr=0.1), lambda: 0.0, direction_rank=0, **PAPER_RULE)


def test_an_error_inside_the_search_pass_puts_w_t_back():
    """The pass writes the first candidate as it goes: if it fails half way (here the anchor
    store, on the second tensor), the tensors already written come back to W_t exactly."""
    model = make_mlp(0)
    scored = []

    def gate() -> float:
        scored.append([p.detach().clone() for p in model.parameters()])
        return 0.0

    opt = ExtrapolatingOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), eval_fn=gate,
                                 schedule=[2], **PAPER_RULE)
    data = batches(1, 2)
    train(model, opt, data, stop=1)
    store, calls = opt.extrapolator.store, []
    real = store.delta_run

    def failing(index, start, stop, base, out):
        calls.append(index)
        if index == 1:
            raise RuntimeError("store failed")
        return real(index, start, stop, base, out)

    store.delta_run = failing
    with pytest.raises(RuntimeError, match="store failed"):
        train(model, opt, data, start=1)
    assert calls[0] == 0 and calls[-1] == 1  # the first tensor was written, then it failed
    (w_t,) = scored  # the search scored W_t, then failed in its pass
    assert all(torch.equal(p, w) for p, w in zip(model.parameters(), w_t, strict=True))
    assert opt.extrapolator.history == []  # no search recorded
