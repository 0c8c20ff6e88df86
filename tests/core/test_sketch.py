"""The secant cosine: the sketch's estimate is within its documented accuracy of the exact
cosine, shards sketch like the whole tensor, and the extrapolator records it every search."""

from __future__ import annotations

import math

import pytest
import torch

from lookahead_opd import PAPER_RULE, Extrapolator
from lookahead_opd.distributed import ShardLayout
from lookahead_opd.sketch import (
    ACCURACY,
    MAX_SIZE,
    MIN_SIZE,
    POOL,
    SecantSketch,
    _hash,
    cosine_tolerance,
    sketch_size,
)

SHAPES = [(400, 1000), (3000,), (20, 30, 50)]  # 433,000 elements
NUMEL = sum(math.prod(s) for s in SHAPES)
K = sketch_size(NUMEL)


def _reference_hash(x: int, key: int) -> int:
    """splitmix64's output function of ``key + (x + 1)·γ`` on unsigned 64-bit Python ints."""
    mask = (1 << 64) - 1
    z = (key + (x + 1) * 0x9E3779B97F4A7C15) & mask
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
    return z ^ (z >> 31)


def test_the_hash_wraps_like_unsigned_64_bit_arithmetic():
    xs = [0, 1, 2, 12345678901, -5, (1 << 63) - 1, -(1 << 63)]
    for key in (0, 987654321, -(1 << 62)):
        got = [v & ((1 << 64) - 1) for v in _hash(torch.tensor(xs), key).tolist()]
        assert got == [_reference_hash(x, key) for x in xs]


