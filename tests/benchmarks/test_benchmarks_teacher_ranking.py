"""`benchmarks/teacher_ranking.py --smoke`: every teacher is built, scored and distilled, the
analysis (ρ intervals, regrets, the paired comparison) is written, and a rerun resumes."""

from __future__ import annotations

import importlib.util
import json

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

from benchmarks import teacher_ranking as tr  # noqa: E402


@pytest.mark.slow
def test_smoke_run_writes_the_analysis_and_resumes(tmp_path, monkeypatch):
    monkeypatch.setenv("LOOKAHEAD_OPD_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "results"
    assert tr.main(["--smoke", "--out", str(out), "--max-runs", "3"]) == 0
    first = json.loads((out / "teacher_ranking-smoke.json").read_text())
    assert len(first["runs"]) == 3
    assert tr.main(["--smoke", "--out", str(out)]) == 0  # resumes: the rest only
    d = json.loads((out / "teacher_ranking-smoke.json").read_text())
    names = d["teachers"]
    assert names == ["teacher", *(f"path-{n}" for n in tr.QUICK["path_steps"]), "independent",
                     "sharp", "zeropad", "minus", "self:solution", "copy"]
    assert len(tr.FULL["path_steps"]) == len(tr.QUICK["path_steps"])  # 10 teachers in both
    assert list(d["runs"].values())[:3] == list(first["runs"].values())
    assert len(d["runs"]) == len(names) * len(tr.QUICK["opd_seeds"])
    assert len({(r["teacher"], r["seed"]) for r in d["runs"].values()}) == len(d["runs"])
    # The sharpened teacher is its source with every logit scaled: the same argmax.
    assert d[tr.ACCURACY]["sharp"] == d[tr.ACCURACY]["teacher"]
    _, paths, _ = tr.build_teachers(tr.QUICK, 0)  # cached by the run above
    x = torch.tensor([[1, 5, 7, 9]])
    with torch.no_grad():
        torch.testing.assert_close(tr._load(paths["sharp"])(x).logits,
                                   tr.QUICK["sharpen"] * tr._load(paths["teacher"])(x).logits)
    a = d["analysis"]
    assert set(a["scores"]) == {*tr.SCORES, tr.ACCURACY}
    for s in a["scores"].values():
        assert s["top"] and 0 <= s["top_regret"] <= 1
    assert set(a["paired"]) == set(tr.DIAGNOSTIC)
    assert "teacher accuracy" in a["verdict"]
    md = (out / "teacher_ranking-smoke.md").read_text()
    assert "Paired comparison" in md and "`zeropad`" in md
    if importlib.util.find_spec("matplotlib"):
        assert (out / "teacher_ranking-smoke.png").stat().st_size > 0


def test_top_regret_and_spearman():
    assert tr.top_regret([1.0, 3.0, 2.0], [0.5, 0.1, 0.2]) == pytest.approx(0.4)
    assert tr.top_regret([3.0, 3.0, 1.0], [0.4, 0.2, 0.0]) == pytest.approx(0.1)  # tie: mean
    assert tr.spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert tr.spearman([None, 2, 3, 4], [0, 3, 2, 1]) == pytest.approx(-1.0)
    assert tr.spearman([1, 1, 1], [1, 2, 3]) is None
    m = tr._nanmean_rows(np.array([[1.0, np.nan], [3.0, np.nan]]))
    assert m[0] == 2.0 and np.isnan(m[1])
