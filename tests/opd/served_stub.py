"""A stand-in for vLLM's OpenAI-compatible server, for the faults a real one won't produce on
demand: slow answers, 500s, 400s, wrong lengths, garbage. On 127.0.0.1 at a free port, in a
daemon thread; every test stops it.

A well-behaved answer scores position t of the prompt (t >= 1) as ``expected_logprob(ids, t)``
and lists ``top_k`` more tokens below it, in vLLM's ``prompt_logprobs`` layout.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from collections import deque
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

MODEL = "stub-teacher"
MAX_MODEL_LEN = 64


def expected_logprob(ids: list[int], t: int) -> float:
    """The stub's log-probability of ``ids[t]`` after ``ids[:t]`` (depends on both)."""
    return -0.1 * (ids[t] % 7) - 0.01 * t - 0.001 * (ids[t - 1] % 5)


def _positions(ids: list[int], top_k: int) -> list:
    out: list = [None]
    for t in range(1, len(ids)):
        lp = expected_logprob(ids, t)
        entry = {str(ids[t]): {"logprob": lp, "rank": 1 + top_k, "decoded_token": str(ids[t])}}
        for r in range(top_k):  # more likely tokens than the one there, ids above the probe's
            entry[str(1000 + r)] = {"logprob": lp + (top_k - r) * 0.05, "rank": r + 1,
                                    "decoded_token": str(1000 + r)}
        out.append(entry)
    return out


class _Server(ThreadingHTTPServer):
    """A client that hangs up mid-answer (a run that stopped on a failure closes its pool) is
    not the stub's error: no traceback on the test's stderr for it."""

    daemon_threads = True

    def handle_error(self, request, client_address) -> None:
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)


class StubServer:
    """``actions`` holds what the next ``/v1/completions`` requests get, one each, popped in
    order (``"ok"`` once it is empty): ``"ok"``, ``"slow"`` (sleeps ``slow_s`` first), an int
    status (answered with that HTTP status), ``"short"`` (one position missing), ``"garbage"``
    (not JSON). ``requests`` counts them; ``max_logprobs`` refuses larger ``prompt_logprobs``
    with vLLM's 400 text."""

    def __init__(self, *, model: str = MODEL, max_logprobs: int = 20, slow_s: float = 1.0,
                 decode=str) -> None:
        self.actions: deque = deque()
        self.requests = 0
        self.concurrent = 0
        self.max_concurrent = 0
        self.model, self.max_logprobs, self.slow_s, self.decode = model, max_logprobs, slow_s, decode
        self._lock = threading.Lock()
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet
                pass

            def _send(self, status: int, payload: bytes | object) -> None:
                body = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self):
                if self.path == "/health":
                    self._send(200, b"")
                elif self.path == "/v1/models":
                    self._send(200, {"data": [{"id": stub.model, "max_model_len": MAX_MODEL_LEN}]})
                else:
                    self._send(404, {"error": "not found"})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with stub._lock:
                    stub.requests += 1
                    stub.concurrent += 1
                    stub.max_concurrent = max(stub.max_concurrent, stub.concurrent)
                    action = stub.actions.popleft() if stub.actions else "ok"
                try:
                    status, payload = self._answer(body, action)
                finally:  # before the answer goes out: the client may send its next at once
                    with stub._lock:
                        stub.concurrent -= 1
                self._send(status, payload)

            def _answer(self, body, action):
                ids, k = body["prompt"], body["prompt_logprobs"]
                if action == "slow":
                    time.sleep(stub.slow_s)
                elif isinstance(action, int):
                    return action, {"error": {"message": f"stub status {action}"}}
                elif action == "garbage":
                    return 200, b"<html>not json"
                if k > stub.max_logprobs:
                    return 400, {"error": {"message": f"Requested prompt logprobs of {k}, which "
                                           f"is greater than max allowed: {stub.max_logprobs}"}}
                positions = _positions(ids, k)
                for entry in positions[1:]:
                    for v in entry.values():
                        v["decoded_token"] = stub.decode(int(v["decoded_token"]))
                if action == "short":
                    positions = positions[:-1]
                return 200, {"choices": [{"index": 0, "text": "x", "prompt_logprobs": positions}]}

        self.server = _Server(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
