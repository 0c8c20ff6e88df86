"""`benchmarks/loss_memory.py`: its three methods compute one loss; the memory guard."""

from __future__ import annotations

import pytest

pytest.importorskip("trl")

from benchmarks import loss_memory  # noqa: E402


@pytest.mark.slow
def test_dense_chunked_and_trl_give_the_same_loss_and_gradients(monkeypatch):
    monkeypatch.setitem(loss_memory.SHAPES, "tiny", (8, 50))
    runs = [loss_memory.run_one(m, "tiny", 37, chunk=5) for m in loss_memory.METHODS]
    dense = runs[0]
    assert dense["loss"] > 0.1  # a divergence that is not trivially zero
    for r in runs[1:]:
        for k in ("loss", "grad_hidden_norm", "grad_weight_norm"):
            assert r[k] == pytest.approx(dense[k], rel=1e-4), (r["method"], k)


def test_expected_peaks_follow_each_method_own_growth():
    def run(method, tokens, peak):
        return {"method": method, "shape": "qwen2.5", "tokens": tokens, "vocab": 151936,
                "loss_peak_bytes": peak, "measured": True}

    done = {"a": run("dense", 1024, 1024 * 151936 * 46.0), "b": run("chunked", 1024, 1.3e9),
            "c": run("chunked", 2048, 1.4e9)}
    # dense: bytes per logit; chunked: the line through its two largest sizes.
    assert loss_memory._expected_bytes(done, "dense", "qwen2.5", 4096) == pytest.approx(
        4096 * 151936 * 46.0)
    assert loss_memory._expected_bytes(done, "chunked", "qwen2.5", 4096) == pytest.approx(1.6e9)
    assert loss_memory._expected_bytes(done, "trl", "qwen2.5", 4096) is None
