"""Losses for on-policy distillation (OPD): per-token reverse-KL policy gradient and full-vocab KLs.

Conventions (shared by every loss here):

- Inputs are *aligned* per-token tensors over ``[B, T]``: position ``t`` of the logits / logprobs
  scores ``tokens[:, t]``. Use :func:`shift_for_next_token` to get there from raw causal-LM
  outputs.
- ``completion_mask`` ``[B, T]`` (bool or 0/1) is 1 on sampled completion tokens only; prompt and
  padding positions never affect a loss value or a gradient.
- Every loss is ``sum over masked tokens / num_tokens``. Pass the number of completion tokens in
  the whole gradient-accumulation window as ``num_tokens`` so that micro-batch losses (and their
  gradients) add up to a per-token mean; ``None`` uses this batch's mask sum.
- Math is done in fp32 (or fp64 when given fp64); teacher quantities never carry gradient.

Pure torch: this module must not import transformers (vocab checks use duck typing).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = [
    "LOSSES",
    "LOSS_INPUTS",
    "LossInputs",
    "LossOutput",
    "TokenScores",
    "compute_loss",
    "discounted_returns",
    "generalized_jsd_loss",
    "get_loss",
    "group_advantages",
    "policy_gradient_loss",
    "reverse_kl_loss",
    "reverse_kl_pg_loss",
    "shift_for_next_token",
    "token_logprobs",
]

# Rows of a no-grad logprob computation are processed in chunks of about this many logits, so a
# bf16 teacher never needs a full fp32 copy of its [B, T, V] logits.
_CHUNK_ELEMENTS = 1 << 25
# Stand-in for log(0) inside KL sums: keeps 0·log 0 = 0 and gradients finite when logits hold -inf.
_LOG_FLOOR = -1e4

NumTokens = int | float | torch.Tensor | None
_INT_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)


@dataclass
class LossOutput:
    """A loss to backpropagate plus detached metrics.

    ``metrics`` are plain floats averaged over *this* batch's masked tokens (not divided by the
    global ``num_tokens``); ``metrics["num_tokens"]`` is this batch's token count so callers can
    weight micro-batches when aggregating.
    """

    loss: torch.Tensor
    metrics: dict[str, float] = field(default_factory=dict)


# ---------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for half/bf16/fp32 inputs, fp64 for fp64 inputs (so gradcheck works)."""
    return torch.promote_types(dtype, torch.float32)


def _check_mask(
    mask: torch.Tensor, shape: torch.Size, name: str = "completion_mask"
) -> torch.Tensor:
    if not isinstance(mask, torch.Tensor):
        raise TypeError(
            f"{name} must be a torch.Tensor of shape {tuple(shape)}, got {type(mask).__name__}"
        )
    if mask.shape != shape:
        raise ValueError(
            f"{name} has shape {tuple(mask.shape)} but the per-token inputs have shape "
            f"{tuple(shape)}; they must match (shift_for_next_token aligns causal-LM outputs)"
        )
    if mask.dtype == torch.bool:
        return mask
    if mask.is_floating_point() or mask.dtype in _INT_DTYPES:
        return mask != 0
    raise TypeError(f"{name} must be bool or 0/1 numeric, got dtype {mask.dtype}")


def _resolve_num_tokens(num_tokens: NumTokens, mask: torch.Tensor) -> torch.Tensor | float:
    """The loss denominator: the caller's window-wide count, or this batch's mask sum (≥ 1)."""
    if num_tokens is None:
        return mask.sum().clamp(min=1).to(torch.float32)
    if isinstance(num_tokens, torch.Tensor):
        if num_tokens.numel() != 1:
            raise ValueError(
                f"num_tokens must be a scalar, got a tensor of shape {tuple(num_tokens.shape)}"
            )
        return num_tokens.to(device=mask.device, dtype=torch.float32).reshape(())
    if isinstance(num_tokens, bool) or not isinstance(num_tokens, int | float):
        raise TypeError(
            f"num_tokens must be an int, float, scalar tensor or None, got {num_tokens!r}"
        )
    if not math.isfinite(num_tokens) or num_tokens <= 0:
        raise ValueError(f"num_tokens must be a positive finite number, got {num_tokens!r}")
    return float(num_tokens)


