"""Chunked losses (``--loss_chunk_size``) equal the dense ones; the ``Teacher`` seam."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import tiny_qwen2
from hypothesis import given
from hypothesis import strategies as st

from lookahead_opd import PAPER_RULE
from lookahead_opd.integrations.opd.logits import NextTokenLogits, OutputHead, model_logits
from lookahead_opd.integrations.opd.losses import (
    TokenScores,
    compute_loss,
    generalized_jsd_loss,
    reverse_kl_loss,
    teacher_needs,
)
from lookahead_opd.integrations.opd.scoring import loss_chunk_rows, score_tokens
from lookahead_opd.integrations.opd.teacher import (
    ModelTeacher,
    Teacher,
    TeacherNeeds,
    TeacherScores,
)

pytest.importorskip("transformers")

from lookahead_opd.integrations.opd.config import OPDConfig  # noqa: E402
from lookahead_opd.integrations.opd.engines import HFEngine  # noqa: E402
from lookahead_opd.integrations.opd.tasks import ArithmeticTask  # noqa: E402
from lookahead_opd.integrations.opd.tokenizer import char_tokenizer  # noqa: E402
from lookahead_opd.integrations.opd.trainer import OPDTrainer  # noqa: E402


def _close(a: torch.Tensor, b: torch.Tensor) -> None:
    """rtol 1e-5 (fp32), with an atol for entries near zero relative to the tensor's scale."""
    scale = float(b.detach().abs().max()) if b.numel() else 0.0
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6 * scale + 1e-7)


def _reference_logits(h, weight, bias, vocab, scale, softcap):
    """The head written out on its own: every position projected, then cut to ``vocab``."""
    z = h @ weight.T + (0 if bias is None else bias)
    z = z * scale
    if softcap is not None:
        z = torch.tanh(z / softcap) * softcap
    return z[..., :vocab]


@st.composite
def cases(draw):
    b, t = draw(st.integers(1, 3)), draw(st.integers(1, 6))
    hidden, vocab, pad = draw(st.integers(2, 8)), draw(st.integers(2, 40)), draw(st.integers(0, 3))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    mask = torch.rand(b, t, generator=g) < draw(st.sampled_from([0.0, 0.5, 1.0]))
    return dict(
        b=b, t=t, hidden=hidden, vocab=vocab, pad=pad, g=g, mask=mask,
        bias=draw(st.booleans()), scale=draw(st.sampled_from([1.0, 0.0625, 3.0])),
        softcap=draw(st.sampled_from([None, 5.0, 30.0])),
        temperature=draw(st.sampled_from([1.0, 0.5, 2.3])), chunk=draw(st.integers(1, 7)),
        beta=draw(st.sampled_from([0.0, 0.3, 0.5, 1.0])), loss=draw(st.sampled_from(["rkl", "jsd"])))


@pytest.mark.slow
@given(cases())
def test_chunked_full_vocab_losses_equal_the_dense_ones(c):
    """Loss, metrics and the gradients to the hidden states, the head weight and its bias, for
    random shapes, masks, temperatures, transforms and padded vocabularies."""
    def make(requires_grad):
        h = torch.randn(c["b"], c["t"], c["hidden"], generator=c["g"])
        w = torch.randn(c["vocab"] + c["pad"], c["hidden"], generator=c["g"])
        bias = torch.randn(c["vocab"] + c["pad"], generator=c["g"]) if c["bias"] else None
        return [x.requires_grad_(requires_grad) if x is not None else None for x in (h, w, bias)]

    student, teacher = make(True), make(False)
    kw = dict(temperature=c["temperature"])
    if c["loss"] == "jsd":
        def fn(s, t, m):
            return generalized_jsd_loss(s, t, m, beta=c["beta"], num_tokens=7, **kw)
    else:
        def fn(s, t, m):
            return reverse_kl_loss(s, t, m, num_tokens=7, **kw)
    transform = dict(vocab=c["vocab"], scale=c["scale"], softcap=c["softcap"])
    dense = fn(_reference_logits(*student, **transform), _reference_logits(*teacher, **transform),
               c["mask"])
    dense_grads = torch.autograd.grad(dense.loss, [x for x in student if x is not None])

    def chunked(h, w, bias):
        head = OutputHead(w, bias, vocab_size=c["vocab"], scale=c["scale"], softcap=c["softcap"])
        return NextTokenLogits(h, head, c["chunk"])

    out = fn(chunked(*student), chunked(*teacher), c["mask"])
    grads = torch.autograd.grad(out.loss, [x for x in student if x is not None])
    _close(out.loss, dense.loss)
    assert out.metrics.keys() == dense.metrics.keys()
    for k in dense.metrics:
        _close(torch.tensor(out.metrics[k]), torch.tensor(dense.metrics[k]))
    for a, b in zip(grads, dense_grads, strict=True):
        _close(a, b)
        if c["pad"]:  # the padded rows of the head are never projected: no gradient
            assert a.shape[0] != c["vocab"] + c["pad"] or not a[c["vocab"]:].any()


