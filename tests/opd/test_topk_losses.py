"""The top-k losses (``topk_forward_kl``, ``topk_reverse_kl``, ``topk_jsd``): the teacher's top-k
tokens plus one tail bucket. Properties against the full-vocabulary losses, gradients at the
tail's extremes, chunking, the options, and a trainer whose teacher is served (``served_stub``
answering with a real model's top-k)."""

from __future__ import annotations

import threading

import pytest
import served_stub
import torch
from conftest import tiny_qwen2
from hypothesis import given
from hypothesis import strategies as st

from lookahead_opd.integrations.opd.logits import NextTokenLogits, OutputHead, model_logits
from lookahead_opd.integrations.opd.losses import (
    DEFAULT_TOPK,
    TokenScores,
    compute_loss,
    generalized_jsd_loss,
    reverse_kl_loss,
    teacher_needs,
    topk_forward_kl_loss,
    topk_jsd_loss,
    topk_reverse_kl_loss,
)
from lookahead_opd.integrations.opd.teacher import ModelTeacher, TeacherNeeds, TeacherScores

pytest.importorskip("transformers")

from lookahead_opd.integrations.opd.config import OPDConfig  # noqa: E402
from lookahead_opd.integrations.opd.engines import HFEngine  # noqa: E402
from lookahead_opd.integrations.opd.scoring import score_tokens  # noqa: E402
from lookahead_opd.integrations.opd.served import connect  # noqa: E402
from lookahead_opd.integrations.opd.tasks import ArithmeticTask  # noqa: E402
from lookahead_opd.integrations.opd.tokenizer import char_tokenizer  # noqa: E402
from lookahead_opd.integrations.opd.train import (  # noqa: E402
    check_run,
    parse_config,
    teacher_top_k,
)
from lookahead_opd.integrations.opd.trainer import OPDTrainer  # noqa: E402

BETAS = (0.0, 0.3, 0.5, 1.0)


def topk_loss(s, top, m, beta, **kw):
    """The registered top-k loss of ``beta`` (0: forward KL, 1: reverse KL, else JSD(β))."""
    if beta == 0.0:
        return topk_forward_kl_loss(s, top, m, **kw)
    if beta == 1.0:
        return topk_reverse_kl_loss(s, top, m, **kw)
    return topk_jsd_loss(s, top, m, beta=beta, **kw)


def full_loss(s, t, m, beta):
    """The matching full-vocabulary loss."""
    return reverse_kl_loss(s, t, m) if beta == 1.0 else generalized_jsd_loss(s, t, m, beta=beta)


def top_of(teacher_logits, k, mask):
    return NextTokenLogits(teacher_logits).topk(k, mask)


@st.composite
def cases(draw, dtype=torch.float64):
    b, t, v = draw(st.integers(1, 3)), draw(st.integers(1, 5)), draw(st.integers(2, 30))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    scale = draw(st.sampled_from([0.1, 1.0, 4.0, 20.0]))
    s = (torch.randn(b, t, v, generator=g, dtype=torch.float64) * scale).to(dtype)
    te = (torch.randn(b, t, v, generator=g, dtype=torch.float64) * scale).to(dtype)
    mask = torch.rand(b, t, generator=g) < 0.7
    mask[0, 0] = True
    return dict(s=s, t=te, mask=mask, v=v, k=draw(st.integers(1, v)),
                beta=draw(st.sampled_from(BETAS)))


# ------------------------------------------------------------------ the properties

@given(cases())
def test_with_k_the_vocabulary_each_top_k_loss_is_its_full_loss(c):
    """(a) k = V: no tail is left, the same loss and the same gradient to the student."""
    s, m, beta = c["s"].requires_grad_(True), c["mask"], c["beta"]
    got = topk_loss(s, top_of(c["t"], c["v"], m), m, beta)
    (g_top,) = torch.autograd.grad(got.loss, s)
    want = full_loss(s, c["t"], m, beta)
    (g_full,) = torch.autograd.grad(want.loss, s)
    torch.testing.assert_close(got.loss, want.loss, rtol=1e-6, atol=1e-9)
    torch.testing.assert_close(g_top, g_full, rtol=1e-6, atol=1e-9)


