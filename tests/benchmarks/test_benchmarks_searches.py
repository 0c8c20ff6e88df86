"""`benchmarks/searches.py`: the secant part's AUCs and shadow rule count what they say, and its
smoke pipeline writes its table; the patience part's replay of recorded searches. The numbers
themselves belong to the committed runs."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers")

from benchmarks import searches  # noqa: E402


def _point(run: int, cosine: float, kept: bool, evals: int = 2) -> dict:
    return {"variant": "v", "lr_multiplier": 1.0, "seed": run, "step": 8, "n_evals": evals,
            "seconds": 0.5 * evals, "secant_cosine": cosine, "accepted": 1.0 if kept else None}


def test_auc_counts_pairs_and_ties():
    assert searches.auc([0.9, 0.8], [0.1, 0.2]) == 1.0
    assert searches.auc([0.1], [0.9]) == 0.0
    assert searches.auc([0.5], [0.5, 0.4]) == 0.75  # one tie (half), one win
    assert searches.auc([], [0.1]) is None


def test_within_run_auc_ignores_pairs_across_runs():
    # Run 0 is straight and keeps some, run 1 is crooked and keeps none: pooled, the cosine
    # looks useful; within run 0 the kept searches have the lower cosine.
    pts = [_point(0, 0.8, True), _point(0, 0.85, True), _point(0, 0.9, False),
           _point(1, 0.2, False), _point(1, 0.3, False)]
    kept = [p["secant_cosine"] for p in pts if p["accepted"] is not None]
    rejected = [p["secant_cosine"] for p in pts if p["accepted"] is None]
    assert searches.auc(kept, rejected) == pytest.approx(4 / 6)
    assert searches.within_run_auc(pts) == 0.0
    assert searches.within_run_auc([_point(0, 0.8, True), _point(1, 0.1, False)]) is None


def test_shadow_rule_counts_skips_and_misses():
    pts = [_point(0, 0.1, False, 2), _point(0, 0.3, True, 3), _point(0, 0.7, True, 4)]
    r = searches.shadow(pts, 0.5)
    assert (r["skipped"], r["kept_missed"], r["kept_jumps"]) == (2, 1, 2)
    assert (r["evals_saved"], r["evals_total"], r["seconds_saved"]) == (5, 9, 2.5)


@pytest.mark.slow
def test_smoke_runs_the_secant_part_then_replays_it(tmp_path):
    assert searches.main(["--smoke", "--out", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "secant_auc-smoke.json").read_text())
    runs = list(results["runs"].values())
    assert len(runs) == 2
    for run in runs:
        assert run["searches"][0]["secant_cosine"] is None
        assert all(-1.0 <= s["secant_cosine"] <= 1.0 for s in run["searches"][1:])
    assert "Within-run ROC AUC" in (tmp_path / "secant_auc-smoke.md").read_text()
    replayed = json.loads((tmp_path / "patience-smoke.json").read_text())["replay"]
    assert replayed["sources"] == ["secant_auc-smoke.json"]
    assert sum(row["runs"] for row in replayed["table"]["neg_kl"][:1]) == 2


def test_replay_skips_every_search_after_k_refused_in_a_row():
    searches_ = [(True, 3), (False, 2), (False, 2), (True, 3), (False, 2)]
    assert searches.replay(searches_, 2) == {"skipped": 2, "skipped_evals": 5, "lost": 1}
    assert searches.replay(searches_, 3) == {"skipped": 0, "skipped_evals": 0, "lost": 0}
    assert searches.replay([(False, 2)] * 4, 1) == {"skipped": 3, "skipped_evals": 6, "lost": 0}


def _regimes_run(kept: list[bool], gate_seconds: float = 1.0) -> dict:
    jumps = [{"step": 2 ** i, "accepted": 1.0 if k else None, "scores": [0.0, 0.0] if k else [0.0]}
             for i, k in enumerate(kept)]
    return {"method": "effopd", "jumps": jumps, "gate_seconds": gate_seconds,
            "gate_evals": sum(1 + len(j["scores"]) for j in jumps),
            "train_seconds": {"1": 1.0, "10": 10.0}, "wall_seconds": 12.0}


def test_patience_groups_by_gate_and_recommends_the_smallest_exact_k(tmp_path):
    # Runs of the −KL secant gate: a kept jump after two refusals (k = 2 would lose it).
    runs = {"a": _regimes_run([True, False, False, True, False, False, False]),
            "b": _regimes_run([False] * 6),
            "plain": {"method": "plain", "jumps": [], "gate_seconds": 0.0}}
    (tmp_path / "regimes.json").write_text(json.dumps({"runs": runs}))
    # The exact-match gate of the secant part: a jump kept after four refusals.
    search = [{"accepted": None, "n_evals": 2}] * 4 + [{"accepted": 2.0, "n_evals": 3}]
    (tmp_path / "secant_auc.json").write_text(json.dumps({"runs": {"x": {
        "variant": "accuracy", "searches": search, "gate_seconds": 2.0, "wall_seconds": 20.0}}}))
    # The speed-up study's runs: their options are in its summary.
    eff = {"variant": "e", "jumps": [{"accepted": None, "n_evals": 2}], "gate_seconds": 1.0,
           "gate_evals": 2, "train_seconds": {"5": 5.0}}
    (tmp_path / "speedup.json").write_text(json.dumps({"runs": {"e/0": eff}, "summary": {
        "e": {"options": {"extrapolate": True, "gate": "neg_kl", "direction": "averaged"}}}}))
    out = tmp_path / "out"
    assert searches.main(["--part", "patience", "--results", str(tmp_path), "--out", str(out)]) == 0
    results = json.loads((out / "patience.json").read_text())["replay"]
    assert results["recommended"] == 3
    assert set(results["table"]) == {"neg_kl", "accuracy", "neg_kl, averaged"}
    k2, k3 = results["table"]["neg_kl"][1], results["table"]["neg_kl"][2]
    assert (k2["runs"], k2["lost"], k2["runs_changed"]) == (2, 1, 1)
    # k = 3: run a stops after its last three refusals (none left), run b after step 4.
    assert (k3["lost"], k3["skipped"], k3["skipped_evals"]) == (0, 3, 6)
    assert k3["gate_share"] == pytest.approx(2 / 20)
    assert k3["gate_share_after"] == pytest.approx((2 - 6 / 12) / 20)
    md = (out / "patience.md").read_text()
    assert "**k = 3 is the smallest patience" in md and "`accuracy` gate" in md
    assert "(`regimes.json`, `secant_auc.json`, `speedup.json`)" in md
