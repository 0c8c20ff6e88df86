"""The commands as a careful user meets them, through the real entry point
(``lookahead_opd.integrations.cli.main``): every bad input ends in one line on stderr and status 2 before
any model loads, leaving every earlier file as it was; a re-run never overwrites an earlier
run by accident; a damaged checkpoint is set aside and the run resumes from the one before."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import tiny_qwen2

transformers = pytest.importorskip("transformers")

from lookahead_opd.integrations import cli  # noqa: E402


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    """A tiny student and teacher saved as Hugging Face directories (char tokenizer)."""
    from lookahead_opd.integrations.opd.tokenizer import char_tokenizer

    root = tmp_path_factory.mktemp("models")
    tokenizer = char_tokenizer()
    for name, seed in (("student", 0), ("teacher", 1)):
        tiny_qwen2(len(tokenizer), seed, tokenizer=tokenizer).save_pretrained(root / name)
        tokenizer.save_pretrained(root / name)
    return {"student": str(root / "student"), "teacher": str(root / "teacher")}


def _train_args(models: dict[str, str], output_dir: Path, *extra: str) -> list[str]:
    return ["train", "--student", models["student"], "--teacher", models["teacher"],
            "--output_dir", str(output_dir), "--batch_size", "8", "--max_steps", "4",
            "--eval_every", "0", "--eval_size", "8", "--gate_size", "8", "--max_new_tokens", "4",
            "--learning_rate", "1e-2", "--no_progress", *extra]


def _files(root: Path) -> dict[str, tuple[bytes, int]]:
    """Every file under ``root`` with its bytes and mtime: 'no earlier file changed'."""
    return {str(p.relative_to(root)): (p.read_bytes(), p.stat().st_mtime_ns)
            for p in sorted(root.rglob("*")) if p.is_file()}


def _run(capsys, argv: list[str], status: int) -> str:
    """Run the command; check its status and that stderr is at most 3 lines, no traceback."""
    assert cli.main(argv) == status
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) <= 3, err
    return err


def _earlier(tmp_path: Path) -> Path:
    """A directory with files a failed command must not touch."""
    (tmp_path / "keep").mkdir()
    (tmp_path / "keep" / "notes.txt").write_text("an earlier file\n")
    (tmp_path / "a_file").write_text("not a directory\n")
    return tmp_path


# --------------------------------------------------------------------------- 1. bad input
def test_train_bad_input_one_line_before_loading(tmp_path, capsys, models, monkeypatch):
    from huggingface_hub import constants

    root = _earlier(tmp_path)
    bad_yaml = root / "keep" / "run.yaml"
    bad_yaml.write_text("learning_rate: [1e-3\nbatch_size: 8\n")
    before = _files(root)
    out = root / "out"
    cases = [
        (["--config", str(bad_yaml)], "not valid YAML at line"),
        (["--output_dir", str(root / "a_file")], "is a file"),
        (["--output_dir", str(root / "a_file" / "run")], "is under"),
        (["--device", "cud4"], "device must be a torch device"),
        (["--coefficients", "-1"], "coefficients must be"),  # no --extrapolate: still checked
        (["--learning_rate", "-1e-3"], "learning_rate must be > 0, got -0.001"),  # it parses
        (["--max_steps"], "expected one argument"),
        (["--max_steps", "x"], "invalid int value"),
        (["--no_such_flag", "1"], "unrecognized arguments: --no_such_flag 1"),
    ]
    if not torch.cuda.is_available():
        cases.append((["--device", "cuda"], "use --device cpu"))
    for extra, message in cases:
        err = _run(capsys, _train_args(models, out, *extra), 2)
        assert err.startswith("lookahead-opd train: ") and message in err, (extra, err)
    # A Hub id that is neither here nor in the cache, offline: said at once, no retries.
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    args = _train_args(models, out)
    args[args.index("--student") + 1] = "nobody/no-such-model"
    err = _run(capsys, args, 2)
    assert "'nobody/no-such-model' was not found" in err and "need no network" in err
    assert _files(root) == before and not out.exists()


def test_demo_diagnose_toy_bad_input(tmp_path, capsys):
    root = _earlier(tmp_path)
    before = _files(root)
    cases = [
        (["demo", "--output_dir", str(root / "a_file")], "is a file"),
        (["demo", "--threads", "0"], "threads must be >= 1"),
        (["demo", "--coefficients", "-1"], "coefficients must be"),
        (["demo", "--learning_rate", "-1e-3"], "learning_rate must be > 0"),
        (["demo", "--size", "huge"], "size must be one of"),
        (["demo", "--bogus"], "unrecognized arguments"),
        (["diagnose", "--student", "x", "--teacher", "self:solution", "--device", "cud4"],
         "device must be"),
        (["diagnose", "--student", str(root / "keep"), "--teacher", "self:solution",
          "--output_dir", str(root / "a_file" / "d")], "is under"),
        (["toy", "--lr", "-1e-3"], "lr must be > 0"),
        (["toy", "--steps", "0"], "steps must be >= 1"),
        (["toy", "--steps"], "expected one argument"),
    ]
    for argv, message in cases:
        err = _run(capsys, argv, 2)
        assert err.startswith(f"lookahead-opd {argv[0]}: ") and message in err, (argv, err)
    assert _files(root) == before


def test_a_failure_while_training_keeps_its_traceback(tmp_path, capsys, models, monkeypatch):
    """Status 2 is for input checked explicitly; anything else raises as it is."""
    from lookahead_opd.integrations.opd.trainer import OPDTrainer

    def boom(self):
        raise ValueError("a bug in the middle of training")

    monkeypatch.setattr(OPDTrainer, "train_step", boom)
    with pytest.raises(ValueError, match="a bug in the middle"):
        cli.main(_train_args(models, tmp_path / "run"))


# --------------------------------------------------------------------------- 2. re-runs
@pytest.mark.slow
def test_rerun_refuses_then_resume_or_overwrite(tmp_path, capsys, models):
    out = tmp_path / "run"
    _run(capsys, _train_args(models, out, "--save_every", "2"), 0)
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-4"]
    before = _files(tmp_path)
    err = _run(capsys, _train_args(models, out), 2)
    assert "holds an earlier run" in err and "--resume" in err and "--overwrite_output_dir" in err
    assert _files(tmp_path) == before
    err = _run(capsys, _train_args(models, out, "--resume", "--overwrite_output_dir"), 2)
    assert "contradict" in err and _files(tmp_path) == before

    # Start over with fewer steps than the old run's checkpoints: the old ones are cleared
    # first, and the new run's own newest checkpoint is the one ``latest`` names.
    _run(capsys, _train_args(models, out, "--overwrite_output_dir", "--max_steps", "3",
                             "--save_every", "1"), 0)
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-3"]
    assert (out / "latest").read_text().strip() == "checkpoint-3"
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == [0, 1, 2, 3]

    # --resume continues it.
    _run(capsys, _train_args(models, out, "--resume", "--max_steps", "5", "--save_every", "1"), 0)
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-4", "checkpoint-5"]
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == [0, 1, 2, 3, 4, 5]


def test_pruning_keeps_the_new_checkpoint_among_higher_old_steps(tmp_path):
    """A resumed run can find higher steps than its own (past a damaged checkpoint): pruning
    keeps the checkpoint just written and the newest before it, never by name order."""
    from lookahead_opd.integrations.opd.checkpoint import write_checkpoint

    for step in (2, 4, 30, 40):
        (tmp_path / f"checkpoint-{step}").mkdir()

    class Saved:
        def save_pretrained(self, path):
            (Path(path) / "model.safetensors").write_bytes(b"x")

    class Config:
        def save(self, path):
            Path(path).write_text("{}")

    write_checkpoint(tmp_path, 6, model=Saved(), tokenizer=None, state={}, config=Config())
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == ["checkpoint-4", "checkpoint-6"]
    assert (tmp_path / "latest").read_text().strip() == "checkpoint-6"


# --------------------------------------------------------------------------- 3. damage
@pytest.mark.slow
def test_resume_past_a_truncated_checkpoint(tmp_path, capsys, models):
    out = tmp_path / "run"
    _run(capsys, _train_args(models, out, "--save_every", "2"), 0)
    weights = out / "checkpoint-4" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    truncated = weights.stat().st_size
    kept = _files(out / "checkpoint-2")
    # A fresh process, as a user runs it: the warning goes to stderr through logging's
    # last-resort handler, which pytest's log capture would otherwise replace.
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "lookahead_opd.integrations.cli",
                           *_train_args(models, out, "--resume", "--max_steps", "5")],
                          capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) <= 3 and "Traceback" not in proc.stderr, proc.stderr
    assert any("checkpoint-4 does not load" in line and "corrupt-checkpoint-4" in line
               and "resuming from checkpoint-2" in line for line in lines), proc.stderr
    assert (out / "corrupt-checkpoint-4" / "model.safetensors").stat().st_size == truncated
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-5"]
    assert _files(out / "checkpoint-2") == kept  # loaded, not rewritten
    assert (out / "latest").read_text().strip() == "checkpoint-5"
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == [0, 1, 2, 3, 4, 5]  # steps 3-4 trained again from checkpoint-2


@pytest.mark.slow
def test_zoo_removes_killed_builds_through_the_demo(tmp_path, capsys):
    """The demo (--quick, on the cached pair) removes the work folders of killed zoo builds:
    the process gone or untouched for an hour; a live build's folder stays. It exports the
    models to a stable place and prints it; ``train`` runs on them."""
    pytest.importorskip("matplotlib")
    from lookahead_opd.demo.run import DemoConfig
    from lookahead_opd.demo.zoo import build_pair

    # The demo's pair: shipped with the package, or the default cache's build of it.
    pair = build_pair(teacher_regime=DemoConfig.teacher_regime, progress=False)
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / pair.student_path.parent.name).symlink_to(pair.student_path.parent)
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True).stdout.strip()
    stale = {f".a.tmp-{gone}-x1": False, f".b.tmp-{os.getpid()}-x2": True,  # live: kept
             ".c.tmp-oldrand1": False, ".d.tmp-newrand2": True}  # no pid: by age
    for name in stale:
        (cache / name / "student").mkdir(parents=True)
    old = os.path.getmtime(cache) - 7200
    for p in (cache / ".c.tmp-oldrand1", cache / ".c.tmp-oldrand1" / "student"):
        os.utime(p, (old, old))

    out, models = tmp_path / "demo", tmp_path / "models"
    torch.set_num_threads(2)
    try:
        assert cli.main(["demo", "--quick", "--output_dir", str(out), "--cache_dir", str(cache),
                         "--export_dir", str(models), "--no_progress"]) == 0
        assert torch.get_num_threads() == 1  # the CLIs' default (benchmarks/results/threads.md)
    finally:
        torch.set_num_threads(1)
    printed, err = capsys.readouterr()
    assert "Traceback" not in err and len(err.strip().splitlines()) <= 3, err
    assert {p.name for p in cache.iterdir() if p.name.startswith(".")} == {
        name for name, kept in stale.items() if kept}
    assert f"--student {models / 'student'} --teacher {models / 'teacher'}" in printed
    for role in ("student", "teacher"):
        assert (models / role / "config.json").is_file()
        assert (models / role / "model.safetensors").read_bytes() == (
            pair.student_path.parent / role / "model.safetensors").read_bytes()
    _run(capsys, _train_args({"student": str(models / "student"),
                              "teacher": str(models / "teacher")}, tmp_path / "train"), 0)


# --------------------------------------------------------------------------- 4-6. threads, help
@pytest.fixture
def loading_bars():
    """Model loading bars on for the test, as in a fresh process, and on again after it
    (``--no_progress`` turns them off for the whole process)."""
    from transformers.utils import logging

    logging.enable_progress_bar()
    yield
    logging.enable_progress_bar()


def test_no_progress_silences_every_bar_and_one_thread(tmp_path, capsys, models,
                                                      loading_bars):
    assert cli.main(_train_args(models, tmp_path / "a", "--progress", "true")) == 0
    err = capsys.readouterr().err
    assert "OPD:" in err  # the bars exist ...
    if int(transformers.__version__.split(".")[0]) >= 5:  # 4.x shows no bar for one shard
        assert "Loading weights" in err
    torch.set_num_threads(2)
    try:
        _run(capsys, _train_args(models, tmp_path / "b"), 0)
        assert capsys.readouterr().err == ""  # ... and --no_progress turns every one off
        assert torch.get_num_threads() == 1  # the default --threads
        torch.set_num_threads(2)
        assert cli.main(["toy", "--steps", "2"]) == 0 and torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(1)


def _help_entries(text: str) -> dict[str, str]:
    """``--flag`` -> its help text, from argparse's --help output."""
    entries: dict[str, str] = {}
    key = None
    for line in text.splitlines():
        if line.startswith("  -"):
            head, _, rest = line.strip().partition("  ")
            key = head.split(",")[0].split(" ")[0]
            entries[key] = rest.strip()
        elif key and line.startswith("      "):
            entries[key] = f"{entries[key]} {line.strip()}".strip()
        else:
            key = None
    return entries


