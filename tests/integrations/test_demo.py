"""`lookahead-opd demo --quick` end to end: builds (or loads) the tiny pair, runs plain OPD and
EffOPD from the same student, prints the table and writes results.json and the plot."""

from __future__ import annotations

import json
import re

import pytest

pytest.importorskip("transformers")
pytest.importorskip("matplotlib")

from lookahead_opd.integrations.opd.zoo import BASE_RANGE, TEACHER_MIN  # noqa: E402

from lookahead_opd import cli  # noqa: E402


def test_demo_quick_end_to_end(tmp_path, capsys):
    out = tmp_path / "demo"
    assert cli.main(["demo", "--quick", "--output_dir", str(out), "--progress", "false"]) == 0
    printed = capsys.readouterr().out
    assert "steps to target" in printed and "speed-up" in printed
    results = json.loads((out / "results.json").read_text())
    acc = results["models"]["accuracies"]
    assert acc["teacher"] >= TEACHER_MIN and BASE_RANGE[0] <= acc["student"] <= BASE_RANGE[1]
    opd, eff = results["runs"]["opd"], results["runs"]["effopd"]
    # Same student, same seed: the curves start at the same accuracy.
    assert opd["evals"][0] == eff["evals"][0]
    assert opd["evals"][-1][0] == eff["evals"][-1][0] == results["config"]["max_steps"]
    assert opd["searches"] == 0 and eff["searches"] == 4  # steps 1, 2, 4, 8
    assert eff["gate_evals"] >= eff["searches"]
    assert (out / "accuracy_vs_step.png").stat().st_size > 0


def test_demo_rejects_bad_regime(tmp_path):
    from lookahead_opd.integrations.opd.demo import DemoConfig, run_demo

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
    for flag in ("--student", "--teacher", "--extrapolate", "--resume", "--overwrite_output_dir"):
        assert not re.search(rf"{flag}(?![\w-])", help_text)  # --teacher_regime stays
    assert cli.main(["demo", "--output_dir", str(tmp_path / "d"), "--student", "x"]) == 2
    err = capsys.readouterr().err
    assert "--student" in err and "Traceback" not in err and len(err.strip().splitlines()) <= 3
    assert not (tmp_path / "d").exists()
