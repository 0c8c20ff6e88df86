"""The torch-only example and the command dispatcher."""

import pytest

from lookahead_opd import PAPER_RULE
from lookahead_opd.demo.toy import format_result, run_toy
from lookahead_opd.integrations import cli


def test_toy_jumps_are_accepted_and_help() -> None:
    result = run_toy(32)
    assert len(result.plain) == len(result.wrapped) == 33
    assert result.plain[0] == result.wrapped[0]  # same initial model
    accepted = [r for r in result.jumps if r.accepted is not None]
    assert accepted, "small-lr SGD on a smooth target should accept at least one jump"
    # Every accepted jump improved the gate score it was judged on.
    assert all(r.best_score < r.score_before for r in accepted)
    assert result.wrapped[-1] < result.plain[-1]
    text = format_result(result)
    assert "steps to val loss" in text and "c=" in text


def test_where_the_ladders_bend_the_default_is_the_plain_run_and_the_paper_rule_jumps() -> None:
    result = run_toy(16, lr=0.02)  # the step-1 ladder still improves at c = 16, but bends
    assert result.jumps and all(r.accepted is None for r in result.jumps)
    assert result.wrapped == result.plain
    paper = run_toy(16, lr=0.02, **PAPER_RULE)
    assert [r.accepted for r in paper.jumps][:1] == [16.0]


def test_toy_rejects_bad_steps() -> None:
    with pytest.raises(ValueError, match="steps"):
        run_toy(0)


def test_cli_dispatch(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["toy", "--steps", "4"]) == 0
    assert "wrapped val loss" in capsys.readouterr().out
    assert cli.main(["nope"]) == 2
    assert "unknown command" in capsys.readouterr().err
    assert cli.main(["--help"]) == 0
    assert "demo" in capsys.readouterr().out
