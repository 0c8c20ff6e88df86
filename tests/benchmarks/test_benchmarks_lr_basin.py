"""`benchmarks/lr_basin.py`: the plan (lr search, then the grid from best/16 outwards, seeds,
the sweep), the basin width, and the smoke pipeline with every method through the OPD loop.
The numbers belong to the committed run."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers")
pytest.importorskip("matplotlib")
pytest.importorskip("prodigyopt")
pytest.importorskip("mechanic_pytorch")

from benchmarks import lr_basin  # noqa: E402


def test_basin_is_the_contiguous_span_around_the_best_start():
    per = {1 / 32: None, 1 / 16: 200, 1 / 8: 60, 1 / 4: 50, 1 / 2: 70, 1.0: 40, 2.0: None}
    assert lr_basin.basin(per, reference=40) == 1.0  # ≤ 50: best×1, and 1/4 (not adjacent)
    assert lr_basin.basin(per, reference=48) == 1.0  # ≤ 60: 1/8, 1/4 and 1, but 1/2 breaks it
    assert lr_basin.basin(per, reference=56) == 8.0  # ≤ 70: 1/8 … 1
    assert lr_basin.basin(per, reference=200) == 16.0  # ≤ 250: 1/16 … 1 (2 never reached)
    assert lr_basin.basin(per, reference=10) is None and lr_basin.basin(per, None) is None


def test_each_seed_gets_its_own_basin_on_the_seeded_starts():
    a = lr_basin.STUDY.parse(["--cells", "long-128/sft/adamw"])

    def at(steps_by_seed):  # one start's record: its seeds and their steps to 75%
        return {"seeds": list(steps_by_seed), "steps_0.75": list(steps_by_seed.values())}

    methods = {
        "adamw": {"1": at({0: 40, 1: 50, 2: 40})},
        "effopd": {"0.0625": at({0: 45, 1: 200}), "0.25": at({0: 44, 1: 60}),
                   "1": at({0: 40, 1: 48, 2: 40})},
    }
    widths = [lr_basin.basin_of(methods, "effopd", s, 0.75, a.seed_factors) for s in (0, 1, 2)]
    # seed 0: all three starts ≤ 1.25 × 40; seed 1: best/4 and best ≤ 1.25 × 50; seed 2: not run
    assert widths == [16.0, 4.0, None]
    assert lr_basin.fmt_widths(widths) == "16× / 4× / —"
    assert lr_basin.fmt_widths([16.0, 4.0, "none"]) == "16× / 4× / none (none–16×)"
    methods["adamw"]["1"] = at({0: None, 1: 50, 2: 40})  # AdamW at best missed: no basin
    assert lr_basin.basin_of(methods, "effopd", 0, 0.75, a.seed_factors) == "none"


def test_the_plan_searches_first_then_runs_from_best_over_16_outwards():
    a = lr_basin.STUDY.parse(["--cells", "long-128/sft/adamw"])
    name = "long-128/sft/adamw"
    cell = a.cell_specs[name]
    results = {"runs": {}, "bases": {f"{cell['task']}|{cell['teacher']}|0": {
        "base": 0.3, "targets": {"0.5": 0.5, "0.75": 0.6, "0.9": 0.7}}}}
    assert lr_basin.plan(a, results, name) == [("adamw", lr, 0) for lr in cell["lrs"]]

    def add(lr, reach, final=0.7):
        evals = [[0, 0.3], [reach or 300, final]]
        results["runs"][lr_basin.run_key(name, "adamw", lr, 0)] = {
            "cell": name, "method": "adamw", "lr": lr, "seed": 0, "evals": evals,
            "final_accuracy": evals[-1][1], "crashed": None, "train_seconds": {"0": 0.0}}

    for lr, reach in zip(cell["lrs"], (60, 40, 80, None), strict=True):
        add(lr, reach, final=0.2 if reach is None else 0.7)  # the best inside: no extension
    best = cell["lrs"][1]
    assert lr_basin.best_lr(a, results, name) == best
    todo = lr_basin.plan(a, results, name)
    methods = list(lr_basin.METHODS)
    assert todo[: len(methods)] == [(m, best / 16, 0) for m in methods]  # best/16 first
    assert {lr / best for _, lr, s in todo if s == 0 and _ in methods} >= set(lr_basin.FACTORS)
    assert {(lr / best, s) for m, lr, s in todo if s > 0} == {
        (f, s) for f in lr_basin.SEED_FACTORS for s in (1, 2)}
    sweep = [lr for m, lr, s in todo[-len(lr_basin.SWEEP):]]
    assert sweep == pytest.approx([best / 16 * x for x in lr_basin.SWEEP])
    # Grid runs at other lrs do not move the best lr the grid was built around.
    add(best / 8, 10)
    assert lr_basin.best_lr(a, results, name) == best


def test_the_search_goes_one_lr_further_while_the_best_is_at_an_end():
    a = lr_basin.STUDY.parse(["--cells", "long-128/sft/adamw"])
    name = "long-128/sft/adamw"
    cell = a.cell_specs[name]
    lrs = cell["lrs"]
    results = {"runs": {}, "bases": {f"{cell['task']}|{cell['teacher']}|0": {
        "base": 0.3, "targets": {"0.5": 0.5, "0.75": 0.6, "0.9": 0.7}}}}

    def add(lr, reach):
        results["runs"][lr_basin.run_key(name, "adamw", lr, 0)] = {
            "cell": name, "method": "adamw", "lr": lr, "seed": 0, "crashed": None,
            "evals": [[0, 0.3], [reach, 0.7]], "final_accuracy": 0.7, "train_seconds": {}}

    for lr, reach in zip(lrs, (40, 60, 80, 100), strict=True):  # the lowest is the best
        add(lr, reach)
    assert lr_basin.search_lrs(a, results, name) == [lrs[0] / 2, *lrs]
    add(lrs[0] / 2, 30)
    assert lr_basin.search_lrs(a, results, name) == [lrs[0] / 4, lrs[0] / 2, *lrs]
    add(lrs[0] / 4, 20)  # two extensions at most
    assert lr_basin.search_lrs(a, results, name)[0] == lrs[0] / 4
    assert lr_basin.best_lr(a, results, name) == lrs[0] / 4


def test_unknown_cells_and_methods_are_clear_errors():
    with pytest.raises(SystemExit):
        lr_basin.STUDY.parse(["--cells", "nope"])
    with pytest.raises(SystemExit):
        lr_basin.STUDY.parse(["--methods", "adamw,sgdx"])


@pytest.mark.slow
def test_smoke_runs_every_method_and_resumes(tmp_path, monkeypatch):
    out = tmp_path / "lr"
    assert lr_basin.main(["--smoke", "--out", str(out)]) == 0
    results = json.loads((out / "lr_basin-smoke.json").read_text())
    runs = results["runs"].values()
    assert {r["method"] for r in runs} == set(lr_basin.METHODS)
    assert all(r["evals"][0][0] == 0 and not r["crashed"] for r in runs)
    # The default schedule searches at steps 1, 2, 4; every=8 not within 6 steps.
    assert all(r["gate_evals"] > 0 for r in runs if r["method"] in ("effopd", "effopd-follow"))
    assert all(r["gate_evals"] == 0 for r in runs if r["method"] == "effopd-every")
    assert all(r["gate_evals"] == 0 for r in runs if not r["method"].startswith("effopd"))
    (c,) = results["summary"].values()
    assert c["status"] == "grid done" and set(c["methods"]) == set(lr_basin.METHODS)
    md = (out / "lr_basin-smoke.md").read_text()
    assert "## Verdict" in md and "AdamW's best lr" in md and (out / "lr_basin-smoke.png").exists()
    monkeypatch.setattr(lr_basin, "run_one", lambda *a, **k: pytest.fail("a finished run ran again"))
    assert lr_basin.main(["--smoke", "--out", str(out)]) == 0
    assert lr_basin.main(["--smoke", "--out", str(out), "--report-only"]) == 0
    assert (out / "lr_basin-smoke.md").read_text() == md
