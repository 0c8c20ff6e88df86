"""The runnable examples in examples/ run, as scripts, and do what their docstrings say."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
POWERS = [1, 2, 4, 8, 16]  # --steps 16
# The examples' lr (3e-3) is one where the default search keeps no jump; a third of it is one
# where its step-1 ladder stays near linear, so the tests of the jumps' plumbing run there.
SMALL_LR = "1e-3"


def _run(args: list[str], timeout: float = 120) -> list[dict]:
    """Run a command from the repository root; the JSON lines it printed."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(
        args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout, check=False
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = []
    for line in proc.stdout.splitlines():
        if line.startswith("{"):
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:  # a Trainer's printed log dict
                continue
    return out


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_raw_loop_script_jumps_and_beats_the_baseline():
    def run(*flags: str) -> dict:
        (r,) = _run([sys.executable, "examples/raw_loop.py", "--steps", "16", "--json", *flags])
        return r

    wrapped, plain = run("--lr", SMALL_LR), run("--lr", SMALL_LR, "--no-extrapolation")
    assert wrapped["searches"] == POWERS  # optimizer steps, with 2 micro-batches each
    assert any(c is not None for c in wrapped["accepted"])
    assert wrapped["lr"] == pytest.approx(0.0, abs=1e-12)  # the cosine schedule ran out
    assert plain["searches"] == [] and plain["gate_loss_before"] == wrapped["gate_loss_before"]
    assert wrapped["gate_loss_after"] < plain["gate_loss_after"] < plain["gate_loss_before"]
    # At the example's own lr the ladders bend: nothing is kept, and the run is the plain one.
    wrapped, plain = run(), run("--no-extrapolation")
    assert wrapped["accepted"] and all(c is None for c in wrapped["accepted"])
    assert wrapped["checksum"] == plain["checksum"]


def test_raw_loop_resume_continues_exactly(tmp_path):
    raw_loop = _load("raw_loop")
    ckpt = str(tmp_path / "ckpt.pt")
    full = raw_loop.train(16, lr=float(SMALL_LR), save_at=6, checkpoint=ckpt)
    resumed = raw_loop.train(16, lr=float(SMALL_LR), resume=ckpt)
    assert resumed["searches"] == full["searches"] == POWERS
    assert resumed["accepted"] == full["accepted"]
    assert None in full["accepted"] and any(c is not None for c in full["accepted"])
    assert resumed["checksum"] == full["checksum"]
    assert resumed["gate_loss_after"] == full["gate_loss_after"]


@pytest.mark.slow
def test_accelerate_loop_script_one_process(tmp_path):
    save = tmp_path / "state"
    (r,) = _run(
        [
            sys.executable,
            "examples/accelerate_loop.py",
            "--cpu",
            "--steps",
            "16",
            "--lr",
            SMALL_LR,
            "--json",
            "--save-dir",
            str(save),
        ]
    )
    assert r["processes"] == 1
    assert r["wrapped"] == "AcceleratedOptimizer(ExtrapolatingOptimizer)"
    assert r["searches"] == POWERS
    assert any(c is not None for c in r["accepted"])
    assert r["gate_loss_after"] < r["gate_loss_before"]
    saved = torch.load(save / "optimizer.bin", weights_only=True)
    assert saved["extrapolator"]["step_count"] == 16
    assert [h["step"] for h in saved["extrapolator"]["history"]] == POWERS


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("torchrun") is None, reason="torchrun not on PATH")
def test_accelerate_loop_script_two_processes_decide_together(tmp_path):
    _run(
        [
            "torchrun",
            "--standalone",
            "--nproc-per-node",
            "2",
            "examples/accelerate_loop.py",
            "--cpu",
            "--steps",
            "16",
            "--lr",
            SMALL_LR,
            "--out",
            str(tmp_path),
        ],
        timeout=240,
    )
    results = [json.loads((tmp_path / f"result-{r}.json").read_text()) for r in range(2)]
    assert sorted(r["process"] for r in results) == [0, 1]
    a, b = results
    assert a["processes"] == b["processes"] == 2
    assert a["searches"] == b["searches"] == POWERS
    assert a["accepted"] == b["accepted"] and any(c is not None for c in a["accepted"])
    assert a["scores"] == b["scores"]  # the averaged gate scores, the same on both ranks
    assert a["params"] == b["params"]  # bit-identical replicas after the jumps


def _doc_blocks() -> list[str]:
    """The python blocks of docs/integrations.md that say they are complete examples."""
    text = (ROOT / "docs" / "integrations.md").read_text()
    blocks = [b.split("```", 1)[0] for b in text.split("```python\n")[1:]]
    return [b for b in blocks if b.startswith("# complete example")]


@pytest.mark.slow
def test_docs_complete_examples_run(tmp_path):
    blocks = _doc_blocks()
    assert len(blocks) == 3  # raw loop, Trainer, Lightning
    for i, block in enumerate(blocks):
        script = tmp_path / f"block{i}.py"
        script.write_text(block.replace('"/tmp/', f'"{tmp_path}/'))
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        proc = subprocess.run(
            [sys.executable, str(script)],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=180,
            check=False,
        )
        assert proc.returncode == 0, (block[:200], proc.stderr[-3000:])
        # Every block ends by printing its (step, accepted) pairs: powers of two.
        steps = [s for s, _ in eval(proc.stdout.strip().splitlines()[-1])]  # noqa: S307
        assert steps and steps == [2**k for k in range(len(steps))], steps


@pytest.mark.slow
def test_trl_distillation_example(tmp_path):
    # Not imported here: the subprocess does it (trl>=1.16 from the dev extra has the trainer).
    if importlib.util.find_spec("trl") is None:
        pytest.skip("trl is not installed")
    (r,) = _run([sys.executable, "examples/trl_distillation.py", str(tmp_path / "out")])
    # Every search reaches the trainer's log; three refused ones in a row end the searching
    # (the default patience), so the steps are powers of two up to the last.
    assert r["searches"] == r["logged"] and r["searches"] == [1, 2, 4, 8][:len(r["searches"])]
    assert len(r["searches"]) >= 3 and r["accepted"][-3:] == [None] * 3
    assert r["agreement_after"] > r["agreement_before"]
