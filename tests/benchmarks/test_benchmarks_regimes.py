"""`benchmarks/regimes.py --smoke`: the staged grid runs end to end, writes the json / md / heat
map, and a rerun skips every finished run. The numbers belong to the committed full run."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers")
pytest.importorskip("matplotlib")

from benchmarks import harness, regimes  # noqa: E402


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("regimes")
    assert regimes.main(["--smoke", "--out", str(out)]) == 0
    return out


@pytest.mark.slow
@pytest.mark.slow
def test_smoke_writes_the_staged_grid(smoke):
    results = json.loads((smoke / "regimes-smoke.json").read_text())
    (name, cell), = results["cells"].items()
    runs = results["runs"]
    lrs = cell["lrs"]
    # Stage 1: every lr, both methods, seed 0; each run stopped at the target or the cap.
    for lr in lrs:
        for method in ("plain", "effopd"):
            r = runs[regimes.run_key(name, method, lr, 0)]
            assert r["evals"][0][0] == 0 and r["evals"][-1][0] <= results["config"]["max_steps"]
            assert r["cell"] == name and r["method"] == method and r["lr"] == lr
    # The noise pass at plain's best lr: micro-batch gradients are noisier than whole-step ones.
    noise = [r for r in runs.values() if r["method"] == "noise"]
    assert len(noise) == 1
    n = noise[0]["noise"]
    assert n["steps"] == results["config"]["noise_steps"]
    assert n["grad_sq_small"] > n["grad_sq_big"] > 0
    # Stage 2: seed 1 at each method's two best lrs (both lrs here).
    assert {(r["method"], r["lr"]) for r in runs.values() if r["seed"] == 1} == {
        (m, lr) for m in ("plain", "effopd") for lr in lrs}
    # EffOPD searched at steps 1, 2, 4 (runs that stopped early searched less).
    eff = runs[regimes.run_key(name, "effopd", lrs[0], 0)]
    assert [j["step"] for j in eff["jumps"]] == [s for s in (1, 2, 4) if s <= eff["evals"][-1][0]]
    assert all(-1 <= c <= 1 for _, c in runs[regimes.run_key(name, "plain", lrs[0], 0)]["secant_cosines"])
    s = results["summary"][name]
    assert s["status"] == "stage 2 done" and s["paired_seeds"] == [0, 1]
    assert set(s["methods"]) == {"plain", "effopd"} and s["noise"] == n
    assert set(s["ratios"]) == {f"{w}_{f:g}" for w in ("steps", "seconds") for f in regimes.FRACTIONS}
    # The gate's share of EffOPD's clock: plain has no gate; EffOPD's searched, inside its clock.
    assert s["methods"]["plain"]["gate_share"] == [0.0, 0.0]
    assert all(0 < x < 1 for x in s["methods"]["effopd"]["gate_share"])
    md = (smoke / "regimes-smoke.md").read_text()
    assert "**Verdict.**" in md and "## The map" in md and "## Not run" in md and name in md
    assert (smoke / "regimes-smoke_map.png").stat().st_size > 0


@pytest.mark.slow
def test_rerun_skips_finished_runs(smoke, monkeypatch):
    before = json.loads((smoke / "regimes-smoke.json").read_text())["runs"]

    def no_runs(*args, **kwargs):
        raise AssertionError("a finished run was run again")

    monkeypatch.setattr(regimes, "run_one", no_runs)
    assert regimes.main(["--smoke", "--out", str(smoke)]) == 0
    after = json.loads((smoke / "regimes-smoke.json").read_text())
    assert after["runs"] == before and after["summary"]


@pytest.mark.slow
def test_report_only_keeps_the_runs_options_and_machine(smoke, tmp_path, monkeypatch):
    """A rewrite of the report says what the runs were made with, not this call's defaults."""
    results = json.loads((smoke / "regimes-smoke.json").read_text())
    results["config"]["warmup_steps"] = 3
    results["machine"]["git_commit"] = "abc123"
    (tmp_path / "regimes-smoke.json").write_text(json.dumps(results))
    monkeypatch.setattr(regimes, "run_one", lambda *args, **kwargs: pytest.fail("a run"))
    assert regimes.main(["--smoke", "--out", str(tmp_path), "--report-only"]) == 0
    md = (tmp_path / "regimes-smoke.md").read_text()
    assert "lr warmup 3 steps" in md and "last at abc123," in md
    with pytest.raises(SystemExit, match="no regimes.json"):
        regimes.main(["--out", str(tmp_path), "--report-only"])


