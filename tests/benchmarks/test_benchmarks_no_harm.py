"""`benchmarks/no_harm.py`: the fork branches differ by one search each (branch `none` never
searches, `<=s` searches up to step s), the plan orders forks before the screen, and the smoke
pipeline's report comes back byte for byte from its json. The numbers belong to the real study."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from benchmarks import no_harm  # noqa: E402
from benchmarks.common import previous_results  # noqa: E402


@pytest.mark.slow
def test_the_branches_differ_by_one_search_and_the_report_regenerates(tmp_path):
    assert no_harm.main(["--smoke", "--out", str(tmp_path)]) == 0
    results = previous_results(tmp_path, "no_harm-smoke")
    runs = results["runs"]
    assert list(runs) == ["fork|none|0.001|0", "fork|<=1|0.001|0", "fork|<=2|0.001|0",
                          "screen|late|0.001|0"]
    searched = {k: [j["step"] for j in r["jumps"]] for k, r in runs.items()}
    assert searched["fork|none|0.001|0"] == [] and searched["fork|<=1|0.001|0"] == [1]
    assert searched["fork|<=2|0.001|0"] == [1, 2]
    # the same steps for every branch, the KL every FORK_KL_EVERY of them
    steps = {k: [s for s, _ in r["kl"]] for k, r in runs.items() if k.startswith("fork")}
    assert len(set(map(tuple, steps.values()))) == 1
    assert steps["fork|none|0.001|0"] == list(range(0, 5, no_harm.FORK_KL_EVERY))
    # until the first search the branches are the same run
    first = [r["kl"][0][1] for k, r in runs.items() if k.startswith("fork")]
    assert len(set(first)) == 1
    md = (tmp_path / "no_harm-smoke.md").read_text()
    assert no_harm.main(["--smoke", "--out", str(tmp_path), "--report-only"]) == 0
    assert (tmp_path / "no_harm-smoke.md").read_text() == md


@pytest.mark.slow
def test_rivals_and_confirmation_make_each_run_once_and_prodigy_takes_the_advice(tmp_path):
    argv = ["--smoke", "--out", str(tmp_path), "--stages", "screen,advice,rivals,confirm",
            "--variants", "lr_follow", "--default", "lr_follow"]
    assert no_harm.main(argv) == 0
    results = previous_results(tmp_path, "no_harm-smoke")
    runs = results["runs"]
    # EffOPD + lr_follow is the screen's variant: its seed-0 run is the screen's, made once,
    # and the confirmation of lr_follow reuses both seeds' runs; plain has no real_lm-full here
    assert sorted(runs) == sorted([
        "screen|lr_follow|0.001|0", "advice|d_coef=0.5|0.001|0", "advice|d_coef=0.1|0.001|0",
        *(f"rival|{n}|0.001|{s}" for s in (0, 1)
          for n in ("prodigy", "prodigy, advised", "effopd(prodigy)")),
        "rival|lr_follow|0.001|1", "confirm|plain|0.001|0", "confirm|plain|0.001|1"])
    pick = results["summary"]["advice"]["pick"]
    assert pick in no_harm.ADVICE
    advised = runs["rival|prodigy, advised|0.001|1"]["options"]
    assert advised["optimizer"] == "prodigy" and advised["warmup_steps"] == no_harm.ADVICE_WARMUP
    assert '"d0": 0.001' in advised["optimizer_kwargs"]
    assert f'"d_coef": {no_harm.ADVICE[pick]}' in advised["optimizer_kwargs"]
    assert "d_coef" not in runs["rival|prodigy|0.001|0"]["options"]["optimizer_kwargs"]
    assert runs["rival|effopd(prodigy)|0.001|0"]["options"]["extrapolate"] is True
    (candidate,) = results["summary"]["confirm"]
    (confirmed,) = candidate["rows"]
    assert candidate["name"] == "lr_follow"
    assert confirmed["seeds"] == [0, 1] and confirmed["complete"]
    assert confirmed["no_harm"] == (not confirmed["harmed"])
    # the patience replay reads the default's runs, the screen's seed 0 and the rival's seed 1
    (replayed,) = results["summary"]["patience"]
    searched = [runs[k]["jumps"] for k in ("screen|lr_follow|0.001|0", "rival|lr_follow|0.001|1")]
    for row in replayed["rows"]:
        assert row["runs"] == 2 and row["searches"] == sum(map(len, searched))
        assert row["gate_share_after"] <= row["gate_share"]
    md = (tmp_path / "no_harm-smoke.md").read_text()
    assert "Picked: `" in md and "**Verdict:** `lr_follow`" in md
    assert no_harm.main(["--smoke", "--out", str(tmp_path), "--report-only"]) == 0
    assert (tmp_path / "no_harm-smoke.md").read_text() == md


def test_a_reset_variant_reuses_its_twin_only_where_the_twin_kept_no_jump(tmp_path):
    import argparse

    a = argparse.Namespace(smoke=True, out=tmp_path)
    refused, kept = {"accepted": None}, {"accepted": 16.0}
    results = {"runs": {"confirm|untuned_only|1e-05|0": {"jumps": [refused, refused]},
                        "confirm|untuned_only|3e-06|0": {"jumps": [kept, refused]}}}
    same = no_harm.find_run(a, results, "reset+untuned_only", 1e-5, 0)
    assert same is results["runs"]["confirm|untuned_only|1e-05|0"]
    assert no_harm.find_run(a, results, "reset+untuned_only", 3e-6, 0) is None
    assert no_harm.find_run(a, results, "reset+untuned_only", 1e-6, 0) is None
    # a run of its own wins over the twin's
    own = results["runs"]["confirm|reset+untuned_only|1e-05|0"] = {"jumps": []}
    assert no_harm.find_run(a, results, "reset+untuned_only", 1e-5, 0) is own


def test_the_confirmation_lists_each_candidate_once_in_the_order_run(tmp_path):
    import argparse

    runs = {k: {} for k in ("screen|late|1e-05|0", "confirm|untuned_only|3e-06|0",
                            "confirm|plain|3e-06|1", "confirm|late|3e-06|0",
                            "confirm|untuned_only|3e-05|0")}
    a = argparse.Namespace(default="margin")
    assert no_harm.candidates(a, {"runs": runs}) == ["untuned_only", "late", "margin"]
    a.default = "late"
    assert no_harm.candidates(a, {"runs": runs}) == ["untuned_only", "late"]
