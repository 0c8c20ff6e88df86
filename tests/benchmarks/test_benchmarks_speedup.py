"""`benchmarks/speedup.py --smoke`: the pipeline (pairs, variants, summary, tables, plots) runs;
the numbers themselves belong to the committed full run."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers")
pytest.importorskip("matplotlib")

from benchmarks import harness, speedup  # noqa: E402


@pytest.mark.slow
def test_smoke_run_writes_every_output(tmp_path):
    assert speedup.main(["--smoke", "--out", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "speedup-smoke.json").read_text())
    assert set(results["summary"]) == set(speedup.SMOKE_VARIANTS)
    for key, run in results["runs"].items():
        name, seed = key.split("/")
        assert run["variant"] == name and run["seed"] == int(seed)
        assert run["evals"][0][0] == 0 and run["evals"][-1][0] == results["config"]["steps"]
    s = results["summary"]
    # Same student and seed: every variant starts from the same accuracy.
    assert len({results["runs"][f"{n}/0"]["evals"][0][1] for n in s}) == 1
    assert s["opd@x1"]["searches"] == [0] and s["effopd@x1"]["searches"] == [3]  # steps 1, 2, 4
    assert s["fixed"]["gate_evals"] == [0]  # ungated
    assert 0 < s["effopd@x1"]["target"] <= 0.9
    md = (tmp_path / "speedup-smoke.md").read_text()
    assert "## lr sweep" in md and "## methods" in md and "Against a tuned baseline" in md
    for png in ("speedup-smoke_accuracy.png", "speedup-smoke_bars.png"):
        assert (tmp_path / png).stat().st_size > 0


def test_every_variant_has_a_plain_baseline_and_known_options():
    from lookahead_opd.integrations.opd.config import OPDConfig

    for name, spec in speedup.VARIANTS.items():
        assert speedup._plain_for(name) in speedup.VARIANTS, name
        assert spec["pair"] in harness.ZOO_PAIRS
        OPDConfig(task=spec["task"] or harness.ZOO_PAIRS[spec["pair"]][0], **spec["config"]).validate()