@given(cases())
def test_the_bucketed_divergence_never_exceeds_the_full_one(c):
    """(b) Data processing: merging the tail into one outcome can only lower a KL (and the
    JSD, a KL to the mixture), and it stays >= 0."""
    m, beta = c["mask"], c["beta"]
    got = float(topk_loss(c["s"], top_of(c["t"], c["k"], m), m, beta).loss)
    full = float(full_loss(c["s"], c["t"], m, beta).loss)
    assert -1e-9 <= got <= full + 1e-6, (got, full)


def test_closed_form_with_one_token_and_the_tail():
    """k = 1 on three tokens: two outcomes, the teacher's first token and the other two
    merged (not the top-k renormalised, which would be 0 here)."""
    p, q = torch.tensor([0.5, 0.3, 0.2]), torch.tensor([0.2, 0.5, 0.3])
    m = torch.ones(1, 1, dtype=torch.bool)
    s, t = q.log().view(1, 1, 3), p.log().view(1, 1, 3)
    top = top_of(t, 1, m)

    def kl(a, b):
        return sum(x * torch.log(x / y) for x, y in zip(a, b, strict=True))

    pb, qb = torch.tensor([0.5, 0.5]), torch.tensor([0.2, 0.8])
    mix = 0.3 * pb + 0.7 * qb
    for beta, want in ((0.0, kl(pb, qb)), (1.0, kl(qb, pb)),
                       (0.3, 0.3 * kl(pb, mix) + 0.7 * kl(qb, mix))):
        assert float(topk_loss(s, top, m, beta).loss) == pytest.approx(float(want), rel=1e-5)


def test_a_small_k_is_strictly_below_the_full_kl_and_grows_with_k():
    g = torch.Generator().manual_seed(3)
    s, t = torch.randn(2, 4, 50, generator=g), torch.randn(2, 4, 50, generator=g) * 0.5
    m = torch.ones(2, 4, dtype=torch.bool)
    full = float(reverse_kl_loss(s, t, m).loss)
    by_k = [float(topk_reverse_kl_loss(s, top_of(t, k, m), m).loss) for k in (1, 5, 20, 49, 50)]
    assert by_k == sorted(by_k) and by_k[0] < 0.5 * full, (by_k, full)  # a flat teacher: far below
    assert by_k[-1] == pytest.approx(full, rel=1e-5)


def _extremes():
    """(student logits, teacher logits, k) where the teacher's top-k holds ~all of its mass, or
    little of it, and where logits are -inf."""
    g = torch.Generator().manual_seed(0)
    v = 16
    spread = torch.randn(2, 3, v, generator=g)
    peaked = torch.zeros(2, 3, v)
    peaked[..., 2] = 80.0  # the tail's mass ~ v·e^-80: far below fp32's epsilon
    masked = torch.randn(2, 3, v, generator=g)
    masked[..., 10:] = float("-inf")  # a cut vocabulary: the top-12 holds -inf entries
    half = masked * 0.5
    return {
        "teacher top-1 mass ~1, student spread": (spread, peaked, 1),
        "both top-1 masses ~1": (peaked.clone(), peaked, 1),
        "teacher top-1 mass ~1, student peaked elsewhere": (peaked.roll(1, -1), peaked, 1),
        "flat teacher, k=1: tail 15/16": (spread, torch.zeros(2, 3, v), 1),
        "flat teacher, k=v": (spread, torch.zeros(2, 3, v), v),
        "-inf logits on both sides": (half, masked, 12),
    }


