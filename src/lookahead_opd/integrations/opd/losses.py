"""Losses for on-policy distillation (OPD): per-token reverse-KL policy gradient, full-vocab KLs,
and KLs over the teacher's top-k tokens plus one tail bucket.

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
- No loss assumes (tokens × vocab) tensors: the full-vocabulary losses take dense logits or
  ``NextTokenLogits`` (final hidden states + the output head, projected a chunk of completion
  rows at a time), and each loss declares what it reads from the teacher (``LossInputs.teacher``,
  a ``TeacherNeeds``).

Pure torch: this module must not import transformers (vocab checks use duck typing).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from .logits import NextTokenLogits, compute_dtype, sum_row_chunks, token_logprobs
from .teacher import TeacherNeeds, TeacherScores

__all__ = [
    "DEFAULT_TOPK",
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
    "teacher_needs",
    "token_logprobs",
    "topk_forward_kl_loss",
    "topk_jsd_loss",
    "topk_reverse_kl_loss",
]

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


Logits = torch.Tensor | NextTokenLogits  # dense [B, T, V], or hidden states + head


def _as_logits(name: str, x: Logits) -> NextTokenLogits:
    states = x.states if isinstance(x, NextTokenLogits) else x
    if not isinstance(states, torch.Tensor) or states.dim() != 3:
        shape = tuple(states.shape) if isinstance(states, torch.Tensor) else type(x).__name__
        raise ValueError(f"{name} must be a [B, T, V] tensor or NextTokenLogits, got {shape}")
    if not states.is_floating_point():
        raise TypeError(f"{name} must be floating point, got dtype {states.dtype}")
    return x if isinstance(x, NextTokenLogits) else NextTokenLogits(x)


def _check_logit_pair(student_logits: Logits, teacher_logits: Logits
                      ) -> tuple[NextTokenLogits, NextTokenLogits]:
    s, t = _as_logits("student_logits", student_logits), _as_logits("teacher_logits", teacher_logits)
    if s.states.shape[:2] != t.states.shape[:2]:
        raise ValueError(
            f"student_logits {tuple(s.states.shape)} and teacher_logits "
            f"{tuple(t.states.shape)} must share [B, T]"
        )
    if s.vocab_size != t.vocab_size:
        raise ValueError(
            f"vocab sizes differ: student_logits has V={s.vocab_size}, "
            f"teacher_logits has V={t.vocab_size}; check the tokenizers with "
            "check_vocab_compatible() and slice both with align_vocab(logits, vocab_size)"
        )
    return s, t


def _log_probs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    x = logits.to(compute_dtype(logits.dtype))
    if temperature != 1.0:
        x = x / temperature
    return torch.log_softmax(x, dim=-1)


def _row_sums(
    kernel: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, ...]],
    student: NextTokenLogits,
    teacher: NextTokenLogits,
    mask: torch.Tensor,
    temperature: float,
) -> tuple[torch.Tensor, ...]:
    """``kernel(student_logprobs, teacher_logprobs)`` (each a tuple of sums over rows) summed
    over the masked rows, taken ``student.chunk_size`` rows at a time (``sum_row_chunks``).

    Selecting rows first skips prompt/padding compute and makes masked positions unable to leak
    NaN/inf into the loss or the gradient. The teacher's log-probs carry no gradient.
    """
    def rows(s: torch.Tensor, t: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return kernel(_log_probs(s, temperature), _log_probs(t, temperature))

    return sum_row_chunks(rows, [student, teacher], mask)


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


def _check_logprob_inputs(
    student_logprobs: torch.Tensor,
    completion_mask: torch.Tensor,
    *,
    teacher_logprobs: torch.Tensor,
    sampler_logprobs: torch.Tensor | None,
) -> torch.Tensor:
    """Check that ``student_logprobs`` is ``[B, T]`` and the teacher's (and the sampler's, when
    given) log-probs have its shape; return the checked completion mask."""
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
    return mask


def _ppo_objective(
    ratio: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    bounds: tuple[float, float] | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token ``ratio·A``, or PPO's ``min(r·A, clip(r, low, high)·A)`` with ``bounds``;
    also the mask of (completion) tokens whose clipped branch is active."""
    objective = ratio * advantages
    if bounds is None:
        return objective, torch.zeros_like(mask)
    clipped = ratio.clamp(bounds[0], bounds[1]) * advantages
    clip_active = (clipped < objective) & mask
    return torch.minimum(objective, clipped), clip_active


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
    mask = _check_logprob_inputs(
        student_logprobs, completion_mask,
        teacher_logprobs=teacher_logprobs, sampler_logprobs=sampler_logprobs,
    )
    bounds = _clip_bounds(clip_ratio)
    denom = _resolve_num_tokens(num_tokens, mask)

    dtype = compute_dtype(student_logprobs.dtype)
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
    objective, clip_active = _ppo_objective(ratio, advantages, mask, bounds)
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
    dtype = compute_dtype(student_logprobs.dtype)
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
    student_logits: Logits,
    teacher_logits: Logits,
    completion_mask: torch.Tensor,
    *,
    num_tokens: NumTokens = None,
    temperature: float = 1.0,
) -> LossOutput:
    """Exact full-vocabulary reverse KL(π_student ‖ π_teacher) per token, summed / num_tokens.

    The analytic counterpart of :func:`reverse_kl_pg_loss` (no sampling variance, needs both
    models' full logits). Gradient flows through the student only. Metrics: ``reverse_kl``
    (mean per token), ``student_entropy``, ``num_tokens``.

    Each side is dense logits ``[B, T, V]`` or ``NextTokenLogits``: given hidden states and a
    head, the completion rows are projected ``chunk_size`` at a time under activation
    checkpointing (``map_row_chunks``), the same loss without a (tokens × vocab) tensor.
    """
    student, teacher = _check_logit_pair(student_logits, teacher_logits)
    mask = _check_mask(completion_mask, student.states.shape[:2])
    _check_temperature(temperature)
    denom = _resolve_num_tokens(num_tokens, mask)

    kl_sum, entropy_sum = _row_sums(_reverse_kl_sums, student, teacher, mask, temperature)
    loss = kl_sum / denom
    with torch.no_grad():
        n_local = mask.sum()
        n = n_local.clamp(min=1)
        metrics = _metrics(
            reverse_kl=kl_sum / n, student_entropy=entropy_sum / n, num_tokens=n_local
        )
    return LossOutput(loss=loss, metrics=metrics)


