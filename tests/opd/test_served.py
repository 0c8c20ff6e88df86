"""The served teacher's client and its checks against a stand-in server (``served_stub``): the
faults a real vLLM server won't produce on demand. The real server: tests/vllm_engine."""

from __future__ import annotations

import threading

import pytest
import torch
from served_stub import MODEL, StubServer, expected_logprob

from lookahead_opd.integrations.opd.served import (
    TeacherClient,
    TeacherServerError,
    probe_server,
)
from lookahead_opd.integrations.opd.train import check_run

SEQS = [[1, 5, 9, 12, 4], [1, 7, 3], [1, 2, 2, 2, 2, 2, 8]]


@pytest.fixture
def stub():
    s = StubServer(slow_s=3.0)
    yield s
    s.close()


def _client(*urls, **kw) -> TeacherClient:
    kw = {"timeout": 10, "retries": 2, "backoff": 0.01, "model": MODEL, **kw}
    return TeacherClient(list(urls), **kw)


class _Tok:
    """decode as the stub does (id → its decimal text)."""

    def decode(self, ids):
        return "".join(str(i) for i in ids)


def test_scores_come_back_in_order_with_the_servers_values(stub):
    out = _client(stub.url, max_inflight=3).score(SEQS, step=4)
    for ids, s in zip(SEQS, out, strict=True):
        want = torch.tensor([expected_logprob(ids, t) for t in range(1, len(ids))])
        torch.testing.assert_close(s.logprobs, want)
        assert s.top_ids is None


def test_top_k_is_sorted_most_likely_first(stub):
    (s,) = _client(stub.url).score([SEQS[0]], top_k=3)
    assert s.top_ids.shape == (4, 3) and s.top_logprobs.shape == (4, 3)
    assert torch.equal(s.top_ids[0], torch.tensor([1000, 1001, 1002]))
    assert (s.top_logprobs[:, :-1] >= s.top_logprobs[:, 1:]).all()


def test_received_bytes_count_every_answer_and_grow_with_k(stub):
    client = _client(stub.url)
    client.score([SEQS[0]], top_k=1)
    one = client.received_bytes
    client.score([SEQS[0]], top_k=8)
    eight = client.received_bytes - one
    assert one > 0 and eight > 2 * one  # 8 entries per position where there was one


def test_in_flight_requests_are_bounded(stub):
    stub.slow_s = 0.05
    stub.actions.extend(["slow"] * 12)
    _client(stub.url, max_inflight=2, timeout=5).score([SEQS[1]] * 12)
    assert stub.max_concurrent == 2


def test_500_and_429_are_retried_then_succeed(stub):
    stub.actions.extend([500, 429])
    (s,) = _client(stub.url).score([SEQS[0]], step=2)
    assert stub.requests == 3 and s.logprobs.numel() == 4


def test_retries_spent_is_one_line_naming_server_and_step(stub):
    stub.actions.extend([503] * 3)
    with pytest.raises(TeacherServerError) as err:
        _client(stub.url, retries=2).score([SEQS[0]], step=7)
    msg = str(err.value)
    assert "\n" not in msg and stub.url in msg and "step 7" in msg and "3 attempts" in msg
    assert "HTTP 503" in msg and stub.requests == 3


def test_400_is_not_retried(stub):
    stub.actions.append(400)
    with pytest.raises(TeacherServerError, match="HTTP 400"):
        _client(stub.url, retries=5).score([SEQS[0]], step=1)
    assert stub.requests == 1


@pytest.mark.slow
def test_slow_server_times_out_and_is_retried(stub):
    stub.actions.extend(["slow", "slow"])  # 3 s each; the third attempt is answered at once
    (s,) = _client(stub.url, timeout=1, retries=2).score([SEQS[1]])
    assert stub.requests == 3 and s.logprobs.numel() == 2
    stub.actions.extend(["slow"] * 3)
    with pytest.raises(TeacherServerError, match="no answer within --teacher_timeout 1 s"):
        _client(stub.url, timeout=1, retries=2).score([SEQS[1]], step=3)


def test_wrong_lengths_and_garbage_are_one_line_not_retried(stub):
    stub.actions.append("short")
    with pytest.raises(TeacherServerError, match="positions for the 5 tokens sent"):
        _client(stub.url).score([SEQS[0]], step=0)
    assert stub.requests == 1
    stub.actions.append("garbage")
    with pytest.raises(TeacherServerError, match="not JSON"):
        _client(stub.url).score([SEQS[0]], step=0)
    assert stub.requests == 2


def test_unreachable_server_is_retried_then_one_line():
    with _closed_url() as url:
        with pytest.raises(TeacherServerError, match="connection failed") as err:
            _client(url, retries=1).score([SEQS[0]], step=5)
        assert "after 2 attempts" in str(err.value) and url in str(err.value)


