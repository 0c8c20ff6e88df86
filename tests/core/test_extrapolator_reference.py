"""``Extrapolator`` against the plain ``ReferenceExtrapolator``, bit for bit.

Two copies of a random small problem (a few parameters of random shapes, 1-D to 3-D; a random
quadratic or a tiny MLP) train side by side: the same base optimizer (SGD with momentum or
Adam), the same gradients plus noise from one seeded generator, a deterministic gate (minus a
validation loss, or the loss itself with ``mode="min"``). One copy is searched by the fused
``Extrapolator``, the other by the reference; after every step the weights must be
``torch.equal`` and every search must have tried the same coefficients, got the same scores
and kept the same jump. Every option that changes the weights is drawn. The tensors are small
(at most 81 elements): see the reference's docstring for where the low-rank store stops being
bit-exact on large matrices.
"""

from __future__ import annotations

import collections
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lookahead_opd import PAPER_RULE, Extrapolator
from lookahead_opd.extrapolator_reference import ReferenceExtrapolator
from lookahead_opd.snapshot import LowRankSnapshot

pytestmark = pytest.mark.filterwarnings("ignore:eval_fn gave a non-finite score")
SETTINGS = settings(max_examples=30, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


class Problem:
    """Parameters, a training loss and a validation loss, all from ``seed``."""

    def __init__(self, seed: int, kind: str, shapes: list[tuple[int, ...]], hidden: int,
                 dtype: torch.dtype, frozen: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.kind, self.dtype = kind, dtype
        if kind == "mlp":  # x (d) -> tanh(W1 x + b1) (hidden) -> W2 h + b2 (o)
            d, o = shapes[0][-1], max(1, shapes[-1][0])
            shapes = [(hidden, d), (hidden,), (o, hidden), (o,)]
            teacher = [torch.randn(s, generator=g) for s in shapes]
            self.x, self.x_val = torch.randn(16, d, generator=g), torch.randn(16, d, generator=g)
            self.y, self.y_val = self._mlp(teacher, self.x), self._mlp(teacher, self.x_val)
        else:  # Σ a·(p − target)², ill-conditioned; the gate's targets are a little off
            self.scale = [torch.rand(s, generator=g) * 4 + 0.05 for s in shapes]
            self.target = [torch.randn(s, generator=g) for s in shapes]
            self.target_val = [t + 0.1 * torch.randn(t.shape, generator=g) for t in self.target]
        self.init = [(0.5 * torch.randn(s, generator=g)).to(dtype) for s in shapes]
        # A frozen parameter gets no gradient: its Δ is 0, and so, from the initial reference,
        # is the low-rank store's Y, which takes the ill-conditioned path.
        self.frozen = [i < frozen for i in range(len(shapes))]

    @staticmethod
    def _mlp(w: list[torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x @ w[0].float().T + w[1].float()) @ w[2].float().T + w[3].float()

    def loss(self, params: list[torch.Tensor], val: bool = False) -> torch.Tensor:
        if self.kind == "mlp":
            x, y = (self.x_val, self.y_val) if val else (self.x, self.y)
            return (self._mlp(params, x) - y).square().mean()
        target = self.target_val if val else self.target
        return sum(((p.float() - t).square() * a).sum()
                   for p, t, a in zip(params, target, self.scale, strict=True))

    def val_examples(self, params: list[torch.Tensor]) -> torch.Tensor:
        """The validation loss per example, whose mean is about ``loss(val=True)``: per input
        row (mlp), or each weighted squared error times their count (quadratic)."""
        if self.kind == "mlp":
            return (self._mlp(params, self.x_val) - self.y_val).square().mean(dim=1)
        terms = torch.cat([((p.float() - t).square() * a).flatten()
                           for p, t, a in zip(params, self.target_val, self.scale, strict=True)])
        return terms * terms.numel()


shapes = st.lists(st.one_of(
    st.tuples(st.integers(1, 9)),
    st.tuples(st.integers(1, 9), st.integers(1, 9)),
    st.tuples(st.integers(1, 4), st.integers(1, 4), st.integers(1, 4)),
), min_size=1, max_size=4)


@st.composite
def problems(draw):
    return dict(
        problem=Problem(draw(st.integers(0, 2**31 - 1)), draw(st.sampled_from(["quadratic", "mlp"])),
                        draw(shapes), draw(st.integers(1, 8)),
                        draw(st.sampled_from([torch.float32] * 4 + [torch.bfloat16])),
                        draw(st.sampled_from([0, 0, 0, 1, 2]))),
        nan_above=draw(st.sampled_from([None, None, None, 1.0, 0.8])),
        seed=draw(st.integers(0, 2**31 - 1)),
        optimizer=draw(st.sampled_from(["sgd", "adam"])),
        lr=draw(st.sampled_from([1e-3, 1e-2, 3e-2])),
        noise=draw(st.sampled_from([0.0, 0.1, 1.0])),
        steps=draw(st.integers(1, 20)),
    )


def coefficient_lists(zero: bool):
    values = ([0.0] if zero else []) + [0.25, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 8.0]
    return st.lists(st.sampled_from(values), min_size=1, max_size=5, unique=True).map(sorted)


@st.composite
def options(draw, **fixed):
    """Every option that changes the weights, drawn; ``fixed`` ones are set."""
    direction = fixed.get("direction", draw(st.sampled_from(["secant", "averaged"])))
    o = dict(direction=direction,
             mode=draw(st.sampled_from(["max", "min"])),
             min_improvement=draw(st.sampled_from([0.0, 0.0, 1e-4, 1e-2])),
             coefficients=draw(st.one_of(st.sampled_from(["geometric", "linear"]),
                                         coefficient_lists(direction == "averaged"))),
             max_candidates=draw(st.sampled_from([None, None, 1, 2, 3, 6])),
             patience=draw(st.sampled_from([None, None, 1, 2, 3])),
             direction_rank=draw(st.sampled_from([None, None, 1, 2])),
             on_jump=draw(st.sampled_from(["keep", "reset"])),
             margin=draw(st.sampled_from([0.0, 0.0, 0.0, 0.5, 2.0])),
             back_off=draw(st.sampled_from([0, 0, 1, 2, 9])),
             linearity=draw(st.sampled_from([0.0, 0.0, 0.0, 0.5, 1.0])),
             offload=None)
    schedule = "fixed" if {"schedule", "every"} & set(fixed) else draw(
        st.sampled_from(["powers_of_two", "every", "steps"]))
    if schedule == "every":
        o["every"] = draw(st.integers(1, 3))
    elif schedule == "steps":
        o["schedule"] = draw(st.lists(st.integers(1, 20), min_size=1, max_size=8, unique=True))
    if fixed.get("snapshot", draw(st.sampled_from(["full", "lowrank"]))) == "lowrank":
        o.update(snapshot="lowrank", rank=draw(st.integers(1, 3)))
        if draw(st.booleans()):
            o["reference"] = "given"  # replaced by a random state dict in ``check``
    o.update(fixed)
    return o


def check(case: dict, opts: dict) -> list:
    """Train the two copies side by side; assert they agree; return the fused history."""
    problem: Problem = case["problem"]
    fused = [t.clone().requires_grad_() for t in problem.init]
    plain = [t.clone().requires_grad_() for t in problem.init]
    opts = dict(opts)
    if opts.get("reference") == "given":
        g = torch.Generator().manual_seed(case["seed"] + 1)
        opts["reference"] = {f"param.{i}": torch.randn(t.shape, generator=g).to(t.dtype)
                             for i, t in enumerate(problem.init)}
    sign = 1.0 if opts.get("mode") == "min" else -1.0
    nan_above = None if case["nan_above"] is None else (
        case["nan_above"] * float(problem.loss(problem.init, val=True)))

    def gate(params):
        def score():
            loss = float(problem.loss(params, val=True))
            if opts.get("margin"):  # one score per example (a NaN one where the loss is high)
                x = sign * problem.val_examples(params)
                return x * math.nan if nan_above is not None and loss > nan_above else x
            return math.nan if nan_above is not None and loss > nan_above else sign * loss
        return score

    def make(params):
        if case["optimizer"] == "sgd":
            return torch.optim.SGD(params, lr=case["lr"], momentum=0.9)
        return torch.optim.Adam(params, lr=case["lr"])

    opt_f, opt_p = make(fused), make(plain)
    ex = Extrapolator(fused, gate(fused), optimizer=opt_f, **opts)
    ref = ReferenceExtrapolator(plain, gate(plain), optimizer=opt_p, **opts)
    noise = torch.Generator().manual_seed(case["seed"])
    for _ in range(case["steps"]):
        kicks = [case["noise"] * torch.randn(t.shape, generator=noise) for t in fused]
        for params, opt in ((fused, opt_f), (plain, opt_p)):
            opt.zero_grad()
            problem.loss(params).backward()
            for p, k, frozen in zip(params, kicks, problem.frozen, strict=True):
                p.grad.add_(k.to(p.dtype)).mul_(not frozen)
            opt.step()
        a, b = ex.after_step(), ref.after_step()
        assert (a is None) == (b is None)
        if a is not None:
            assert (a.step, a.coefficients, a.accepted) == (b.step, b.coefficients, b.accepted)
            assert _same([a.score_before, *a.scores], [b.score_before, *b.scores])
        for p, q in zip(fused, plain, strict=True):
            assert torch.equal(p, q), (ex.history, ref.history)
        assert ex.searching == ref.searching
    return ex.history


def _same(a: list[float], b: list[float]) -> bool:
    return len(a) == len(b) and all(x == y or (math.isnan(x) and math.isnan(y))
                                    for x, y in zip(a, b, strict=True))


@pytest.mark.slow
@SETTINGS
@given(case=problems(), opts=options())
def test_every_option_at_random_matches_the_reference(case, opts):
    check(case, opts)


# Each option value forced once (the others drawn), so every one is exercised.
FORCED = [
    dict(schedule="powers_of_two"), dict(every=1), dict(every=3), dict(schedule=[1, 2, 3, 5, 8]),
    dict(coefficients="geometric"), dict(coefficients="linear"),
    dict(coefficients=[0.5, 1.0, 3.0]), dict(coefficients=[0.25, 4.0], max_candidates=1),
    dict(max_candidates=1), dict(max_candidates=3), dict(min_improvement=1e-3),
    dict(margin=0.5), dict(margin=2.0), dict(margin=1.0, min_improvement=1e-3),
    dict(back_off=1), dict(back_off=2), dict(back_off=9), dict(back_off=1, coefficients="linear"),
    dict(back_off=1, direction="averaged"), dict(back_off=2, direction_rank=1),
    dict(linearity=0.5), dict(linearity=0.5, back_off=1), dict(linearity=1.0, mode="min"),
    dict(linearity=0.5, direction="averaged", coefficients=[0.0, 1.0, 2.0, 4.0]),
    dict(linearity=0.5, coefficients="linear"),
    dict(mode="max"), dict(mode="min"), dict(patience=1), dict(patience=2),
    dict(direction="secant"), dict(direction="averaged"),
    dict(direction="averaged", coefficients=[0.0, 1.0, 2.0]),
    dict(direction_rank=1), dict(direction_rank=2), dict(on_jump="keep"), dict(on_jump="reset"),
    dict(snapshot="full"), dict(snapshot="lowrank", rank=1), dict(snapshot="lowrank", rank=2),
    dict(snapshot="lowrank", rank=2, reference="given"),
    dict(snapshot="lowrank", rank=1, direction="averaged"),
    dict(snapshot="lowrank", rank=2, direction_rank=1),
]


@pytest.mark.parametrize("fixed", FORCED, ids=lambda d: ",".join(f"{k}={v}" for k, v in d.items()))
@settings(SETTINGS, max_examples=10)
@given(data=st.data())
def test_each_option_matches_the_reference(fixed, data):
    check(data.draw(problems()), data.draw(options(**fixed)))


@pytest.mark.parametrize("opts", [dict(), dict(direction="averaged", coefficients="linear"),
                                  dict(direction_rank=1, on_jump="reset")])
def test_tensors_of_several_chunks_match_the_reference(opts):
    """The fused search writes candidates 2¹⁶ elements at a time and forms Δ in sketch blocks
    of 6801: neither changes a bit (a low-rank store's larger matrices do, see the reference)."""
    problem = Problem(7, "quadratic", [(260, 270), (7000,)], 1, torch.float32)
    history = check(dict(problem=problem, seed=7, optimizer="adam", lr=1e-2, noise=0.5,
                         steps=8, nan_above=None), opts)
    assert any(r.accepted is not None for r in history)


def test_the_comparison_sees_kept_and_refused_jumps_and_every_low_rank_path(monkeypatch):
    """The branches the reference mirrors are reached: kept and refused searches, and a refused
    search's low-rank anchor built from ``Δ`` (no ``_compress``), or from the weights when
    ``Y`` is ill-conditioned (a frozen parameter), as well as a kept jump's."""
    paths: collections.Counter = collections.Counter()
    advance, compress = LowRankSnapshot.advance, LowRankSnapshot._compress

    def counting_advance(self, index, tensor, scale, **kwargs):
        before = paths["compress"]
        advance(self, index, tensor, scale, **kwargs)
        if self.compresses(self._shapes[index]):
            paths[("refused" if scale == 1.0 else "kept or unobserved",
                   "from delta" if paths["compress"] == before else "from weights")] += 1

    def counting_compress(self, *args, **kwargs):
        paths["compress"] += 1
        return compress(self, *args, **kwargs)

    monkeypatch.setattr(LowRankSnapshot, "advance", counting_advance)
    monkeypatch.setattr(LowRankSnapshot, "_compress", counting_compress)
    kept = refused = 0
    for seed in range(4):
        case = dict(problem=Problem(seed, "quadratic", [(6, 5), (4,), (3, 7)], 1, torch.float32,
                                    frozen=seed % 2), seed=seed, optimizer="sgd", lr=1e-2,
                    noise=0.3 * seed, steps=16, nan_above=None)
        history = check(case, dict(snapshot="lowrank", rank=2, **PAPER_RULE))
        kept += sum(r.accepted is not None for r in history)
        refused += sum(r.accepted is None for r in history)
    assert kept and refused
    assert paths[("refused", "from delta")] and paths[("refused", "from weights")], paths
    assert paths[("kept or unobserved", "from weights")], paths
