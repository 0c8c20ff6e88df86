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


def _run(args: list[str], timeout: float = 120) -> list[dict]:
    """Run a command from the repository root; the JSON lines it printed."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(
        args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout, check=False
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_raw_loop_script_jumps_and_beats_the_baseline():
    (wrapped,) = _run([sys.executable, "examples/raw_loop.py", "--steps", "16", "--json"])
    (plain,) = _run(
        [sys.executable, "examples/raw_loop.py", "--steps", "16", "--json", "--no-extrapolation"]
    )
    assert wrapped["searches"] == POWERS  # optimizer steps, with 2 micro-batches each
    assert any(c is not None for c in wrapped["accepted"])
    assert wrapped["lr"] == pytest.approx(0.0, abs=1e-12)  # the cosine schedule ran out
    assert plain["searches"] == [] and plain["gate_loss_before"] == wrapped["gate_loss_before"]
    assert wrapped["gate_loss_after"] < plain["gate_loss_after"] < plain["gate_loss_before"]


def test_raw_loop_resume_continues_exactly(tmp_path):
    raw_loop = _load("raw_loop")
    ckpt = str(tmp_path / "ckpt.pt")
    full = raw_loop.train(16, save_at=6, checkpoint=ckpt)
    resumed = raw_loop.train(16, resume=ckpt)
    assert resumed["searches"] == full["searches"] == POWERS
    assert resumed["accepted"] == full["accepted"]
    assert resumed["checksum"] == full["checksum"]
    assert resumed["gate_loss_after"] == full["gate_loss_after"]


def test_accelerate_loop_script_one_process(tmp_path):
    save = tmp_path / "state"
    (r,) = _run(
        [
            sys.executable,
            "examples/accelerate_loop.py",
            "--cpu",
            "--steps",
            "16",
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


@pytest.mark.skipif(shutil.which("torchrun") is None, reason="torchrun not on PATH")
def test_accelerate_loop_script_two_processes_decide_together():
    results = _run(
        [
            "torchrun",
            "--nproc-per-node",
            "2",
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            "localhost:0",
            "examples/accelerate_loop.py",
            "--cpu",
            "--steps",
            "16",
            "--json",
        ],
        timeout=240,
    )
    assert sorted(r["process"] for r in results) == [0, 1]
    a, b = results
    assert a["processes"] == b["processes"] == 2
    assert a["searches"] == b["searches"] == POWERS
    assert a["accepted"] == b["accepted"] and any(c is not None for c in a["accepted"])
    assert a["scores"] == b["scores"]  # the averaged gate scores, the same on both ranks
    assert a["params"] == b["params"]  # bit-identical replicas after the jumps
