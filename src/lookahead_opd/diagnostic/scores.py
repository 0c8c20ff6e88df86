"""Per-node scores of a teacher, as pure functions on tensors (paper B, "Unmasking OPD").

At a node (a prefix the student visits) the candidate set ``C`` holds a few next tokens. With
the student's probabilities ``p`` and the teacher's ``q`` renormalised on ``C``, and the
estimated success probability ``P_k`` of each candidate (force ``k``, finish with the student):

- ideal logit gradient ``g*_j = p_j (P_j − V)``, ``V = Σ p_k P_k`` (``∂V/∂z_j`` through the
  softmax: the update that raises the student's success fastest);
- distillation logit gradient: the *descent* direction ``−∂L/∂z`` of the distillation loss on
  ``C`` (reverse KL: ``p_j (f_j − f̄)``, ``f = log q − log p``; forward KL: ``q − p``; TRL's
  generalised JSD with ``β``);
- alignment ``cos(g*, g_distill)``; ``None`` when the teacher's gradient is zero (a teacher equal
  to the student moves nothing: reported as such, never as NaN);
- teacher advantage ``Σ_k (q_k − p_k) P_k``.

Every function accepts a trailing candidate dimension ``[..., C]`` and an optional boolean
``mask`` of the same shape (padding of nodes with fewer candidates). Math is in float64.
Proxies that need no rollouts (reverse KL, JS, top-K overlap, teacher mass on the student's
top-K) use the full next-token distributions.
"""

from __future__ import annotations

import math

import torch

__all__ = [
    "DISTILL_LOSSES",
    "ZERO_GRADIENT_TOL",
    "renormalise",
    "ideal_gradient",
    "distillation_gradient",
    "cosine",
    "alignment",
    "teacher_advantage",
    "has_signal",
    "proxy_scores",
]

DISTILL_LOSSES = ("reverse_kl", "forward_kl", "jsd")
# A distillation gradient with a smaller Euclidean norm (probabilities are ≤ 1) is "zero".
ZERO_GRADIENT_TOL = 1e-9
_TINY = 1e-300  # floor inside logs: q_k = 0 gives a large finite term, not −inf


