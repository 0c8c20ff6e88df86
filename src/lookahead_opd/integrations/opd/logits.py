"""Next-token logits a loss can read without (tokens × vocab) tensors.

A causal LM's logits are ``head(final hidden state)``. ``NextTokenLogits`` holds one model's
scores over the aligned positions ``[B, T]`` (position ``t`` predicts ``tokens[:, t]``, see
``losses.shift_for_next_token``) in one of two forms:

- dense: the logits ``[B, T, V]`` themselves (``head is None``), as the model returned them;
- chunked: the final hidden states ``[B, T, H]`` and the model's ``OutputHead``, which a loss
  applies to a chunk of rows at a time (only the completion rows, and inside activation
  checkpointing where gradients flow), so no (tokens × vocab) tensor ever exists.

``model_logits`` runs a Hugging Face causal LM once and returns either form. The chunked form
asks the model for the logits of its last position only (``logits_to_keep=1``) and checks that
its own ``OutputHead`` reproduces them: a model whose head transforms logits in a way
``OutputHead`` does not know is refused in one line, never scored with a silently different
loss. Under FSDP2 the root module reshards the ``lm_head`` after its forward, so the chunked
form gathers it once per call (``OutputHead.unsharded``), its gradient reduce-scattered back.

Pure torch: this module must not import transformers (models are duck-typed).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

__all__ = ["OutputHead", "NextTokenLogits", "model_logits", "map_row_chunks", "sum_row_chunks",
           "token_logprobs", "compute_dtype"]

# Rows of a no-grad logprob computation are processed in chunks of about this many logits, so a
# bf16 teacher never needs a full fp32 copy of its [B, T, V] logits.
_CHUNK_ELEMENTS = 1 << 25
_INT_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for half/bf16/fp32 inputs, fp64 for fp64 inputs (so gradcheck works)."""
    return torch.promote_types(dtype, torch.float32)


