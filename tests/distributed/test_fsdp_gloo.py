"""The OPD loop with ``fsdp=True`` on two gloo processes: the sharded step is the
single-process step, four sharded steps are the replicated path's, resume is bitwise, every
rank decides alike and holds half the state; engines see the full weights.

The workers (``_fsdp_workers``) train and record; the asserting happens here.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("transformers")

import _dist_workers as w  # noqa: E402
import _fsdp_workers as fw  # noqa: E402

# slow: every test here launches two processes, or reads a module fixture that did.
pytestmark = [pytest.mark.skipif(not dist.is_available(), reason="torch.distributed unavailable"),
              pytest.mark.slow]

DECISION = ("step", "coefficients", "accepted", "n_evals")


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> list[dict]:
    tmp = tmp_path_factory.mktemp("fsdp_opd")
    return w.launch(fw.opd_worker, tmp, str(tmp))


@pytest.fixture(scope="module")
def single(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("fsdp_single")
    return {"one_step": fw.single_process_run(tmp / "one", **fw.ONE_STEP),
            "effopd": fw.single_process_run(tmp / "effopd", max_steps=1, extrapolate=True),
            "dense": fw.single_process_run(tmp / "dense", **fw.CHUNKED, loss_chunk_size=0)}


def _close(a: dict, b: dict, **tol) -> None:
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], msg=k, **tol)


def test_one_sharded_step_is_the_single_process_step(runs, single):
    ref = single["one_step"]
    for r in runs:
        one = r["one_step"]
        _close(one["params"], ref["params"], rtol=1e-5, atol=1e-7)
        assert one["losses"] == pytest.approx(ref["losses"], rel=1e-5)
        assert one["grad_norms"] == pytest.approx(ref["grad_norms"], rel=1e-5)
    # The step moved the weights by far more than the tolerance: the comparison shows something.
    init = fw.models(fw.tokenizer())[0].state_dict()
    moved = max(float((ref["params"][k] - init[k]).abs().max()) for k in ref["params"])
    assert moved > 1e-3


def test_four_sharded_steps_match_the_replicated_path(runs):
    for r in runs:
        rep, sh = r["replicated"], r["sharded"]
        # AdamW (see ONE_STEP) and a c = 4 jump amplify summation-order differences in
        # near-zero gradients: 1e-4 is 1% of one step's update (lr 1e-2).
        _close(sh["params"], rep["params"], rtol=1e-5, atol=1e-4)
        assert sh["losses"] == pytest.approx(rep["losses"], rel=1e-5)
        assert [{k: h[k] for k in DECISION} for h in sh["history"]] == [
            {k: h[k] for k in DECISION} for h in rep["history"]]
        # ‖Δ‖ is the whole update's, not the local shard's.
        assert [h["direction_norm"] for h in sh["history"]] == pytest.approx(
            [h["direction_norm"] for h in rep["history"]], rel=1e-4)
    assert [h["step"] for h in runs[0]["sharded"]["history"]] == [1, 2, 4]


def test_every_rank_takes_the_same_decisions(runs):
    def decisions(history: list[dict]) -> list[dict]:
        return [{k: v for k, v in h.items() if k != "seconds"} for h in history]

    for name in ("sharded", "resumed"):
        a, b = (r[name] for r in runs)
        assert decisions(a["history"]) == decisions(b["history"])  # scores bit for bit too
        for k in a["params"]:
            assert torch.equal(a["params"][k], b["params"][k]), (name, k)
    assert all(h["coefficients"] for h in runs[0]["sharded"]["history"])  # candidates were scored


def test_resume_is_bitwise(runs):
    for r in runs:
        full, resumed = r["sharded"], r["resumed"]
        for k in full["params"]:
            assert torch.equal(full["params"][k], resumed["params"][k]), k
        assert resumed["losses"] == full["losses"][2:]  # the two steps run after the resume
        assert [h["step"] for h in resumed["history"]] == [1, 2, 4]  # restored, then step 4
        assert resumed["history"][-1]["scores"] == full["history"][-1]["scores"]


def test_each_rank_holds_its_share_of_the_state(runs, single):
    ref = sum(single["effopd"]["bytes"].values())
    assert single["effopd"]["bytes"]["anchor"] > 0
    for r in runs:
        mine = sum(r["sharded"]["bytes"].values())
        # The secant sketch (k + 1 float64) is the same whole vector on every rank.
        sketch = r["sharded"]["bytes"]["sketch"]
        assert sketch == single["effopd"]["bytes"]["sketch"] > 0
        assert mine - sketch <= (1 / w.WORLD_SIZE + 0.05) * (ref - sketch), (
            r["sharded"]["bytes"], single["effopd"]["bytes"])


def test_sharded_teacher_and_mixed_precision(runs, single):
    for r in runs:
        assert r["sharded_teacher"]["teacher_sharded"]
        assert not r["one_step"]["teacher_sharded"]
        # Sharding the teacher changes where it lives, not what it computes.
        _close(r["sharded_teacher"]["params"], single["one_step"]["params"], rtol=1e-5, atol=1e-7)
    a, b = (r["bf16"] for r in runs)
    assert all(torch.isfinite(torch.tensor(x)) for x in a["losses"])
    assert a["losses"] == b["losses"]
    for k in a["params"]:
        assert a["params"][k].dtype == torch.float32  # the shards keep --dtype
        assert torch.equal(a["params"][k], b["params"][k])
    # Computing in bf16 is not computing in fp32: the losses differ, slightly.
    fp32 = runs[0]["sharded"]["losses"][0]
    assert a["losses"][0] != fp32 and a["losses"][0] == pytest.approx(fp32, rel=0.05)


def test_fsdp_without_a_process_group_is_one_line(tmp_path, capsys):
    with pytest.raises(ValueError, match="torchrun") as err:
        fw.trainer(fw.config(tmp_path, fsdp=True), 0, "fixed")
    assert "\n" not in str(err.value)
    # The CLI says so in one line, before loading any model.
    from lookahead_opd.integrations.opd.train import main

    tok = fw.tokenizer()
    model_dir = tmp_path / "model"
    fw.models(tok)[0].save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    capsys.readouterr()  # drop save_pretrained's progress bar
    assert main(["--student", str(model_dir), "--teacher", str(model_dir), "--fsdp",
                 "--output_dir", str(tmp_path / "run")]) == 2
    err_lines = capsys.readouterr().err.strip().splitlines()
    assert len(err_lines) == 1 and "fsdp needs a torch.distributed process group" in err_lines[0]


def test_engines_get_full_weights_block_by_block_and_ranks_generate_in_step(tmp_path):
    r0, r1 = w.launch(fw.engines_worker, tmp_path)
    tok = fw.tokenizer()
    full = fw.tiny_qwen2(len(tok), 7, tokenizer=tok)
    expected = dict(full.named_parameters())
    for r in (r0, r1):
        assert r["num_pushes"] == 1
        assert r["received"].keys() == expected.keys()
        for k, t in expected.items():
            assert torch.equal(r["received"][k], t.detach()), k
        # At no point did the push hold more gathered bytes than one decoder block's.
        total = sum(t.numel() * t.element_size() for t in expected.values())
        assert r["peak_alive"] <= max(max(r["block_bytes"]), max(
            t.numel() * t.element_size() for t in expected.values()))
        assert r["peak_alive"] < total / 2
    # Rank 0 ran one prompt, rank 1 three (batches of one): both finished, and each greedy
    # completion is what the unsharded model generates.
    from lookahead_opd.integrations.opd.engines import HFEngine

    for r in (r0, r1):
        ref = HFEngine(full, tok).generate(r["prompts"], max_new_tokens=5, temperature=0.0)
        assert r["texts"] == ref.texts
    assert len(r0["texts"]) == 1 and len(r1["texts"]) == 3


def test_cli_under_torchrun_trains_checkpoints_and_resumes_sharded(tmp_path):
    """``lookahead-opd train --fsdp`` as a user runs it: two torchrun processes load the
    models on the CPU, shard student and teacher, checkpoint through DCP, and resume."""
    import json
    import os
    import subprocess
    import sys

    tok = fw.tokenizer()
    student, teacher = fw.models(tok)
    for name, model in (("student", student), ("teacher", teacher)):
        model.save_pretrained(tmp_path / name)
        tok.save_pretrained(tmp_path / name)
    out = tmp_path / "run"

    def train(*extra: str) -> None:
        args = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc-per-node", "2", "-m", "lookahead_opd.integrations.cli", "train",
                "--student", str(tmp_path / "student"), "--teacher", str(tmp_path / "teacher"),
                "--fsdp", "--fsdp_teacher", "shard", "--extrapolate", "--gate", "neg_kl",
                "--batch_size", "8", "--gate_size", "4", "--eval_size", "4", "--max_new_tokens",
                "4", "--learning_rate", "1e-2", "--save_every", "1", "--eval_every", "0",
                "--progress", "false", "--output_dir", str(out), *extra]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        proc = subprocess.run(args, env=env, capture_output=True, text=True, timeout=300,
                              check=False)
        assert proc.returncode == 0, proc.stderr[-4000:]

    train("--max_steps", "2")
    train("--max_steps", "3", "--resume")
    steps = [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == [0, 1, 2, 3]
    last = out / (out / "latest").read_text().strip()
    assert last.name == "checkpoint-3"
    assert (last / "dcp").is_dir() and (last / "rank0.pt").is_file() and (last / "rank1.pt").is_file()
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-3"]


def test_the_chunked_loss_and_gate_under_fsdp_are_the_dense_single_process_step(runs, single):
    """``--loss_chunk_size`` with a sharded student and teacher: the lm_head gathered after the
    root's forward, its gradient summed back onto the shards, the gate's -KL chunked too."""
    ref = single["dense"]
    for r in runs:
        one = r["chunked"]
        _close(one["params"], ref["params"], rtol=1e-5, atol=1e-7)
        assert one["losses"] == pytest.approx(ref["losses"], rel=1e-5)
        assert one["grad_norms"] == pytest.approx(ref["grad_norms"], rel=1e-5)
        assert one["history"] and one["history"][0]["coefficients"]  # the -KL gate scored
    moved = max(float((ref["params"][k] - fw.models(fw.tokenizer())[0].state_dict()[k]).abs().max())
                for k in ref["params"] if k.startswith("lm_head"))
    assert moved > 1e-4  # the lm_head's own gradient reached it
