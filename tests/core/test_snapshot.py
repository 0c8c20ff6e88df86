"""Anchor stores: exactness, memory bounds and round trips."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from lookahead_opd import PAPER_RULE, ExtrapolatingOptimizer, FullSnapshot, LowRankSnapshot
from lookahead_opd.sketch import sketch_size


def low_rank(m: int, n: int, r: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(m, r, generator=g) @ torch.randn(r, n, generator=g)


def test_full_snapshot_is_exact_in_the_param_dtype():
    t = torch.randn(5, 7).to(torch.bfloat16)
    original = t.clone()
    store = FullSnapshot()
    store.add(["w"], [t])
    t.add_(1.0)  # the store holds a copy, not a view
    assert torch.equal(store.anchor(0, t.device), original.float())
    assert store.nbytes() == 5 * 7 * 2


def test_full_snapshot_offload_and_dtype():
    store = FullSnapshot(device="cpu", dtype=torch.float32)
    store.add(["w"], [torch.ones(3, dtype=torch.bfloat16)])
    assert store.nbytes() == 12
    assert store.state_dict()["anchors"][0].dtype == torch.float32


@given(
    m=st.integers(8, 40),
    n=st.integers(8, 40),
    true_rank=st.integers(1, 4),
    extra=st.integers(0, 3),
    seed=st.integers(0, 1000),
)
def test_low_rank_is_exact_when_the_update_rank_fits(m, n, true_rank, extra, seed):
    rank = true_rank + extra
    reference = torch.randn(m, n, generator=torch.Generator().manual_seed(seed + 1))
    update = low_rank(m, n, true_rank, seed)
    store = LowRankSnapshot(rank)
    store.add(["w"], [reference])
    store.capture(0, reference + update)
    approx = store.anchor(0, torch.device("cpu"))
    if (m + n) * rank < m * n:
        assert set(store.state_dict()["entries"][0]) == {"U", "V"}
    assert torch.allclose(approx, reference + update, atol=1e-4 * (1 + update.abs().max()))


def test_low_rank_bytes_are_bounded():
    shapes = [(64, 48), (32, 128), (48,), (16, 4, 3, 3)]
    tensors = [torch.randn(s) for s in shapes]
    rank = 4
    store = LowRankSnapshot(rank)
    store.add([f"t{i}" for i in range(len(shapes))], tensors)
    bound = 0
    for s in shapes:
        if len(s) >= 2:
            m, n = s[0], torch.Size(s).numel() // s[0]
            bound += (m + n) * rank * 4 if (m + n) * rank < m * n else m * n * 4
        else:
            bound += s[0] * 4
    assert store.nbytes() <= bound
    assert store.nbytes() < sum(t.numel() * 4 for t in tensors) / 3
    assert store.reference_nbytes() == sum(t.numel() * 4 for t in tensors)


def test_low_rank_error_falls_as_rank_grows():
    g = torch.Generator().manual_seed(0)
    # a full-rank update with a decaying spectrum, as real updates have
    u, _ = torch.linalg.qr(torch.randn(96, 96, generator=g))
    v, _ = torch.linalg.qr(torch.randn(80, 80, generator=g))
    sigma = torch.tensor([0.7**i for i in range(80)])
    update = u[:, :80] @ torch.diag(sigma) @ v.T
    errors = []
    for rank in (1, 2, 4, 8, 16):
        store = LowRankSnapshot(rank, power_iters=4)
        store.add(["w"], [torch.zeros(96, 80)])
        store.capture(0, update)
        errors.append(float((store.anchor(0, torch.device("cpu")) - update).norm() / update.norm()))
    assert all(b < a for a, b in zip(errors, errors[1:], strict=False)), errors
    assert errors[-1] < 0.01


def test_warm_start_tracks_a_slowly_rotating_update():
    # One power iteration per capture, warm-started, converges over repeated captures.
    g = torch.Generator().manual_seed(3)
    base = low_rank(64, 64, 3, 1) + 0.01 * torch.randn(64, 64, generator=g)
    store = LowRankSnapshot(3)
    store.add(["w"], [torch.zeros(64, 64)])
    errors = []
    for i in range(5):
        target = base * (1 + 0.1 * i)
        store.capture(0, target)
        errors.append(float((store.anchor(0, torch.device("cpu")) - target).norm() / target.norm()))
    assert errors[-1] <= errors[0] + 1e-6 and errors[-1] < 0.05


def test_zero_difference_then_a_real_one():
    store = LowRankSnapshot(2)
    ref = torch.randn(20, 30)
    store.add(["w"], [ref])  # the anchor equals the reference: U·Vᵀ = 0
    assert torch.allclose(store.anchor(0, torch.device("cpu")), ref)
    update = low_rank(20, 30, 2, 7)
    store.capture(0, ref + update)
    assert torch.allclose(store.anchor(0, torch.device("cpu")), ref + update, atol=1e-4)


def test_user_reference_by_name_and_from_a_file(tmp_path):
    model = torch.nn.Linear(32, 24)
    reference = {k: v.clone() - 1.0 for k, v in model.state_dict().items()}
    path = tmp_path / "ref.pt"
    torch.save(reference, path)
    for ref in (reference, str(path)):
        opt = ExtrapolatingOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1),
            eval_fn=lambda: 0.0,
            params=model.named_parameters(),
            snapshot="lowrank",
            rank=1,
            reference=ref,
            **PAPER_RULE,
        )
        store = opt.extrapolator.store
        assert store.reference_nbytes() == 0
        # W − reference is the all-ones matrix, rank 1: the anchor is exact
        assert torch.allclose(store.anchor(0, torch.device("cpu")), model.weight, atol=1e-5)
        assert store.state_dict()["reference"] is None
    with pytest.raises(ValueError, match="no tensor named"):
        ExtrapolatingOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1), eval_fn=lambda: 0.0,
            snapshot="lowrank", rank=1, reference=reference,
            **PAPER_RULE,
        )
    with pytest.raises(ValueError, match="does not exist"):
        LowRankSnapshot(1, str(tmp_path / "missing.pt"))


def test_low_rank_state_round_trip_with_a_user_reference_needs_the_reference():
    model = torch.nn.Linear(16, 16)
    reference = {k: torch.zeros_like(v) for k, v in model.state_dict().items()}
    mk = lambda ref: ExtrapolatingOptimizer(  # noqa: E731
        torch.optim.SGD(model.parameters(), lr=0.1), eval_fn=lambda: 0.0,
        params=model.named_parameters(), snapshot="lowrank", rank=2, reference=ref,
        **PAPER_RULE,
    )
    saved = mk(reference).state_dict()
    mk(reference).load_state_dict(saved)
    with pytest.raises(ValueError, match="user-given reference"):
        mk(None).load_state_dict(saved)


def test_bad_low_rank_options():
    with pytest.raises(ValueError, match="rank"):
        LowRankSnapshot(0)
    with pytest.raises(ValueError, match="power_iters"):
        LowRankSnapshot(2, power_iters=0)
    with pytest.raises(TypeError, match="reference"):
        LowRankSnapshot(2, reference=42)


def test_memory_report():
    model = torch.nn.Linear(256, 256)
    full = ExtrapolatingOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), eval_fn=lambda: 0.0, **PAPER_RULE)
    low = ExtrapolatingOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), eval_fn=lambda: 0.0, snapshot="lowrank", rank=4, **PAPER_RULE
    )
    avg = ExtrapolatingOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), eval_fn=lambda: 0.0, direction="averaged", offload="cpu", **PAPER_RULE
    )
    n = 256 * 256 + 256
    sketch = (sketch_size(n) + 1) * 8  # the previous direction's sketch, float64
    assert full.extrapolator.nbytes() == {"anchor": n * 4, "average": 0, "sketch": sketch}
    assert low.extrapolator.nbytes()["anchor"] == (256 + 256) * 4 * 4 + 256 * 4
    assert avg.extrapolator.nbytes() == {"anchor": n * 4, "average": n * 4, "sketch": sketch}


def test_log_geometry_records_the_direction_metrics():
    model = torch.nn.Linear(8, 8)
    opt = ExtrapolatingOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), eval_fn=lambda: 0.0, log_geometry=True, **PAPER_RULE
    )
    model(torch.randn(4, 8)).sum().backward()
    opt.step()
    geo = opt.history[0].geometry
    assert geo["n_matrices"] == 1
    # one SGD step on a linear layer with a batch of 4 has rank ≤ 4
    assert 1.0 <= geo["effective_rank"] <= 4.0 + 1e-6
    assert geo["fro_norm_total"] == pytest.approx(opt.history[0].direction_norm, rel=1e-5)


def _captured(store):
    """``store`` over three tensors of awkward shapes, each anchor a perturbed copy; returns the
    generator (to draw more from) and the tensors."""
    g = torch.Generator().manual_seed(0)
    tensors = [torch.randn(s, generator=g) for s in [(700, 300), (300,), (40, 5, 7)]]
    store.add([f"t{i}" for i in range(3)], tensors)
    for i, t in enumerate(tensors):
        store.capture(i, t + 0.1 * torch.randn(t.shape, generator=g))
    return g, tensors


@pytest.mark.parametrize("store", [FullSnapshot(), LowRankSnapshot(3)], ids=["full", "lowrank"])
def test_anchor_runs_are_the_anchor_whatever_the_split(store):
    """A search reads the anchor run by run: any split gives the anchor's bits (the low-rank
    store rebuilds fixed groups of rows, so its values do not depend on the split)."""
    g, tensors = _captured(store)
    for i, t in enumerate(tensors):
        whole = store.anchor(i, t.device).reshape(-1)
        for step in (t.numel(), 65_536, 6_801, 1_000, 299):
            runs = [store.anchor_run(i, a, min(a + step, t.numel()), t.device).float()
                    for a in range(0, t.numel(), step)]
            assert torch.equal(torch.cat(runs), whole), (i, step)


def test_a_refused_search_hands_the_backup_to_the_full_store():
    """After a refused search the anchor is W_t, held in the backup tensor itself (no copy)."""
    w = torch.nn.Parameter(torch.randn(50, 40))
    opt = ExtrapolatingOptimizer(torch.optim.SGD([w], lr=0.1), eval_fn=lambda: 0.0, **PAPER_RULE)
    w.grad = torch.randn(50, 40)
    opt.step()  # step 1: a search, refused
    store = opt.extrapolator.store
    assert torch.equal(store.anchor(0, w.device), w.detach())
    assert store._anchors[0].data_ptr() != w.data_ptr()  # a copy of the weights, not them
    before = store._anchors[0]
    w.grad = torch.randn(50, 40)
    opt.step()  # step 2: refused again; its backup becomes the anchor
    assert store._anchors[0] is not before and torch.equal(store.anchor(0, w.device), w.detach())


@pytest.mark.parametrize("store", [FullSnapshot(), LowRankSnapshot(3)], ids=["full", "lowrank"])
def test_delta_runs_are_base_minus_the_anchor_whatever_the_split(store):
    """A search forms Δ run by run (``delta_run``): any split gives ``base − anchor`` bit for
    bit, the low-rank store subtracting each rebuilt group of rows where the run meets it."""
    g, tensors = _captured(store)
    for i, t in enumerate(tensors):
        base = (t + torch.randn(t.shape, generator=g)).reshape(-1)
        whole = base - store.anchor(i, t.device).reshape(-1)
        for step in (t.numel(), 262_144, 65_536, 6_801, 299):
            out = torch.empty(t.numel())
            for a in range(0, t.numel(), step):
                z = min(a + step, t.numel())
                assert store.delta_run(i, a, z, base[a:z], out[a:z]).data_ptr() == out[a:z].data_ptr()
            assert torch.equal(out, whole), (i, step)


def _observed_pair(shape, delta_rank=None, seed=0, rank=4):
    """A low-rank store with a non-trivial anchor, a copy of it, and a base for a search:
    ``(store, copy, base, anchor)``; ``delta_rank`` makes ``base − anchor`` of that rank."""
    g = torch.Generator().manual_seed(seed)
    w0 = torch.randn(shape, generator=g)
    store = LowRankSnapshot(rank, seed=seed)
    store.add(["w"], [w0])
    store.capture(0, w0 + 0.1 * torch.randn(shape, generator=g))
    anchor = store.anchor(0, w0.device)
    m = shape[0]
    n = w0.numel() // m
    step = (torch.randn(shape, generator=g) if delta_rank is None
            else low_rank(m, n, delta_rank, seed + 1).reshape(shape))
    twin = LowRankSnapshot(rank, seed=seed)
    twin.add(["w"], [w0])
    twin.load_state_dict(store.state_dict())
    return store, twin, anchor + 0.05 * step, anchor


def _feed(store, delta, run):
    flat = delta.reshape(-1)
    for a in range(0, flat.numel(), run):
        store.observe(0, a, flat[a : a + run].clone())


@pytest.mark.parametrize(("shape", "run"), [((300, 70), 1000), ((300, 70), 70), ((300, 70), 33),
                                            ((40, 5, 7), 12), ((257, 129), 20_000)])
def test_a_refused_searchs_low_rank_anchor_from_the_pass_is_the_capture(shape, run):
    """The pass hands Δ to the store run by run (runs that start and end inside rows, runs
    shorter than a row); the refused search's new anchor ``anchor + Δ`` built from it is the
    one a capture of the weights gives, to float32 rounding, without reading the weights
    (here: NaNs), and the random generator is where the capture leaves it (exact resume)."""
    store, twin, base, anchor = _observed_pair(shape)
    _feed(store, base - anchor, run)
    store.advance(0, torch.full(shape, float("nan")), 1.0)
    twin.capture(0, base)
    got, want = store.anchor(0, base.device), twin.anchor(0, base.device)
    assert torch.isfinite(got).all()
    assert float((got - want).norm()) <= 1e-5 * float((base - store._refs[0]).norm())
    assert torch.equal(store._generator.get_state(), twin._generator.get_state())
    assert store._observed == {}


def test_an_accepted_jumps_low_rank_anchor_is_captured_from_the_weights():
    """An accepted jump leaves ``anchor + (1 + c)·Δ``, whose products the pass did not form:
    the store compresses the weights, from the warm start it drew in the pass, so the anchor
    is the capture's bit for bit."""
    store, twin, base, anchor = _observed_pair((90, 70))
    _feed(store, base - anchor, 1000)
    new = anchor + 3.0 * (base - anchor)
    store.advance(0, new, 3.0)
    twin.capture(0, new)
    assert torch.equal(store.anchor(0, new.device), twin.anchor(0, new.device))