@pytest.mark.parametrize("command", ["train", "demo", "diagnose"])
def test_negated_flags_say_what_they_do(command, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main([command, "--help"])
    assert exit_.value.code == 0
    entries = _help_entries(capsys.readouterr().out)
    negated = [flag for flag in entries if flag.startswith("--no_")]
    assert "--no_progress" in negated
    for flag in negated:
        positive = entries["--" + flag[len("--no_"):]]
        assert entries[flag] and entries[flag] != positive and "default" not in entries[flag]


def test_an_optional_flag_takes_none_and_other_words_stay_errors():
    from lookahead_opd.integrations.cli import UsageError
    from lookahead_opd.integrations.cli_support import parse_dataclass
    from lookahead_opd.integrations.opd.config import OPDConfig

    default = parse_dataclass(OPDConfig, [], prog="train")
    assert default.patience is not None and default.max_grad_norm is not None
    off = parse_dataclass(OPDConfig, ["--patience", "none", "--max_grad_norm", "None"],
                          prog="train")
    assert off.patience is None and off.max_grad_norm is None
    assert parse_dataclass(OPDConfig, ["--patience", "2"], prog="train").patience == 2
    with pytest.raises(UsageError, match="invalid int value: 'never'"):
        parse_dataclass(OPDConfig, ["--patience", "never"], prog="train")
    with pytest.raises(UsageError, match="invalid float value: 'none'"):  # not optional
        parse_dataclass(OPDConfig, ["--learning_rate", "none"], prog="train")


def test_local_start_in_help_and_readme(capsys):
    from lookahead_opd.integrations.opd.train import LOCAL_START

    with pytest.raises(SystemExit):
        cli.main(["train", "--help"])
    shown = capsys.readouterr().out
    command = [line.strip() for line in LOCAL_START.splitlines()
               if line.strip().startswith(("lookahead-opd train", "--"))][:3]
    readme = (Path(__file__).parents[2] / "README.md").read_text()
    assert command[0].startswith("lookahead-opd train --student runs/demo/models/student")
    for line in command:
        assert line in shown and line in readme, line
    assert "--resume" in readme and "--overwrite_output_dir" in readme
