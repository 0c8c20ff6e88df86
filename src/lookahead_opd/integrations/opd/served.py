"""A teacher behind vLLM's OpenAI-compatible server: the HTTP client and the checks run before
step 0.

``TeacherClient.score`` sends each sequence's token ids (prompt + completion, no padding) to
``/v1/completions`` with ``max_tokens=1`` and ``prompt_logprobs=k`` — what TRL's async
distillation and verl send — and reads back each position's log-probability of the token that
is there (``k=0``: that token only) and, for ``k > 0``, the top-k. Standard library only
(``http.client`` and a thread pool), so the core extras stay as they are.

Failure is never silent and never a hang: every request has a timeout; connection errors,
timeouts, HTTP 429 and 5xx are retried with exponential backoff (a 4xx is the request's fault
and is not); once retries are spent, or when a response does not parse or its lengths differ
from what was sent, one ``TeacherServerError`` line names the server and the step.
"""

from __future__ import annotations

import http.client
import json
import threading
import time
import urllib.parse
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any

import torch

from .engines.base import tokenize_prompts
from .teacher import Teacher, TeacherNeeds, TeacherScores

__all__ = ["TeacherServerError", "TeacherClient", "SequenceScores", "ServerInfo",
           "ServedTeacher", "check_url", "connect", "probe_server"]

# Server answers worth another try: overloaded (429) or failing (5xx). Any other 4xx means the
# request itself is wrong, and sending it again would only fail again.
_MAX_BACKOFF_S = 30.0


def _retryable_status(status: int) -> bool:
    return status == 429 or status >= 500


class TeacherServerError(RuntimeError):
    """A served teacher failed: one line naming the server, the step and what happened."""


def check_url(url: str) -> str:
    """``url`` without a trailing slash; ``ValueError`` unless it is ``http(s)://host[:port]``."""
    parsed = urllib.parse.urlsplit(url)
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        raise ValueError(f"teacher URL {url!r} must look like http://HOST:PORT (vLLM's server)")
    try:
        parsed.port  # noqa: B018 - raises on a bad port
    except ValueError:
        raise ValueError(f"teacher URL {url!r} has a bad port") from None
    return url.rstrip("/")


@dataclass(frozen=True)
class SequenceScores:
    """One sequence as the server scored it. Position ``t`` (of ``len(ids) - 1``) is token
    ``ids[t + 1]`` given ``ids[:t + 1]``: ``logprobs[t]`` is its log-probability; with
    ``top_k > 0``, ``top_ids[t]`` / ``top_logprobs[t]`` are the k most likely tokens there,
    most likely first."""

    logprobs: torch.Tensor
    top_ids: torch.Tensor | None = None
    top_logprobs: torch.Tensor | None = None


@dataclass(frozen=True)
class ServerInfo:
    """What ``/v1/models`` says: the served model's id and its ``max_model_len``."""

    url: str
    model: str
    max_model_len: int | None


class _Failure(Exception):
    """One attempt failed; ``retry`` says whether another may succeed. An HTTP error answer
    keeps its ``body`` (vLLM's message) and ``retry_after`` header."""

    def __init__(self, what: str, *, retry: bool, body: str = "",
                 retry_after: str | None = None) -> None:
        super().__init__(what)
        self.retry, self.body, self.retry_after = retry, body, retry_after