def _prep(x: torch.Tensor, mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.as_tensor(x).to(torch.float64)
    m = torch.ones_like(x, dtype=torch.bool) if mask is None else torch.as_tensor(mask).bool()
    if m.shape != x.shape:
        raise ValueError(f"mask shape {tuple(m.shape)} must match {tuple(x.shape)}")
    return torch.where(m, x, torch.zeros_like(x)), m


def renormalise(probs: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """``probs`` restricted to the (masked) candidate set and rescaled to sum to 1.
    A row whose mass on the set is zero stays zero."""
    x, _ = _prep(probs, mask)
    total = x.sum(-1, keepdim=True)
    return torch.where(total > 0, x / total.clamp_min(_TINY), torch.zeros_like(x))


def ideal_gradient(p: torch.Tensor, p_succ: torch.Tensor,
                   mask: torch.Tensor | None = None) -> torch.Tensor:
    """``g*_j = p_j (P_j − V)`` with ``V = Σ_k p_k P_k``; ``p`` renormalised on the set."""
    p, m = _prep(p, mask)
    s, _ = _prep(p_succ, m)
    value = (p * s).sum(-1, keepdim=True)
    return torch.where(m, p * (s - value), torch.zeros_like(p))


def distillation_gradient(p: torch.Tensor, q: torch.Tensor, loss: str = "reverse_kl", *,
                          beta: float = 0.5, mask: torch.Tensor | None = None) -> torch.Tensor:
    """The descent direction ``−∂L/∂z`` of a distillation loss on the candidate set's logits.

    ``p`` (student) and ``q`` (teacher) are renormalised on the set. ``loss``: ``reverse_kl``
    (KL(p‖q)), ``forward_kl`` (KL(q‖p)), or ``jsd`` with TRL's ``beta`` (0 = forward KL,
    1 = reverse KL, else ``β KL(q‖m) + (1−β) KL(p‖m)``, ``m = βq + (1−β)p``). All have the
    form ``p_j (f_j − f̄)``, ``f̄ = Σ p_k f_k``; for the JSD ``f = (1−β) log(m/p)``.
    """
    if loss not in DISTILL_LOSSES:
        raise ValueError(f"loss must be one of {', '.join(DISTILL_LOSSES)}; got {loss!r}")
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"beta must be in [0, 1] (0 = forward KL, 1 = reverse KL), got {beta!r}")
    p, m = _prep(p, mask)
    q, _ = _prep(q, m)
    if loss == "jsd" and beta == 0.0:
        loss = "forward_kl"
    if loss == "jsd" and beta == 1.0:
        loss = "reverse_kl"
    if loss == "forward_kl":
        return torch.where(m, q - p, torch.zeros_like(p))
    logp = p.clamp_min(_TINY).log()
    if loss == "reverse_kl":
        f = q.clamp_min(_TINY).log() - logp
    else:
        mix = beta * q + (1.0 - beta) * p
        f = (1.0 - beta) * (mix.clamp_min(_TINY).log() - logp)
    f = torch.where(m & (p > 0), f, torch.zeros_like(f))
    fbar = (p * f).sum(-1, keepdim=True)
    return torch.where(m, p * (f - fbar), torch.zeros_like(p))


def cosine(a: torch.Tensor, b: torch.Tensor, *, tol: float = ZERO_GRADIENT_TOL) -> torch.Tensor:
    """Cosine similarity along the last dim; NaN where either vector's norm is ≤ ``tol``
    (callers turn NaN into ``None`` plus a flag; see :func:`alignment`)."""
    a = torch.as_tensor(a, dtype=torch.float64)
    b = torch.as_tensor(b, dtype=torch.float64)
    na, nb = a.norm(dim=-1), b.norm(dim=-1)
    ok = (na > tol) & (nb > tol)
    cos = (a * b).sum(-1) / (na * nb).clamp_min(_TINY)
    return torch.where(ok, cos.clamp(-1.0, 1.0), torch.full_like(cos, math.nan))


def alignment(ideal: torch.Tensor, distill: torch.Tensor,
              *, tol: float = ZERO_GRADIENT_TOL) -> tuple[float | None, bool]:
    """``(cos(g*, g_distill), zero_gradient)`` for one node. The cosine is ``None`` when either
    gradient is zero; ``zero_gradient`` says the teacher's gradient is the zero one."""
    zero = bool(torch.as_tensor(distill, dtype=torch.float64).norm() <= tol)
    value = float(cosine(ideal, distill, tol=tol))
    return (None if math.isnan(value) else value), zero


def teacher_advantage(p: torch.Tensor, q: torch.Tensor, p_succ: torch.Tensor,
                      mask: torch.Tensor | None = None) -> torch.Tensor:
    """``Σ_k (q_k − p_k) P_k`` = E_q[P_succ] − E_p[P_succ] on the (renormalised) set."""
    p, m = _prep(p, mask)
    q, _ = _prep(q, m)
    s, _ = _prep(p_succ, m)
    return ((q - p) * s).sum(-1)


def has_signal(p_succ: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """True where the candidates' success rates are not all equal (else ``g* = 0``: the node
    carries no signal and is excluded from averages)."""
    s, m = _prep(p_succ, mask)
    hi = torch.where(m, s, torch.full_like(s, -math.inf)).amax(-1)
    lo = torch.where(m, s, torch.full_like(s, math.inf)).amin(-1)
    return hi > lo


def proxy_scores(student_logprobs: torch.Tensor, teacher_logprobs: torch.Tensor,
                 k: int) -> dict[str, torch.Tensor]:
    """Rollout-free proxies from full next-token log-probs ``[..., V]``: ``reverse_kl``
    KL(p‖q), ``js`` (symmetric Jensen–Shannon, nats), ``topk_overlap`` |topK(p) ∩ topK(q)|/K,
    ``teacher_mass_topk`` (teacher probability on the student's top-K)."""
    if student_logprobs.shape != teacher_logprobs.shape:
        raise ValueError(f"student {tuple(student_logprobs.shape)} and teacher "
                         f"{tuple(teacher_logprobs.shape)} log-probs must have one shape")
    vocab = student_logprobs.shape[-1]
    if not 1 <= k <= vocab:
        raise ValueError(f"k must be in 1..{vocab}, got {k}")
    lp = student_logprobs.to(torch.float64).clamp_min(math.log(_TINY))
    lq = teacher_logprobs.to(torch.float64).clamp_min(math.log(_TINY))
    p, q = lp.exp(), lq.exp()
    lm = torch.logaddexp(lp, lq) - math.log(2.0)
    reverse_kl = (p * (lp - lq)).sum(-1)
    js = 0.5 * (p * (lp - lm)).sum(-1) + 0.5 * (q * (lq - lm)).sum(-1)
    top_p = lp.topk(k, dim=-1).indices
    top_q = lq.topk(k, dim=-1).indices
    overlap = (top_p.unsqueeze(-1) == top_q.unsqueeze(-2)).any(-1).sum(-1).to(torch.float64) / k
    mass = q.gather(-1, top_p).sum(-1)
    return {"reverse_kl": reverse_kl.clamp_min(0.0), "js": js.clamp_min(0.0),
            "topk_overlap": overlap, "teacher_mass_topk": mass}