def test_blocks_draw_shifts_rows_and_signs_evenly():
    sketch = SecantSketch(NUMEL)
    shift, row, sign = sketch.draws(3, torch.arange(128_000))
    assert int(shift.min()) >= 0 and int(shift.max()) < sketch.size
    counts = torch.bincount(shift * 128 // sketch.size, minlength=128)
    assert int(counts.min()) > 800 and int(counts.max()) < 1200
    assert torch.bincount(row, minlength=POOL).tolist() == pytest.approx([8000] * POOL, rel=0.1)
    assert abs(float(sign.mean())) < 0.02 and set(sign.tolist()) == {-1.0, 1.0}
    table = sketch.signs(torch.device("cpu"))
    assert table.shape == (POOL, sketch.size) and abs(float(table.mean())) < 0.01
    # Another parameter draws other values for the same blocks.
    assert not torch.equal(sketch.draws(4, torch.arange(100))[0], shift[:100])


def test_size_follows_the_documented_rule():
    assert sketch_size(10) == MIN_SIZE == 6801 and MIN_SIZE % 2 == 1
    assert cosine_tolerance(MIN_SIZE) <= ACCURACY < cosine_tolerance(MIN_SIZE - 2)
    assert sketch_size(134_515_008) == 262_725  # SmolLM2-135M: 512 blocks of 262,725
    assert sketch_size(10**13) == MAX_SIZE
    assert all(sketch_size(n) % 2 == 1 for n in (10, 512 * 7000, 512 * 7001 + 5, 10**13))


@pytest.mark.parametrize("layout", [None, ShardLayout((70, 300), (30, 0), 1),
                                    ShardLayout((70, 300), (0, 100), 1)])
def test_pieces_cover_each_element_once_in_order(layout):
    sketch = SecantSketch(NUMEL)
    local = torch.zeros(40, 300) if layout is None or layout.offset[1] == 0 else torch.zeros(70, 50)
    run = sketch.start(torch.device("cpu"))
    pieces = list(run.pieces(0, local, layout))
    assert [p.start for p in pieces] == [0] + [p.stop for p in pieces[:-1]]
    assert pieces[-1].stop == local.numel() and all(p.mine for p in pieces)
    for p in pieces:  # each run lies in one block
        assert p.offset == -1 or p.offset + (p.stop - p.start) <= sketch.size


def _pair(kind: str, rho: float, g: torch.Generator) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Two directions over ``SHAPES`` whose cosine is about ``rho``."""
    a, b = [], []
    for shape in SHAPES:
        if kind == "random":
            x = torch.randn(shape, generator=g)
            y = rho * x + math.sqrt(1 - rho**2) * torch.randn(shape, generator=g)
        elif kind == "lowrank":  # rank-2 matrices sharing one of their two components
            m, rest = shape[0], math.prod(shape[1:])
            u, v, w = (torch.randn(m, 1, generator=g) for _ in range(3))
            p, q, r = (torch.randn(1, rest, generator=g) for _ in range(3))
            x = (u @ p + v @ q).reshape(shape)
            y = (u @ p + (rho * v) @ q + w @ r).reshape(shape)
        elif kind == "sparse":  # 1% of the entries, partly on the same support
            x = torch.randn(shape, generator=g) * (torch.rand(shape, generator=g) < 0.01)
            y = rho * x + torch.randn(shape, generator=g) * (torch.rand(shape, generator=g) < 0.01)
        else:  # periodic with the sketch's period: every block of a tensor alike
            n = math.prod(shape)
            u, v = torch.randn(K, generator=g), torch.randn(K, generator=g)
            x = u.repeat(n // K + 1)[:n].reshape(shape)
            y = (rho * u + math.sqrt(1 - rho**2) * v).repeat(n // K + 1)[:n].reshape(shape)
        a.append(x)
        b.append(y)
    return a, b


def _exact(a: list[torch.Tensor], b: list[torch.Tensor]) -> tuple[float, float]:
    fa = torch.cat([t.reshape(-1) for t in a]).double()
    fb = torch.cat([t.reshape(-1) for t in b]).double()
    return float(fa @ fb / (fa.norm() * fb.norm())), float(fb.norm() / fa.norm())


KINDS = ["random", "lowrank", "sparse", "periodic"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("rho", [0.95, 0.6, 0.0, -0.5])
def test_cosine_is_within_the_documented_accuracy(kind, rho):
    g = torch.Generator().manual_seed(hash((kind, rho)) % 2**31)
    a, b = _pair(kind, rho, g)
    sketch = SecantSketch(NUMEL)
    sketch.remember(sketch.measure((i, t, None) for i, t in enumerate(a)))
    cosine, ratio = sketch.compare(sketch.measure((i, t, None) for i, t in enumerate(b)))
    exact_cosine, exact_ratio = _exact(a, b)
    assert abs(cosine - exact_cosine) <= cosine_tolerance(sketch.size)
    # The norms: float32 dot products per block, summed in float64 (~1e-7 relative).
    assert ratio == pytest.approx(exact_ratio, rel=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_the_error_spreads_no_wider_than_the_stated_standard_deviation(kind):
    """Over 128 hash seeds, the root-mean-square of ``ĉ − c`` stays within the first-order
    bound ``(1 − c²)·√(1 + 1/POOL)/√k``, with 20% slack for the sample (an rms of 128 draws
    is within ±6% of the true spread at one standard deviation). At 400 seeds the four kinds
    measured 0.95–1.01× the Gaussian projection's ``(1 − c²)/√k``."""
    a, b = _pair(kind, 0.6, torch.Generator().manual_seed(7))
    exact, _ = _exact(a, b)
    errors = []
    for seed in range(128):
        sketch = SecantSketch(NUMEL, seed=seed)
        sketch.remember(sketch.measure((i, t, None) for i, t in enumerate(a)))
        errors.append(sketch.compare(sketch.measure((i, t, None) for i, t in enumerate(b)))[0] - exact)
    rms = math.sqrt(sum(e * e for e in errors) / len(errors))
    assert rms <= 1.2 * (1 - exact**2) * math.sqrt(1 + 1 / POOL) / math.sqrt(K)
    assert abs(sum(errors) / len(errors)) <= 3 * rms / math.sqrt(len(errors))  # unbiased


def test_identical_and_opposite_directions_are_exactly_plus_and_minus_one():
    g = torch.Generator().manual_seed(0)
    a = [torch.randn(s, generator=g) for s in SHAPES]
    sketch = SecantSketch(NUMEL)
    sketch.remember(sketch.measure((i, t, None) for i, t in enumerate(a)))
    for scale, want in ((3.0, 1.0), (-0.5, -1.0)):
        cosine, ratio = sketch.compare(sketch.measure((i, scale * t, None) for i, t in enumerate(a)))
        assert cosine == pytest.approx(want, abs=1e-12)
        assert ratio == pytest.approx(abs(scale), rel=1e-6)  # scale * t rounds in fp32


def test_shards_sketch_like_the_whole_tensor():
    """Keyed by the global element index: row shards, column shards and replicated shards
    (each counted 1/replicas) add up to the whole tensor's sketch, as FSDP ranks' do."""
    g = torch.Generator().manual_seed(1)
    w = torch.randn(70, 300, generator=g)  # 21,000 elements: 4 blocks of 6,801
    sketch = SecantSketch(w.numel())
    whole = sketch.measure([(3, w, None)])

    def layout(offset: tuple[int, int], replicas: int = 1) -> ShardLayout:
        return ShardLayout((70, 300), offset, replicas)

    rows = sketch.measure([(3, w[:33], layout((0, 0)))]) + sketch.measure(
        [(3, w[33:], layout((33, 0)))]
    )
    # Column shards are scattered in the global tensor: hashed element by element.
    cols = sketch.measure([(3, w[:, :128], layout((0, 0)))]) + sketch.measure(
        [(3, w[:, 128:], layout((0, 128)))]
    )
    replicated = sum(sketch.measure([(3, part, layout(off, 2))])
                     for part, off in ((w[:33], (0, 0)), (w[33:], (33, 0))) for _ in range(2))
    for got in (rows, cols, replicated):  # the buckets add in float32: in another order here
        torch.testing.assert_close(got, whole, rtol=1e-6, atol=1e-6 * float(whole[:-1].abs().max()))
    # Another parameter index hashes elsewhere.
    assert not torch.allclose(sketch.measure([(4, w, None)])[:-1], whole[:-1])


def _sgd_run(grads, direction="secant", steps=32):
    """SGD on one tensor along the given gradients, a gate that never improves; returns the
    weights after every step and the extrapolator."""
    w = torch.zeros(5000, requires_grad=True)
    opt = torch.optim.SGD([w], lr=0.1)
    ex = Extrapolator([w], lambda: 0.0, direction=direction, **PAPER_RULE)
    seen = [w.detach().clone()]
    for t in range(steps):
        w.grad = grads(t)
        opt.step()
        ex.after_step()
        seen.append(w.detach().clone())
    return seen, ex


def _cos(x: torch.Tensor, y: torch.Tensor) -> float:
    return float(x.double() @ y.double() / (x.double().norm() * y.double().norm()))


def test_records_the_cosine_of_successive_secants():
    g = torch.Generator().manual_seed(2)
    drift = torch.randn(5000, generator=g)
    noise = torch.randn(33, 5000, generator=g)
    seen, ex = _sgd_run(lambda t: drift + 2.0 * noise[t])
    steps = [r.step for r in ex.history]
    assert steps == [1, 2, 4, 8, 16, 32]
    deltas = [seen[b] - seen[a] for a, b in zip([0, *steps[:-1]], steps, strict=True)]
    tol = cosine_tolerance(ex.secant.size)
    assert ex.history[0].secant_cosine is None and ex.history[0].norm_ratio is None
    for rec, prev, cur in zip(ex.history[1:], deltas[:-1], deltas[1:], strict=True):
        assert abs(rec.secant_cosine - _cos(cur, prev)) <= tol
        assert rec.norm_ratio == pytest.approx(float(cur.norm() / prev.norm()), rel=1e-5)
        assert rec.direction_norm == pytest.approx(float(cur.norm()), rel=1e-5)


def test_constant_gradient_is_straight_and_noise_is_not():
    g = torch.Generator().manual_seed(3)
    const = torch.randn(5000, generator=g)
    _, straight = _sgd_run(lambda t: const)
    noise = torch.randn(33, 5000, generator=g)
    _, walk = _sgd_run(lambda t: noise[t])
    tol = cosine_tolerance(straight.secant.size)
    for rec in straight.history[1:]:
        assert rec.secant_cosine == pytest.approx(1.0, abs=1e-9)
        # Doubling windows on a straight path: the secant doubles (the first window is 1 step).
        assert rec.norm_ratio == pytest.approx(1.0 if rec.step == 2 else 2.0, rel=1e-5)
    for rec in walk.history[1:]:
        assert abs(rec.secant_cosine) <= tol  # independent windows: cosine 0
        # A random walk's secant grows like √(window): ratio ≈ √2 (1 at step 2).
        want = 1.0 if rec.step == 2 else math.sqrt(2)
        assert rec.norm_ratio == pytest.approx(want, rel=0.1)


def test_averaged_direction_compares_the_window_averages():
    """With direction="averaged" the direction sketched is the one extrapolated: the
    difference of successive window averages (the anchor after a rejection)."""
    g = torch.Generator().manual_seed(4)
    drift = torch.randn(5000, generator=g)
    noise = torch.randn(33, 5000, generator=g)
    seen, ex = _sgd_run(lambda t: drift + 3.0 * noise[t], direction="averaged")
    steps = [r.step for r in ex.history]
    averages = [seen[0]] + [torch.stack(seen[a + 1 : b + 1]).mean(0)
                            for a, b in zip([0, *steps[:-1]], steps, strict=True)]
    deltas = [y - x for x, y in zip(averages, averages[1:], strict=False)]
    tol = cosine_tolerance(ex.secant.size)
    for rec, prev, cur in zip(ex.history[1:], deltas[:-1], deltas[1:], strict=True):
        assert abs(rec.secant_cosine - _cos(cur, prev)) <= tol
        assert rec.norm_ratio == pytest.approx(float(cur.norm() / prev.norm()), rel=1e-4)


def test_sketch_state_is_checked_and_added_params_restart_it():
    w = torch.zeros(10, requires_grad=True)
    ex = Extrapolator([w], lambda: 0.0, **PAPER_RULE)
    for _ in range(2):
        ex.after_step()
    assert ex.secant.previous is not None
    ex.add_params([("more", torch.zeros(1000))])
    assert ex.secant.size == sketch_size(1010) and ex.secant.previous is None
    other = SecantSketch(10**8)
    with pytest.raises(ValueError, match="size"):
        other.load_state_dict(ex.secant.state_dict())


def test_summary_counts_what_the_searches_bought():
    """On a straight path the gate keeps jumps; the summary's extra distance is the jumps'
    length over the optimizer's, both measured here from the weights themselves."""
    w = torch.zeros(200, requires_grad=True)
    target = torch.linspace(-1, 1, 200)
    opt = torch.optim.SGD([w], lr=0.01)
    ex = Extrapolator([w], lambda: -float((w - target).square().sum()), **PAPER_RULE)
    jumped = moved = 0.0
    last = w.detach().clone()
    for _ in range(40):
        w.grad = 2 * (w.detach() - target)
        opt.step()
        before = w.detach().clone()
        if ex.after_step() is not None:
            moved += float((before - last).norm())
            jumped += float((w.detach() - before).norm())
            last = w.detach().clone()
    s = ex.summary()
    assert s.searches == len(ex.history) == 6
    assert s.kept_jumps == sum(r.accepted is not None for r in ex.history) > 0
    assert s.gate_evals == sum(r.n_evals for r in ex.history)
    assert s.extra_distance == pytest.approx(jumped / moved, rel=1e-5)
    assert s.mean_secant_cosine == pytest.approx(1.0, abs=1e-6)  # gradient descent on a quadratic
    # ... and a gate that never improves keeps nothing.
    w2 = torch.zeros(10, requires_grad=True)
    never = Extrapolator([w2], lambda: 0.0, **PAPER_RULE)
    never.after_step()
    assert never.summary().kept_jumps == 0 and never.summary().extra_distance == 0.0
    assert never.summary().mean_secant_cosine is None
    assert "1 searches" in str(never.summary())