class OutputHead:
    """A model's projection from final hidden states to logits, with its own final-logit
    transform, cut to the shared vocabulary:
    ``logits = softcap · tanh(scale · (h·Wᵀ + b) / softcap)[:, :vocab_size]`` (no tanh without
    ``softcap``). ``scale`` is Cohere's ``logit_scale`` (or ``1 / logits_scaling``, Granite's);
    ``softcap`` is Gemma-2's ``final_logit_softcapping``. Rows of ``W`` past ``vocab_size`` (a
    padded embedding) are never projected. ``weight`` may be a tied input embedding."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, *, vocab_size: int,
                 scale: float = 1.0, softcap: float | None = None) -> None:
        if weight.dim() != 2 or weight.shape[0] < vocab_size:
            raise ValueError(f"an output head needs a [V >= {vocab_size}, H] weight, got "
                             f"{tuple(weight.shape)}")
        self.weight, self.bias, self.vocab_size = weight, bias, vocab_size
        self.scale, self.softcap = float(scale), softcap

    @property
    def hidden_size(self) -> int:
        return self.weight.shape[1]

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits ``[..., vocab_size]`` of ``hidden`` ``[..., H]`` (in the weight's dtype)."""
        return self.transform(self.linear(hidden))

    def linear(self, hidden: torch.Tensor) -> torch.Tensor:
        """``h·Wᵀ + b`` on the shared vocabulary (before the final-logit transform)."""
        n = self.vocab_size
        bias = None if self.bias is None else self.bias[:n]
        return nn.functional.linear(hidden.to(self.weight.dtype), self.weight[:n], bias)

    def transform(self, logits: torch.Tensor) -> torch.Tensor:
        """The model's final-logit transform (scale, soft-capping) of ``linear``'s output."""
        if self.scale != 1.0:
            logits = logits * self.scale
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits

    @classmethod
    def of(cls, model: Any, vocab_size: int) -> OutputHead:
        """``model``'s head (``get_output_embeddings()``, an ``nn.Linear``) and the final-logit
        transform its config declares; ``ValueError`` in one line for a head it cannot read."""
        get = getattr(model, "get_output_embeddings", None)
        head = get() if callable(get) else None
        if not isinstance(head, nn.Linear):
            raise ValueError(f"--loss_chunk_size: {type(model).__name__}'s output head is "
                             f"{type(head).__name__}, not an nn.Linear the chunked loss can "
                             "project; use --loss_chunk_size 0")
        config = getattr(model, "config", None)
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        scale = getattr(text, "logit_scale", None) or 1.0  # Cohere multiplies ...
        divide = getattr(text, "logits_scaling", None)  # ... Granite divides
        if divide:
            scale = scale / divide
        softcap = getattr(text, "final_logit_softcapping", None) or None
        return cls(head.weight, head.bias, vocab_size=vocab_size, scale=scale, softcap=softcap)

    def unsharded(self, dtype: torch.dtype) -> OutputHead:
        """This head with an FSDP2-sharded weight and bias (``DTensor``s: after the root
        module's forward they are resharded) all-gathered once, in ``dtype`` (the dtype the
        forward computed in, under mixed precision). Their gradients go back to the shards
        summed over the ranks (a reduce-scatter), as FSDP reduces the other parameters'
        (``sharding.shard`` sums). The same head when nothing is sharded."""
        def full(t: torch.Tensor | None) -> torch.Tensor | None:
            if t is None or type(t).__name__ != "DTensor":
                return t
            from torch.distributed.tensor import Partial, Replicate

            ndim = t.device_mesh.ndim
            return t.redistribute(placements=[Replicate()] * ndim).to_local(
                grad_placements=[Partial()] * ndim).to(dtype)

        weight = full(self.weight)
        if weight is self.weight:
            return self
        return OutputHead(weight, full(self.bias), vocab_size=self.vocab_size, scale=self.scale,
                          softcap=self.softcap)

    def check(self, hidden: torch.Tensor, logits: torch.Tensor, what: str) -> None:
        """Raise ``ValueError`` unless this head maps ``hidden`` ``[n, H]`` to the model's own
        ``logits`` ``[n, V']`` (on the shared vocabulary; tolerance of the weight's dtype)."""
        with torch.no_grad():
            mine = self(hidden).float()
            theirs = logits[..., : self.vocab_size].float()
            eps = torch.finfo(self.weight.dtype).eps
            tol = 64 * eps * (1.0 + theirs.abs().amax().item()) * math.sqrt(self.hidden_size)
            if mine.shape != theirs.shape or (mine - theirs).abs().amax().item() > tol:
                raise ValueError(
                    f"--loss_chunk_size: {what}'s output head transforms its logits in a way "
                    " the chunked loss does not reproduce (known: lm_head, Cohere's "
                    "logit_scale, Granite's logits_scaling, Gemma-2's final_logit_softcapping, "
                    "a padded vocabulary); use --loss_chunk_size 0")


