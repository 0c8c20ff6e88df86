"""state_dict round trips: a resumed run continues bit-identically to an uninterrupted one."""

from __future__ import annotations

import io

import pytest
import torch
from conftest import batches, make_mlp, params_equal, target, train
from hypothesis import given
from hypothesis import strategies as st

from lookahead_opd import PAPER_RULE, ExtrapolatingOptimizer, JumpRecord

STEPS = 20


class SeededGate:
    """A deterministic gate whose answers depend on the weights, so jumps are both accepted
    and rejected, and a resumed run sees the same scores as the uninterrupted one."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        g = torch.Generator().manual_seed(99)
        self.x = torch.randn(32, 6, generator=g)
        self.y = target(self.x)

    def __call__(self) -> float:
        with torch.no_grad():
            return -float((self.model(self.x.to(self.model[0].weight.dtype)) - self.y).pow(2).mean())


def build(snapshot: str, direction: str, optimizer: str = "adamw"):
    model = make_mlp(0)
    base = {
        "adamw": lambda: torch.optim.AdamW(model.parameters(), lr=3e-3),
        "sgd": lambda: torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9),
    }[optimizer]()
    opt = ExtrapolatingOptimizer(
        base,
        eval_fn=SeededGate(model),
        snapshot=snapshot,
        rank=2 if snapshot == "lowrank" else None,
        direction=direction,
        **PAPER_RULE,
    )
    return model, opt


def roundtrip(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


@given(
    cut=st.integers(0, STEPS),
    snapshot=st.sampled_from(["full", "lowrank"]),
    direction=st.sampled_from(["secant", "averaged"]),
    optimizer=st.sampled_from(["adamw", "sgd"]),
)
@pytest.mark.slow
def test_resume_at_any_step_is_bit_identical(cut, snapshot, direction, optimizer):
    data = batches(5, STEPS)
    ref_model, ref_opt = build(snapshot, direction, optimizer)
    train(ref_model, ref_opt, data)

    model, opt = build(snapshot, direction, optimizer)
    train(model, opt, data, stop=cut)
    saved = roundtrip({"model": model.state_dict(), "opt": opt.state_dict()})

    fresh_model, fresh_opt = build(snapshot, direction, optimizer)
    fresh_model.load_state_dict(saved["model"])
    fresh_opt.load_state_dict(saved["opt"])
    assert fresh_opt.step_count == cut
    train(fresh_model, fresh_opt, data, start=cut)

    assert params_equal(ref_model, fresh_model)
    # The sketch of the previous direction resumes too: every search after the first compares.
    assert all(r.secant_cosine is not None for r in ref_opt.history[1:])
    assert [r.to_dict() | {"seconds": 0} for r in ref_opt.history] == [
        r.to_dict() | {"seconds": 0} for r in fresh_opt.history
    ]


def test_the_reference_run_exercises_acceptance_and_rejection():
    # Guards the property test above: it is only meaningful if, across the configurations it
    # samples, some jump is kept and some candidate is turned down (weights restored).
    kept = rejected = 0
    for snapshot in ("full", "lowrank"):
        for optimizer in ("adamw", "sgd"):
            model, opt = build(snapshot, "secant", optimizer)
            train(model, opt, batches(5, STEPS))
            for r in opt.history:
                kept += r.accepted is not None
                rejected += r.accepted is None or len(r.scores) > r.coefficients.index(r.accepted) + 1
    assert kept > 0 and rejected > 0


def test_state_dict_is_the_base_format_plus_one_key():
    model, opt = build("full", "secant")
    train(model, opt, batches(5, 3))
    sd = opt.state_dict()
    assert set(sd) == {"state", "param_groups", "extrapolator"}
    assert sd["extrapolator"]["step_count"] == 3
    assert len(sd["extrapolator"]["history"]) == 2


def test_a_plain_base_state_dict_loads():
    model, opt = build("full", "secant")
    train(model, opt, batches(5, 3))
    plain = torch.optim.AdamW(model.parameters(), lr=3e-3)
    plain.load_state_dict(roundtrip(opt.base.state_dict()))

    other_model, other = build("full", "secant")
    other.load_state_dict(roundtrip(opt.base.state_dict()))
    assert other.step_count == 0  # the extrapolator keeps its own state
    for p, q in zip(model.parameters(), other_model.parameters(), strict=False):
        assert torch.equal(opt.state[p]["exp_avg"], other.state[q]["exp_avg"])
    # and the wrapper's param_groups still follow the base after it rebinds them
    assert other.param_groups is other.base.param_groups


def test_loading_a_wrapper_state_into_a_bare_optimizer_needs_the_key_dropped():
    model, opt = build("full", "secant")
    train(model, opt, batches(5, 2))
    sd = opt.state_dict()
    sd.pop("extrapolator")
    torch.optim.AdamW(model.parameters(), lr=3e-3).load_state_dict(sd)


def test_mismatched_states_are_clear_errors():
    _, full = build("full", "secant")
    _, low = build("lowrank", "secant")
    _, avg = build("full", "averaged")
    with pytest.raises(ValueError, match="lowrank"):
        full.load_state_dict(low.state_dict())
    with pytest.raises(ValueError, match="direction"):
        full.load_state_dict(avg.state_dict())
    bad = full.state_dict()
    bad["extrapolator"]["version"] = 99
    with pytest.raises(ValueError, match="version"):
        full.load_state_dict(bad)


def test_jump_record_round_trip():
    r = JumpRecord(step=4, score_before=0.1, coefficients=[1.0, 2.0], scores=[0.2, 0.1], accepted=1.0, n_evals=3)
    assert JumpRecord.from_dict(roundtrip(r.to_dict())) == r
    assert r.best_score == 0.2
