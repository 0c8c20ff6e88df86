"""Closed-form checks of the per-node scores on hand-built distributions."""

from __future__ import annotations

import math

import pytest
import torch

from lookahead_opd.diagnostic import (
    alignment,
    bootstrap_mean,
    candidate_set,
    cosine,
    distillation_gradient,
    has_signal,
    ideal_gradient,
    node_depths,
    proxy_scores,
    renormalise,
    teacher_advantage,
)

P = torch.tensor([0.5, 0.3, 0.15, 0.05], dtype=torch.float64)
SUCC = torch.tensor([0.2, 0.9, 0.0, 1.0], dtype=torch.float64)


def test_ideal_gradient_closed_form_and_autograd():
    v = float((P * SUCC).sum())
    expected = P * (SUCC - v)
    assert torch.allclose(ideal_gradient(P, SUCC), expected)
    assert abs(float(ideal_gradient(P, SUCC).sum())) < 1e-12  # softmax Jacobian: sums to 0
    z = P.log().clone().requires_grad_(True)
    (torch.softmax(z, -1) * SUCC).sum().backward()  # V(z) = Σ softmax(z)_k P_k
    assert torch.allclose(z.grad, expected)


@pytest.mark.parametrize("loss", ["reverse_kl", "jsd_beta_1"])
def test_teacher_along_the_ideal_direction_has_alignment_one(loss):
    # q ∝ p·exp(c·P_succ) makes f = log q − log p = c·P_succ + const, so p(f − f̄) = c·g*
    # (the JSD with β = 1 is the reverse KL).
    q = renormalise(P * torch.exp(3.0 * SUCC))
    g = (distillation_gradient(P, q, "reverse_kl") if loss == "reverse_kl"
         else distillation_gradient(P, q, "jsd", beta=1.0))
    value, zero = alignment(ideal_gradient(P, SUCC), g)
    assert not zero
    assert value == pytest.approx(1.0, abs=1e-12)
    anti, _ = alignment(ideal_gradient(P, SUCC), -g)
    assert anti == pytest.approx(-1.0, abs=1e-12)


def test_forward_kl_teacher_equal_to_ideal_direction():
    q = P + 0.4 * ideal_gradient(P, SUCC)
    assert torch.all(q > 0) and float(q.sum()) == pytest.approx(1.0)
    value, _ = alignment(ideal_gradient(P, SUCC), distillation_gradient(P, q, "forward_kl"))
    assert value == pytest.approx(1.0, abs=1e-12)


@pytest.mark.parametrize("loss,beta", [("reverse_kl", 0.5), ("forward_kl", 0.5), ("jsd", 0.3),
                                       ("jsd", 0.0), ("jsd", 1.0)])
def test_teacher_equal_to_student_has_zero_gradient_not_nan(loss, beta):
    g = distillation_gradient(P, P.clone(), loss, beta=beta)
    assert torch.count_nonzero(g.abs() > 1e-15) == 0
    value, zero = alignment(ideal_gradient(P, SUCC), g)
    assert value is None and zero is True
    assert math.isnan(float(cosine(ideal_gradient(P, SUCC), g)))


def test_teacher_advantage_by_hand():
    p = torch.tensor([0.5, 0.3, 0.2])
    q = torch.tensor([0.2, 0.3, 0.5])
    s = torch.tensor([0.0, 0.5, 1.0])
    # (0.2−0.5)·0 + (0.3−0.3)·0.5 + (0.5−0.2)·1 = 0.3
    assert float(teacher_advantage(p, q, s)) == pytest.approx(0.3)
    assert float(teacher_advantage(p, p, s)) == 0.0
    # renormalised on a 2-token set {0, 2}: p = (5/7, 2/7), q = (2/7, 5/7): advantage 3/7
    mask = torch.tensor([True, False, True])
    pr, qr = renormalise(p, mask), renormalise(q, mask)
    assert float(teacher_advantage(pr, qr, s, mask)) == pytest.approx(3 / 7)