@dataclass
class NextTokenLogits:
    """One model's next-token scores at the aligned positions ``[B, T]``: the logits
    ``[B, T, V]`` when ``head`` is None (dense), else the final hidden states ``[B, T, H]``
    that ``head`` projects ``chunk_size`` rows at a time (0: all rows at once)."""

    states: torch.Tensor
    head: OutputHead | None = None
    chunk_size: int = 0

    @property
    def dense(self) -> bool:
        return self.head is None

    @property
    def vocab_size(self) -> int:
        return self.states.shape[-1] if self.head is None else self.head.vocab_size

    def project(self, rows: torch.Tensor) -> torch.Tensor:
        """Logits ``[n, V]`` of ``rows`` ``[n, V or H]`` taken from ``states``."""
        return rows if self.head is None else self.head(rows)

    def logits(self) -> torch.Tensor:
        """The full ``[B, T, V]`` logits (a projection of every position when chunked: only
        for small batches and for the dense path's own callers)."""
        return self.project(self.states)

    def detach(self) -> NextTokenLogits:
        return NextTokenLogits(self.states.detach(), self.head, self.chunk_size)

    def token_logprobs(self, tokens: torch.Tensor, mask: torch.Tensor,
                       temperature: float = 1.0) -> torch.Tensor:
        """Log-probs ``[B, T]`` (fp32) of ``tokens`` on the ``mask``ed positions under
        ``softmax(logits / temperature)``. Dense: of every position (``token_logprobs``);
        chunked: 0 off the mask, a logsumexp per chunk of masked rows, never a (tokens × vocab)
        tensor."""
        if self.head is None:
            return token_logprobs(self.states if temperature == 1.0 else self.states / temperature,
                                  tokens)

        def pick(logits: torch.Tensor, token: torch.Tensor) -> tuple[torch.Tensor]:
            x = logits.to(compute_dtype(logits.dtype))
            if temperature != 1.0:
                x = x / temperature
            return (x.gather(-1, token.long()[:, None]).squeeze(-1) - torch.logsumexp(x, -1),)

        picked = map_row_chunks(pick, [self], mask, tokens)
        rows = torch.cat([p for (p,) in picked])
        return torch.zeros(mask.shape, dtype=rows.dtype, device=rows.device).masked_scatter(
            mask, rows)

    def topk(self, k: int, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The ``k`` largest log-probs ``[B, T, k]`` (fp32, descending) and their token ids on
        the ``mask``ed positions (0 elsewhere), a chunk of rows at a time; no grad."""
        def top(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            x = torch.log_softmax(logits.to(compute_dtype(logits.dtype)), -1)
            return x.topk(k, dim=-1)

        with torch.no_grad():
            values, ids = zip(*map_row_chunks(top, [self], mask), strict=True)
            shape = (*mask.shape, k)
            out_v = torch.zeros(shape, dtype=values[0].dtype, device=mask.device)
            out_i = torch.zeros(shape, dtype=torch.long, device=mask.device)
            out_v[mask], out_i[mask] = torch.cat(values), torch.cat(ids)
        return out_v, out_i


def map_row_chunks(fn: Callable[..., tuple[torch.Tensor, ...]], logits: Sequence[NextTokenLogits],
                   mask: torch.Tensor, *per_token: torch.Tensor) -> list[tuple[torch.Tensor, ...]]:
    """``fn(*logits_of_each_source, *per_token_values)`` on each chunk of the ``mask``ed rows
    (the first source's ``chunk_size`` rows at a time; 0: one chunk of all of them, even
    none). Each source's rows are projected to logits inside the chunk; where a source has a
    head and grad is enabled, the chunk runs under activation checkpointing
    (``use_reentrant=False``), so its (chunk × vocab) tensors are freed after the forward and
    recomputed in the backward: peak memory grows with the chunk, not with the tokens. Only
    the first source keeps its gradient (the others are teachers: projected without grad)."""
    rows = [x.states[mask] if i == 0 else x.states.detach()[mask] for i, x in enumerate(logits)]
    extra = [v[mask] for v in per_token]
    n = rows[0].shape[0]
    step = logits[0].chunk_size or max(n, 1)

    def piece(*chunks: torch.Tensor) -> tuple[torch.Tensor, ...]:
        projected = [logits[0].project(chunks[0])]
        with torch.no_grad():
            projected += [x.project(c) for x, c in zip(logits[1:], chunks[1:len(logits)],
                                                       strict=True)]
        return fn(*projected, *chunks[len(logits):])

    checkpointed = torch.is_grad_enabled() and any(x.head is not None for x in logits)
    out = []
    for start in range(0, max(n, 1), step):
        chunks = [r[start:start + step] for r in rows + extra]
        out.append(checkpoint(piece, *chunks, use_reentrant=False) if checkpointed
                   else piece(*chunks))
    return out


def sum_row_chunks(fn: Callable[..., tuple[torch.Tensor, ...]], logits: Sequence[NextTokenLogits],
                   mask: torch.Tensor, *per_token: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``fn(*logits_of_each_source, *per_token_values)`` (a tuple of sums over the chunk's rows;
    the first carries the gradient, the others are metrics) summed over the chunks of the
    ``mask``ed rows, as ``map_row_chunks`` takes them (``per_token``: ``[B, T, ...]`` values
    without gradient, e.g. a teacher's top-k, cut to the same rows). Where the first source has
    a head and grad is enabled, the first sum's gradient with respect to the rows and the
    head's weight and bias is computed chunk by chunk in the forward (``_SumsWithGradient``):
    each chunk's (chunk × vocab) tensors are freed before the next one, and the backward only
    scales the stored gradients, so no projection is recomputed."""
    student = logits[0]
    head = student.head
    if head is None or not torch.is_grad_enabled():
        chunks = map_row_chunks(fn, logits, mask, *per_token)
        totals = chunks[0]
        for more in chunks[1:]:
            totals = tuple(a + b for a, b in zip(totals, more, strict=True))
        return totals
    rows = student.states[mask]
    others = [x.detach() for x in logits[1:]]
    params = [head.weight] + ([] if head.bias is None else [head.bias])
    extra = [v.detach() for v in per_token]
    return _SumsWithGradient.apply(fn, head, others, extra, mask, student.chunk_size, rows,
                                   *params)


class _SumsWithGradient(torch.autograd.Function):
    """``sum_row_chunks`` with the gradient taken in the forward: per chunk, the logits
    ``z = h·Wᵀ + b`` are a leaf, ``∂sum/∂z`` comes from autograd through the head's transform
    and ``fn``, and ``∂/∂h = ∂z·W``, ``∂/∂W += ∂zᵀ·h``, ``∂/∂b += Σ ∂z`` accumulate in
    buffers the size of the rows and of the head."""

    @staticmethod
    def forward(ctx, fn, head, others, extra, mask, chunk_size, rows, weight, bias=None):
        n, vocab = rows.shape[0], head.vocab_size
        other_rows = [x.states[mask] for x in others]
        extra_rows = [v[mask] for v in extra]
        grad_rows = torch.zeros_like(rows) if ctx.needs_input_grad[6] else None
        # Accumulated over the chunks in fp32 (a bf16 head's gradient is rounded once, at the
        # end, as one dense matmul's would be).
        acc = compute_dtype(weight.dtype)
        grad_weight = (torch.zeros_like(weight, dtype=acc) if ctx.needs_input_grad[7]
                       else None)
        grad_bias = (torch.zeros_like(bias, dtype=acc)
                     if bias is not None and ctx.needs_input_grad[8] else None)
        step = chunk_size or max(n, 1)
        totals = None
        for start in range(0, max(n, 1), step):
            h = rows[start:start + step]
            with torch.enable_grad():
                z = head.linear(h).detach().requires_grad_(True)
                outs = fn(head.transform(z), *[x.project(r[start:start + step])
                                               for x, r in zip(others, other_rows, strict=True)],
                          *[r[start:start + step] for r in extra_rows])
                (dz,) = torch.autograd.grad(outs[0], z)
            if grad_rows is not None:
                grad_rows[start:start + step] = (dz @ weight[:vocab]).to(rows.dtype)
            if grad_weight is not None:
                grad_weight[:vocab].addmm_(dz.T.to(acc), h.to(acc))
            if grad_bias is not None:
                grad_bias[:vocab] += dz.sum(0, dtype=acc)
            outs = tuple(o.detach() for o in outs)
            totals = outs if totals is None else tuple(a + b for a, b in zip(totals, outs,
                                                                               strict=True))
        ctx.grads = (grad_rows, grad_weight, grad_bias)
        ctx.dtypes = (rows.dtype, weight.dtype, None if bias is None else bias.dtype)
        return totals

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_sum, *_):
        grads = tuple(None if g is None else g.mul_(grad_sum.to(g.dtype)).to(dtype)
                      for g, dtype in zip(ctx.grads, ctx.dtypes, strict=True))
        ctx.grads = None
        return (None, None, None, None, None, None, *grads)


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
    dtype = compute_dtype(logits.dtype)
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


