"""Two CPU processes on gloo: every rank takes the same accept/reject decisions.

The workers (``_dist_workers``) only train and record; the asserting happens here, in the
pytest process, on what each rank saved.
"""

from __future__ import annotations

import math

import _dist_workers as w
import pytest
import torch
import torch.distributed as dist

from lookahead_opd.schedule import resolve_coefficients

# slow: every test here launches two processes, or reads a module fixture that did.
pytestmark = [pytest.mark.skipif(not dist.is_available(), reason="torch.distributed unavailable"),
              pytest.mark.slow]

COEFFICIENTS = resolve_coefficients("geometric")


def _decide(score_before: float, scores: list[float]) -> list[bool]:
    """Independent replay of the gate (mode="max", min_improvement=0): whether each
    evaluated candidate beats the best so far, up to and including the first that does not."""
    best, verdicts = score_before, []
    for s in scores:
        verdicts.append(math.isfinite(s) and s > best)
        if not verdicts[-1]:
            break
        best = s
    return verdicts


def _accepted(coefficients: list[float], verdicts: list[bool]) -> float | None:
    kept = [c for c, ok in zip(coefficients, verdicts, strict=True) if ok]
    return kept[-1] if kept else None


def _per_search(raw: list[float], history: list[dict]) -> list[list[float]]:
    """Split one rank's raw scores into the searches' evaluations (s0, candidates...)."""
    out, k = [], 0
    for rec in history:
        out.append(raw[k : k + rec["n_evals"]])
        k += rec["n_evals"]
    assert k == len(raw), "eval_fn was called outside the searches"
    return out


def _mean(raw: list[list[list[float]]]) -> list[list[float]]:
    """Per search and evaluation, the mean over ranks of ``raw[rank][search][eval]``."""
    return [
        [sum(vals) / len(raw) for vals in zip(*searches, strict=True)]
        for searches in zip(*raw, strict=True)
    ]


def _same(a: list[float], b: list[float]) -> bool:
    """Exactly equal, NaN equal to NaN."""
    return len(a) == len(b) and all(
        x == y or (math.isnan(x) and math.isnan(y)) for x, y in zip(a, b, strict=True)
    )


def _assert_same_everywhere(results: list[dict]) -> None:
    """Identical history and bit-identical parameters on every rank."""
    first = results[0]
    for other in results[1:]:
        for a, b in zip(first["history"], other["history"], strict=True):
            assert (a["step"], a["coefficients"], a["accepted"]) == (
                b["step"],
                b["coefficients"],
                b["accepted"],
            )
            assert _same([a["score_before"], *a["scores"]], [b["score_before"], *b["scores"]])
            # The secant sketch is all-reduced: every rank reads the same cosine, bit for bit.
            for key in ("secant_cosine", "norm_ratio", "direction_norm"):
                assert a[key] == b[key], (a["step"], key)
        for name, p in first["params"].items():
            assert torch.equal(p, other["params"][name]), name


def _assert_follows(acting: list[list[float]], results: list[dict]) -> None:
    """The history's scores are ``acting`` (per search: s0, candidates), its decisions are what
    those scores imply, the search stopped where they say, and the weights left in place are
    bit-exactly the ones the kept evaluation saw."""
    res = results[0]
    for rec, scores in zip(res["history"], acting, strict=True):
        assert _same([rec["score_before"], *rec["scores"]], scores)
        verdicts = _decide(scores[0], scores[1:])
        assert len(verdicts) == len(rec["coefficients"])
        assert verdicts[-1] is False or len(verdicts) == len(COEFFICIENTS)
        assert rec["accepted"] == _accepted(rec["coefficients"], verdicts)
    for r in results:
        k = 0
        for rec in r["history"]:
            kept = 0 if rec["accepted"] is None else 1 + rec["coefficients"].index(rec["accepted"])
            left = r["after"][rec["step"]]
            for name, p in r["seen"][k + kept].items():
                assert torch.equal(p, left[name]), (rec["step"], name)
            k += rec["n_evals"]


def _disagrees(raw: list[list[float]], history: list[dict]) -> bool:
    """Would this rank's own scores have decided differently in some search?"""
    return any(
        _decide(s[0], s[1:]) != _decide(rec["score_before"], rec["scores"])
        for s, rec in zip(raw, history, strict=True)
    )


def _assert_both_paths(history: list[dict]) -> None:
    assert any(rec["accepted"] is not None for rec in history), "no jump was accepted"
    assert any(
        rec["coefficients"][-1:] != [rec["accepted"]] for rec in history if rec["coefficients"]
    ), "no candidate was rejected"


@pytest.mark.parametrize("reduce", ["mean", "rank0"])
def test_ddp_ranks_decide_together(tmp_path, reduce):
    results = w.launch(w.ddp_worker, tmp_path, reduce, w.alternating)
    _assert_same_everywhere(results)
    history = results[0]["history"]
    raw = [_per_search(r["raw"], r["history"]) for r in results]
    _assert_follows(_mean(raw) if reduce == "mean" else raw[0], results)
    _assert_both_paths(history)
    # Ranks that would have decided differently on their own scores were overruled.
    overruled = [r for r in range(w.WORLD_SIZE) if _disagrees(raw[r], history)]
    assert overruled == ([0, 1] if reduce == "mean" else [1])