def test_chunked_bf16_head_matches_the_dense_loss():
    """A bf16 head, one row per chunk: the loss and its gradients (bf16, as the parameters) are
    the dense loss's to bf16 precision."""
    g = torch.Generator().manual_seed(0)
    h = torch.randn(2, 40, 16, generator=g).bfloat16().requires_grad_(True)
    w = (torch.randn(50, 16, generator=g) / 4).bfloat16().requires_grad_(True)
    ht, wt = torch.randn(2, 40, 16, generator=g).bfloat16(), torch.randn(50, 16, generator=g)
    mask = torch.ones(2, 40, dtype=torch.bool)
    dense = reverse_kl_loss(h @ w.T, ht @ wt.bfloat16().T, mask)
    dense_grads = torch.autograd.grad(dense.loss, [h, w])
    out = reverse_kl_loss(NextTokenLogits(h, OutputHead(w, vocab_size=50), 1),
                          NextTokenLogits(ht, OutputHead(wt.bfloat16(), vocab_size=50), 1), mask)
    grads = torch.autograd.grad(out.loss, [h, w])
    assert all(x.dtype == torch.bfloat16 for x in grads)
    torch.testing.assert_close(out.loss, dense.loss, rtol=1e-2, atol=1e-3)
    for a, b in zip(grads, dense_grads, strict=True):
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-2 * float(b.abs().max()))


@given(cases())
def test_chunked_sampled_token_logprobs_equal_the_dense_ones(c):
    """The sampled tokens' log-probs (and their gradient) from a logsumexp per chunk."""
    g = c["g"]
    h = torch.randn(c["b"], c["t"], c["hidden"], generator=g, requires_grad=True)
    w = torch.randn(c["vocab"] + c["pad"], c["hidden"], generator=g, requires_grad=True)
    tokens = torch.randint(0, c["vocab"], (c["b"], c["t"]), generator=g)
    head = OutputHead(w, vocab_size=c["vocab"], softcap=c["softcap"])
    dense = NextTokenLogits(head(h)).token_logprobs(tokens, c["mask"])
    chunked = NextTokenLogits(h, head, c["chunk"]).token_logprobs(tokens, c["mask"])
    weights = torch.randn(c["b"], c["t"], generator=g) * c["mask"]
    _close(chunked * c["mask"], dense * c["mask"])
    for a, b in zip(torch.autograd.grad((chunked * weights).sum(), [h, w]),
                    torch.autograd.grad((dense * weights).sum(), [h, w]), strict=True):
        _close(a, b)


def test_topk_is_the_log_softmax_topk():
    g = torch.Generator().manual_seed(0)
    h, w = torch.randn(2, 5, 4, generator=g), torch.randn(11, 4, generator=g)
    mask = torch.tensor([[1, 1, 0, 1, 1], [0, 1, 1, 1, 0]], dtype=torch.bool)
    head = OutputHead(w, vocab_size=9)
    values, ids = NextTokenLogits(h, head, 2).topk(3, mask)
    ref_v, ref_i = torch.log_softmax(head(h), -1).topk(3, dim=-1)
    _close(values[mask], ref_v[mask])
    assert torch.equal(ids[mask], ref_i[mask]) and not values[~mask].any()


# --------------------------------------------------------------------- through real models

@pytest.fixture(scope="module")
def tokenizer():
    return char_tokenizer()


