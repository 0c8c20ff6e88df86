"""The OPD loop on two gloo processes: one decision, identical weights, split work."""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("transformers")

import _dist_workers as w  # noqa: E402
from _opd_workers import opd_worker  # noqa: E402

# slow: every test here launches two processes, or reads a module fixture that did.
pytestmark = [pytest.mark.skipif(not dist.is_available(), reason="torch.distributed unavailable"),
              pytest.mark.slow]


@pytest.mark.parametrize("extrapolate", [False, True])
def test_opd_ranks_stay_identical_and_split_the_work(tmp_path, extrapolate):
    out = tmp_path / "run"
    r0, r1 = w.launch(opd_worker, tmp_path, str(out), extrapolate)
    for k, v in r0["params"].items():
        assert torch.equal(v, r1["params"][k]), k  # broadcast at start, summed gradients after
    assert r0["losses"] == r1["losses"] and r0["evals"] == r1["evals"]
    assert r0["gate_size"] == r1["gate_size"] == 4  # each rank scores half of the 8-problem gate
    assert not set(r0["prompts"]) & set(r1["prompts"])  # each rank its half of the batch
    assert len(r0["prompts"]) == len(r1["prompts"]) == 4
    if extrapolate:
        assert [h["step"] for h in r0["history"]] == [1, 2, 4]
        same = ("score_before", "coefficients", "scores", "accepted", "n_evals")
        for a, b in zip(r0["history"], r1["history"], strict=True):  # the reduced gate scores
            assert {k: a[k] for k in same} == {k: b[k] for k in same}
    # Rank 0 alone writes the log and the checkpoints.
    steps = [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == [0, 1, 2, 3, 4]
    assert (out / "latest").read_text().strip() == "checkpoint-4"