def _check_temperature(temperature: float) -> None:
    if (
        not isinstance(temperature, int | float)
        or not math.isfinite(temperature)
        or temperature <= 0
    ):
        raise ValueError(f"temperature must be a positive finite number, got {temperature!r}")


def _check_logit_pair(student_logits: torch.Tensor, teacher_logits: torch.Tensor) -> None:
    for name, t in (("student_logits", student_logits), ("teacher_logits", teacher_logits)):
        if not isinstance(t, torch.Tensor) or t.dim() != 3:
            shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{name} must be a [B, T, V] tensor, got {shape}")
        if not t.is_floating_point():
            raise TypeError(f"{name} must be floating point, got dtype {t.dtype}")
    if student_logits.shape[:2] != teacher_logits.shape[:2]:
        raise ValueError(
            f"student_logits {tuple(student_logits.shape)} and teacher_logits "
            f"{tuple(teacher_logits.shape)} must share [B, T]"
        )
    if student_logits.shape[-1] != teacher_logits.shape[-1]:
        raise ValueError(
            f"vocab sizes differ: student_logits has V={student_logits.shape[-1]}, "
            f"teacher_logits has V={teacher_logits.shape[-1]}; check the tokenizers with "
            "check_vocab_compatible() and slice both with align_vocab(logits, vocab_size)"
        )