def _batch(tokenizer, seed=0, rows=3, length=12):
    g = torch.Generator().manual_seed(seed)
    seq = torch.randint(3, len(tokenizer), (rows, length), generator=g)
    attn = torch.ones_like(seq)
    attn[0, :3] = 0  # a left-padded prompt
    completion = torch.zeros_like(seq)
    completion[:, 6:] = 1
    completion[1, 10:] = 0  # a completion that ended early (right padding)
    attn[1, 10:] = 0
    return seq, attn, completion


@pytest.mark.parametrize("loss", ["reverse_kl_pg", "reverse_kl", "jsd", "drgrpo"])
@pytest.mark.parametrize("tied,pad", [(False, 0), (True, 0), (False, 5)])
def test_score_tokens_chunked_equals_dense_on_a_model(tokenizer, loss, tied, pad):
    """Every loss through ``score_tokens``: the same loss, metrics and gradients on every
    parameter, with a tied embedding and with a padded vocabulary (the head larger than the
    tokenizer's vocabulary)."""
    vocab = len(tokenizer)
    student = tiny_qwen2(vocab + pad, 0)
    student.config.tie_word_embeddings = tied
    if tied:
        student.lm_head.weight = student.model.embed_tokens.weight
    teacher = tiny_qwen2(vocab + pad, 1).requires_grad_(False)
    seq, attn, completion = _batch(tokenizer)
    config = OPDConfig(loss=loss, jsd_beta=0.3)
    results = []
    for chunk in (0, 4):
        student.zero_grad()
        scores = score_tokens(student, teacher, seq, attn, completion, vocab,
                              needs=teacher_needs(loss), chunk_size=chunk,
                              advantages=torch.tensor([1.0, -0.5, 0.25]))
        out = compute_loss(loss, scores, num_tokens=20, options=config.loss_options())
        out.loss.backward()
        results.append((out, {n: p.grad.clone() for n, p in student.named_parameters()}))
    (dense, dense_grads), (chunked, grads) = results
    _close(chunked.loss.detach(), dense.loss.detach())
    for k in dense.metrics:
        assert chunked.metrics[k] == pytest.approx(dense.metrics[k], rel=1e-5, abs=1e-6), k
    for name, grad in grads.items():
        _close(grad, dense_grads[name])


def test_model_heads_with_their_own_transform(tokenizer):
    """Gemma-2's soft-capping and Cohere's logit_scale are reproduced; a head that transforms
    its logits some other way, or is not a Linear, is refused in one line."""
    from transformers import (
        CohereConfig,
        CohereForCausalLM,
        Gemma2Config,
        Gemma2ForCausalLM,
        Qwen2ForCausalLM,
    )

    small = dict(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                 num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=16)
    torch.manual_seed(0)
    models = [Gemma2ForCausalLM(Gemma2Config(**small, final_logit_softcapping=2.0)),
              CohereForCausalLM(CohereConfig(**small, logit_scale=0.5))]
    seq, attn, completion = _batch(tokenizer)
    mask = completion[:, 1:].bool()
    for model in models:
        model.eval()
        with torch.no_grad():
            dense = model_logits(model, seq, attn, len(tokenizer))
            chunked = model_logits(model, seq, attn, len(tokenizer), chunk_size=3)
            assert chunked.head is not None and chunked.head.scale * (
                chunked.head.softcap or 1) != 1.0
            _close(chunked.logits()[mask], dense.states[mask])

    class Doubled(Qwen2ForCausalLM):  # an unknown final-logit transform
        def forward(self, *args, **kwargs):
            out = super().forward(*args, **kwargs)
            out.logits = out.logits * 2
            return out

    odd = Doubled(tiny_qwen2(len(tokenizer), 0).config)
    with pytest.raises(ValueError, match="Doubled's output head transforms its logits.*"
                                         "--loss_chunk_size 0"):
        model_logits(odd, seq, attn, len(tokenizer), chunk_size=3)
    odd = tiny_qwen2(len(tokenizer), 0)
    odd.lm_head = torch.nn.Sequential(odd.lm_head)
    with pytest.raises(ValueError, match="not an nn.Linear"):
        model_logits(odd, seq, attn, len(tokenizer), chunk_size=3)