class TeacherClient:
    """Scores token-id sequences on one or several vLLM servers serving the same model.

    At most ``max_inflight`` requests are open at once (per client, so per process: every rank
    of a torchrun job has its own), each sent to the server with the fewest in flight.
    ``timeout`` bounds each request in seconds; a failed attempt is tried again up to
    ``retries`` times, after ``backoff · 2^i`` seconds (or the server's ``Retry-After``).
    ``received_bytes`` counts the bytes of every answer body read (the price of a larger k).
    """

    def __init__(self, urls: str | Sequence[str], *, max_inflight: int = 16,
                 timeout: float = 600.0, retries: int = 5, backoff: float = 0.5,
                 model: str | None = None) -> None:
        urls = [urls] if isinstance(urls, str) else list(urls)
        if not urls:
            raise ValueError("TeacherClient needs at least one server URL")
        if max_inflight < 1 or timeout <= 0 or retries < 0 or backoff < 0:
            raise ValueError(f"need max_inflight >= 1, timeout > 0, retries >= 0, backoff >= 0; "
                             f"got {max_inflight}, {timeout}, {retries}, {backoff}")
        self.urls = [check_url(u) for u in urls]
        self.max_inflight, self.timeout, self.retries, self.backoff = (
            max_inflight, timeout, retries, backoff)
        self.model = model
        self._inflight = [0] * len(self.urls)
        self._turn = 0  # breaks ties between equally loaded servers in turn
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self.received_bytes = 0

    # ------------------------------------------------------------------ transport
    def _request(self, url: str, method: str, path: str, body: dict[str, Any] | None = None
                 ) -> Any:
        """One attempt: the decoded JSON answer, or ``_Failure``."""
        parts = urllib.parse.urlsplit(url)
        cls = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
        conn = cls(parts.hostname, parts.port, timeout=self.timeout)
        try:
            data = None if body is None else json.dumps(body).encode()
            conn.request(method, parts.path + path, body=data,
                         headers={"Content-Type": "application/json"} if data else {})
            resp = conn.getresponse()
            raw = resp.read()
            with self._lock:
                self.received_bytes += len(raw)
        except TimeoutError:
            raise _Failure(f"no answer within --teacher_timeout {self.timeout:g} s",
                           retry=True) from None
        except (OSError, http.client.HTTPException) as err:
            raise _Failure(f"connection failed ({type(err).__name__}: {err})", retry=True) from None
        finally:
            conn.close()
        if resp.status != 200:
            text = raw[:200].decode(errors="replace").replace("\n", " ")
            raise _Failure(f"HTTP {resp.status}: {text}", retry=_retryable_status(resp.status),
                           body=text, retry_after=resp.getheader("Retry-After"))
        if path == "/health":
            return None
        try:
            return json.loads(raw)
        except ValueError:
            raise _Failure(f"the answer is not JSON ({raw[:60]!r})", retry=False) from None

    def _call(self, method: str, path: str, body: dict[str, Any] | None = None, *,
              url: str | None = None, step: int | None = None,
              parse: Callable[[Any], Any] | None = None) -> Any:
        """``_request`` with retries, on ``url`` or on the least busy server, its answer read by
        ``parse``; one ``TeacherServerError`` line naming the server once retries are spent,
        or when the answer does not parse."""
        attempt = 0
        where = "before step 0" if step is None else f"at step {step}"
        while True:
            index = self._acquire() if url is None else None
            target = url or self.urls[index]  # type: ignore[index]
            try:
                answer = self._request(target, method, path, body)
            except _Failure as failure:
                if not failure.retry or attempt >= self.retries:
                    tries = f" after {attempt + 1} attempts" if attempt else ""
                    raise TeacherServerError(f"teacher server {target} failed {where}{tries}: "
                                             f"{failure}") from None
                delay = min(self.backoff * 2 ** attempt, _MAX_BACKOFF_S)
                if failure.retry_after and failure.retry_after.isdigit():
                    delay = min(float(failure.retry_after), _MAX_BACKOFF_S)
                attempt += 1
            else:
                if parse is None:
                    return answer
                try:
                    return parse(answer)
                except (KeyError, IndexError, TypeError, ValueError) as err:
                    raise TeacherServerError(f"teacher server {target} answered {where} with "
                                             f"what does not fit the request: {err}") from None
            finally:
                if index is not None:
                    self._release(index)
            time.sleep(delay)

    def _acquire(self) -> int:
        with self._lock:
            n = len(self.urls)
            index = min(range(n), key=lambda i: (self._inflight[i], (i - self._turn) % n))
            self._inflight[index] += 1
            self._turn = (index + 1) % n
            return index

    def _release(self, index: int) -> None:
        with self._lock:
            self._inflight[index] -= 1

    # ------------------------------------------------------------------ scoring
    def score(self, sequences: Sequence[Sequence[int]], *, top_k: int = 0,
              step: int | None = None) -> list[SequenceScores]:
        """Every sequence's per-position log-probs (``SequenceScores``), in order. Requests run
        ``max_inflight`` at a time; the first failure cancels the rest and is raised."""
        if self.model is None:
            raise RuntimeError("TeacherClient.score before the model is known: call probe_server")
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.max_inflight, thread_name_prefix="teacher")
        futures = [self._pool.submit(self._score_one, list(map(int, ids)), top_k, step)
                   for ids in sequences]
        done, pending = wait(futures, return_when=FIRST_EXCEPTION)
        for f in pending:
            f.cancel()
        for f in futures:
            if f in done and f.exception() is not None:
                raise f.exception()  # type: ignore[misc]
        return [f.result() for f in futures]

    def _score_one(self, ids: list[int], top_k: int, step: int | None) -> SequenceScores:
        body = {"model": self.model, "prompt": ids, "max_tokens": 1, "prompt_logprobs": top_k,
                "temperature": 1.0}
        return self._call("POST", "/v1/completions", body, step=step,
                          parse=lambda answer: _parse_prompt_logprobs(answer, ids, top_k))

    def healthy(self, url: str) -> bool:
        """Whether ``url`` answers ``/health`` now: one attempt, no retries (a launcher's
        readiness poll; ``probe_server`` is the check before step 0)."""
        try:
            self._request(url, "GET", "/health")
        except _Failure:
            return False
        return True

    def info(self, url: str) -> ServerInfo:
        """``/v1/models`` of one server."""
        def read(answer: Any) -> ServerInfo:
            card = answer["data"][0]
            return ServerInfo(url, str(card["id"]), card.get("max_model_len"))

        return self._call("GET", "/v1/models", url=url, parse=read)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None


