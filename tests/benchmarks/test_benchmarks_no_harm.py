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
    # linearity keeps only from ladders untuned_only keeps from: through it, twice removed
    assert no_harm.find_run(a, results, "reset+linear", 1e-5, 0) is same
    assert no_harm.find_run(a, results, "linear", 3e-6, 0) is None
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


def test_only_lrs_and_seeds_slice_the_plan_and_stay_out_of_the_config(tmp_path):
    argv = ["--out", str(tmp_path), "--stages", "confirm", "--default", "late"]
    whole = no_harm.jobs(no_harm.STUDY.parse(argv), {"runs": {}})
    a = no_harm.STUDY.parse([*argv, "--only-lrs", "3e-6", "--only-seeds", "0,1"])
    sliced = no_harm.jobs(a, {"runs": {}})
    assert [job for _, job in sliced] == [job for _, job in whole
                                          if job[2] == 3e-6 and job[3] in (0, 1)]
    assert {job[1] for _, job in sliced} == {"plain", "late"} and len(sliced) == 4
    assert "only_lrs" not in no_harm.STUDY.config(a)
    with pytest.raises(SystemExit):
        no_harm.STUDY.parse([*argv, "--only-seeds", "one"])


@pytest.mark.parametrize("scores", [
    [-0.1611, -0.1549, -0.1490, -0.1380, -0.1186, -0.0886],  # 1e-6's step-1 ladder: 0.77
    [-0.1787, -0.1595, -0.1426, -0.1142, -0.0761, -0.0620],  # 3e-6's: 0.18
    [0.0, 0.1, 0.2, 0.4, 0.8, 1.6],  # straight: 1
    [0.0, 0.05, 0.2, 0.3, 0.25],  # turned: none
    [0.0, 0.01, 0.03, 0.07, 0.15, 0.31],  # still steepening: above 1
])
def test_the_reports_bend_is_what_linearity_reads(scores):
    import torch

    from lookahead_opd import ExtrapolatingOptimizer

    model = torch.nn.Linear(2, 1)
    ladder = {"score_before": scores[0], "scores": scores[1:],
              "coefficients": [1.0, 2.0, 4.0, 8.0, 16.0][:len(scores) - 1]}
    ratio = no_harm.rung_ratio(ladder)
    for q in (0.1, 0.5, 0.9, 1.0, 1.5):
        it = iter(scores)
        opt = ExtrapolatingOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                     eval_fn=lambda it=it: next(it), schedule=[1], linearity=q)
        model(torch.ones(1, 2)).sum().backward()
        opt.step()
        kept = opt.history[0].accepted is not None
        assert kept == (ratio is not None and ratio >= q)


def test_a_seed_is_judged_only_beside_plains_run(monkeypatch):
    """A candidate's run whose plain twin is not made yet leaves the row incomplete, unjudged;
    once plain's is there, a KL ratio that cannot be read (a diverged run) is harm."""
    import argparse

    a = argparse.Namespace(seeds=(0, 1), confirm_lrs=(1e-5,))
    monkeypatch.setattr(no_harm, "candidates", lambda a, results: ["late"])

    def judged(paired):
        row = {"seeds": [0, 1], "paired": paired, "steps_ratio_0.9": [1.0, None],
               "kl_ratio": [1.0, None]}
        monkeypatch.setattr(no_harm, "seeds_of", lambda *args: dict(row))
        ((row,),) = [c["rows"] for c in no_harm.confirm(a, {"runs": {}})]
        return row

    waiting = judged([True, False])
    assert waiting["harmed"] == [] and not waiting["complete"] and not waiting["no_harm"]
    diverged = judged([True, True])
    assert [h["seed"] for h in diverged["harmed"]] == [1] and diverged["complete"]
