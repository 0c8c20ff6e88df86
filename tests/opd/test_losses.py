"""OPD losses: closed forms, analytic gradients, masking, normalisation, vocab checks."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from lookahead_opd.integrations.opd import logits as logits_module
from lookahead_opd.integrations.opd.losses import (
    LOSS_INPUTS,
    LOSSES,
    LossOutput,
    discounted_returns,
    generalized_jsd_loss,
    get_loss,
    group_advantages,
    policy_gradient_loss,
    reverse_kl_loss,
    reverse_kl_pg_loss,
    shift_for_next_token,
    token_logprobs,
)
from lookahead_opd.integrations.opd.vocab import align_vocab, check_vocab_compatible


def logits_of(*rows: list[float]) -> torch.Tensor:
    """[1, T, V] logits whose softmax is exactly the given probability rows."""
    return torch.tensor(rows, dtype=torch.float64).log().unsqueeze(0)


def kl(p: list[float], q: list[float]) -> float:
    return sum(a * math.log(a / b) for a, b in zip(p, q, strict=True) if a > 0)


def rand_case(seed: int = 0, b: int = 3, t: int = 6, v: int = 7, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    s = (torch.randn(b, t, v, generator=g) * 2).to(dtype)
    te = (torch.randn(b, t, v, generator=g) * 2).to(dtype)
    mask = torch.rand(b, t, generator=g) > 0.3
    mask[0, 0] = True
    mask[-1, -1] = False
    return s, te, mask


FULL_VOCAB = {
    "reverse_kl": lambda s, t, m, **kw: reverse_kl_loss(s, t, m, **kw),
    "jsd0": lambda s, t, m, **kw: generalized_jsd_loss(s, t, m, beta=0.0, **kw),
    "jsd03": lambda s, t, m, **kw: generalized_jsd_loss(s, t, m, beta=0.3, **kw),
    "jsd05": lambda s, t, m, **kw: generalized_jsd_loss(s, t, m, beta=0.5, **kw),
    "jsd1": lambda s, t, m, **kw: generalized_jsd_loss(s, t, m, beta=1.0, **kw),
}


def grad_of(fn, s, t, m, **kw):
    s = s.detach().clone().requires_grad_(True)
    out = fn(s, t, m, **kw)
    out.loss.backward()
    return out, s.grad


# ------------------------------------------------------------------------------ alignment / lp


def test_shift_for_next_token_pairs_logits_with_the_next_token():
    logits = torch.arange(2 * 4 * 3, dtype=torch.float32).reshape(2, 4, 3)
    ids = torch.tensor([[0, 1, 2, 0], [2, 2, 1, 0]])
    mask = torch.tensor([[0, 0, 1, 1], [0, 1, 1, 0]], dtype=torch.bool)
    lg, tok, m = shift_for_next_token(logits, ids, mask)
    assert lg.shape == (2, 3, 3) and tok.shape == (2, 3) and m.shape == (2, 3)
    assert (
        torch.equal(lg, logits[:, :3])
        and torch.equal(tok, ids[:, 1:])
        and torch.equal(m, mask[:, 1:])
    )
    with pytest.raises(ValueError, match="completion_mask"):
        shift_for_next_token(logits, ids, mask[:, :3])
    with pytest.raises(ValueError, match="input_ids"):
        shift_for_next_token(logits, ids[:, :3], mask[:, :3])


def test_token_logprobs_matches_log_softmax_gather_and_keeps_grad():
    s, _, _ = rand_case(1)
    tokens = torch.randint(0, s.shape[-1], s.shape[:2], generator=torch.Generator().manual_seed(2))
    ref = torch.log_softmax(s.double(), -1).gather(-1, tokens[..., None]).squeeze(-1)
    x = s.clone().requires_grad_(True)
    lp = token_logprobs(x, tokens)
    assert lp.dtype == torch.float32
    torch.testing.assert_close(lp.double(), ref, atol=1e-5, rtol=0)
    lp.sum().backward()
    expected = torch.nn.functional.one_hot(tokens, s.shape[-1]) - torch.softmax(s.double(), -1)
    torch.testing.assert_close(x.grad.double(), expected, atol=1e-5, rtol=0)


def test_token_logprobs_no_grad_chunking_on_a_shifted_view(monkeypatch):
    s, _, _ = rand_case(3, b=2, t=9, v=5)
    tokens = torch.randint(0, 5, (2, 9), generator=torch.Generator().manual_seed(4))
    lg, tok, _ = shift_for_next_token(
        s.to(torch.bfloat16), tokens, torch.ones(2, 9, dtype=torch.bool)
    )
    full = token_logprobs(lg.float().requires_grad_(True), tok).detach()
    monkeypatch.setattr(logits_module, "_CHUNK_ELEMENTS", 10)  # 2 rows per chunk: many chunks, ragged tail
    with torch.no_grad():
        chunked = token_logprobs(lg, tok)
    assert chunked.dtype == torch.float32 and chunked.shape == (2, 8)
    torch.testing.assert_close(chunked, full, atol=1e-6, rtol=0)


def test_token_logprobs_errors_name_the_problem():
    with pytest.raises(ValueError, match=r"tokens \(2, 3\)"):
        token_logprobs(torch.zeros(2, 4, 5), torch.zeros(2, 3, dtype=torch.long))
    with pytest.raises(TypeError, match="integer"):
        token_logprobs(torch.zeros(2, 4, 5), torch.zeros(2, 4))


# ---------------------------------------------------------------------------- closed forms


def test_reverse_kl_closed_form_two_and_three_way():
    p1, q1 = [0.75, 0.25], [0.5, 0.5]
    out = reverse_kl_loss(logits_of(p1), logits_of(q1), torch.ones(1, 1, dtype=torch.bool))
    assert out.loss.item() == pytest.approx(0.75 * math.log(1.5) + 0.25 * math.log(0.5), abs=1e-12)

    p, q = [[0.2, 0.3, 0.5], [0.6, 0.3, 0.1]], [[0.1, 0.1, 0.8], [1 / 3, 1 / 3, 1 / 3]]
    out = reverse_kl_loss(logits_of(*p), logits_of(*q), torch.ones(1, 2, dtype=torch.bool))
    expected = (kl(p[0], q[0]) + kl(p[1], q[1])) / 2
    assert out.loss.item() == pytest.approx(expected, abs=1e-12)
    assert out.metrics["reverse_kl"] == pytest.approx(expected, rel=1e-6)
    assert out.metrics["num_tokens"] == 2
    entropy = -sum(a * math.log(a) for row in p for a in row) / 2
    assert out.metrics["student_entropy"] == pytest.approx(entropy, rel=1e-6)


def test_jsd_closed_forms_and_endpoints():
    p, q = [0.2, 0.3, 0.5], [0.1, 0.1, 0.8]  # student p, teacher q
    s, t, m = logits_of(p), logits_of(q), torch.ones(1, 1, dtype=torch.bool)
    assert generalized_jsd_loss(s, t, m, beta=0.0).loss.item() == pytest.approx(kl(q, p), abs=1e-12)
    assert generalized_jsd_loss(s, t, m, beta=1.0).loss.item() == pytest.approx(kl(p, q), abs=1e-12)
    for beta in (0.25, 0.5, 0.9):
        mix = [beta * b + (1 - beta) * a for a, b in zip(p, q, strict=True)]
        expected = beta * kl(q, mix) + (1 - beta) * kl(p, mix)
        got = generalized_jsd_loss(s, t, m, beta=beta).loss.item()
        assert got == pytest.approx(expected, abs=1e-12), beta
    # The TRL endpoints are exact KLs, not limits of the mixture form (which -> 0).
    assert generalized_jsd_loss(s, t, m, beta=1e-6).loss.item() < 1e-5 < kl(q, p)


def test_jsd_endpoints_equal_forward_and_reverse_kl_on_random_logits():
    s, t, m = rand_case(5)
    torch.testing.assert_close(
        generalized_jsd_loss(s, t, m, beta=1.0).loss, reverse_kl_loss(s, t, m).loss
    )
    # beta=0 is KL(teacher || student): the reverse KL with the roles swapped.
    torch.testing.assert_close(
        generalized_jsd_loss(s, t, m, beta=0.0).loss, reverse_kl_loss(t, s, m).loss
    )
    assert not torch.allclose(
        generalized_jsd_loss(s, t, m, beta=0.0).loss, reverse_kl_loss(s, t, m).loss
    )


def test_jsd_half_is_symmetric_and_other_betas_mirror():
    s, t, m = rand_case(6)
    a = generalized_jsd_loss(s, t, m, beta=0.5).loss
    b = generalized_jsd_loss(t, s, m, beta=0.5).loss
    torch.testing.assert_close(a, b, atol=1e-6, rtol=0)
    # JSD_beta(student, teacher) = JSD_{1-beta}(teacher, student), and beta=0.3 is not symmetric.
    c = generalized_jsd_loss(s, t, m, beta=0.3).loss
    torch.testing.assert_close(c, generalized_jsd_loss(t, s, m, beta=0.7).loss, atol=1e-6, rtol=0)
    assert abs(c.item() - generalized_jsd_loss(t, s, m, beta=0.3).loss.item()) > 1e-4


@given(seed=st.integers(0, 10_000), beta=st.floats(0.01, 0.99))
def test_jsd_is_bounded_by_the_mixture_entropy(seed, beta):
    s, t, m = rand_case(seed, b=2, t=3, v=5)
    s, t = s * 4, t * 4
    per = generalized_jsd_loss(s, t, m, beta=beta).metrics["jsd"]
    bound = -beta * math.log(beta) - (1 - beta) * math.log(1 - beta)
    assert -1e-6 <= per <= bound + 1e-6
    assert reverse_kl_loss(s, t, m).metrics["reverse_kl"] >= -1e-6


def test_jsd_validates_beta():
    s, t, m = rand_case(0)
    for bad in (-0.1, 1.5, float("nan"), "0.5"):
        with pytest.raises(ValueError, match="beta"):
            generalized_jsd_loss(s, t, m, beta=bad)


# ------------------------------------------------------------------------------- gradients


def test_reverse_kl_gradient_matches_the_analytic_formula_and_teacher_gets_none():
    s, t, m = rand_case(7, dtype=torch.float64)
    teacher = t.clone().requires_grad_(True)
    out, g = grad_of(reverse_kl_loss, s, teacher, m, num_tokens=10)
    assert teacher.grad is None
    lp, lq = torch.log_softmax(s, -1), torch.log_softmax(t, -1)
    p = lp.exp()
    kl_rows = (p * (lp - lq)).sum(-1, keepdim=True)
    expected = p * (lp - lq - kl_rows) / 10 * m[..., None]
    torch.testing.assert_close(g, expected, atol=1e-12, rtol=0)


@pytest.mark.parametrize("name", list(FULL_VOCAB))
def test_full_vocab_gradcheck_in_float64(name):
    s, t, m = rand_case(8, b=2, t=3, v=4, dtype=torch.float64)
    fn = FULL_VOCAB[name]
    assert torch.autograd.gradcheck(
        lambda x: fn(x, t, m, temperature=1.5).loss, (s.clone().requires_grad_(True),)
    )


@pytest.mark.parametrize("name", list(FULL_VOCAB))
def test_zero_loss_and_gradient_when_student_equals_teacher(name):
    s, _, m = rand_case(9)
    out, g = grad_of(FULL_VOCAB[name], s, s.clone(), m)
    assert abs(out.loss.item()) < 1e-6
    assert g.abs().max().item() < 1e-6
    # and a different teacher gives a clearly non-zero loss and gradient
    out2, g2 = grad_of(FULL_VOCAB[name], s, s + torch.randn_like(s), m)
    assert out2.loss.item() > 1e-3 and g2.abs().max().item() > 1e-4


def test_pg_gradient_is_minus_advantage_over_num_tokens():
    g = torch.Generator().manual_seed(10)
    lp_s = torch.randn(2, 5, generator=g, dtype=torch.float64) - 2
    lp_t = torch.randn(2, 5, generator=g, dtype=torch.float64) - 2
    mask = torch.tensor([[0, 1, 1, 1, 0], [1, 1, 0, 0, 0]], dtype=torch.bool)
    for discount in (0.0, 0.9):
        x = lp_s.clone().requires_grad_(True)
        out = reverse_kl_pg_loss(x, lp_t, mask, discount=discount, num_tokens=7)
        out.loss.backward()
        adv = discounted_returns(-(lp_s - lp_t), mask, discount)
        torch.testing.assert_close(x.grad, -adv * mask / 7, atol=1e-12, rtol=0)
        torch.testing.assert_close(out.loss, -(adv * mask).sum() / 7)
        assert out.metrics["advantage"] == pytest.approx((adv * mask).sum().item() / 5, rel=1e-6)
        assert out.metrics["reverse_kl"] == pytest.approx(
            ((lp_s - lp_t) * mask).sum().item() / 5, rel=1e-6
        )
        assert out.metrics["ratio"] == pytest.approx(1.0) and out.metrics["clip_frac"] == 0.0
    # The per-token loss value at a single token is -A (ratio 1): hand example.
    one = reverse_kl_pg_loss(torch.tensor([[-1.0]]), torch.tensor([[-0.25]]), torch.ones(1, 1))
    assert one.loss.item() == pytest.approx(-0.75)


def test_pg_teacher_never_receives_gradient():
    lp_s = torch.full((1, 3), -1.0, requires_grad=True)
    lp_t = torch.full((1, 3), -2.0, requires_grad=True)
    reverse_kl_pg_loss(lp_s, lp_t, torch.ones(1, 3)).loss.backward()
    assert lp_t.grad is None and lp_s.grad is not None


# ----------------------------------------------------------------- discounted returns / clipping


def test_discounted_returns_hand_example_and_padding():
    adv = torch.tensor(
        [[1.0, 2.0, 3.0, 9.0, 9.0], [9.0, 9.0, 1.0, 2.0, 3.0], [1.0, 2.0, 9.0, 3.0, 4.0]]
    )
    mask = torch.tensor([[1, 1, 1, 0, 0], [0, 0, 1, 1, 1], [1, 1, 0, 1, 1]], dtype=torch.bool)
    got = discounted_returns(adv, mask, 0.5)
    expected = torch.tensor(
        [
            [1 + 0.5 * 2 + 0.25 * 3, 2 + 0.5 * 3, 3.0, 0.0, 0.0],  # right padding: pads ignored
            [0.0, 0.0, 2.75, 3.5, 3.0],  # left padding: prompt gets nothing
            [1 + 0.5 * 2, 2.0, 0.0, 3 + 0.5 * 4, 4.0],  # packed: no crossing the gap
        ]
    )
    torch.testing.assert_close(got, expected)
    torch.testing.assert_close(discounted_returns(adv, mask, 0.0), adv * mask)
    # gamma=1 on a long row: plain reverse cumulative sum (checks the doubling scan at T=37)
    long = torch.randn(2, 37, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    ones = torch.ones(2, 37, dtype=torch.bool)
    torch.testing.assert_close(discounted_returns(long, ones, 1.0), long.flip(1).cumsum(1).flip(1))
    with pytest.raises(ValueError, match="discount"):
        discounted_returns(adv, mask, 1.5)


def test_pg_ratio_clipping():
    lp_old = torch.zeros(1, 4, dtype=torch.float64)
    ratios = torch.tensor([[1.5, 1.5, 0.5, 1.1]], dtype=torch.float64)
    lp_s = ratios.log()
    adv = torch.tensor([[1.0, -1.0, -1.0, 2.0]], dtype=torch.float64)
    lp_t = lp_s + adv  # A = -(lp_s - lp_t)
    mask = torch.ones(1, 4, dtype=torch.bool)

    x = lp_s.clone().requires_grad_(True)
    out = reverse_kl_pg_loss(x, lp_t, mask, sampler_logprobs=lp_old, clip_ratio=0.2, num_tokens=4)
    out.loss.backward()
    # token 0: r=1.5>1.2, A>0 -> clipped (no grad); token 1: r=1.5, A<0 -> unclipped r·A;
    # token 2: r=0.5<0.8, A<0 -> clipped; token 3: r=1.1 inside -> r·A.
    objective = torch.tensor([1.2 * 1.0, 1.5 * -1.0, 0.8 * -1.0, 1.1 * 2.0], dtype=torch.float64)
    assert out.loss.item() == pytest.approx(-objective.sum().item() / 4, abs=1e-12)
    expected_grad = -torch.tensor([[0.0, 1.5 * -1.0, 0.0, 1.1 * 2.0]], dtype=torch.float64) / 4
    torch.testing.assert_close(x.grad, expected_grad, atol=1e-12, rtol=0)
    assert out.metrics["clip_frac"] == pytest.approx(0.5)
    assert out.metrics["ratio"] == pytest.approx(ratios.mean().item())

    # Without clipping every token gets r·A; asymmetric clip (0.2, 0.6) unclips token 0.
    x2 = lp_s.clone().requires_grad_(True)
    reverse_kl_pg_loss(x2, lp_t, mask, sampler_logprobs=lp_old, num_tokens=4).loss.backward()
    torch.testing.assert_close(x2.grad, -ratios * adv / 4)
    out3 = reverse_kl_pg_loss(lp_s, lp_t, mask, sampler_logprobs=lp_old, clip_ratio=(0.2, 0.6))
    assert out3.metrics["clip_frac"] == pytest.approx(0.25)
    for bad in (0.0, -0.1, (0.2, 0.0)):
        with pytest.raises(ValueError, match="clip_ratio"):
            reverse_kl_pg_loss(lp_s, lp_t, mask, clip_ratio=bad)


# ------------------------------------------------------------------- masking / normalisation


def _pg_from_logits(s, t, m, **kw):
    tokens = torch.zeros(s.shape[:2], dtype=torch.long)
    return reverse_kl_pg_loss(
        token_logprobs(s, tokens), token_logprobs(t, tokens), m, discount=0.7, **kw
    )


ALL = {**FULL_VOCAB, "reverse_kl_pg": _pg_from_logits}


@pytest.mark.parametrize("name", list(ALL))
def test_masked_positions_change_nothing(name):
    s, t, m = rand_case(11)
    fn = ALL[name]
    out, g = grad_of(fn, s, t, m)
    g2 = torch.Generator().manual_seed(12)
    s2 = torch.where(m[..., None], s, torch.randn(s.shape, generator=g2) * 50)
    t2 = torch.where(m[..., None], t, torch.randn(s.shape, generator=g2) * 50)
    out2, grad2 = grad_of(fn, s2, t2, m)
    assert out.loss.item() == out2.loss.item()
    assert torch.equal(g, grad2)
    assert torch.all(g[~m] == 0) and g[m].abs().sum() > 0
    assert out.metrics == out2.metrics


@pytest.mark.parametrize("name", list(ALL))
def test_micro_batches_with_global_num_tokens_add_up_to_the_full_batch(name):
    s, t, m = rand_case(13, b=4)
    fn = ALL[name]
    full, g_full = grad_of(fn, s, t, m)
    n = int(m.sum())
    x = s.clone().requires_grad_(True)
    total = sum(fn(x[i:j], t[i:j], m[i:j], num_tokens=n).loss for i, j in ((0, 1), (1, 4)))
    total.backward()
    torch.testing.assert_close(total, full.loss, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(x.grad, g_full, atol=1e-7, rtol=1e-6)
    # Without the global count each micro-batch would average on its own: different result.
    local = sum(fn(s[i:j], t[i:j], m[i:j]).loss for i, j in ((0, 1), (1, 4)))
    assert abs(local.item() - full.loss.item()) > 1e-4


def test_num_tokens_validation_and_empty_mask():
    s, t, m = rand_case(14)
    for bad in (0, -3, float("inf")):
        with pytest.raises(ValueError, match="num_tokens"):
            reverse_kl_loss(s, t, m, num_tokens=bad)
    empty = torch.zeros_like(m)
    for fn in ALL.values():
        out, g = grad_of(fn, s, t, empty)
        assert out.loss.item() == 0.0 and torch.all(g == 0) and out.metrics["num_tokens"] == 0
    torch.testing.assert_close(
        reverse_kl_loss(s, t, m, num_tokens=torch.tensor(5.0)).loss,
        reverse_kl_loss(s, t, m, num_tokens=5).loss,
    )


def test_shape_errors_name_shapes():
    s, t, m = rand_case(15)
    with pytest.raises(ValueError, match=r"completion_mask has shape \(3, 5\)"):
        reverse_kl_loss(s, t, m[:, :5])
    with pytest.raises(ValueError, match="vocab sizes differ.*align_vocab"):
        generalized_jsd_loss(s, t[..., :5], m)
    with pytest.raises(ValueError, match="teacher_logprobs"):
        reverse_kl_pg_loss(torch.zeros(3, 6), torch.zeros(3, 5), m)
    with pytest.raises(ValueError, match="temperature"):
        reverse_kl_loss(s, t, m, temperature=0)


def test_temperature_softens_both_distributions():
    s, t, m = rand_case(16)
    got = reverse_kl_loss(s, t, m, temperature=2.0).loss
    torch.testing.assert_close(got, reverse_kl_loss(s / 2, t / 2, m).loss)
    assert abs(got.item() - reverse_kl_loss(s, t, m).loss.item()) > 1e-3


# --------------------------------------------------------------------------- dtype / stability


@pytest.mark.parametrize("name", list(ALL))
def test_bf16_logits_give_fp32_accurate_results(name):
    s, t, m = rand_case(17, v=50)
    sb, tb = s.to(torch.bfloat16), t.to(torch.bfloat16)
    fn = ALL[name]
    out_b, g_b = grad_of(fn, sb, tb, m)
    out_f, g_f = grad_of(fn, sb.float(), tb.float(), m)  # same values, upcast first
    assert out_b.loss.dtype == torch.float32 and torch.isfinite(out_b.loss)
    torch.testing.assert_close(out_b.loss, out_f.loss, atol=1e-6, rtol=1e-6)
    assert g_b.dtype == torch.bfloat16
    torch.testing.assert_close(g_b.float(), g_f.to(torch.bfloat16).float())


@pytest.mark.parametrize("name", list(FULL_VOCAB))
def test_neg_inf_logits_stay_finite(name):
    s, t, m = rand_case(18)
    s[..., -1] = float("-inf")  # a vocab slot both models forbid (e.g. padded embeddings)
    t[..., -1] = float("-inf")
    s[..., 2] = -1e30  # a near-impossible but finite slot
    out, g = grad_of(FULL_VOCAB[name], s, t, m)
    assert torch.isfinite(out.loss) and torch.isfinite(g).all()
    ref = FULL_VOCAB[name](s[..., :-1], t[..., :-1], m).loss
    torch.testing.assert_close(out.loss, ref, atol=1e-6, rtol=1e-6)


def test_large_logits_do_not_overflow():
    s, t, m = rand_case(19)
    out = reverse_kl_loss(s * 1e3 + 1e4, t * 1e3, m)
    lp = token_logprobs(s * 1e4, torch.zeros(s.shape[:2], dtype=torch.long))
    assert torch.isfinite(out.loss) and torch.isfinite(lp).all() and (lp <= 0).all()


# ------------------------------------------------------------------------------ vocabularies


class FakeTokenizer:
    def __init__(self, vocab: dict[str, int]) -> None:
        self._vocab = vocab

    def get_vocab(self) -> dict[str, int]:
        return dict(self._vocab)

    def __len__(self) -> int:
        return len(self._vocab)


def fake_model(vocab_size: int) -> SimpleNamespace:
    return SimpleNamespace(config=SimpleNamespace(vocab_size=vocab_size))


VOCAB = {tok: i for i, tok in enumerate(["<pad>", "<eos>", "a", "b", "c"])}


def test_vocab_identical_tokenizers_pass_and_mismatches_raise():
    assert check_vocab_compatible(FakeTokenizer(VOCAB), FakeTokenizer(dict(VOCAB))) == 5
    assert check_vocab_compatible(VOCAB, dict(VOCAB)) == 5
    assert check_vocab_compatible(7, 7) == 7
    with pytest.raises(ValueError, match="differ in size: student has 5 tokens, teacher has 6"):
        check_vocab_compatible(FakeTokenizer(VOCAB), FakeTokenizer({**VOCAB, "d": 5}))
    swapped = {**VOCAB, "a": 3, "b": 2}
    with pytest.raises(ValueError, match=r"same size \(5\) but different token->id maps.*'a'"):
        check_vocab_compatible(FakeTokenizer(VOCAB), FakeTokenizer(swapped))


def test_vocab_padded_teacher_embeddings_are_tolerated_with_identical_tokenizers():
    tok = FakeTokenizer(VOCAB)
    size = check_vocab_compatible(
        fake_model(8), fake_model(16), student_tokenizer=tok, teacher_tokenizer=FakeTokenizer(VOCAB)
    )
    assert size == 8
    assert check_vocab_compatible(fake_model(8), fake_model(16), tokenizer=tok) == 8
    logits = torch.randn(2, 3, 16)
    assert torch.equal(align_vocab(logits, size), logits[..., :8])
    # the same padded sizes without tokenizers cannot be verified -> error asks for them
    with pytest.raises(ValueError, match="no tokenizers were given"):
        check_vocab_compatible(fake_model(8), fake_model(16))
    # a tokenizer with ids beyond a model's logits can never work
    with pytest.raises(ValueError, match="has 4 logits but the tokenizer uses ids up to 4"):
        check_vocab_compatible(fake_model(4), fake_model(16), tokenizer=tok)
    # padded models but different tokenizers are still an error
    with pytest.raises(ValueError, match="different token->id maps"):
        check_vocab_compatible(
            fake_model(8),
            fake_model(16),
            student_tokenizer=tok,
            teacher_tokenizer=FakeTokenizer({**VOCAB, "a": 3, "b": 2}),
        )
    with pytest.raises(ValueError, match="V=16 < vocab_size=20"):
        align_vocab(logits, 20)
    with pytest.raises(TypeError, match="cannot read a vocabulary"):
        check_vocab_compatible(object(), 5)


def test_vocab_check_with_real_hf_objects():
    transformers = pytest.importorskip("transformers")
    from lookahead_opd.integrations.opd.tokenizer import char_tokenizer

    tok = char_tokenizer()
    n = len(tok)

    def model(vocab_size: int):
        cfg = transformers.LlamaConfig(
            vocab_size=vocab_size,
            hidden_size=8,
            intermediate_size=16,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
        )
        return transformers.LlamaForCausalLM(cfg)

    student, teacher = model(n), model(n + 11)
    assert check_vocab_compatible(tok, char_tokenizer()) == n
    assert check_vocab_compatible(student, teacher, tokenizer=tok) == n
    with pytest.raises(ValueError, match="differ in size"):
        check_vocab_compatible(tok, char_tokenizer("0123456789+"))
    with pytest.raises(ValueError, match="no tokenizers"):
        check_vocab_compatible(student, teacher)


# ---------------------------------------------------------------------------------- registry


def test_registry():
    assert set(LOSSES) == {"reverse_kl_pg", "reverse_kl", "jsd", "drgrpo", "topk_forward_kl",
                           "topk_reverse_kl", "topk_jsd"} == set(LOSS_INPUTS)
    assert get_loss("jsd") is generalized_jsd_loss and get_loss(" Reverse_KL ") is reverse_kl_loss
    assert get_loss("reverse_kl_pg") is reverse_kl_pg_loss
    with pytest.raises(
        ValueError, match="unknown loss 'kl'; accepted names: drgrpo, jsd, reverse_kl, reverse_kl_pg"
    ):
        get_loss("kl")
    s, t, m = rand_case(20)
    assert isinstance(get_loss("jsd")(s, t, m, beta=0.2), LossOutput)


# ---------------------------------------------------------------------------------- RL baseline


def test_group_advantages_subtract_the_group_mean_only():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0])
    adv = group_advantages(rewards, 3)
    torch.testing.assert_close(adv, torch.tensor([2 / 3, -1 / 3, -1 / 3, -2 / 3, 1 / 3, 1 / 3]))
    assert group_advantages(torch.ones(4), 2).abs().max() == 0  # all equal: no signal
    with pytest.raises(ValueError, match="divisible"):
        group_advantages(rewards, 4)


def test_policy_gradient_loss_gradient_is_advantage_times_score():
    torch.manual_seed(0)
    lp = torch.randn(3, 5, requires_grad=True)
    mask = torch.tensor([[0, 1, 1, 0, 0], [0, 1, 1, 1, 1], [0, 0, 1, 0, 0]], dtype=torch.bool)
    adv = torch.tensor([0.5, -1.0, 2.0])
    out = policy_gradient_loss(lp, adv, mask, num_tokens=10)
    out.loss.backward()
    expected = -(adv[:, None] * mask) / 10
    torch.testing.assert_close(lp.grad, expected)
    assert out.metrics["num_tokens"] == 7
    with pytest.raises(ValueError, match="advantages must be"):
        policy_gradient_loss(lp, adv[:2], mask)
