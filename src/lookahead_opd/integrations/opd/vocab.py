"""Vocabulary alignment: whether a student and a teacher score the same token ids, and the
logits slice they share (models pad their output embedding to different sizes).

Pure torch: this module must not import transformers (checks use duck typing).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["check_vocab_compatible", "align_vocab"]



@dataclass
class _VocabSide:
    vocab: Mapping[str, int] | None = None  # token -> id, when a tokenizer/dict was given
    logits_size: int | None = None  # rows of the output embedding, when a model/int was given
    what: str = ""


def _model_logits_size(obj: Any) -> int | None:
    get_out = getattr(obj, "get_output_embeddings", None)
    if callable(get_out):
        head = get_out()
        weight = getattr(head, "weight", None)
        if isinstance(weight, torch.Tensor) and weight.dim() == 2:
            return int(weight.shape[0])
    config = getattr(obj, "config", None)
    if config is not None:
        get_text = getattr(config, "get_text_config", None)
        text_config = get_text() if callable(get_text) else config
        size = getattr(text_config, "vocab_size", None) or getattr(config, "vocab_size", None)
        if isinstance(size, int):
            return size
    return None


def _describe(obj: Any, role: str, tokenizer: Any = None) -> _VocabSide:
    side = _VocabSide(what=f"{role} ({type(obj).__name__})")
    if isinstance(obj, bool):
        raise TypeError(
            f"{role}: expected a tokenizer, model, vocab size or vocab dict, got {obj!r}"
        )
    if isinstance(obj, int):
        side.logits_size = obj
    elif isinstance(obj, Mapping):
        side.vocab = obj
    elif callable(getattr(obj, "get_vocab", None)):
        side.vocab = obj.get_vocab()
    else:
        side.logits_size = _model_logits_size(obj)
        if side.logits_size is None:
            raise TypeError(
                f"{role}: cannot read a vocabulary from {type(obj).__name__}; pass a tokenizer "
                "(with get_vocab), a model (with config.vocab_size or get_output_embeddings), an "
                "int vocab size, or a token->id dict"
            )
    if tokenizer is not None and side.vocab is None:
        extra = _describe(tokenizer, f"{role}_tokenizer")
        if extra.vocab is None:
            raise TypeError(
                f"{role}_tokenizer must be a tokenizer or token->id dict, "
                f"got {type(tokenizer).__name__}"
            )
        side.vocab = extra.vocab
    if side.logits_size is not None and side.logits_size <= 0:
        raise ValueError(f"{role}: vocab size must be positive, got {side.logits_size}")
    return side


def _first_differences(a: Mapping[str, int], b: Mapping[str, int], limit: int = 3) -> list[str]:
    out = []
    for tok in sorted(
        set(a) | set(b), key=lambda t: (min(a.get(t, 1 << 62), b.get(t, 1 << 62)), t)
    ):
        if a.get(tok) != b.get(tok):
            out.append(f"{tok!r}: student id {a.get(tok)} vs teacher id {b.get(tok)}")
            if len(out) == limit:
                break
    return out


def _check_same_vocab(student: Mapping[str, int], teacher: Mapping[str, int]) -> None:
    """Raise ``ValueError`` unless the two token->id maps are equal (naming a few differences)."""
    if len(student) != len(teacher):
        raise ValueError(
            f"vocabularies differ in size: student has {len(student)} tokens, teacher has "
            f"{len(teacher)}; OPD needs the same tokenizer for student and teacher"
        )
    if dict(student) != dict(teacher):
        diffs = "; ".join(_first_differences(student, teacher))
        raise ValueError(
            f"vocabularies have the same size ({len(student)}) but different token->id maps "
            f"(e.g. {diffs}); OPD needs the same tokenizer for student and teacher"
        )


def check_vocab_compatible(
    student: Any,
    teacher: Any,
    *,
    student_tokenizer: Any = None,
    teacher_tokenizer: Any = None,
    tokenizer: Any = None,
) -> int:
    """Check that student and teacher score the same token ids; return the shared logits size.

    ``student``/``teacher`` may each be a tokenizer (``get_vocab``), a model
    (``config.vocab_size`` / ``get_output_embeddings``), an int vocab size or a token->id dict;
    give the tokenizers with ``*_tokenizer`` (or one shared ``tokenizer``) when passing models
    (ignored for a side that is already a tokenizer or dict).
    Raises ``ValueError`` when the token->id maps differ, when a tokenizer has ids beyond a
    model's logits, or when two models' sizes differ without tokenizers to prove them identical.
    Embedding matrices padded past the tokenizer (``config.vocab_size > len(tokenizer)``) are
    fine: slice both logits to the returned size with :func:`align_vocab`.
    """
    if tokenizer is not None:
        if student_tokenizer is not None or teacher_tokenizer is not None:
            raise ValueError(
                "pass either tokenizer= (shared) or student_tokenizer=/teacher_tokenizer=, not both"
            )
        student_tokenizer = teacher_tokenizer = tokenizer
    s = _describe(student, "student", student_tokenizer)
    t = _describe(teacher, "teacher", teacher_tokenizer)

    if s.vocab is not None and t.vocab is not None and s.vocab is not t.vocab:
        _check_same_vocab(s.vocab, t.vocab)
    vocab = s.vocab if s.vocab is not None else t.vocab
    needed = (max(vocab.values()) + 1 if vocab else 0) if vocab is not None else None

    sizes = [x.logits_size for x in (s, t) if x.logits_size is not None]
    for side in (s, t):
        if side.logits_size is not None and needed is not None and side.logits_size < needed:
            raise ValueError(
                f"{side.what} has {side.logits_size} logits but the tokenizer uses ids up to "
                f"{needed - 1}; the model cannot score every token"
            )
    if len(sizes) == 2 and sizes[0] != sizes[1] and vocab is None:
        raise ValueError(
            f"model vocab sizes differ (student {s.logits_size}, teacher {t.logits_size}) and no "
            "tokenizers were given to show they share one; pass student_tokenizer=/"
            "teacher_tokenizer= (or tokenizer=) so padded embedding matrices can be told apart "
            "from different vocabularies"
        )
    if sizes:
        return min(sizes)
    assert needed is not None
    return needed


def align_vocab(logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Slice ``logits[..., :vocab_size]`` (a view) so padded-vocab models share one size."""
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size <= 0:
        raise ValueError(f"vocab_size must be a positive int, got {vocab_size!r}")
    if logits.shape[-1] < vocab_size:
        raise ValueError(
            f"logits have V={logits.shape[-1]} < vocab_size={vocab_size}; can only slice down, "
            "use the size returned by check_vocab_compatible"
        )
    return logits[..., :vocab_size]
