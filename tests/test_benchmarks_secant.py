"""`benchmarks/secant.py`: the AUCs and the shadow rule count what they say, and the quick
pipeline writes its table; the numbers themselves belong to the committed full run."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers")

from benchmarks import secant  # noqa: E402


def _point(run: int, cosine: float, kept: bool, evals: int = 2) -> dict:
    return {"variant": "v", "lr_multiplier": 1.0, "seed": run, "step": 8, "n_evals": evals,
            "seconds": 0.5 * evals, "secant_cosine": cosine, "accepted": 1.0 if kept else None}


def test_auc_counts_pairs_and_ties():
    assert secant.auc([0.9, 0.8], [0.1, 0.2]) == 1.0
    assert secant.auc([0.1], [0.9]) == 0.0
    assert secant.auc([0.5], [0.5, 0.4]) == 0.75  # one tie (half), one win
    assert secant.auc([], [0.1]) is None


def test_within_run_auc_ignores_pairs_across_runs():
    # Run 0 is straight and keeps some, run 1 is crooked and keeps none: pooled, the cosine
    # looks useful; within run 0 the kept searches have the lower cosine.
    pts = [_point(0, 0.8, True), _point(0, 0.85, True), _point(0, 0.9, False),
           _point(1, 0.2, False), _point(1, 0.3, False)]
    kept = [p["secant_cosine"] for p in pts if p["accepted"] is not None]
    rejected = [p["secant_cosine"] for p in pts if p["accepted"] is None]
    assert secant.auc(kept, rejected) == pytest.approx(4 / 6)
    assert secant.within_run_auc(pts) == 0.0
    assert secant.within_run_auc([_point(0, 0.8, True), _point(1, 0.1, False)]) is None


def test_shadow_rule_counts_skips_and_misses():
    pts = [_point(0, 0.1, False, 2), _point(0, 0.3, True, 3), _point(0, 0.7, True, 4)]
    r = secant.shadow(pts, 0.5)
    assert (r["skipped"], r["kept_missed"], r["kept_jumps"]) == (2, 1, 2)
    assert (r["evals_saved"], r["evals_total"], r["seconds_saved"]) == (5, 9, 2.5)


def test_quick_run_writes_the_table(tmp_path):
    assert secant.main(["--quick", "--out", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "secant_auc.json").read_text())
    runs = list(results["runs"].values())
    assert len(runs) == 2
    for run in runs:
        assert run["searches"][0]["secant_cosine"] is None
        assert all(-1.0 <= s["secant_cosine"] <= 1.0 for s in run["searches"][1:])
    assert "Within-run ROC AUC" in (tmp_path / "secant_auc.md").read_text()
