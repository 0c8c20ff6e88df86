"""Where the OPD loop's per-step metrics go: ``metrics.jsonl`` always, plus TensorBoard
and/or Weights & Biases (``report_to``). Only rank 0 writes; every rank gets the same dicts."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["MetricsLog"]


class MetricsLog:
    """Appends each metrics dict to ``output_dir/metrics.jsonl`` and the ``report_to`` writers.

    Disabled (``enabled=False``, every rank but 0) it writes nothing. The writers are opened
    here, so a missing TensorBoard or W&B fails before any training."""

    def __init__(self, output_dir: Path, report_to: list[str], *, run_config: dict[str, Any],
                 enabled: bool = True) -> None:
        self.path = output_dir / "metrics.jsonl"
        self.enabled = enabled
        self.writers: list[_Writer] = []
        for name in report_to if enabled else []:
            try:
                self.writers.append(_TensorBoard(output_dir / "tb") if name == "tensorboard"
                                    else _WandB(run_config, output_dir))
            except ImportError as err:
                raise ValueError(f"report_to={name} needs {err.name}: pip install {err.name}") from err

    def start_at(self, step: int) -> None:
        """Drop the JSON lines past ``step`` (a resumed run), or all of them at step 0, so the
        log has no duplicated steps."""
        if not self.enabled or not self.path.exists():
            return
        if step == 0:
            self.path.unlink()
            return
        keep = [line for line in self.path.read_text().splitlines()
                if line and json.loads(line)["step"] <= step]
        self.path.write_text("".join(line + "\n" for line in keep))

    def log(self, m: dict[str, Any]) -> None:
        if not self.enabled:
            return
        with self.path.open("a") as f:
            f.write(json.dumps(m) + "\n")
        for w in self.writers:
            w.log(m)

    def flush(self) -> None:
        for w in self.writers:
            w.flush()


class _Writer:
    def log(self, m: dict[str, Any]) -> None: ...
    def flush(self) -> None: ...


class _TensorBoard(_Writer):
    def __init__(self, logdir: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.w = SummaryWriter(str(logdir))

    def log(self, m: dict[str, Any]) -> None:
        for k, v in m.items():
            if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "step":
                self.w.add_scalar(k, v, m["step"])

    def flush(self) -> None:
        self.w.flush()


class _WandB(_Writer):
    def __init__(self, run_config: dict[str, Any], output_dir: Path) -> None:
        import wandb

        self.run = wandb.init(config=run_config, dir=str(output_dir))

    def log(self, m: dict[str, Any]) -> None:
        self.run.log({k: v for k, v in m.items() if k != "jump"}, step=m["step"])