def test_an_ill_conditioned_update_is_compressed_from_the_weights():
    """The first step away from the reference, of rank 1 < rank, leaves the pass's products
    singular: the store compresses the weights instead, from the same (random) warm start, so
    the anchor is the capture's bit for bit."""
    w0 = torch.randn(120, 80, generator=torch.Generator().manual_seed(0))
    store, twin = LowRankSnapshot(6), LowRankSnapshot(6)
    store.add(["w"], [w0])
    twin.add(["w"], [w0])
    base = w0 + 0.05 * low_rank(120, 80, 1, 1)
    _feed(store, base - store.anchor(0, w0.device), 500)
    store.advance(0, base, 1.0)
    twin.capture(0, base)
    assert torch.equal(store.anchor(0, base.device), twin.anchor(0, base.device))
    assert float((store.anchor(0, base.device) - base).norm()) <= 1e-4 * float(base.norm())


def test_an_incomplete_or_stale_observation_is_not_used():
    """Δ fed out of order, or not all of it, or no coefficient (``scale=None``): the anchor
    is captured from the weights."""
    for feed, scale in (("gap", 1.0), ("half", 1.0), ("whole", None)):
        store, twin, base, anchor = _observed_pair((60, 50))
        delta = (base - anchor).reshape(-1)
        if feed == "gap":
            store.observe(0, 0, delta[:100].clone())
            store.observe(0, 200, delta[200:].clone())
        elif feed == "half":
            store.observe(0, 0, delta[:1500].clone())
        else:
            _feed(store, base - anchor, 700)
        store.advance(0, base, scale)
        twin.capture(0, base)
        assert torch.equal(store.anchor(0, base.device), twin.anchor(0, base.device)), feed


