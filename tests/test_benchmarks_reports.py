"""Every committed report the harness's studies wrote regenerates byte for byte from its
committed json with ``--report-only`` (no training): moving code into ``benchmarks/harness.py``
must not change what a study says about its runs."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

pytest.importorskip("matplotlib")

from benchmarks import (  # noqa: E402
    geometry,
    lr_basin,
    overhead,
    patience,
    regimes,
    scale,
    secant,
    speedup,
    teacher_ranking,
)

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results"

# (study, folder under results/, stem, extra argv)
REPORTS = [
    (regimes, "", "regimes", []),
    (regimes, "regimes-nowarmup", "regimes", []),
    (regimes, "regimes-rebuilt", "regimes", []),
    (speedup, "", "speedup", []),
    (secant, "", "secant_auc", []),
    (patience, "", "patience", []),
    (geometry, "", "geometry", []),
    (scale, "", "scale-h200-seed0", ["--stem", "scale-h200-seed0"]),
    (scale, "", "scale-h200-seed1", ["--stem", "scale-h200-seed1"]),
    (teacher_ranking, "", "teacher_ranking", []),
    (lr_basin, "", "lr_basin", []),
    (overhead, "", "overhead", []),
]


@pytest.mark.parametrize(("study", "folder", "stem", "argv"), REPORTS,
                         ids=[f"{f or s.__name__.split('.')[-1]}:{stem}" for s, f, stem, _ in REPORTS])
def test_report_only_rewrites_the_committed_report(tmp_path, study, folder, stem, argv):
    committed = RESULTS / folder
    shutil.copy(committed / f"{stem}.json", tmp_path / f"{stem}.json")
    out = "--output_dir" if study is teacher_ranking else "--out"
    assert study.main(["--report-only", out, str(tmp_path), *argv]) == 0
    assert (tmp_path / f"{stem}.md").read_bytes() == (committed / f"{stem}.md").read_bytes()


def test_report_only_without_a_json_is_one_clear_error(tmp_path):
    for study in (speedup, secant, patience, geometry, overhead):
        with pytest.raises(SystemExit, match="--report-only: no"):
            study.main(["--report-only", "--out", str(tmp_path)])
