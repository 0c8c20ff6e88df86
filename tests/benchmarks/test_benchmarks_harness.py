"""``benchmarks.harness.Study``: the protocol every study runs on (one command line, one flow)
on a toy study: smoke settings under an explicit option, the stems, resuming, ``--max-runs``,
``--report-only`` from the json with the options its runs were made with, the refusals, and a
study of several parts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import harness


def toy(calls: list, **fields) -> harness.Study:
    def options(p):
        p.add_argument("--n", type=int, default=3)
        p.add_argument("--scale", type=float, default=1.0)

    def report(a, data):
        return f"# toy\n\nscale {a.scale}, runs {sorted(data['runs'])}, sum {data['summary']}\n"

    def run(a, ctx, i):
        calls.append(i)
        return {"value": i * a.scale, "ctx": ctx}

    return harness.Study(
        "toy", "a toy study", report, options=options, uses=("threads", "budget"),
        smoke=dict(n=2, scale=0.5), report_options=("scale",), same=("n",),
        prepare=lambda a, store: "shared", jobs=lambda a, store, ctx: [(f"r{i}", i) for i in range(a.n)],
        run=run, summarize=lambda a, data: sum(r["value"] for r in data["runs"].values()),
        **fields)


def test_smoke_settings_yield_to_the_command_line_and_name_the_stem():
    study = toy([])
    a = study.parse(["--smoke", "--n", "5"])
    assert (a.n, a.scale, a.stem, a.threads, a.budget_s) == (5, 0.5, "toy-smoke", 1, None)
    assert study.parse(["--stem", "other"]).stem == "other"
    with pytest.raises(SystemExit):
        study.parse(["--device", "cuda"])  # a CPU study
    assert "--workers" not in study.parser().format_help()  # not a shared-json study


def test_runs_resume_report_only_rewrites_and_refusals(tmp_path):
    calls: list = []
    study = toy(calls)
    assert study.main(["--out", str(tmp_path), "--max-runs", "2", "--scale", "2"]) == 0
    assert calls == [0, 1]
    assert study.main(["--out", str(tmp_path), "--scale", "2"]) == 0  # the rest only
    assert calls == [0, 1, 2]
    data = json.loads((tmp_path / "toy.json").read_text())
    assert data["runs"]["r2"] == {"value": 4.0, "ctx": "shared"} and data["summary"] == 6.0
    assert data["config"]["scale"] == 2.0 and data["commands"] and data["machine"]
    md = (tmp_path / "toy.md").read_text()
    (tmp_path / "toy.md").unlink()
    # --report-only: the json's options (scale 2), not this call's defaults; no run
    assert study.main(["--out", str(tmp_path), "--report-only"]) == 0
    assert (tmp_path / "toy.md").read_text() == md and calls == [0, 1, 2]
    with pytest.raises(SystemExit, match="made with n 3"):
        study.main(["--out", str(tmp_path), "--n", "4"])
    with pytest.raises(SystemExit, match="--report-only: no toy-smoke.json"):
        study.main(["--out", str(tmp_path), "--smoke", "--report-only"])


def test_a_study_of_parts_runs_one_or_all(tmp_path):
    calls: list = []
    one, two = toy(calls), toy(calls)
    two.stem = "toy2"
    assert harness.main(one, two, argv=["--part", "toy2", "--out", str(tmp_path)]) == 0
    assert not (tmp_path / "toy.json").exists() and (tmp_path / "toy2.md").exists()
    assert harness.main(one, two, argv=["--out", str(tmp_path)]) == 0
    assert (tmp_path / "toy.md").exists() and calls == [0, 1, 2, 0, 1, 2]
    with pytest.raises(SystemExit):
        harness.main(one, two, argv=["--part", "nope"])


def test_a_run_deletes_its_scratch_folder_and_nothing_else(tmp_path, monkeypatch):
    from lookahead_opd.demo import compare

    def fake_run_variant(config, *args, **kwargs):  # writes a "checkpoint", as a real run does
        checkpoint = Path(config.output_dir) / "checkpoint-1"
        checkpoint.mkdir(parents=True)
        (checkpoint / "model.bin").write_bytes(b"0" * 100)
        return {"evals": [[0, 0.0]], "train_seconds": {1: 0.1}, "jumps": []}

    monkeypatch.setattr(compare, "run_variant", fake_run_variant)
    monkeypatch.setattr(harness, "load_task", lambda spec, tokenizer=None: None)
    pair = {"student": None, "teacher": None, "tokenizer": None}
    scratch = harness.opd_config(f"test-{tmp_path.name}", "r0", max_steps=1)
    mine = harness.opd_config(f"test-{tmp_path.name}", "r1", max_steps=1,
                              output_dir=str(tmp_path / "mine"))
    for config in (scratch, mine):
        record = harness.run(config, pair, "unused")
        assert record["crashed"] is None and record["evals"] == [[0, 0.0]]
    assert scratch.output_dir.startswith(harness.SCRATCH)
    assert not Path(scratch.output_dir).exists()
    assert (tmp_path / "mine" / "checkpoint-1" / "model.bin").exists()  # a caller's folder stays