def model_logits(model: nn.Module, sequences: torch.Tensor, attention_mask: torch.Tensor,
                 vocab_size: int, *, chunk_size: int = 0) -> NextTokenLogits:
    """``model``'s next-token scores on left-padded ``sequences`` (the positions ``generate``
    used, from the mask), aligned with ``sequences[:, 1:]`` and cut to ``vocab_size``: dense
    logits (``chunk_size=0``), or the final hidden states and the model's checked
    ``OutputHead``, projected ``chunk_size`` rows at a time. Keeps the graph when grad is
    enabled."""
    position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
    kwargs = dict(input_ids=sequences, attention_mask=attention_mask, position_ids=position_ids)
    if not chunk_size:
        logits = model(**kwargs).logits
        return NextTokenLogits(logits[:, :-1, :vocab_size])
    head = OutputHead.of(model, vocab_size)
    try:
        out = model(**kwargs, output_hidden_states=True, logits_to_keep=1)
    except TypeError as err:
        raise ValueError(f"--loss_chunk_size: {type(model).__name__} does not return its hidden "
                         f"states with logits_to_keep ({err}); use --loss_chunk_size 0") from None
    hidden = out.hidden_states[-1]
    head = head.unsharded(hidden.dtype)
    head.check(hidden[:, -1], out.logits[:, -1], type(model).__name__)
    return NextTokenLogits(hidden[:, :-1], head, chunk_size)