def test_lr_follow_scale_is_the_same_on_every_rank(tmp_path):
    """Ranks whose own scores would decide differently follow the shared decision, and so does
    the lr scale that the decisions set."""
    results = w.launch(w.ddp_worker, tmp_path, "mean", w.alternating, {"lr_follow": 8.0})
    _assert_same_everywhere(results)
    assert results[0]["scales"] == results[1]["scales"]
    kept = [h["accepted"] for h in results[0]["history"] if h["accepted"] is not None]
    assert kept and max(results[0]["scales"]) > 1.0  # a kept jump raised it


def test_nan_on_one_rank_rejects_on_all(tmp_path):
    results = w.launch(w.ddp_worker, tmp_path, "mean", w.nan_on_rank1_first_candidate)
    _assert_same_everywhere(results)
    first = results[0]["history"][0]
    assert first["coefficients"] == [1.0] and math.isnan(first["scores"][0])
    assert first["accepted"] is None
    # Rank 0 alone would have taken the jump: the rejection is the NaN's doing.
    r0 = results[0]["raw"]
    assert math.isfinite(r0[1]) and r0[1] > r0[0]
    raw = [_per_search(r["raw"], r["history"]) for r in results]
    _assert_follows(_mean(raw), results)
    for r in results:
        assert any(cat == "RuntimeWarning" and "non-finite" in msg for cat, msg in r["warnings"]), (
            r["warnings"]
        )


def test_fsdp2_matches_single_process(tmp_path):
    try:
        from torch.distributed.fsdp import fully_shard  # noqa: F401
    except ImportError as e:
        pytest.skip(f"torch.distributed.fsdp.fully_shard unavailable: {e}")
    results = w.launch(w.fsdp_worker, tmp_path)
    # The shards really are partial (uneven, and empty on rank 1 for the last layer).
    assert results[0]["local_shapes"] != results[1]["local_shapes"]
    _assert_same_everywhere(results)
    ref = w.reference_run()
    history = results[0]["history"]
    _assert_both_paths(history)
    for got, want in zip(history, ref["history"], strict=True):
        assert (got["step"], got["coefficients"], got["accepted"]) == (
            want["step"],
            want["coefficients"],
            want["accepted"],
        )
        assert got["scores"] == pytest.approx(want["scores"], rel=1e-5, abs=1e-7)
        # Shards sketch their part of the global tensor: the cosine is the unsharded run's.
        for key in ("secant_cosine", "norm_ratio"):
            # None at the first search (no previous direction); pytest >= 9 refuses approx(None).
            if want[key] is None:
                assert got[key] is None
            else:
                assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-6)
    for name, p in ref["params"].items():
        torch.testing.assert_close(results[0]["params"][name], p, rtol=1e-5, atol=1e-6)


def test_low_rank_searches_agree_on_every_rank(tmp_path):
    """The low-rank store builds each new anchor from the products the search's pass computes:
    under DDP every rank computes them from the same Δ, so decisions, weights and anchors are
    bit-identical; under FSDP each rank compresses its own shard and the decisions (and so the
    gathered weights) are still the same everywhere."""
    lowrank = {"snapshot": "lowrank", "rank": 2}
    for sub in ("ddp", "fsdp"):
        (tmp_path / sub).mkdir()
    ddp = w.launch(w.ddp_worker, tmp_path / "ddp", "mean", w.alternating, lowrank)
    _assert_same_everywhere(ddp)
    _assert_both_paths(ddp[0]["history"])
    for a, b in zip(ddp[0]["anchors"], ddp[1]["anchors"], strict=True):
        assert torch.equal(a, b)
    try:
        from torch.distributed.fsdp import fully_shard  # noqa: F401
    except ImportError:
        return
    fsdp = w.launch(w.fsdp_worker, tmp_path / "fsdp", lowrank)
    _assert_same_everywhere(fsdp)
    assert [a.shape for a in fsdp[0]["anchors"]] != [a.shape for a in fsdp[1]["anchors"]]


def test_sketch_is_the_same_on_every_rank_and_matches_one_process(tmp_path):
    """Replicated tensors split their chunks between ranks, shards add their own part; after
    the all-reduce both ranks hold the single-process sketch (to the float32 rounding of the
    buckets, which add in another order), bit-identical to each other."""
    pytest.importorskip("torch.distributed.tensor")
    from lookahead_opd.sketch import SecantSketch

    results = w.launch(w.sketch_worker, tmp_path)
    big, weight = w.sketch_inputs()
    sketch = SecantSketch(big.numel() + weight.numel())
    want = sketch.measure([(0, big, None), (1, weight, None)])
    for key in ("replicated", "rows", "cols"):
        assert torch.equal(results[0][key], results[1][key]), key
        torch.testing.assert_close(results[0][key], want, rtol=1e-6,
                                   atol=1e-6 * float(want[:-1].abs().max()))