def test_auto_chunk_size():
    assert loss_chunk_rows(0, 10**6, 10**6) == 0 and loss_chunk_rows(7, 1, 1) == 7
    assert loss_chunk_rows(None, 64, 64) == 0  # small: dense
    assert loss_chunk_rows(None, 4096, 151936) == 128


# --------------------------------------------------------------------- the Teacher seam

def test_teacher_needs_order_and_checks():
    sampled, full, top5, top20 = (TeacherNeeds.SAMPLED, TeacherNeeds.FULL, TeacherNeeds.topk(5),
                                  TeacherNeeds.topk(20))
    assert full.covers(top20) and top20.covers(top5) and not top5.covers(top20)
    assert top5.covers(sampled) and not sampled.covers(top5) and not top20.covers(full)
    assert teacher_needs("reverse_kl_pg") == teacher_needs("drgrpo") == sampled
    assert teacher_needs("reverse_kl") == teacher_needs("jsd") == full
    with pytest.raises(ValueError, match="k > 0 goes with level 'topk'"):
        TeacherNeeds("full", 3)
    with pytest.raises(ValueError, match="level must be one of"):
        TeacherNeeds("logits")


class SampledOnly(Teacher):
    """A teacher that, like an inference server, gives only the sampled tokens' log-probs."""

    def __init__(self, model, vocab_size):
        self.inner, self.vocab_size, self.calls = ModelTeacher(model, vocab_size), vocab_size, 0

    @property
    def capability(self):
        return TeacherNeeds.SAMPLED

    def score(self, sequences, attention_mask, completion_mask, needs):
        self.calls += 1
        got = self.inner.score(sequences, attention_mask, completion_mask, TeacherNeeds.SAMPLED)
        return TeacherScores(token_logprobs=got.token_logprobs)


def _trainer(tmp_path, tokenizer, teacher=None, **options):
    student = tiny_qwen2(len(tokenizer), 0, tokenizer=tokenizer)
    if teacher is None:
        teacher = tiny_qwen2(len(tokenizer), 1, tokenizer=tokenizer)
        with torch.no_grad():
            teacher.lm_head.weight.mul_(30.0)
    defaults = dict(output_dir=str(tmp_path), batch_size=8, max_steps=3, learning_rate=1e-2,
                    max_new_tokens=4, eval_every=0, eval_size=8, gate_size=8, progress=False,
                    max_grad_norm=None)
    config = OPDConfig(**{**defaults, **options})
    return OPDTrainer(config, student, teacher, ArithmeticTask(),
                      HFEngine(student, tokenizer, batch_size=64), tokenizer=tokenizer)


@pytest.mark.slow
def test_a_teacher_that_gives_sampled_logprobs_trains_like_the_module(tmp_path, tokenizer):
    """A ``Teacher`` other than a module runs the sampled-token loss exactly as the module
    does; a loss or gate that needs more is refused before step 0, in one line."""
    teacher_model = tiny_qwen2(len(tokenizer), 1, tokenizer=tokenizer)
    with torch.no_grad():
        teacher_model.lm_head.weight.mul_(30.0)
    served = SampledOnly(copy.deepcopy(teacher_model).requires_grad_(False), len(tokenizer))
    a = _trainer(tmp_path / "a", tokenizer, teacher_model).train()
    b = _trainer(tmp_path / "b", tokenizer, served).train()
    assert served.calls == 3
    assert [m.get("loss") for m in a.metrics] == [m.get("loss") for m in b.metrics]
    for needs, options in (("the full distribution", dict(loss="jsd")),
                           ("the full distribution", dict(extrapolate=True, gate="neg_kl"))):
        with pytest.raises(ValueError, match=f"reads {needs} from the teacher, but "
                                             "SampledOnly gives at most the sampled"):
            _trainer(tmp_path / "c", tokenizer, served, **options)


# --------------------------------------------------------------------- the OPD loop

