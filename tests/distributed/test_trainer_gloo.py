"""Two CPU processes on gloo running ``transformers.Trainer`` (DDP) with the
ExtrapolationCallback: every rank takes the same decisions, the parameters stay identical on
all ranks after the jumps, and the gate score is each rank's slice's score averaged.

The workers (``_trainer_workers``) train and record; the asserting happens here.
"""

from __future__ import annotations

import _dist_workers as w
import _trainer_workers as tw
import pytest
import torch
import torch.distributed as dist

pytest.importorskip("transformers")
# slow: every test here launches two processes, or reads a module fixture that did.
pytestmark = [pytest.mark.skipif(not dist.is_available(), reason="torch.distributed unavailable"),
              pytest.mark.slow]

SEARCH_STEPS = [1, 2, 4, 8]


def _decide(score_before: float, scores: list[float]) -> list[bool]:
    best, verdicts = score_before, []
    for s in scores:
        verdicts.append(s > best)
        if not verdicts[-1]:
            break
        best = s
    return verdicts


def _split(raw: list[float], history: list[dict]) -> list[list[float]]:
    out, k = [], 0
    for rec in history:
        out.append(raw[k : k + rec["n_evals"]])
        k += rec["n_evals"]
    assert k == len(raw), "eval_fn was called outside the searches"
    return out


def _same_everywhere(runs: list[dict]) -> None:
    """Identical histories and, after every optimizer step and at the end, identical weights."""
    a, b = runs
    assert [(r["step"], r["coefficients"], r["accepted"]) for r in a["history"]] == [
        (r["step"], r["coefficients"], r["accepted"]) for r in b["history"]
    ]
    assert [[r["score_before"], *r["scores"]] for r in a["history"]] == [
        [r["score_before"], *r["scores"]] for r in b["history"]
    ]
    assert sorted(a["after"]) == list(range(1, tw.STEPS + 1))
    for step, params in a["after"].items():
        for name, p in params.items():
            assert torch.equal(p, b["after"][step][name]), (step, name)
    for name, p in a["params"].items():
        assert torch.equal(p, b["params"][name]), name


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict]:
    tmp = tmp_path_factory.mktemp("trainer_gloo")
    return w.launch(tw.trainer_worker, tmp, str(tmp))


def test_eval_fn_scores_are_averaged_and_ranks_decide_together(results):
    assert all(r["world"] == 2 for r in results)
    runs = [r["eval_fn"] for r in results]
    assert runs[0]["ddp"] == "DistributedDataParallel"
    _same_everywhere(runs)
    history = runs[0]["history"]
    assert [r["step"] for r in history] == SEARCH_STEPS
    raw = [_split(r["raw"], r["history"]) for r in runs]
    overruled = set()
    for i, rec in enumerate(history):
        # The score acted on is the mean of the two ranks' slice scores, bit for bit.
        mean = [(x + y) / 2 for x, y in zip(raw[0][i], raw[1][i], strict=True)]
        assert [rec["score_before"], *rec["scores"]] == mean
        verdicts = _decide(mean[0], mean[1:])
        kept = [c for c, ok in zip(rec["coefficients"], verdicts, strict=True) if ok]
        assert rec["accepted"] == (kept[-1] if kept else None)
        for r in range(2):
            if _decide(raw[r][i][0], raw[r][i][1:]) != verdicts:
                overruled.add(r)
    assert any(rec["accepted"] is not None for rec in history), "no jump was accepted"
    assert overruled, "no rank would have decided differently alone: the test shows nothing"


def test_gate_dataset_is_sharded_over_ranks_and_identical_after_jumps(results):
    runs = [r["gate_dataset"] for r in results]
    _same_everywhere(runs)
    history = runs[0]["history"]
    assert [r["step"] for r in history] == SEARCH_STEPS
    assert any(rec["accepted"] is not None for rec in history), "no jump was accepted"
    # Each evaluation fetched disjoint halves of the gate set on the two ranks.
    per_eval = tw.GATE_SIZE // 2
    n_evals = sum(rec["n_evals"] for rec in history)
    fetched = [r["fetched"] for r in runs]
    assert [len(f) for f in fetched] == [n_evals * per_eval] * 2
    for k in range(n_evals):
        halves = [set(f[k * per_eval : (k + 1) * per_eval]) for f in fetched]
        assert halves[0].isdisjoint(halves[1])
        assert halves[0] | halves[1] == set(range(tw.GATE_SIZE))
    # The first search's s0 is minus the mean of the two halves' losses at the weights the
    # optimizer produced at step 1 (the gate metric is eval_loss, minimised).
    model = tw.make_model()
    model.load_state_dict(runs[0]["stepped"][1], strict=False)
    gate = tw.Counting(tw.GATE_SIZE, seed=2).ids
    halves = [tw.slice_loss(model, ids) for ids in gate.chunk(2)]
    assert history[0]["score_before"] == pytest.approx(sum(halves) / 2, rel=1e-5)
    assert halves[0] != pytest.approx(halves[1], rel=1e-3)  # the halves really differ