@pytest.mark.slow
def test_a_rebuilt_pair_that_differs_is_refused(smoke, monkeypatch):
    """The json records each pair's accuracies; resuming on a pair built differently (zoo builds
    differ across machines and thread counts) skips the cell with a one-line reason in the json
    and the report, instead of mixing two studies."""
    path = smoke / "regimes-smoke.json"
    results = json.loads(path.read_text())
    (key, record), = results["pairs"].items()
    assert set(record["accuracies"]) >= {"student", "teacher"}
    record["accuracies"] = {**record["accuracies"], "teacher": record["accuracies"]["teacher"] / 2}
    path.write_text(json.dumps(results))
    monkeypatch.setattr(regimes, "pending", lambda *args: [("plain", 1e-3, 9, False)])

    def no_runs(*args, **kwargs):
        raise AssertionError("a run on a different pair")

    monkeypatch.setattr(regimes, "run_one", no_runs)
    assert regimes.main(["--smoke", "--out", str(smoke)]) == 0
    after = json.loads(path.read_text())
    (name, why), = after["unavailable"].items()
    assert f"is not the one the json's {key} runs used" in why and "\n" not in why
    assert after["runs"] == results["runs"] and why in (smoke / "regimes-smoke.md").read_text()
    # The rest of a json written before pairs were recorded: its bases' teacher accuracy.
    legacy = {"pairs": {}, "bases": {f"{key}|0": {"teacher": 0.5}}}
    cell = {"task": key.split("|")[0], "teacher": key.split("|")[1], "kind": "main"}
    pair = {"build": "b", "accuracies": {"teacher": 0.5}}
    assert harness.check_pair(legacy, cell, pair) is None and legacy["pairs"][key]["build"] == "b"
    legacy = {"pairs": {}, "bases": {f"{key}|0": {"teacher": 0.5}}}
    why = harness.check_pair(legacy, cell, {**pair, "accuracies": {"teacher": 0.4}})
    assert "(b: teacher 40.0%)" in why and "(an earlier build: teacher 50.0%)" in why


def test_verdict_names_a_cell_only_when_every_paired_seed_clears_the_bar():
    def cell(ratios, counts=True):
        return {"counts": counts, "paired_seeds": [0, 1, 2], "verdict_fraction": 0.9,
                "ratios": {"steps_0.9": ratios}}

    assert "No counted cell" in regimes.verdict({"a": cell([1.3, 1.25, 1.19])})
    assert "1.30×" in regimes.verdict({"a": cell([1.3, 1.25, 1.19])})
    assert "in: a" in regimes.verdict({"a": cell([1.3, 1.25, 1.2])})
    assert "No counted cell" in regimes.verdict({"a": cell([1.3, 1.25, 1.2], counts=False)})


def test_the_gate_line_reports_only_counted_cells():
    def cell(shares, counts=True):
        return {"counts": counts, "methods": {"effopd": {"gate_share": shares}}}

    line = regimes.gate_line({"a": cell([0.01, 0.03]), "b": cell([0.5], counts=False)})
    assert "took 1.0–3.0% of its training clock: a 2.0 [1.0–3.0]%." in line and "b " not in line
    assert regimes.gate_line({"b": cell([0.5], counts=False)}) == ""
    run = {"gate_seconds": 2.0, "train_seconds": {"9": 10.0, "10": 40.0}}
    assert harness.gate_share(run) == 0.05  # of the clock at the run's last step
    assert harness.gate_share({"gate_seconds": 0.0, "train_seconds": {}}) is None