@pytest.mark.slow
@pytest.mark.parametrize("loss", ["reverse_kl", "jsd", "reverse_kl_pg"])
def test_an_opd_run_with_chunking_gives_the_metrics_of_one_without(tmp_path, tokenizer, loss):
    """fp32, same seed: the same per-step metrics (and gate decisions) with and without
    chunking, to float rounding."""
    runs = [_trainer(tmp_path / str(chunk), tokenizer, loss=loss, loss_chunk_size=chunk,
                     max_steps=4, extrapolate=True, gate="neg_kl").train()
            for chunk in (0, 3)]
    dense, chunked = ([m for m in r.metrics if "loss" in m] for r in runs)
    assert len(dense) == len(chunked) == 4
    for d, c in zip(dense, chunked, strict=True):
        for k in ("loss", "reverse_kl", "grad_norm", "num_tokens", "reward"):
            if d.get(k) is not None:
                assert c[k] == pytest.approx(d[k], rel=1e-4, abs=1e-6), (k, d["step"])
    assert [j["accepted"] for j in runs[0].jumps] == [j["accepted"] for j in runs[1].jumps]


@pytest.mark.slow
def test_gate_scores_the_teacher_once_with_the_same_decisions(tmp_path, tokenizer, monkeypatch):
    """The -KL gate's teacher scores on the fixed gate rollouts are computed once per run
    (and again after a resume loads other rollouts), and a run that recomputes them at every
    evaluation takes the same decisions and ends at the same weights."""
    def run(path, recompute):
        t = _trainer(path, tokenizer, extrapolate=True, gate="neg_kl", max_steps=4, **PAPER_RULE)
        calls = []
        t.teacher.register_forward_hook(lambda *_: calls.append(1))
        if recompute:
            gate = t.gate_reverse_kl

            def fresh():
                t._gate_teacher = None
                return gate()

            monkeypatch.setattr(t, "gate_reverse_kl", fresh)
        result = t.train()
        return t, result, len(calls)

    cached, cached_result, cached_calls = run(tmp_path / "a", recompute=False)
    fresh, fresh_result, fresh_calls = run(tmp_path / "b", recompute=True)
    assert cached.gate_evals == fresh.gate_evals >= 4
    # one teacher forward per step's loss, plus one for the gate set (vs one per evaluation)
    assert cached_calls == 4 + 1 and fresh_calls == 4 + fresh.gate_evals
    def decisions(result):
        return [{k: v for k, v in j.items() if k != "seconds"} for j in result.jumps]

    assert decisions(cached_result) == decisions(fresh_result)
    assert any(j["accepted"] for j in cached_result.jumps)  # the gate had something to decide
    for (name, a), b in zip(cached.student.state_dict().items(),
                            fresh.student.state_dict().values(), strict=True):
        assert torch.equal(a, b), name

    before = cached.gate_reverse_kl()
    assert cached.load_checkpoint() and cached._gate_teacher is None
    assert cached.gate_reverse_kl() == before


@pytest.mark.parametrize("chunk", [0, 3])
def test_rl_loss_scores_completions_under_the_temperature_that_sampled_them(chunk):
    """drgrpo's log-probs are the sampler's, softmax(logits / T), dense and chunked (a 0.7
    sampler scored at 1 would bias the policy gradient); the distillation pair stays at 1."""
    torch.manual_seed(0)
    h, w = torch.randn(2, 6, 8), torch.randn(20, 8)
    tokens, mask = torch.randint(0, 20, (2, 6)), torch.rand(2, 6) > 0.3
    head = OutputHead(w, vocab_size=20)
    student = NextTokenLogits(head(h)) if chunk == 0 else NextTokenLogits(h, head, chunk)
    teacher = TeacherScores(token_logprobs=torch.zeros(2, 6))

    def picked(t: float) -> torch.Tensor:
        ref = torch.log_softmax(head(h).double() / t, -1).gather(-1, tokens[..., None])[..., 0]
        return torch.where(mask, ref, 0.0)

    scores = TokenScores(student, teacher, tokens, mask, torch.ones(2), temperature=0.7)
    sampler, _ = scores.rewards()
    torch.testing.assert_close(torch.where(mask, sampler.double(), 0.0), picked(0.7), atol=1e-5,
                               rtol=0)
    own, _ = scores.logprobs()
    torch.testing.assert_close(torch.where(mask, own.double(), 0.0), picked(1.0), atol=1e-5, rtol=0)
    assert not torch.allclose(picked(0.7), picked(1.0))