def _masked_rows(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    mask: torch.Tensor,
    temperature: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs of the masked rows only ([N, V], compute dtype); the teacher's are detached.

    Selecting rows first skips prompt/padding compute and makes masked positions unable to leak
    NaN/inf into the loss or the gradient.
    """
    dtype = _compute_dtype(student_logits.dtype)
    s = student_logits[mask].to(dtype)
    with torch.no_grad():
        t = teacher_logits.detach()[mask].to(dtype)
        if temperature != 1.0:
            t = t / temperature
        lt = torch.log_softmax(t, dim=-1)
    if temperature != 1.0:
        s = s / temperature
    ls = torch.log_softmax(s, dim=-1)
    return ls, lt


def _floor_log(lp: torch.Tensor) -> torch.Tensor:
    """Replace -inf log-probs by a large finite value (gradient-safe, unlike where on p·log p)."""
    return torch.where(torch.isneginf(lp), torch.full_like(lp, _LOG_FLOOR), lp)


def _kl_rows(lp: torch.Tensor, lq: torch.Tensor) -> torch.Tensor:
    """KL(p‖q) per row from log-probs: Σ_v p_v (log p_v − log q_v), with 0·log 0 = 0."""
    return (lp.exp() * (_floor_log(lp) - _floor_log(lq))).sum(dim=-1)


def _metrics(**values: torch.Tensor) -> dict[str, float]:
    """Detach and convert scalar tensors to floats with a single device sync."""
    stacked = torch.stack([v.detach().to(torch.float32).reshape(()) for v in values.values()])
    return dict(zip(values, stacked.tolist(), strict=True))


# ---------------------------------------------------------------------------------------------
# alignment and log-probs
# ---------------------------------------------------------------------------------------------


def shift_for_next_token(
    logits: torch.Tensor, input_ids: torch.Tensor, completion_mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Standard causal shift: ``logits[:, :-1]`` score ``input_ids[:, 1:]`` under ``mask[:, 1:]``.

    ``completion_mask`` marks completion tokens in ``input_ids``; the shifted mask therefore marks
    the logit positions that predict a completion token. Returns views (no copies).
    """
    if logits.dim() != 3:
        raise ValueError(f"logits must be [B, T, V], got shape {tuple(logits.shape)}")
    if input_ids.dim() != 2 or input_ids.shape != logits.shape[:2]:
        raise ValueError(
            f"input_ids must be [B, T] matching logits {tuple(logits.shape)}, "
            f"got {tuple(input_ids.shape)}"
        )
    if completion_mask.shape != input_ids.shape:
        raise ValueError(
            f"completion_mask {tuple(completion_mask.shape)} must match "
            f"input_ids {tuple(input_ids.shape)}"
        )
    if input_ids.shape[1] < 2:
        raise ValueError(f"need at least 2 positions to shift, got T={input_ids.shape[1]}")
    return logits[:, :-1], input_ids[:, 1:], completion_mask[:, 1:]


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """``log softmax(logits)[..., tokens]`` in fp32 (fp64 if given fp64), shape ``tokens.shape``.

    Computed as ``logit[token] − logsumexp(logits)`` so no full log-softmax is materialised: with
    grad, at most one fp32 copy of the logits exists (none if they are already fp32); without grad
    (e.g. the teacher) rows are processed in chunks and no full fp32 copy is ever made.
    """
    if not isinstance(logits, torch.Tensor) or logits.dim() < 1 or not logits.is_floating_point():
        raise TypeError(f"logits must be a floating-point tensor [..., V], got {logits!r:.80}")
    if not isinstance(tokens, torch.Tensor) or tokens.dtype not in _INT_DTYPES:
        dtype = tokens.dtype if isinstance(tokens, torch.Tensor) else type(tokens).__name__
        raise TypeError(f"tokens must be an integer tensor, got {dtype}")
    if tokens.shape != logits.shape[:-1]:
        raise ValueError(
            f"tokens {tuple(tokens.shape)} must match logits {tuple(logits.shape)} without the "
            "vocab dim (aligned: logits at position t score tokens[t]; see shift_for_next_token)"
        )
    dtype = _compute_dtype(logits.dtype)
    index = tokens.long().unsqueeze(-1)
    if torch.is_grad_enabled() and logits.requires_grad:
        x = logits.to(dtype)
        return x.gather(-1, index).squeeze(-1) - torch.logsumexp(x, dim=-1)

    with torch.no_grad():
        vocab = logits.shape[-1]
        # [B, T, V] views such as logits[:, :-1] are not flattenable without a copy, but each
        # row logits[b] is: iterate over rows, then chunk within a row.
        rows = logits.detach().reshape(1, -1, vocab) if logits.dim() != 3 else logits.detach()
        row_idx = index.reshape(rows.shape[0], rows.shape[1], 1)
        out = torch.empty(rows.shape[:2], dtype=dtype, device=logits.device)
        step = max(1, _CHUNK_ELEMENTS // max(vocab, 1))
        for b in range(rows.shape[0]):
            for start in range(0, rows.shape[1], step):
                chunk = rows[b, start : start + step].to(dtype)
                sel = chunk.gather(-1, row_idx[b, start : start + step]).squeeze(-1)
                out[b, start : start + step] = sel - torch.logsumexp(chunk, dim=-1)
        return out.reshape(tokens.shape)


# ---------------------------------------------------------------------------------------------
# losses
# ---------------------------------------------------------------------------------------------


def discounted_returns(
    values: torch.Tensor, completion_mask: torch.Tensor, discount: float
) -> torch.Tensor:
    """``G_t = Σ_{k≥t} γ^{k−t} A_k`` along each row, restarting at every masked position.

    A return never crosses a masked position (prompt, padding, or the gap between packed
    sequences) and is 0 there. Runs as a log2(T)-step parallel scan, so long sequences stay fast.
    """
    if values.dim() != 2:
        raise ValueError(f"values must be [B, T], got shape {tuple(values.shape)}")
    mask = _check_mask(completion_mask, values.shape)
    if not isinstance(discount, int | float) or not 0.0 <= discount <= 1.0:
        raise ValueError(f"discount must be a float in [0, 1], got {discount!r}")
    b = torch.where(mask, values, torch.zeros_like(values))
    if discount == 0.0 or values.shape[1] < 2:
        return b
    # Linear recurrence G_t = a_t·G_{t+1} + b_t with a_t = γ only when t and t+1 are both
    # completion tokens; combined by doubling (Hillis–Steele) on the pair (a, b).
    a = torch.zeros_like(b)
    a[:, :-1] = torch.where(mask[:, :-1] & mask[:, 1:], discount, 0.0).to(b.dtype)
    length, offset = values.shape[1], 1
    while offset < length:
        b_next = torch.zeros_like(b)
        a_next = torch.zeros_like(a)
        b_next[:, :-offset] = b[:, offset:]
        a_next[:, :-offset] = a[:, offset:]
        b = b + a * b_next
        a = a * a_next
        offset *= 2
    return b


def _clip_bounds(clip_ratio: float | tuple[float, float] | None) -> tuple[float, float] | None:
    if clip_ratio is None:
        return None
    low, high = clip_ratio if isinstance(clip_ratio, tuple | list) else (clip_ratio, clip_ratio)
    for v in (low, high):
        if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or v <= 0:
            raise ValueError(
                "clip_ratio must be ε > 0 or a pair (ε_low, ε_high) of positive floats, "
                f"got {clip_ratio!r}"
            )
    return 1.0 - float(low), 1.0 + float(high)


def reverse_kl_pg_loss(
    student_logprobs: torch.Tensor,
    teacher_logprobs: torch.Tensor,
    completion_mask: torch.Tensor,
    *,
    sampler_logprobs: torch.Tensor | None = None,
    discount: float = 0.0,
    num_tokens: NumTokens = None,
    clip_ratio: float | tuple[float, float] | None = None,
) -> LossOutput:
    """The OPD policy-gradient loss (EffOPD / tinker-cookbook): advantage = −(log π_s − log π_t).

    ``A_t = −(lp_student_t − lp_teacher_t)`` from *detached* student log-probs (optionally the
    discounted return over later completion tokens), then ``−Σ ratio_t·A_t / num_tokens`` with
    ``ratio_t = exp(lp_student_t − sampler_lp_t)``; ``sampler_logprobs=None`` means the detached
    student log-probs (ratio ≡ 1, gradient −A_t/num_tokens per token). ``clip_ratio=ε`` (or
    ``(ε_low, ε_high)``) applies PPO's ``min(r·A, clip(r, 1−ε_low, 1+ε_high)·A)``.

    Metrics: ``reverse_kl`` (mean per-token sample estimate lp_s − lp_t), ``advantage`` (mean A
    after discounting), ``ratio`` (mean), ``clip_frac`` (fraction of tokens whose clipped branch
    is active), ``num_tokens`` (this batch).
    """
    if not isinstance(student_logprobs, torch.Tensor) or student_logprobs.dim() != 2:
        raise ValueError(
            "student_logprobs must be a [B, T] tensor, "
            f"got {getattr(student_logprobs, 'shape', student_logprobs)!r}"
        )
    shape = student_logprobs.shape
    mask = _check_mask(completion_mask, shape)
    others = {"teacher_logprobs": teacher_logprobs}
    if sampler_logprobs is not None:
        others["sampler_logprobs"] = sampler_logprobs
    for name, t in others.items():
        if not isinstance(t, torch.Tensor) or t.shape != shape:
            got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(
                f"{name} must have the shape of student_logprobs {tuple(shape)}, got {got}"
            )
    bounds = _clip_bounds(clip_ratio)
    denom = _resolve_num_tokens(num_tokens, mask)

    dtype = _compute_dtype(student_logprobs.dtype)
    zero = torch.zeros((), dtype=dtype, device=student_logprobs.device)
    # Masked positions may hold anything (even inf/nan): sanitise before any arithmetic.
    lp = torch.where(mask, student_logprobs.to(dtype), zero)
    lp_det = lp.detach()
    lp_teacher = torch.where(mask, teacher_logprobs.detach().to(dtype), zero)
    lp_old = (
        lp_det
        if sampler_logprobs is None
        else torch.where(mask, sampler_logprobs.detach().to(dtype), zero)
    )

    rkl = lp_det - lp_teacher
    advantages = discounted_returns(-rkl, mask, discount)
    ratio = torch.exp(lp - lp_old)
    objective = ratio * advantages
    if bounds is not None:
        clipped = ratio.clamp(bounds[0], bounds[1]) * advantages
        clip_active = (clipped < objective) & mask
        objective = torch.minimum(objective, clipped)
    else:
        clip_active = torch.zeros_like(mask)
    objective = torch.where(mask, objective, zero)
    loss = -objective.sum() / denom

    with torch.no_grad():
        n_local = mask.sum()
        n = n_local.clamp(min=1).to(dtype)
        metrics = _metrics(
            reverse_kl=rkl.sum() / n,
            advantage=advantages.sum() / n,
            ratio=torch.where(mask, ratio.detach(), zero).sum() / n,
            clip_frac=clip_active.sum() / n,
            num_tokens=n_local,
        )
    return LossOutput(loss=loss, metrics=metrics)


def group_advantages(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """Dr. GRPO advantages: each reward minus the mean of its group of ``group_size`` samples of
    one prompt (rows prompt-major); no division by the group's std."""
    if rewards.dim() != 1 or group_size < 1 or rewards.numel() % group_size:
        raise ValueError(f"rewards must be [B] with B divisible by group_size={group_size}, "
                         f"got shape {tuple(rewards.shape)}")
    grouped = rewards.view(-1, group_size)
    return (grouped - grouped.mean(dim=1, keepdim=True)).reshape(-1)


def policy_gradient_loss(
    student_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    completion_mask: torch.Tensor,
    *,
    num_tokens: NumTokens = None,
) -> LossOutput:
    """RL baseline (Dr. GRPO, on-policy): ``−Σ_t A_row · log π(y_t) / num_tokens`` with one
    advantage per row (``group_advantages``), no length or std normalisation per sequence.

    Metrics: ``advantage`` (mean per token), ``num_tokens``.
    """
    if not isinstance(student_logprobs, torch.Tensor) or student_logprobs.dim() != 2:
        raise ValueError("student_logprobs must be a [B, T] tensor")
    mask = _check_mask(completion_mask, student_logprobs.shape)
    if advantages.shape != student_logprobs.shape[:1]:
        raise ValueError(f"advantages must be [B]={tuple(student_logprobs.shape[:1])}, "
                         f"got {tuple(advantages.shape)}")
    denom = _resolve_num_tokens(num_tokens, mask)
    dtype = _compute_dtype(student_logprobs.dtype)
    zero = torch.zeros((), dtype=dtype, device=student_logprobs.device)
    lp = torch.where(mask, student_logprobs.to(dtype), zero)
    adv = advantages.detach().to(dtype)[:, None].expand_as(lp)
    loss = -torch.where(mask, adv * lp, zero).sum() / denom
    with torch.no_grad():
        n_local = mask.sum()
        n = n_local.clamp(min=1).to(dtype)
        metrics = _metrics(advantage=torch.where(mask, adv, zero).sum() / n, num_tokens=n_local)
    return LossOutput(loss=loss, metrics=metrics)


def reverse_kl_loss(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    completion_mask: torch.Tensor,
    *,
    num_tokens: NumTokens = None,
    temperature: float = 1.0,
) -> LossOutput:
    """Exact full-vocabulary reverse KL(π_student ‖ π_teacher) per token, summed / num_tokens.

    The analytic counterpart of :func:`reverse_kl_pg_loss` (no sampling variance, needs both
    models' full logits). Gradient flows through the student only. Metrics: ``reverse_kl``
    (mean per token), ``student_entropy``, ``num_tokens``.
    """
    _check_logit_pair(student_logits, teacher_logits)
    mask = _check_mask(completion_mask, student_logits.shape[:2])
    _check_temperature(temperature)
    denom = _resolve_num_tokens(num_tokens, mask)

    ls, lt = _masked_rows(student_logits, teacher_logits, mask, temperature)
    per_token = _kl_rows(ls, lt)
    loss = per_token.sum() / denom
    with torch.no_grad():
        n_local = mask.sum()
        n = n_local.clamp(min=1)
        entropy = -(ls.exp() * _floor_log(ls)).sum(dim=-1)
        metrics = _metrics(
            reverse_kl=per_token.sum() / n, student_entropy=entropy.sum() / n, num_tokens=n_local
        )
    return LossOutput(loss=loss, metrics=metrics)


def generalized_jsd_loss(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    completion_mask: torch.Tensor,
    *,
    beta: float = 0.5,
    num_tokens: NumTokens = None,
    temperature: float = 1.0,
) -> LossOutput:
    """GKD's generalized JSD in TRL's convention, per token, summed / num_tokens.

    ``beta=0``: forward KL(teacher ‖ student); ``beta=1``: reverse KL(student ‖ teacher);
    otherwise ``beta·KL(teacher ‖ m) + (1−beta)·KL(student ‖ m)`` with
    ``m = beta·p_teacher + (1−beta)·p_student``. As in TRL the endpoints are special-cased (the
    mixture form itself tends to 0 at both ends). Gradient flows through the student only.
    """
    if isinstance(beta, bool) or not isinstance(beta, int | float) or not 0.0 <= beta <= 1.0:
        raise ValueError(
            f"beta must be a float in [0, 1] (0 = forward KL, 1 = reverse KL), got {beta!r}"
        )
    _check_logit_pair(student_logits, teacher_logits)
    mask = _check_mask(completion_mask, student_logits.shape[:2])
    _check_temperature(temperature)
    denom = _resolve_num_tokens(num_tokens, mask)

    ls, lt = _masked_rows(student_logits, teacher_logits, mask, temperature)
    if beta == 0.0:
        per_token = _kl_rows(lt, ls)
    elif beta == 1.0:
        per_token = _kl_rows(ls, lt)
    else:
        # Floor first: logaddexp(-inf, -inf) has a NaN gradient.
        lm = torch.logaddexp(_floor_log(ls) + math.log(1.0 - beta), _floor_log(lt) + math.log(beta))
        per_token = beta * _kl_rows(lt, lm) + (1.0 - beta) * _kl_rows(ls, lm)
    loss = per_token.sum() / denom
    with torch.no_grad():
        n_local = mask.sum()
        n = n_local.clamp(min=1)
        metrics = _metrics(
            jsd=per_token.sum() / n, reverse_kl=_kl_rows(ls, lt).sum() / n, num_tokens=n_local
        )
    return LossOutput(loss=loss, metrics=metrics)


# ---------------------------------------------------------------------------------------------
# registry
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class TokenScores:
    """One batch of sampled completions as the losses see it: both models' next-token logits
    aligned with ``tokens`` (``shift_for_next_token``, one shared vocabulary), the completion
    ``mask``, and one ``advantages`` value per row (the task's rewards, ``group_advantages``)
    when known. Each loss takes its pair of inputs from one of ``logits``, ``logprobs``,
    ``rewards``; the sampled tokens' log-probs are computed once, on first use."""

    student_logits: torch.Tensor
    teacher_logits: torch.Tensor
    tokens: torch.Tensor
    mask: torch.Tensor
    advantages: torch.Tensor | None = None
    _cache: dict[str, torch.Tensor] = field(default_factory=dict, repr=False, compare=False)

    def _logprobs(self, who: str) -> torch.Tensor:
        if who not in self._cache:
            self._cache[who] = token_logprobs(getattr(self, f"{who}_logits"), self.tokens)
        return self._cache[who]

    def logits(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Both models' full logits ``[B, T, V]``."""
        return self.student_logits, self.teacher_logits

    def logprobs(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Both models' log-probs of the sampled tokens ``[B, T]``."""
        return self._logprobs("student"), self._logprobs("teacher")

    def rewards(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The student's log-probs of the sampled tokens and the per-row advantages."""
        if self.advantages is None:
            raise ValueError("this loss learns from the task's rewards: pass advantages=")
        return self._logprobs("student"), self.advantages

    @torch.no_grad()
    def sampled_reverse_kl(self) -> float:
        """Mean over completion tokens of ``log π_s − log π_t`` at the sampled tokens."""
        ls, lt = self.logprobs()
        return float(((ls - lt) * self.mask).sum() / self.mask.sum().clamp(min=1))


@dataclass(frozen=True)
class LossInputs:
    """What a loss of ``LOSSES`` needs. Every loss is called the same way,
    ``loss(student, reference, mask, num_tokens=..., **options)``: ``select`` picks the
    ``(student, reference)`` pair from ``TokenScores``, ``options`` names the config field of
    each extra keyword (``{loss keyword: config field}``)."""

    select: Callable[[TokenScores], tuple[torch.Tensor, torch.Tensor]]
    options: Mapping[str, str] = field(default_factory=dict)


# Every loss by its config name, with what it consumes: per-token log-probs [B, T] or full
# logits [B, T, V] of both models, or the task's rewards (the RL baseline: the teacher is then
# only measured, never learned from).
_REGISTRY: dict[str, tuple[Callable[..., LossOutput], LossInputs]] = {
    "reverse_kl_pg": (reverse_kl_pg_loss, LossInputs(TokenScores.logprobs, {"discount": "discount"})),
    "reverse_kl": (reverse_kl_loss, LossInputs(TokenScores.logits)),
    "jsd": (generalized_jsd_loss, LossInputs(TokenScores.logits, {"beta": "jsd_beta"})),
    "drgrpo": (policy_gradient_loss, LossInputs(TokenScores.rewards)),
}
LOSSES: dict[str, Callable[..., LossOutput]] = {k: fn for k, (fn, _) in _REGISTRY.items()}
LOSS_INPUTS: dict[str, LossInputs] = {k: inputs for k, (_, inputs) in _REGISTRY.items()}


def compute_loss(name: str, scores: TokenScores, *, num_tokens: NumTokens = None,
                 config: Any = None) -> LossOutput:
    """The loss ``name`` of ``scores``, its options read from ``config`` (an ``OPDConfig``;
    None: the loss's defaults). Every loss reports ``reverse_kl``: one that does not learn
    from the teacher gets the sampled-token estimate, measured without gradient."""
    key = _loss_key(name)
    spec = LOSS_INPUTS[key]
    options = {} if config is None else {k: getattr(config, v) for k, v in spec.options.items()}
    student, reference = spec.select(scores)
    out = LOSSES[key](student, reference, scores.mask, num_tokens=num_tokens, **options)
    if "reverse_kl" not in out.metrics:
        out.metrics["reverse_kl"] = scores.sampled_reverse_kl()
    return out


def get_loss(name: str) -> Callable[..., LossOutput]:
    """Look a loss up by its config name (``reverse_kl_pg``, ``reverse_kl``, ``jsd``, ...)."""
    return LOSSES[_loss_key(name)]


def _loss_key(name: str) -> str:
    key = name.strip().lower() if isinstance(name, str) else name
    if key not in LOSSES:
        raise ValueError(f"unknown loss {name!r}; accepted names: {', '.join(sorted(LOSSES))}")
    return key
