"""`lookahead-opd demo --quick` end to end: loads the shipped pair, runs plain OPD at the
reference lr, and plain OPD, EffOPD and EffOPD + lr_follow from the conservative lr; prints the
table, each EffOPD run's summary() reading and the conclusion, and writes results.json and the
plot."""

from __future__ import annotations

import json
import re

import pytest

pytest.importorskip("transformers")
pytest.importorskip("matplotlib")

from lookahead_opd.demo.zoo import RL_BASE_RANGE  # noqa: E402
from lookahead_opd.integrations import cli  # noqa: E402


@pytest.mark.slow
def test_demo_quick_end_to_end(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("LOOKAHEAD_OPD_CACHE", str(tmp_path / "empty-cache"))  # a fresh machine
    out = tmp_path / "demo"
    assert cli.main(["demo", "--quick", "--output_dir", str(out), "--progress", "false"]) == 0
    printed = capsys.readouterr().out
    results = json.loads((out / "results.json").read_text())
    assert not (tmp_path / "empty-cache").exists()  # the shipped pair: nothing built or cached
    assert RL_BASE_RANGE[0] <= results["student_accuracy"] <= RL_BASE_RANGE[1]
    runs, lrs = results["runs"], results["lrs"]
    assert list(runs) == ["reference", "plain", "effopd", "effopd-follow"]
    assert lrs["conservative"] < lrs["reference"]
    assert runs["reference"]["lr"] == lrs["reference"]
    assert {runs[n]["lr"] for n in ("plain", "effopd", "effopd-follow")} == {lrs["conservative"]}
    # Same student, same seed: every curve starts at the same accuracy.
    assert len({json.dumps(r["evals"][0]) for r in runs.values()}) == 1
    assert runs["plain"]["searches"] == runs["reference"]["searches"] == 0
    assert runs["effopd"]["searches"] == 4  # steps 1, 2, 4, 8
    assert runs["effopd"]["gate_evals"] >= runs["effopd"]["searches"]
    targets = results["targets"]
    assert results["student_accuracy"] < targets["0.75"] < targets["0.9"] < results["teacher_accuracy"]
    for r in runs.values():  # a run that reached the target stopped there
        last = r["evals"][-1]
        assert last[0] == results["config"]["max_steps"] or last[1] >= targets["0.9"]
    # The table, the summary() readings and the conclusion, from the run's own numbers.
    for name in runs:
        assert re.search(rf"^{re.escape(name)} ", printed, re.M)
    for name in ("effopd", "effopd-follow"):
        s = runs[name]["summary"]
        assert f"{name} summary(): {s['searches']} searches, {s['kept_jumps']} jumps kept" in printed
    assert "Reading:" in printed and results["conclusion"] in printed
    assert f"from lr {lrs['conservative']:g}" in results["conclusion"]
    for name, label in (("effopd", "EffOPD"), ("plain", "plain OPD")):
        steps = runs[name]["steps_0.75"]
        assert f"{label} {'not reached' if steps is None else steps}" in results["conclusion"]
    assert (out / "accuracy_vs_step.png").stat().st_size > 0


def test_demo_conservative_lr_must_be_below_the_reference(tmp_path, capsys):
    for bad in ("1", "0", "2"):
        assert cli.main(["demo", "--output_dir", str(tmp_path / "d"), "--conservative", bad]) == 2
        err = capsys.readouterr().err
        assert "conservative must be in (0, 1)" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "d").exists()


def test_demo_no_follow_runs_three(tmp_path):
    from lookahead_opd.demo.run import DemoConfig

    names = [r["name"] for r in DemoConfig(follow=False).plan()]
    assert names == ["reference", "plain", "effopd"]


def test_the_conclusion_follows_the_numbers():
    from lookahead_opd.demo.run import conclusion

    def run(steps, gate_evals=0, kept=0, searches=0):
        return {"steps_0.75": steps, "gate_evals": gate_evals, "gate_seconds": 0.5,
                "train_clock": 10.0, "accepted_jumps": kept, "searches": searches}

    def say(ref, plain, eff):
        return conclusion({"lrs": {"reference": 5e-4, "conservative": 5e-4 / 16},
                           "config": {"max_steps": 300, "conservative": 1 / 16},
                           "targets": {"0.75": 0.6, "0.9": 0.7},
                           "runs": {"reference": run(ref), "plain": run(plain),
                                    "effopd": run(eff, 37, 8, 9)}})

    part = say(28, 216, 176)
    assert "from lr 3.125e-05" in part and "EffOPD 176, plain OPD 216" in part
    assert "reference lr 28" in part and "37 evaluations" in part and "kept 8 of 9" in part
    assert "part of the too-small lr (40 steps fewer than plain)" in part and "6.3x faster" in part
    assert "cost nothing" in say(28, 216, 28) and "cost nothing" in say(None, 216, 100)
    assert "plain did not get there" in say(28, None, 200)
    assert "EffOPD not reached" in say(28, 216, None) and "did not get there" in say(28, 216, None)
    assert "no faster than plain" in say(28, 216, 216)


def test_demo_rejects_bad_regime(tmp_path):
    from lookahead_opd.demo.run import DemoConfig, run_demo

    with pytest.raises(ValueError, match="teacher_regime"):
        run_demo(DemoConfig(output_dir=str(tmp_path), teacher_regime="other"))


def test_demo_offers_no_flag_it_would_ignore(tmp_path, capsys):
    # The demo builds its own student and teacher and runs both methods: flags for them would
    # be accepted and silently ignored, so they are not offered.
    with pytest.raises(SystemExit) as exc:
        cli.main(["demo", "--help"])
    assert exc.value.code == 0
    help_text = capsys.readouterr().out
    assert "--learning_rate" in help_text and "--export_dir" in help_text
    for flag in ("--student", "--teacher", "--extrapolate", "--resume", "--overwrite_output_dir",
                 "--lr_follow", "--stop_at_accuracy"):
        assert not re.search(rf"{flag}(?![\w-])", help_text)  # --teacher_regime stays
    assert cli.main(["demo", "--output_dir", str(tmp_path / "d"), "--student", "x"]) == 2
    err = capsys.readouterr().err
    assert "--student" in err and "Traceback" not in err and len(err.strip().splitlines()) <= 3
    assert not (tmp_path / "d").exists()