def test_every_cell_config_is_valid():
    from lookahead_opd.integrations.opd.config import OPDConfig

    args = regimes.STUDY.parse([])
    for cell in args.cell_specs.values():
        assert cell["optimizer"] in ("adamw", "sgd")
        for lr in cell["lrs"]:
            OPDConfig(task="arithmetic", learning_rate=lr, batch_size=cell["prompts"],
                      loss=harness.LOSS, **harness.EFFOPD).validate()


def test_retention_gate_rejects_every_jump_past_the_budget(tmp_path):
    """``run_variant(trainer_class=...)`` trains through the subclass: under a base gate whose
    score rises at every call, jumps are kept when the held-out floor is met and none when not."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from lookahead_opd.demo.compare import run_variant
    from lookahead_opd.demo.zoo import build_pair
    from lookahead_opd.integrations.opd.config import OPDConfig
    from lookahead_opd.integrations.opd.tasks import load_task
    from lookahead_opd.integrations.opd.trainer import OPDTrainer

    pair = build_pair(progress=False)
    tok = AutoTokenizer.from_pretrained(pair.student_path)
    student, teacher = (AutoModelForCausalLM.from_pretrained(p, dtype=torch.float32)
                        for p in (pair.student_path, pair.teacher_path))
    held = load_task("arithmetic:ops=-")
    held_out = {"task": held, "problems": held.problems("gate", 8)}
    config = OPDConfig(task="arithmetic", output_dir=str(tmp_path),
                       max_steps=2, batch_size=4, learning_rate=1e-3, loss=harness.LOSS,
                       eval_every=0, eval_size=8, progress=False,
                       **{**harness.EFFOPD, "gate_size": 8})
    class Rising(OPDTrainer):
        calls = 0

        def gate_score(self) -> float:
            Rising.calls += 1
            return float(Rising.calls)

    kept = {}
    for floor in (-1.0, 2.0):
        run = run_variant(config, student, teacher, load_task("arithmetic"), tok,
                          trainer_class=regimes.retention_gate(Rising, held_out, floor))
        kept[floor] = [j["accepted"] for j in run["jumps"]]
        assert run["gate_evals"] > 0
    assert len(kept[-1.0]) == 2 and all(c is not None for c in kept[-1.0])
    assert kept[2.0] == [None, None]


def test_a_retention_cell_goes_lower_until_a_plain_run_keeps_the_budget():
    args = regimes.STUDY.parse(["--cells", "short-512/retention/adamw"])
    name = "short-512/retention/adamw"
    lrs = args.cell_specs[name]["lrs"]
    bt = {"base": 0.3, "teacher": 0.9, "gain": 0.6, "retention_base": 0.97,
          "targets": {f"{f:g}": 0.3 + f * 0.6 for f in regimes.FRACTIONS}}
    results = {"bases": {f"{regimes.RETENTION['task']}|retention|0": bt}, "runs": {}}

    def add(lr, kept, final=0.9):
        results["runs"][regimes.run_key(name, "plain", lr, 0)] = {
            "cell": name, "method": "plain", "lr": lr, "seed": 0, "extra": kept,
            "evals": [[0, 0.3], [100, final]], "final_accuracy": final, "crashed": None,
            "train_seconds": {"0": 0.0, "100": 1.0}}

    for lr in lrs:
        add(lr, kept=0.05)  # every lr fast, none within 2 points of 97%
    for top in (lrs[-1] * 2, lrs[-1] * 4):
        add(top, kept=0.01, final=0.2)
    assert regimes.stage1_lrs(args, results, name)[0] == lrs[0] / 2
    add(lrs[0] / 2, kept=0.96, final=0.5)  # within the budget, and the best there: lower again
    assert regimes.stage1_lrs(args, results, name)[:2] == [lrs[0] / 4, lrs[0] / 2]
    assert regimes.best_lrs(results, name, "plain", bt, 1) == [lrs[0] / 2]
    assert not regimes.within_budget([results["runs"][regimes.run_key(name, "plain", lrs[0], 0)]], bt)