@pytest.mark.parametrize("direction", ["secant", "averaged"])
def test_low_rank_searches_match_captures_of_the_weights(direction):
    """Whole runs with accepted and refused jumps: building each new anchor from the pass
    gives the weights and anchors that capturing the weights gives, to float32 rounding."""
    from conftest import batches, make_mlp, train
    from test_state import SeededGate

    runs = []
    for observe in (True, False):
        model = make_mlp(0)
        opt = ExtrapolatingOptimizer(torch.optim.AdamW(model.parameters(), lr=3e-3),
                                     eval_fn=SeededGate(model), snapshot="lowrank", rank=2,
                                     direction=direction, **PAPER_RULE)
        if not observe:
            opt.extrapolator.store.observe = lambda *a: None
        train(model, opt, batches(0, 20))
        runs.append((model, opt))
    (m1, o1), (m2, o2) = runs
    h1, h2 = o1.extrapolator.history, o2.extrapolator.history
    assert [r.accepted for r in h1] == [r.accepted for r in h2]
    assert any(r.accepted is not None for r in h1) and any(r.accepted is None for r in h1)
    for p, q in zip(m1.parameters(), m2.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5)
    s1, s2 = o1.extrapolator.store, o2.extrapolator.store
    for i, p in enumerate(m1.parameters()):
        torch.testing.assert_close(s1.anchor(i, p.device), s2.anchor(i, p.device),
                                   rtol=1e-4, atol=1e-5)