@pytest.mark.parametrize("beta", BETAS)
@pytest.mark.parametrize("name", list(_extremes()))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gradients_are_finite_at_the_tails_extremes(name, beta, dtype):
    """(c) A tail of ~0 (the clamp) or of ~1, and -inf logits: a finite loss and gradient,
    which still pulls the student toward the teacher where they differ."""
    s, t, k = _extremes()[name]
    s = s.to(dtype).requires_grad_(True)
    m = torch.ones(s.shape[:2], dtype=torch.bool)
    out = topk_loss(s, top_of(t.to(dtype), k, m), m, beta)
    (grad,) = torch.autograd.grad(out.loss, s)
    assert torch.isfinite(out.loss) and torch.isfinite(grad).all(), name
    if name.startswith("teacher top-1 mass ~1"):
        assert float(out.loss.detach()) > 0.1, (float(out.loss.detach()), name)
    if name == "teacher top-1 mass ~1, student spread":  # raising the teacher's token helps
        assert (grad[..., 2] < 0).all()
    if name == "both top-1 masses ~1":
        assert abs(float(out.loss.detach())) < 1e-6 and grad.abs().max() < 1e-6


def test_the_student_tail_gradient_is_exact_where_its_top_k_holds_nearly_everything():
    """The student's tail comes from its own logits (no 1 − Σ cancellation): gradcheck in
    float64 with a student tail of ~1e-6 and a teacher tail of ~1e-3."""
    g = torch.Generator().manual_seed(1)
    s = torch.randn(1, 2, 6, generator=g, dtype=torch.float64)
    s[..., :2] += 14.0
    t = torch.randn(1, 2, 6, generator=g, dtype=torch.float64)
    t[..., :2] += 7.0
    m = torch.ones(1, 2, dtype=torch.bool)
    top = top_of(t, 2, m)
    for beta in BETAS:
        assert torch.autograd.gradcheck(
            lambda x, beta=beta: topk_loss(x, top, m, beta).loss, (s.requires_grad_(True),))


@given(cases(dtype=torch.float32), st.sampled_from([torch.float32, torch.float64]))
def test_the_loss_is_zero_when_student_equals_teacher(c, dtype):
    """(d) Student = teacher: loss 0 and gradient 0, for any k (the two tails, one from the
    student's logits and one from 1 − Σ of the teacher's k log-probs, agree)."""
    t, m, beta = c["t"].to(dtype), c["mask"], c["beta"]
    s = t.clone().requires_grad_(True)
    out = topk_loss(s, top_of(t, c["k"], m), m, beta)
    (grad,) = torch.autograd.grad(out.loss, s)
    tol = 1e-6 if dtype == torch.float32 else 1e-12
    loss = float(out.loss.detach())
    assert abs(loss) < tol and float(grad.abs().max()) < tol, (loss, c["k"])
    assert abs(out.metrics["topk_reverse_kl"]) < tol


# ------------------------------------------------------------------ chunking, options, errors

@given(st.integers(0, 2**16), st.integers(1, 5), st.booleans(), st.sampled_from(BETAS),
       st.integers(1, 9))