def _reverse_kl_sums(ls: torch.Tensor, lt: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Σ rows of KL(student ‖ teacher) (with grad) and of the student's entropy."""
    per_token = _kl_rows(ls, lt)
    with torch.no_grad():
        entropy = -(ls.exp() * _floor_log(ls)).sum(dim=-1)
    return per_token.sum(), entropy.sum()


def generalized_jsd_loss(
    student_logits: Logits,
    teacher_logits: Logits,
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
    Logits as in :func:`reverse_kl_loss` (dense or chunked).
    """
    if isinstance(beta, bool) or not isinstance(beta, int | float) or not 0.0 <= beta <= 1.0:
        raise ValueError(
            f"beta must be a float in [0, 1] (0 = forward KL, 1 = reverse KL), got {beta!r}"
        )
    student, teacher = _check_logit_pair(student_logits, teacher_logits)
    mask = _check_mask(completion_mask, student.states.shape[:2])
    _check_temperature(temperature)
    denom = _resolve_num_tokens(num_tokens, mask)

    jsd_sum, rkl_sum = _row_sums(functools.partial(_jsd_sums, beta=beta), student, teacher, mask,
                                 temperature)
    loss = jsd_sum / denom
    with torch.no_grad():
        n_local = mask.sum()
        n = n_local.clamp(min=1)
        metrics = _metrics(jsd=jsd_sum / n, reverse_kl=rkl_sum / n, num_tokens=n_local)
    return LossOutput(loss=loss, metrics=metrics)


def _jsd_sums(ls: torch.Tensor, lt: torch.Tensor, *, beta: float
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """Σ rows of the generalized JSD (with grad) and of KL(student ‖ teacher)."""
    if beta == 0.0:
        per_token = _kl_rows(lt, ls)
    elif beta == 1.0:
        per_token = _kl_rows(ls, lt)
    else:
        # Floor first: logaddexp(-inf, -inf) has a NaN gradient.
        lm = torch.logaddexp(_floor_log(ls) + math.log(1.0 - beta), _floor_log(lt) + math.log(beta))
        per_token = beta * _kl_rows(lt, lm) + (1.0 - beta) * _kl_rows(ls, lm)
    with torch.no_grad():
        rkl = _kl_rows(ls, lt).sum()
    return per_token.sum(), rkl


# ---------------------------------------------------------------------------------------------
# top-k losses: the teacher's k most likely tokens and one tail bucket
# ---------------------------------------------------------------------------------------------

# The top-k losses' default k: vLLM's default --max-logprobs, so a served teacher needs no flag.
DEFAULT_TOPK = 20
# The lightest tail bucket told apart from 0. A teacher's tail is 1 − Σ of its k probabilities,
# and below fp32's rounding of a sum near 1 that difference is noise (a served teacher's k
# log-probs may even sum past 1); both tails are floored here, so at k = V they cancel.
_MIN_TAIL = torch.finfo(torch.float32).eps
_LOG_MIN_TAIL, _LOG_MAX_TOP = math.log(_MIN_TAIL), math.log1p(-_MIN_TAIL)
_LOG_HALF = math.log(0.5)


def _log1mexp(a: torch.Tensor) -> torch.Tensor:
    """``log(1 − exp(a))`` for ``a < 0``, accurate on both sides of ``log ½`` (Mächler 2012)."""
    return torch.where(a > _LOG_HALF, torch.log(-torch.expm1(a)), torch.log1p(-torch.exp(a)))


def _bucketed(logits: torch.Tensor, top_lp: torch.Tensor, top_ids: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """Student and teacher log-probs ``[n, k+1]`` over the teacher's top-k tokens plus one
    bucket for the rest of the vocabulary (the last column)."""
    ls = torch.log_softmax(logits.to(compute_dtype(logits.dtype)), dim=-1)
    ids = top_ids.long()
    ls_top = ls.gather(-1, ids)
    # The student's tail from its own logits (every other token's mass) rather than 1 − Σ:
    # exact where its top-k holds nearly everything, and a finite gradient even at k = V
    # (the top-k set to a large finite log-prob, not -inf, whose logsumexp has a NaN gradient).
    ls_tail = torch.logsumexp(ls.scatter(-1, ids, _LOG_FLOOR), dim=-1, keepdim=True)
    lt_top = top_lp.to(ls.dtype)
    lt_mass = torch.logsumexp(lt_top, dim=-1, keepdim=True)
    lt_tail = _log1mexp(lt_mass.clamp(max=_LOG_MAX_TOP))
    return (torch.cat([ls_top, ls_tail.clamp(min=_LOG_MIN_TAIL)], dim=-1),
            torch.cat([lt_top, lt_tail], dim=-1))


def _topk_sums(logits: torch.Tensor, top_lp: torch.Tensor, top_ids: torch.Tensor, *,
               beta: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Σ rows of the bucketed JSD(β) (with grad), of the bucketed reverse KL, and of the
    teacher's tail mass."""
    ls, lt = _bucketed(logits, top_lp, top_ids)
    loss, rkl = _jsd_sums(ls, lt, beta=beta)
    return loss, rkl, lt[:, -1].detach().exp().sum()


def _check_topk(teacher_topk: Any, shape: torch.Size, vocab_size: int, k: int | None
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """The teacher's ``(log-probs, ids)`` ``[B, T, k']``, cut to their first ``k`` columns."""
    if not isinstance(teacher_topk, tuple | list) or len(teacher_topk) != 2:
        raise TypeError("teacher_topk must be a pair (log-probs, token ids), each [B, T, k]")
    lp, ids = teacher_topk
    if lp.dim() != 3 or lp.shape[:2] != shape or ids.shape != lp.shape:
        raise ValueError(f"teacher_topk must be two [B, T, k] tensors with [B, T] = "
                         f"{tuple(shape)}, got {tuple(lp.shape)} and {tuple(ids.shape)}")
    if ids.dtype not in _INT_DTYPES:
        raise TypeError(f"the teacher's top-k token ids must be integers, got {ids.dtype}")
    given = lp.shape[-1]
    if k is not None and not 1 <= k <= given:
        raise ValueError(f"k must be in [1, {given}] (the teacher gave {given} log-probs per "
                         f"position), got {k!r}")
    bad = ids[(ids < 0) | (ids >= vocab_size)]
    if bad.numel():  # a gather would fail on it (on a GPU, as a device-side assert)
        raise ValueError(f"the teacher's top-k holds token id {int(bad[0])}, outside the "
                         f"shared vocabulary of {vocab_size}; the teacher must share the "
                         f"student's vocabulary")
    return (lp, ids) if k is None else (lp[..., :k], ids[..., :k])


def topk_jsd_loss(
    student_logits: Logits,
    teacher_topk: tuple[torch.Tensor, torch.Tensor],
    completion_mask: torch.Tensor,
    *,
    beta: float = 0.5,
    k: int | None = None,
    num_tokens: NumTokens = None,
) -> LossOutput:
    """:func:`generalized_jsd_loss` over k + 1 outcomes: the teacher's top-k tokens at each
    position and one tail bucket holding the mass outside them, for both models.

    ``teacher_topk`` is the teacher's top-k ``(log-probs, token ids)`` ``[B, T, k']`` (a
    served teacher's ``prompt_logprobs=k``, or ``ModelTeacher``'s); ``k`` keeps their first k
    (None: all). The student's log-probs are gathered at those ids. Biased low: merging the
    tail makes this a lower bound of the full divergence (data processing), and the gradient
    ignores how the student spreads its mass inside the tail. Each tail is floored at fp32's
    epsilon. Metrics: ``topk_reverse_kl`` (the bucketed reverse KL), ``teacher_tail`` (the
    teacher's mean mass outside its top-k), ``num_tokens``.
    """
    if isinstance(beta, bool) or not isinstance(beta, int | float) or not 0.0 <= beta <= 1.0:
        raise ValueError(
            f"beta must be a float in [0, 1] (0 = forward KL, 1 = reverse KL), got {beta!r}"
        )
    student = _as_logits("student_logits", student_logits)
    mask = _check_mask(completion_mask, student.states.shape[:2])
    top_lp, top_ids = _check_topk(teacher_topk, mask.shape, student.vocab_size, k)
    denom = _resolve_num_tokens(num_tokens, mask)

    kernel = functools.partial(_topk_sums, beta=beta)
    loss_sum, rkl_sum, tail_sum = sum_row_chunks(kernel, [student], mask, top_lp.detach(),
                                                 top_ids)
    with torch.no_grad():
        n_local = mask.sum()
        n = n_local.clamp(min=1)
        metrics = _metrics(topk_reverse_kl=rkl_sum / n, teacher_tail=tail_sum / n,
                           num_tokens=n_local)
    return LossOutput(loss=loss_sum / denom, metrics=metrics)


def topk_forward_kl_loss(student_logits: Logits, teacher_topk: tuple[torch.Tensor, torch.Tensor],
                         completion_mask: torch.Tensor, *, k: int | None = None,
                         num_tokens: NumTokens = None) -> LossOutput:
    """KL(teacher ‖ student) over the teacher's top-k and a tail bucket (:func:`topk_jsd_loss`
    at ``beta=0``)."""
    return topk_jsd_loss(student_logits, teacher_topk, completion_mask, beta=0.0, k=k,
                         num_tokens=num_tokens)


def topk_reverse_kl_loss(student_logits: Logits, teacher_topk: tuple[torch.Tensor, torch.Tensor],
                         completion_mask: torch.Tensor, *, k: int | None = None,
                         num_tokens: NumTokens = None) -> LossOutput:
    """KL(student ‖ teacher) over the teacher's top-k and a tail bucket (:func:`topk_jsd_loss`
    at ``beta=1``); the −KL gate's score with a teacher that gives its top-k only."""
    return topk_jsd_loss(student_logits, teacher_topk, completion_mask, beta=1.0, k=k,
                         num_tokens=num_tokens)


# ---------------------------------------------------------------------------------------------
# registry
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class TokenScores:
    """One batch of sampled completions as the losses see it, aligned with ``tokens``
    (``shift_for_next_token``, one shared vocabulary): the student's next-token logits (with
    grad; dense or chunked, ``NextTokenLogits``), what the teacher gave (``TeacherScores``), the
    completion ``mask``, and one ``advantages`` value per row (the task's rewards,
    ``group_advantages``) when known. Each loss takes its pair of inputs from one of
    ``logits``, ``logprobs``, ``rewards``; the sampled tokens' log-probs are computed once, on
    first use.

    ``temperature`` is the one the completions were sampled at. ``rewards`` scores them under
    that sampler, ``softmax(logits / temperature)``: the policy gradient is unbiased only for
    the distribution that drew the samples (scored at 1 instead, a 0.7 sampler's gradient
    mixes in a term that sharpens or flattens every visited prefix). The distillation pairs
    (``logprobs``, ``logits``) stay at 1: their objective is the student's own distribution
    against the teacher's, so ``reverse_kl_pg``'s sampled estimate is on-policy only for
    completions sampled at 1 (the config's default)."""

    student: NextTokenLogits
    teacher: TeacherScores
    tokens: torch.Tensor
    mask: torch.Tensor
    advantages: torch.Tensor | None = None
    temperature: float = 1.0
    _cache: dict[str, torch.Tensor] = field(default_factory=dict, repr=False, compare=False)

    def _logprobs(self, who: str) -> torch.Tensor:
        if who not in self._cache:
            mask = self.mask.bool()
            self._cache[who] = (  # "sampler": the student at the sampling temperature
                self.teacher.sampled(self.tokens, mask) if who == "teacher"
                else self.student.token_logprobs(
                    self.tokens, mask, self.temperature if who == "sampler" else 1.0))
        return self._cache[who]

    def logits(self) -> tuple[NextTokenLogits, NextTokenLogits]:
        """Both models' full next-token logits (dense ``[B, T, V]`` or hidden states + head)."""
        return self.student, self.teacher.full()

    def topk(self) -> tuple[NextTokenLogits, tuple[torch.Tensor, torch.Tensor]]:
        """The student's next-token logits and the teacher's top-k (log-probs, token ids)."""
        return self.student, self.teacher.top()

    def logprobs(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Both models' log-probs of the sampled tokens ``[B, T]``."""
        return self._logprobs("student"), self._logprobs("teacher")

    def rewards(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The student's log-probs of the sampled tokens and the per-row advantages."""
        if self.advantages is None:
            raise ValueError("this loss learns from the task's rewards: pass advantages=")
        return self._logprobs("student" if self.temperature == 1.0 else "sampler"), self.advantages

    @torch.no_grad()
    def sampled_reverse_kl(self) -> float:
        """Mean over completion tokens of ``log π_s − log π_t`` at the sampled tokens."""
        ls, lt = self.logprobs()
        return float(((ls - lt) * self.mask).sum() / self.mask.sum().clamp(min=1))


@dataclass(frozen=True)
class LossInputs:
    """What a loss of ``LOSSES`` needs. Every loss is called the same way,
    ``loss(student, reference, mask, num_tokens=..., **options)``: ``select`` picks the
    ``(student, reference)`` pair from ``TokenScores``, ``options`` names the run option of
    each extra keyword (``{loss keyword: option name}``, the names of ``OPDConfig``'s fields,
    given to ``compute_loss`` as ``options``), ``teacher`` is what the loss (its
    metrics included) reads from the teacher."""

    select: Callable[[TokenScores], tuple[Any, Any]]
    teacher: TeacherNeeds
    options: Mapping[str, str] = field(default_factory=dict)


# Every loss by its config name, with what it consumes: per-token log-probs [B, T] or full
# next-token logits (dense or chunked) of both models, the student's logits and the teacher's
# top-k, or the task's rewards (the RL baseline: the teacher is then only measured, never
# learned from). A top-k loss's option "k" is also what it asks the teacher for (teacher_needs).
_SAMPLED, _FULL, _TOPK = TeacherNeeds.SAMPLED, TeacherNeeds.FULL, TeacherNeeds.topk(DEFAULT_TOPK)
_REGISTRY: dict[str, tuple[Callable[..., LossOutput], LossInputs]] = {
    "reverse_kl_pg": (reverse_kl_pg_loss,
                      LossInputs(TokenScores.logprobs, _SAMPLED, {"discount": "discount"})),
    "reverse_kl": (reverse_kl_loss, LossInputs(TokenScores.logits, _FULL)),
    "jsd": (generalized_jsd_loss, LossInputs(TokenScores.logits, _FULL, {"beta": "jsd_beta"})),
    "topk_forward_kl": (topk_forward_kl_loss, LossInputs(TokenScores.topk, _TOPK, {"k": "topk"})),
    "topk_reverse_kl": (topk_reverse_kl_loss, LossInputs(TokenScores.topk, _TOPK, {"k": "topk"})),
    "topk_jsd": (topk_jsd_loss, LossInputs(TokenScores.topk, _TOPK,
                                           {"beta": "jsd_beta", "k": "topk"})),
    "drgrpo": (policy_gradient_loss, LossInputs(TokenScores.rewards, _SAMPLED)),
}
LOSSES: dict[str, Callable[..., LossOutput]] = {k: fn for k, (fn, _) in _REGISTRY.items()}
LOSS_INPUTS: dict[str, LossInputs] = {k: inputs for k, (_, inputs) in _REGISTRY.items()}


def compute_loss(name: str, scores: TokenScores, *, num_tokens: NumTokens = None,
                 options: Mapping[str, Any] | None = None) -> LossOutput:
    """The loss ``name`` of ``scores``. ``options`` holds the run's loss options by their
    config names (``discount``, ``jsd_beta``, ``topk``: ``OPDConfig.loss_options()``); the loss
    reads the ones ``LOSS_INPUTS`` names for it, and a missing one keeps the loss's default.
    Every loss reports ``reverse_kl``: one that does not compute it (the RL baseline, the
    top-k losses) gets the sampled-token estimate, measured without gradient."""
    key = _loss_key(name)
    spec = LOSS_INPUTS[key]
    given = options or {}
    kwargs = {k: given[v] for k, v in spec.options.items() if v in given}
    student, reference = spec.select(scores)
    out = LOSSES[key](student, reference, scores.mask, num_tokens=num_tokens, **kwargs)
    if "reverse_kl" not in out.metrics:
        out.metrics["reverse_kl"] = scores.sampled_reverse_kl()
    return out


def teacher_needs(name: str, options: Mapping[str, Any] | None = None) -> TeacherNeeds:
    """What the loss ``name`` reads from the teacher (``LossInputs.teacher``); a top-k loss
    asks for the ``k`` its option (``topk``) has in ``options`` (absent: ``DEFAULT_TOPK``)."""
    spec = LOSS_INPUTS[_loss_key(name)]
    if spec.teacher.level == "topk" and options and spec.options["k"] in options:
        return TeacherNeeds.topk(options[spec.options["k"]])
    return spec.teacher


def get_loss(name: str) -> Callable[..., LossOutput]:
    """Look a loss up by its config name (``reverse_kl_pg``, ``reverse_kl``, ``jsd``, ...)."""
    return LOSSES[_loss_key(name)]


def _loss_key(name: str) -> str:
    key = name.strip().lower() if isinstance(name, str) else name
    if key not in LOSSES:
        raise ValueError(f"unknown loss {name!r}; accepted names: {', '.join(sorted(LOSSES))}")
    return key
