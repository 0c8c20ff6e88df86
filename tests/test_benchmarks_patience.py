"""`benchmarks/patience.py`: the replay of recorded searches under a patience stop."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers")

from benchmarks import patience  # noqa: E402


def test_replay_skips_every_search_after_k_refused_in_a_row():
    searches = [(True, 3), (False, 2), (False, 2), (True, 3), (False, 2)]
    assert patience.replay(searches, 2) == {"skipped": 2, "skipped_evals": 5, "lost": 1}
    assert patience.replay(searches, 3) == {"skipped": 0, "skipped_evals": 0, "lost": 0}
    assert patience.replay([(False, 2)] * 4, 1) == {"skipped": 3, "skipped_evals": 6, "lost": 0}


def _regimes_run(kept: list[bool], gate_seconds: float = 1.0) -> dict:
    jumps = [{"step": 2 ** i, "accepted": 1.0 if k else None, "scores": [0.0, 0.0] if k else [0.0]}
             for i, k in enumerate(kept)]
    return {"method": "effopd", "jumps": jumps, "gate_seconds": gate_seconds,
            "gate_evals": sum(1 + len(j["scores"]) for j in jumps),
            "train_seconds": {"1": 1.0, "10": 10.0}, "wall_seconds": 12.0}


def test_main_groups_by_gate_and_recommends_the_smallest_exact_k(tmp_path):
    # Runs of the −KL secant gate: a kept jump after two refusals (k = 2 would lose it).
    runs = {"a": _regimes_run([True, False, False, True, False, False, False]),
            "b": _regimes_run([False] * 6),
            "plain": {"method": "plain", "jumps": [], "gate_seconds": 0.0}}
    (tmp_path / "regimes.json").write_text(json.dumps({"runs": runs}))
    # The exact-match gate of the secant study: a jump kept after four refusals.
    search = [{"accepted": None, "n_evals": 2}] * 4 + [{"accepted": 2.0, "n_evals": 3}]
    (tmp_path / "secant_auc.json").write_text(json.dumps({"runs": {"x": {
        "variant": "accuracy", "searches": search, "gate_seconds": 2.0, "wall_seconds": 20.0}}}))
    out = tmp_path / "out"
    assert patience.main(["--results", str(tmp_path), "--out", str(out)]) == 0
    results = json.loads((out / "patience.json").read_text())["replay"]
    assert results["recommended"] == 3 and set(results["table"]) == {"neg_kl", "accuracy"}
    k2, k3 = results["table"]["neg_kl"][1], results["table"]["neg_kl"][2]
    assert (k2["runs"], k2["lost"], k2["runs_changed"]) == (2, 1, 1)
    # k = 3: run a stops after its last three refusals (none left), run b after step 4.
    assert (k3["lost"], k3["skipped"], k3["skipped_evals"]) == (0, 3, 6)
    assert k3["gate_share"] == pytest.approx(2 / 20)
    assert k3["gate_share_after"] == pytest.approx((2 - 6 / 12) / 20)
    md = (out / "patience.md").read_text()
    assert "**k = 3 is the smallest patience" in md and "`accuracy` gate" in md