class _closed_url:
    """A URL on 127.0.0.1 where nothing listens (a stub started and stopped)."""

    def __enter__(self):
        s = StubServer()
        s.close()
        return s.url

    def __exit__(self, *exc):
        return False


def test_least_in_flight_balancing_spreads_and_fails_over(stub):
    other = StubServer()
    try:
        stub.slow_s = other.slow_s = 0.05
        stub.actions.extend(["slow"] * 8)
        other.actions.extend(["slow"] * 8)
        _client(stub.url, other.url, max_inflight=2, timeout=5).score([SEQS[1]] * 8)
        # Two in flight over two servers: never both on one while the other is idle.
        assert stub.max_concurrent == other.max_concurrent == 1
        assert stub.requests + other.requests == 8 and min(stub.requests, other.requests) >= 1
        n = stub.requests
        stub.actions.clear()
        other.actions.clear()
        other.actions.extend([500] * 10)  # one server failing: its retries go to the other
        _client(stub.url, other.url, max_inflight=1, retries=3).score([SEQS[1]] * 4)
        assert stub.requests == n + 4
    finally:
        other.close()


def test_probe_passes_and_learns_the_model(stub):
    client = TeacherClient(stub.url, timeout=10)
    (info,) = probe_server(client, _Tok(), [1, 5, 9, 12], max_sequence_len=20)
    assert client.model == MODEL and info.max_model_len == 64


def test_probe_refusals_are_one_line(stub):
    with pytest.raises(ValueError, match="--max-logprobs 50 or more"):
        probe_server(TeacherClient(stub.url), _Tok(), [1, 5, 9], top_k=50)
    with pytest.raises(ValueError, match="--max-model-len 100 or more"):
        probe_server(TeacherClient(stub.url), _Tok(), [1, 5, 9], max_sequence_len=99)
    with pytest.raises(ValueError, match="serves 'stub-teacher', not 'other'"):
        probe_server(TeacherClient(stub.url, model="other"), _Tok(), [1, 5, 9])


def test_probe_catches_another_vocabulary():
    s = StubServer(decode=lambda i: f"<{i}>")  # the server's tokenizer spells ids differently
    try:
        with pytest.raises(ValueError, match="disagree on token id 5"):
            probe_server(TeacherClient(s.url), _Tok(), [1, 5, 9])
    finally:
        s.close()


@pytest.mark.slow
def test_probe_names_an_unreachable_or_mismatched_pool(stub):
    with _closed_url() as url, pytest.raises(ValueError, match="is `vllm serve` running"):
        probe_server(TeacherClient(url, retries=0), _Tok(), [1, 5, 9])
    other = StubServer(model="another")
    try:
        with pytest.raises(ValueError, match="serve different models"):
            probe_server(TeacherClient([stub.url, other.url]), _Tok(), [1, 5, 9])
    finally:
        other.close()