def _loss(z: torch.Tensor, q: torch.Tensor, loss: str, beta: float) -> torch.Tensor:
    p = torch.softmax(z, -1)
    if loss == "reverse_kl":
        return (p * (p.log() - q.log())).sum()
    if loss == "forward_kl":
        return (q * (q.log() - p.log())).sum()
    m = beta * q + (1 - beta) * p
    return beta * (q * (q.log() - m.log())).sum() + (1 - beta) * (p * (p.log() - m.log())).sum()


@pytest.mark.parametrize("loss,beta", [("reverse_kl", 0.5), ("forward_kl", 0.5), ("jsd", 0.2),
                                       ("jsd", 0.7)])
def test_distillation_gradient_matches_autograd(loss, beta):
    g = torch.Generator().manual_seed(3)
    z = torch.randn(5, 6, generator=g, dtype=torch.float64).requires_grad_(True)
    q = torch.softmax(torch.randn(5, 6, generator=g, dtype=torch.float64), -1)
    _loss(z, q, loss, beta).backward()
    mine = distillation_gradient(torch.softmax(z, -1).detach(), q, loss, beta=beta)
    assert torch.allclose(mine, -z.grad, atol=1e-12), (mine, -z.grad)


def test_padding_mask_is_ignored():
    p = torch.tensor([[0.6, 0.4, 0.0], [0.2, 0.3, 0.5]], dtype=torch.float64)
    q = torch.tensor([[0.3, 0.7, 0.9], [0.5, 0.3, 0.2]], dtype=torch.float64)
    s = torch.tensor([[1.0, 0.0, 7.0], [0.0, 1.0, 1.0]], dtype=torch.float64)
    mask = torch.tensor([[True, True, False], [True, True, True]])
    g = distillation_gradient(p, q, "reverse_kl", mask=mask)
    assert g[0, 2] == 0.0
    ref = distillation_gradient(p[0, :2], q[0, :2], "reverse_kl")
    assert torch.allclose(g[0, :2], ref)
    assert has_signal(s, mask).tolist() == [True, True]
    flat = has_signal(torch.tensor([[1.0, 1.0, 0.0]]), torch.tensor([[True, True, False]]))
    assert flat.tolist() == [False]


def test_proxies():
    lp = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    same = proxy_scores(lp, lp.clone(), 2)
    assert float(same["reverse_kl"]) == pytest.approx(0.0, abs=1e-12)
    assert float(same["js"]) == pytest.approx(0.0, abs=1e-12)
    assert float(same["topk_overlap"]) == 1.0
    assert float(same["teacher_mass_topk"]) == pytest.approx(0.8)
    lq = torch.log(torch.tensor([[0.05, 0.15, 0.3, 0.5]]))
    other = proxy_scores(lp, lq, 2)
    assert float(other["topk_overlap"]) == 0.0
    assert float(other["teacher_mass_topk"]) == pytest.approx(0.2)
    kl = sum(a * math.log(a / b) for a, b in zip([0.5, 0.3, 0.15, 0.05], [0.05, 0.15, 0.3, 0.5],
                                                  strict=True))
    assert float(other["reverse_kl"]) == pytest.approx(kl)
    assert 0 < float(other["js"]) <= math.log(2)


def test_node_depths_and_candidates():
    assert node_depths(1) == [1]
    assert node_depths(9) == [1, 2, 4, 8]
    assert node_depths(0) == []
    assert node_depths(3, "all") == [1, 2, 3]
    with pytest.raises(ValueError, match="spacing"):
        node_depths(3, "linear")
    lp = torch.log(torch.tensor([0.1, 0.4, 0.3, 0.2]))
    assert candidate_set(lp, sampled=2, k=2) == [1, 2]
    assert candidate_set(lp, sampled=0, k=2) == [1, 2, 0]


def test_bootstrap_mean():
    vals = [0.1, 0.5, 0.2, 0.9, 0.4, 0.3]
    a = bootstrap_mean(vals, resamples=500, seed=1)
    assert a == bootstrap_mean(vals, resamples=500, seed=1)
    assert a["ci_lo"] <= a["mean"] <= a["ci_hi"] and a["n"] == 6
    assert a["mean"] == pytest.approx(sum(vals) / 6)
    assert bootstrap_mean([])["mean"] is None