def _parse_prompt_logprobs(answer: Any, ids: list[int], top_k: int) -> SequenceScores:
    """vLLM's ``choices[0].prompt_logprobs``: one entry per prompt token, ``None`` first, then
    ``{token id: {"logprob", "rank", "decoded_token"}}`` holding the token there and the top-k."""
    positions = answer["choices"][0]["prompt_logprobs"]
    if not isinstance(positions, list) or len(positions) != len(ids):
        got = len(positions) if isinstance(positions, list) else type(positions).__name__
        raise ValueError(f"log-probs of {got} positions for the {len(ids)} tokens sent")
    lps = torch.empty(len(ids) - 1, dtype=torch.float32)
    top_ids = torch.zeros(len(ids) - 1, top_k, dtype=torch.long) if top_k else None
    top_lps = torch.full((len(ids) - 1, top_k), float("-inf")) if top_k else None
    for t, entry in enumerate(positions[1:]):
        token = str(ids[t + 1])
        if token not in entry:
            raise ValueError(f"position {t + 1} does not score the token sent there ({token})")
        lps[t] = float(entry[token]["logprob"])
        if top_k:
            best = sorted(entry.items(), key=lambda kv: -float(kv[1]["logprob"]))[:top_k]
            if len(best) < top_k:
                raise ValueError(f"position {t + 1} has {len(best)} of the {top_k} top log-probs")
            top_ids[t] = torch.tensor([int(k) for k, _ in best])  # type: ignore[index]
            top_lps[t] = torch.tensor([float(v["logprob"]) for _, v in best])  # type: ignore[index]
    return SequenceScores(lps, top_ids, top_lps)


def probe_server(client: TeacherClient, tokenizer: Any, probe: Sequence[int], *, top_k: int = 0,
                 max_sequence_len: int | None = None) -> list[ServerInfo]:
    """The checks before step 0, each failure one ``ValueError`` line: every server healthy and
    serving the same model; its ``max_model_len`` holds ``max_sequence_len`` tokens plus the one
    generated; ``top_k`` within its ``--max-logprobs``; and the student's tokenizer and the
    server agree on the ``probe`` token ids (each scored position's token decodes to the same
    text both ways) — a teacher with another vocabulary would otherwise train on garbage
    silently. Sets ``client.model``."""
    infos = []
    for url in client.urls:
        try:
            client._call("GET", "/health", url=url)
            infos.append(client.info(url))
        except TeacherServerError as err:
            raise ValueError(f"{err} (is `vllm serve` running there?)") from None
    models = {i.model for i in infos}
    if len(models) > 1:
        raise ValueError(f"the teacher servers serve different models: "
                         f"{', '.join(f'{i.url}: {i.model}' for i in infos)}")
    if client.model is not None and client.model not in models:
        raise ValueError(f"teacher server {infos[0].url} serves {infos[0].model!r}, not "
                         f"{client.model!r}")
    client.model = infos[0].model
    for info in infos:
        if (max_sequence_len is not None and info.max_model_len is not None
                and max_sequence_len + 1 > info.max_model_len):
            raise ValueError(f"teacher server {info.url} has max_model_len {info.max_model_len}, "
                             f"but prompt + completion + 1 reaches {max_sequence_len + 1} tokens; "
                             f"restart it with --max-model-len {max_sequence_len + 1} or more")
    probe = [int(i) for i in probe]
    if len(probe) < 2:
        raise ValueError("the tokenizer probe needs at least 2 tokens")
    for url in client.urls:
        body = {"model": client.model, "prompt": probe, "max_tokens": 1,
                "prompt_logprobs": top_k, "temperature": 1.0}
        try:
            answer = client._request(url, "POST", "/v1/completions", body)
        except _Failure as failure:
            text = failure.body
            if "logprobs" in text and "max allowed" in text:
                raise ValueError(f"teacher server {url} refuses {top_k} log-probs per token "
                                 f"({text.strip()}); restart it with --max-logprobs {top_k} or "
                                 f"more") from None
            if "vocabulary" in text:
                raise ValueError(f"teacher server {url} does not know the student's token ids "
                                 f"({text.strip()}): the teacher needs the student's "
                                 f"vocabulary") from None
            raise ValueError(f"teacher server {url} failed the scoring probe: {failure}") from None
        _check_probe_tokens(url, answer, probe, tokenizer)
    return infos