def test_client_is_thread_safe_across_concurrent_score_calls(stub):
    client = _client(stub.url, max_inflight=2, timeout=5)
    results = []
    threads = [threading.Thread(target=lambda: results.append(client.score(SEQS))) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 3 and all(len(r) == 3 for r in results)


# ------------------------------------------------------------------ the options, checked once
def _config(**kw):
    from lookahead_opd.integrations.opd.config import OPDConfig

    return OPDConfig(**{"student": "s", **kw})


@pytest.mark.parametrize("kw, message", [
    ({"teacher": "t", "teacher_url": ["http://h:1"]}, "give one of --teacher, --teacher_url"),
    ({"teacher_url": ["localhost:8000"]}, "must look like http://HOST:PORT"),
    ({"teacher_url": ["http://h:1"], "loss": "reverse_kl"}, "loss=reverse_kl needs the teacher's full"),
    ({"teacher_url": ["http://h:1"], "loss": "jsd"}, "loss=jsd needs the teacher's full"),
    ({"teachers": ["a=http://h:1"], "teacher_key": "k", "extrapolate": True, "gate": "neg_kl"},
     "use --gate accuracy"),
    ({"teacher_url": ["http://h:1"], "teacher_timeout": 0}, "teacher_timeout must be > 0"),
    ({"teacher_url": ["http://h:1"], "teacher_max_inflight": 0}, "teacher_max_inflight must be >= 1"),
    ({"teachers": ["a=http://h:1"]}, "--teachers needs --teacher_key"),
    ({"teachers": ["a"], "teacher_key": "k"}, "entries are name=URL_or_path"),
    ({"teachers": ["a=http://h:1", "a=http://h:2"], "teacher_key": "k"}, "names 'a' twice"),
    ({"teachers": ["a=http://h:1"], "teacher_key": "k", "default_teacher": "b"},
     "default_teacher 'b' is not one of"),
    ({"teacher": "t", "teacher_key": "k"}, "go with --teachers"),
])
def test_bad_teacher_options_are_one_line(kw, message):
    with pytest.raises(ValueError, match=message) as err:
        check_run(_config(**kw), check_paths=False)
    assert "\n" not in str(err.value)


def test_teacher_refs_name_urls_and_paths():
    c = _config(teachers=["math=http://a:1,http://b:2", "code=./models/t"], teacher_key="domain",
                default_teacher="math")
    check_run(c, check_paths=False)
    assert c.teacher_refs() == {"math": ["http://a:1", "http://b:2"], "code": "./models/t"}
    assert c.served_teacher()
    assert not _config(teacher="t").served_teacher()
    assert _config(teacher_url=["http://a:1"]).teacher_refs() == {None: ["http://a:1"]}


def test_the_cli_parses_several_urls():
    from lookahead_opd.integrations.opd.train import parse_config

    c = parse_config(["--student", "s", "--teacher_url", "http://a:1", "http://b:2",
                      "--teacher_max_inflight", "4"])
    assert c.teacher_url == ["http://a:1", "http://b:2"] and c.teacher_max_inflight == 4


# ------------------------------------------------------------------ ServedTeacher on the layout
def test_served_teacher_places_each_rows_scores_on_the_aligned_positions(stub):
    from lookahead_opd.integrations.opd.served import ServedTeacher
    from lookahead_opd.integrations.opd.teacher import TeacherNeeds

    # Rollout layout: [pad … pad, prompt | completion, pad …], prompt length 3.
    seq = torch.tensor([[0, 1, 5, 9, 12, 4, 0], [1, 7, 3, 8, 2, 0, 0], [0, 0, 1, 6, 0, 0, 0]])
    attn = torch.tensor([[0, 1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 0, 0], [0, 0, 1, 1, 0, 0, 0]])
    comp = torch.tensor([[0, 0, 0, 0, 1, 1, 0], [0, 0, 0, 1, 1, 0, 0], [0, 0, 0, 0, 0, 0, 0]])
    teacher = ServedTeacher(_client(stub.url), vocab_size=32)
    out = teacher.score(seq, attn, comp, TeacherNeeds.SAMPLED)
    assert out.token_logprobs.shape == (3, 6) and stub.requests == 2  # the empty row: no request
    for b in range(2):
        kept = seq[b][attn[b].bool()].tolist()
        start = int(attn[b].nonzero()[0])
        for t in range(1, len(kept)):  # token kept[t] sits at start + t; aligned at start + t - 1
            assert out.token_logprobs[b, start + t - 1].item() == pytest.approx(
                expected_logprob(kept, t))
    assert (out.token_logprobs[2] == 0).all()
    top = teacher.score(seq, attn, comp, TeacherNeeds.topk(2))
    assert top.topk_ids.shape == (3, 6, 2) and (top.topk_ids[0, 3:5] == 1000).any()
    with pytest.raises(ValueError, match="full distribution"):
        teacher.check(TeacherNeeds.FULL)


@pytest.mark.slow
def test_cli_prints_one_line_when_the_server_fails_mid_run(stub, tmp_path, capsys):
    """lookahead-opd train with --teacher_url: the probe passes, step 1's requests fail."""
    from conftest import tiny_qwen2

    from lookahead_opd.integrations.opd.tokenizer import char_tokenizer
    from lookahead_opd.integrations.opd.train import main

    tok = char_tokenizer()
    stub.decode = lambda i: tok.decode([i])
    tiny_qwen2(len(tok), 0, tokenizer=tok).save_pretrained(tmp_path / "s")
    tok.save_pretrained(tmp_path / "s")
    stub.actions.extend(["ok"] + [500] * 20)  # the probe's request, then every score fails
    capsys.readouterr()  # the saving's progress bars
    code = main(["--student", str(tmp_path / "s"), "--teacher_url", stub.url, "--batch_size",
                 "2", "--max_new_tokens", "3", "--eval_size", "2", "--max_steps", "2",
                 "--teacher_retries", "1", "--no_progress", "--output_dir", str(tmp_path / "r")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and len(err) == 1, err
    assert stub.url in err[0] and "at step 1" in err[0] and "HTTP 500" in err[0]


def test_diagnose_refuses_a_served_teacher_in_one_line():
    from lookahead_opd.diagnostic.teachers import parse_teacher_spec

    with pytest.raises(ValueError, match="full distribution; pass the teacher's model"):
        parse_teacher_spec("http://127.0.0.1:8000")
