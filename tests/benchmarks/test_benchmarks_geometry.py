"""benchmarks/geometry.py --smoke: the whole pipeline (two real OPDTrainer runs, checkpoints,
analyses, report, plots) on fresh tiny models, with the invariants its numbers must satisfy."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("matplotlib")

ROOT = Path(__file__).resolve().parents[2]


def _load_benchmark():
    path = ROOT / "benchmarks" / "geometry.py"
    spec = importlib.util.spec_from_file_location("bench_geometry", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    out = tmp_path_factory.mktemp("geometry")
    assert _load_benchmark().main(["--smoke", "--out", str(out)]) == 0
    return out, json.loads((out / "geometry-smoke.json").read_text())


@pytest.mark.slow
@pytest.mark.slow
def test_files_written(quick):
    out, _ = quick
    for name in ("geometry-smoke.json", "geometry-smoke.md", "geometry-smoke_alignment.png",
                 "geometry-smoke_norms.png", "geometry-smoke_rescale.png"):
        assert (out / name).is_file() and (out / name).stat().st_size > 0, name
    md = (out / "geometry-smoke.md").read_text()
    for heading in ("Table 1", "Subspace alignment", "Update norms by module",
                    "Early checkpoints rescaled", "## Reading"):
        assert heading in md


@pytest.mark.slow
def test_both_methods_ran_and_moved(quick):
    _, r = quick
    assert set(r["runs"]) == {"opd", "rl"}
    assert r["runs"]["opd"]["config"]["loss"] == "reverse_kl"
    assert r["runs"]["rl"]["config"]["loss"] == "drgrpo"
    assert r["runs"]["rl"]["config"]["num_samples"] >= 2
    for run in r["runs"].values():
        assert 0 < run["relative_update"] < 1  # a real, small update
        assert [p["step"] for p in run["curve"]][0] == 0
        assert run["curve"][-1]["step"] == r["config"]["steps"]
        for p in run["curve"]:
            assert 0.0 <= p["accuracy"] <= 1.0
            assert math.isfinite(p["reverse_kl"]) and p["reverse_kl"] >= -1e-6


@pytest.mark.slow
def test_spectral_metrics_in_range(quick):
    _, r = quick
    for run in [*r["runs"].values(), r["random_reference"]]:
        for group in ("all", "attn", "mlp"):
            m = run["spectral"][group]
            assert m["n_matrices"] > 0
            assert 0 < m["spectral_ratio"] <= 1 + 1e-9
            assert m["effective_rank"] >= 1 - 1e-9
            assert 0 < m["effective_rank_fraction"] <= 1 + 1e-9
            # rank <= 64 here, so the top 1% is one direction: the ratio is σ1/‖ΔW‖F
            assert m["top1pct_ratio"] == pytest.approx(m["spectral_ratio"], rel=1e-9)
            assert m["top1pct_ratio"] <= m["top10pct_ratio"] + 1e-9 <= 1 + 2e-9
    for run in r["runs"].values():
        assert run["spectral"]["all"]["sigma1"] > 0
        shapes = run["block_shapes"].values()
        assert len(shapes) == run["spectral"]["all"]["n_matrices"]
        assert run["spectral"]["all"]["effective_rank"] <= max(min(s) for s in shapes)


@pytest.mark.slow
def test_alignment_in_range_and_exact_at_the_end(quick):
    _, r = quick
    for run in r["runs"].values():
        steps = [a["step"] for a in run["alignment"]]
        assert steps == sorted(steps) and steps[-1] == r["config"]["steps"]
        for a in run["alignment"]:
            for key in ("all", "attn", "mlp"):
                assert 0.0 <= a[key] <= 1.0 + 1e-6
            assert -1.0 - 1e-6 <= a["cos_flat"] <= 1.0 + 1e-6
        last = run["alignment"][-1]  # the final update against itself
        assert last["all"] == pytest.approx(1.0, abs=1e-4)
        assert last["cos_flat"] == pytest.approx(1.0, abs=1e-5)
    gaussian = r["random_reference"]["alignment"]["all"]
    assert 0 < gaussian < 0.5  # independent noise: far from aligned


@pytest.mark.slow
def test_norms_by_layer(quick):
    _, r = quick
    for run in r["runs"].values():
        n = run["norms"]
        assert {"layer0.attn", "layer0.mlp", "layer1.attn", "layer1.mlp"} <= set(n["norms"])
        assert all(v >= 0 for v in n["norms"].values())
        assert sum(n["share"].values()) == pytest.approx(1.0, rel=1e-9)
        assert math.sqrt(sum(v * v for v in n["norms"].values())) == pytest.approx(n["total"])


@pytest.mark.slow
def test_rescaled_checkpoints_match_the_final_norm(quick):
    _, r = quick
    betas = r["config"]["beta_values"]
    for run in r["runs"].values():
        assert [x["fraction"] for x in run["rescale"]] == r["config"]["early_fractions"]
        for x in run["rescale"]:
            assert x["beta"] == 1.0
            assert x["norm_ratio_to_final"] == pytest.approx(1.0, rel=1e-5)
            assert 0 < x["norm_ratio_before"] < 1.5
            assert 0.0 <= x["accuracy"] <= 1.0
        sweep = run["beta_sweep"]
        assert [x["beta"] for x in sweep] == betas
        ratios = [x["norm_ratio_to_final"] for x in sweep]
        zero = sweep[betas.index(0.0)]
        # β moves the norm linearly from the early one (β = 0) to the final one (β = 1)
        grows = zero["norm_ratio_before"] < 1
        assert ratios == sorted(ratios, reverse=not grows)
        assert zero["norm_ratio_to_final"] == pytest.approx(zero["norm_ratio_before"])
        raw = next(p for p in run["curve"] if p["step"] == zero["step"])
        assert zero["accuracy"] == raw["accuracy"]  # β = 0 is the checkpoint as is