def _check_probe_tokens(url: str, answer: Any, probe: list[int], tokenizer: Any) -> None:
    try:
        positions = answer["choices"][0]["prompt_logprobs"]
        served = [positions[t][str(probe[t])].get("decoded_token") for t in range(1, len(probe))]
    except (KeyError, IndexError, TypeError):
        raise ValueError(f"teacher server {url} answered the probe without per-token log-probs "
                         f"of the tokens sent (is it vLLM's OpenAI-compatible server?)") from None
    for t, text in enumerate(served, start=1):
        if text is None:
            continue  # the server did not decode (e.g. --skip-tokenizer-init): ids only
        local = tokenizer.decode([probe[t]])
        if text != local:
            raise ValueError(
                f"teacher server {url} and the student's tokenizer disagree on token id "
                f"{probe[t]} ({text!r} there, {local!r} here): the teacher must share the "
                f"student's vocabulary, or it scores other tokens than were sampled")


class ServedTeacher(Teacher):
    """The ``Teacher`` behind vLLM servers (``client``): the sampled tokens' log-probs
    (``prompt_logprobs=0``) or the top-k, never the full distribution. Each row's unpadded
    tokens go as one request. The step the trainer gives (``set_step``) is named in a
    failure."""

    def __init__(self, client: TeacherClient, vocab_size: int) -> None:
        self.client, self.vocab_size = client, vocab_size
        self.step: int | None = None

    def set_step(self, step: int | None) -> None:
        self.step = step

    @property
    def capability(self) -> TeacherNeeds:
        return TeacherNeeds.topk(self.vocab_size)  # the server's --max-logprobs: probe_server

    @torch.no_grad()
    def score(self, sequences: torch.Tensor, attention_mask: torch.Tensor,
              completion_mask: torch.Tensor, needs: TeacherNeeds) -> TeacherScores:
        self.check(needs)
        rows, spans = [], []
        for b in range(sequences.shape[0]):
            kept = attention_mask[b].nonzero().flatten()
            if not completion_mask[b].any() or kept.numel() < 2:
                continue  # nothing of this row is scored
            start, end = int(kept[0]), int(kept[-1]) + 1  # left pad, prompt, completion, pad
            rows.append(sequences[b, start:end].tolist())
            spans.append((b, start, end))
        shape = (sequences.shape[0], sequences.shape[1] - 1)
        out = TeacherScores(token_logprobs=torch.zeros(shape))
        if needs.level == "topk":
            out.topk_logprobs = torch.full((*shape, needs.k), float("-inf"))
            out.topk_ids = torch.zeros((*shape, needs.k), dtype=torch.long)
        for (b, start, end), s in zip(spans, self.client.score(rows, top_k=needs.k,
                                                               step=self.step), strict=True):
            # position t of the server's answer scores token start + t + 1: aligned index start + t
            out.token_logprobs[b, start:end - 1] = s.logprobs
            if needs.level == "topk":
                out.topk_logprobs[b, start:end - 1] = s.top_logprobs
                out.topk_ids[b, start:end - 1] = s.top_ids
        device = sequences.device
        out.token_logprobs = out.token_logprobs.to(device)
        if out.topk_ids is not None:
            out.topk_logprobs, out.topk_ids = out.topk_logprobs.to(device), out.topk_ids.to(device)
        return out

    def close(self) -> None:
        self.client.close()


def connect(urls: Sequence[str], tokenizer: Any, prompts: Sequence[str], max_new_tokens: int, *,
            top_k: int = 0, max_inflight: int = 16, timeout: float = 600.0,
            retries: int = 5) -> ServedTeacher:
    """A ``ServedTeacher`` on ``urls`` (a ``TeacherClient`` with ``max_inflight``, ``timeout``
    and ``retries``: a run's ``teacher_*`` options), after ``probe_server``: the probe is the
    first prompts' tokens, and the longest of ``prompts`` plus ``max_new_tokens`` must fit the
    server, which must give ``top_k`` log-probs per position."""
    client = TeacherClient(urls, max_inflight=max_inflight, timeout=timeout, retries=retries)
    ids = tokenize_prompts(tokenizer, list(prompts))
    longest = max(map(len, ids)) + max_new_tokens
    probe = [t for row in ids[:8] for t in row][:longest]
    probe_server(client, tokenizer, probe, top_k=top_k, max_sequence_len=longest)
    return ServedTeacher(client, len(tokenizer))