def test_chunked_head_equals_dense_logits(seed, chunk, bias, beta, k):
    """The loss from hidden states and a head, projected ``chunk`` rows at a time (the teacher's
    top-k cut to the same rows), equals the dense one: value, metrics and every gradient."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(2, 5, 4, generator=g, requires_grad=True)
    w = torch.randn(12, 4, generator=g, requires_grad=True)
    b = torch.randn(12, generator=g, requires_grad=True) if bias else None
    m = torch.rand(2, 5, generator=g) < 0.6
    top = top_of(torch.randn(2, 5, 9, generator=g) * 3, k, m)  # a 9-token shared vocabulary
    params = [h, w] + ([b] if bias else [])
    chunked = topk_loss(NextTokenLogits(h, OutputHead(w, b, vocab_size=9), chunk), top, m, beta)
    dense_logits = (h @ w.T + (0 if b is None else b))[..., :9]
    dense = topk_loss(dense_logits, top, m, beta)
    for a, want in zip(torch.autograd.grad(chunked.loss, params),
                       torch.autograd.grad(dense.loss, params), strict=True):
        torch.testing.assert_close(a, want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(chunked.loss, dense.loss, rtol=1e-5, atol=1e-7)
    assert chunked.metrics == pytest.approx(dense.metrics, rel=1e-5, abs=1e-7)


@pytest.fixture(scope="module")
def tokenizer():
    return char_tokenizer()


@pytest.mark.parametrize("loss", ["topk_forward_kl", "topk_reverse_kl", "topk_jsd"])
def test_score_tokens_on_a_model_chunked_equals_dense(tokenizer, loss):
    """Through ``score_tokens`` with an in-process teacher (``ModelTeacher``'s own top-k):
    the same loss and gradients with and without chunking, and ``reverse_kl`` is the sampled
    tokens' estimate."""
    vocab = len(tokenizer)
    student, teacher = tiny_qwen2(vocab, 0), tiny_qwen2(vocab, 1).requires_grad_(False)
    g = torch.Generator().manual_seed(0)
    seq = torch.randint(3, vocab, (3, 12), generator=g)
    attn, completion = torch.ones_like(seq), torch.zeros_like(seq)
    attn[0, :3] = 0
    completion[:, 6:] = 1
    config = OPDConfig(loss=loss, topk=5, jsd_beta=0.3)
    results = []
    for chunk in (0, 4):
        student.zero_grad()
        scores = score_tokens(student, teacher, seq, attn, completion, vocab,
                              needs=teacher_needs(loss, config.loss_options()), chunk_size=chunk)
        assert scores.teacher.topk_ids.shape == (3, 11, 5)
        out = compute_loss(loss, scores, num_tokens=20, options=config.loss_options())
        out.loss.backward()
        assert out.metrics["reverse_kl"] == pytest.approx(scores.sampled_reverse_kl())
        results.append((out, [p.grad.clone() for p in student.parameters()]))
    (dense, dense_grads), (chunked, grads) = results
    torch.testing.assert_close(chunked.loss, dense.loss, rtol=1e-5, atol=1e-7)
    for a, b in zip(grads, dense_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_teacher_needs_and_the_options_come_from_the_config():
    assert teacher_needs("topk_jsd") == TeacherNeeds.topk(DEFAULT_TOPK) == TeacherNeeds.topk(20)
    assert teacher_needs("topk_reverse_kl", {"topk": 7}) == TeacherNeeds.topk(7)
    assert teacher_needs("reverse_kl", OPDConfig(topk=7).loss_options()) == TeacherNeeds.FULL
    g = torch.Generator().manual_seed(0)
    s, t = torch.randn(2, 3, 10, generator=g), torch.randn(2, 3, 10, generator=g)
    m = torch.ones(2, 3, dtype=torch.bool)
    lp, ids = top_of(t, 6, m)
    student = NextTokenLogits(s)
    scores = _scores(student, TeacherScores(torch.zeros(2, 3), lp, ids), m)
    out = compute_loss("topk_jsd", scores, options=OPDConfig(topk=4, jsd_beta=0.2).loss_options())
    want = topk_jsd_loss(s, (lp[..., :4], ids[..., :4]), m, beta=0.2)  # more given: k used
    assert float(out.loss) == pytest.approx(float(want.loss))
    assert float(out.loss) != pytest.approx(float(topk_jsd_loss(s, (lp, ids), m, beta=0.2).loss))


def _scores(student, teacher, mask):
    return TokenScores(student, teacher, torch.zeros(mask.shape, dtype=torch.long), mask)


def test_errors_are_one_line_and_name_the_problem():
    g = torch.Generator().manual_seed(0)
    s, t = torch.randn(1, 2, 5, generator=g), torch.randn(1, 2, 5, generator=g)
    m = torch.ones(1, 2, dtype=torch.bool)
    lp, ids = top_of(t, 3, m)
    with pytest.raises(ValueError, match="token id 1003, outside the shared vocabulary of 5"):
        topk_reverse_kl_loss(s, (lp, ids + 1000), m)
    with pytest.raises(ValueError, match=r"k must be in \[1, 3\]"):
        topk_reverse_kl_loss(s, (lp, ids), m, k=4)
    with pytest.raises(ValueError, match="beta must be a float in"):
        topk_jsd_loss(s, (lp, ids), m, beta=1.5)
    with pytest.raises(ValueError, match=r"\[B, T\] = \(1, 2\)"):
        topk_reverse_kl_loss(s, (lp[:, :1], ids[:, :1]), m)
    with pytest.raises(ValueError, match="top-k log-probs, which this teacher did not give"):
        _scores(NextTokenLogits(s), TeacherScores(token_logprobs=torch.zeros(1, 2)), m).topk()


def test_config_accepts_top_k_losses_and_the_gate_with_a_served_teacher():
    served = dict(student="s", teacher_url=["http://h:1"])
    for loss in ("topk_forward_kl", "topk_reverse_kl", "topk_jsd"):
        check_run(OPDConfig(**served, loss=loss), check_paths=False)
    check_run(OPDConfig(**served, extrapolate=True, gate="neg_kl"), check_paths=False)
    check_run(OPDConfig(student="s", teachers=["a=http://h:1"], teacher_key="k",
                        loss="topk_jsd"), check_paths=False)
    with pytest.raises(ValueError, match="topk must be >= 1, got 0"):
        OPDConfig(**served, loss="topk_jsd", topk=0).validate()
    with pytest.raises(ValueError, match="loss=jsd needs the teacher's full.*a topk_\\* loss"):
        check_run(OPDConfig(**served, loss="jsd"), check_paths=False)
    assert teacher_top_k(OPDConfig(**served, loss="topk_jsd", topk=5)) == 5
    assert teacher_top_k(OPDConfig(**served, extrapolate=True, gate="neg_kl", topk=8)) == 8
    assert teacher_top_k(OPDConfig(**served)) == 0
    c = parse_config(["--student", "s", "--loss", "topk_reverse_kl", "--topk", "8"])
    assert (c.loss, c.topk) == ("topk_reverse_kl", 8)


# ------------------------------------------------------------------ a served teacher's run

def _confident(model):
    with torch.no_grad():
        model.lm_head.weight.mul_(30.0)
    return model.requires_grad_(False).eval()


@pytest.fixture
def served(tokenizer, monkeypatch):
    """The stub server answering with ``teacher``'s own log-probs (vLLM's layout): the same
    numbers the in-process teacher gives, so the two runs can be compared."""
    teacher = _confident(tiny_qwen2(len(tokenizer), 1, tokenizer=tokenizer))
    lock = threading.Lock()

    def positions(ids, top_k):
        with lock, torch.no_grad():
            lp = torch.log_softmax(teacher(input_ids=torch.tensor([ids])).logits[0].float(), -1)
        out = [None]
        for t in range(1, len(ids)):
            row, entry = lp[t - 1], {}
            values, ids_ = row.topk(top_k)
            for rank, (v, i) in enumerate(zip(values, ids_, strict=True)):
                entry[str(int(i))] = {"logprob": float(v), "rank": rank + 1,
                                      "decoded_token": str(int(i))}
            entry.setdefault(str(ids[t]), {"logprob": float(row[ids[t]]), "rank": top_k + 1,
                                           "decoded_token": str(ids[t])})
            out.append(entry)
        return out

    monkeypatch.setattr(served_stub, "_positions", positions)
    stub = served_stub.StubServer(decode=lambda i: tokenizer.decode([i]))
    yield stub, teacher
    stub.close()


def _trainer(tmp_path, tokenizer, teacher, **options):
    student = tiny_qwen2(len(tokenizer), 0, tokenizer=tokenizer)
    defaults = dict(output_dir=str(tmp_path), batch_size=8, max_steps=2, learning_rate=1e-2,
                    max_new_tokens=4, eval_every=0, eval_size=8, gate_size=8, progress=False,
                    max_grad_norm=1e6, topk=5)  # norms logged, never clipped
    config = OPDConfig(**{**defaults, **options})
    if teacher == "served":
        task = ArithmeticTask()
        teacher = connect(config.teacher_url, tokenizer,
                          [p.prompt for p in task.problems("train", seed=config.seed)],
                          config.max_new_tokens, top_k=teacher_top_k(config),
                          max_inflight=config.teacher_max_inflight,
                          timeout=config.teacher_timeout, retries=config.teacher_retries)
    return OPDTrainer(config, student, teacher, ArithmeticTask(),
                      HFEngine(student, tokenizer, batch_size=64), tokenizer=tokenizer)


@pytest.mark.slow
def test_a_served_teacher_trains_a_top_k_loss_as_the_in_process_one(served, tokenizer, tmp_path):
    stub, teacher = served
    runs = [_trainer(tmp_path / name, tokenizer, who, loss="topk_jsd", jsd_beta=0.3,
                     **({"teacher_url": [stub.url]} if who == "served" else {})).train()
            for name, who in (("local", teacher), ("served", "served"))]
    local, remote = ([m for m in r.metrics if "loss" in m] for r in runs)
    assert len(local) == len(remote) == 2 and stub.requests > 16  # the probe + 8 rows a step
    for a, b in zip(local, remote, strict=True):
        for key in ("loss", "topk_reverse_kl", "teacher_tail", "reverse_kl", "grad_norm"):
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), key
        assert 0 < a["teacher_tail"] < 1


@pytest.mark.slow
def test_a_served_teacher_gates_on_the_top_k_reverse_kl(served, tokenizer, tmp_path):
    """--extrapolate --gate neg_kl with a served teacher: the gate is the top-k reverse KL on
    the fixed gate rollouts, their teacher scores requested once per run; the score equals the
    in-process top-k one and is below the full reverse KL."""
    stub, teacher = served
    t = _trainer(tmp_path, tokenizer, "served", teacher_url=[stub.url], extrapolate=True,
                 gate="neg_kl", loss="reverse_kl_pg")
    asked, score = [], t.teacher_scorer.score

    def recorded(*args):
        asked.append(args[-1])  # what each call asks for: the loss's, or the gate's
        return score(*args)

    t.teacher_scorer.score = recorded
    result = t.train()
    assert [j["step"] for j in result.jumps] == [1, 2] and t.gate_evals >= 4
    assert asked.count(TeacherNeeds.topk(5)) == 1 and asked.count(TeacherNeeds.SAMPLED) == 2
    g = t._gate_sequences
    local = ModelTeacher(teacher, len(tokenizer))
    args = (g["sequences"], g["attention_mask"], g["completion_mask"])
    with torch.no_grad():
        student = model_logits(t.student, g["sequences"], g["attention_mask"], len(tokenizer))
        mask = g["completion_mask"][:, 1:]
        want = topk_reverse_kl_loss(student, local.score(*args, TeacherNeeds.topk(5)).top(), mask)
        full = reverse_kl_loss(student, local.score(*args, TeacherNeeds.FULL).full(), mask)
    got = t.gate_reverse_kl()
    assert got == pytest.approx(want.metrics["topk_reverse_kl"], rel=1e-4)
    assert 0 < got < full.metrics["reverse_kl"]
    assert asked.count(TeacherNeeds.topk(5)) == 1  # still the scores of the first call


def test_a_top_k_beyond_the_vocabulary_is_one_line(tokenizer, tmp_path):
    teacher = _confident(tiny_qwen2(len(tokenizer), 1, tokenizer=tokenizer))
    with pytest.raises(ValueError, match=f"--topk 1000 exceeds the shared vocabulary of "
                                         f"{len(tokenizer)} tokens"):
        _trainer(tmp_path, tokenizer, teacher, loss="topk_forward_kl", topk=1000)
