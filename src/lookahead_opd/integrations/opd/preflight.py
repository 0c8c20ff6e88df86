"""Preflight: the checks that an OPD run is set up to learn what it means to, run by
``lookahead-opd check`` (same options as ``train``) and by ``lookahead-opd train`` before its
first step. Each fault is one line naming the fix; a warning does not stop the run.

Always (cheap: the tokenizers and one teacher forward on one prompt):

- template: the teacher scores exactly the token ids the student saw, so both tokenizers must
  share the chat template and the special tokens (``--allow_template_mismatch`` accepts a
  difference, with a warning);
- tokenizer: the same vocabulary (size and token->id map, reported by a digest), eos and pad;
- temperature: every teacher scores at temperature 1: what a served teacher's requests ask
  for, and for an in-process one, its scores of a prompt against its own model's log-probs.

With ``--preflight_rollouts`` (a few of the student's own rollouts):

- identity: the student scored as its own teacher through the trainer's loss path gives a
  loss and a reverse KL of 0 (at most ``IDENTITY_TOLERANCE``), and so does the −KL gate;
- top-k mass: for a loss that reads the teacher's top-k log-probs, the mass they hold
  (a warning below ``TOPK_MASS``, with the k that reaches it when the teacher is in process).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import sys
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .engines import Rollout, tokenize_prompts
from .logits import NextTokenLogits, map_row_chunks, model_logits
from .losses import teacher_needs
from .tasks import Problem
from .teacher import ModelTeacher, Teacher, TeacherNeeds
from .vocab import check_vocab_compatible

__all__ = ["Finding", "IDENTITY_TOLERANCE", "TOPK_MASS", "PROBE_ROLLOUTS", "run_preflight",
           "report", "load_teacher_tokenizers", "tokenizer_findings", "check_tokenizer",
           "check_template", "check_temperature", "declared_temperature",
           "measured_temperature", "rollout_findings", "check_identity", "check_gate_identity",
           "topk_mass", "k_for_mass", "check_topk_mass", "vocab_digest"]

IDENTITY_TOLERANCE = 1e-5  # student = teacher: loss and KL at most this
TOPK_MASS = 0.9  # below this mean top-k probability mass, a top-k loss is warned about
PROBE_ROLLOUTS = 4  # prompts of the rollout checks (times num_samples rows)
_TEMPERATURE_GAP = 1e-2  # max |Δ log p| of a teacher's scores against its model's own
_TEMPERATURE_SLACK = 0.05  # a fitted temperature within 5% of 1 is 1 (bf16 rounding, chunks)


@dataclass(frozen=True)
class Finding:
    """One check's outcome: ``status`` is ``ok``, ``warning`` or ``fault``; ``message`` is
    one line (for a fault, it names the fix)."""

    check: str
    status: str
    message: str

    @property
    def fault(self) -> bool:
        return self.status == "fault"


def _ok(check: str, message: str) -> Finding:
    return Finding(check, "ok", message)


def _fault(check: str, message: str) -> Finding:
    return Finding(check, "fault", message)


# --------------------------------------------------------------------------- the runner
def run_preflight(trainer: Any, *, teacher_tokenizers: Mapping[str | None, Any] | None = None,
                  rollouts: bool | None = None) -> list[Finding]:
    """Every check on a built ``OPDTrainer`` (the rollout checks when ``rollouts``, default
    ``config.preflight_rollouts``). ``teacher_tokenizers``: each in-process teacher's
    tokenizer by name (``None``: the run's only teacher), ``load_teacher_tokenizers``. The
    trainer is left as it was: its weights, gate set and teacher."""
    config = trainer.config
    findings = tokenizer_findings(config, trainer.tokenizer, teacher_tokenizers or {})
    findings += check_temperature(trainer)
    if config.preflight_rollouts if rollouts is None else rollouts:
        findings += rollout_findings(trainer)
    return findings


def report(findings: Sequence[Finding], prog: str, *, show_ok: bool = True,
           enabled: bool = True) -> int:
    """Print ``findings``, one line each: ok ones on stdout (with ``show_ok``), warnings and
    faults on stderr; nothing unless ``enabled`` (the other ranks). 2 if any is a fault."""
    if enabled:
        for f in findings:
            if f.status == "ok":
                if show_ok:
                    print(f"ok: {f.check}: {f.message}", file=sys.stdout)
            else:
                kind = "warning: " if f.status == "warning" else ""
                print(f"{prog}: {kind}{f.check}: {f.message}", file=sys.stderr)
    return 2 if any(f.fault for f in findings) else 0


def load_teacher_tokenizers(config: Any) -> dict[str | None, Any]:
    """The tokenizer of each in-process teacher of ``config`` (by ``teacher_refs`` name), pad
    set to eos where it has none (as ``build_trainer`` does for the student's). A teacher
    folder without tokenizer files is left out (``tokenizer_findings`` warns)."""
    from transformers import AutoTokenizer

    from ..model_sources import resolve_model

    out: dict[str | None, Any] = {}
    for name, ref in config.teacher_refs().items():
        if isinstance(ref, list):
            continue  # served: the server probe compares its tokens with the student's
        try:
            tokenizer = AutoTokenizer.from_pretrained(resolve_model(ref))
        except (OSError, ValueError):
            continue
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
        out[name] = tokenizer
    return out


# --------------------------------------------------------------------------- tokenizers
def tokenizer_findings(config: Any, student_tokenizer: Any,
                       teacher_tokenizers: Mapping[str | None, Any]) -> list[Finding]:
    """The tokenizer and template checks of every teacher ``config`` names."""
    out = []
    for name, ref in config.teacher_refs().items():
        who = "the teacher" if name is None else f"teacher {name}"
        if isinstance(ref, list):
            out.append(_ok("tokenizer", f"{who} is served: the server probe found it decodes "
                                        f"the student's token ids alike"))
            continue
        tokenizer = teacher_tokenizers.get(name)
        if tokenizer is None:
            out.append(Finding("tokenizer", "warning", f"no tokenizer of {who} to compare with "
                               f"the student's; only its vocabulary size was checked"))
            continue
        out.append(check_tokenizer(student_tokenizer, tokenizer, who))
        out.append(check_template(student_tokenizer, tokenizer, who,
                                  chat_template=config.chat_template,
                                  allow=config.allow_template_mismatch))
    return out


def vocab_digest(tokenizer: Any) -> str:
    """A short digest of ``tokenizer``'s token->id map (added tokens included)."""
    items = sorted(tokenizer.get_vocab().items(), key=lambda kv: (kv[1], kv[0]))
    return hashlib.sha256(json.dumps(items).encode()).hexdigest()[:12]


def check_tokenizer(student: Any, teacher: Any, who: str = "the teacher") -> Finding:
    """The same vocabulary (size and token->id map), eos and pad."""
    fix = f"give {who} the student's tokenizer, or distill from a teacher that shares it"
    try:
        check_vocab_compatible(student, teacher)
    except ValueError as err:
        reason = str(err).split("; OPD needs")[0]
        return _fault("tokenizer", f"{who}'s vocabulary is not the student's: {reason}; {fix}")
    for name in ("eos", "pad"):
        s_id, t_id = (getattr(t, f"{name}_token_id", None) for t in (student, teacher))
        if s_id != t_id:
            s_tok, t_tok = (getattr(t, f"{name}_token", None) for t in (student, teacher))
            return _fault("tokenizer", f"{who}'s {name} token is {t_tok!r} (id {t_id}), the "
                                       f"student's {s_tok!r} (id {s_id}); {fix}")
    return _ok("tokenizer", f"{who} has the student's vocabulary ({len(student.get_vocab())} "
                            f"tokens, digest {vocab_digest(student)}), eos "
                            f"{student.eos_token!r} and pad {student.pad_token!r}")


def _special_tokens(tokenizer: Any) -> dict[str, Any]:
    """The special tokens a template writes (bos, unk, additional ones...) with their ids;
    eos and pad are the tokenizer check's."""
    out: dict[str, Any] = {}
    for name, value in (getattr(tokenizer, "special_tokens_map", None) or {}).items():
        if name in ("eos_token", "pad_token"):
            continue
        values = value if isinstance(value, list | tuple) else [value]
        ids = tokenizer.convert_tokens_to_ids([str(v) for v in values])
        out[name] = sorted(zip(map(str, values), ids, strict=True))
    return out


def check_template(student: Any, teacher: Any, who: str = "the teacher", *,
                   chat_template: bool = True, allow: bool = False) -> Finding:
    """The same chat template (when prompts go through it) and special tokens, so the token
    ids the student saw are the ones the teacher was trained to read."""
    differ = []
    if chat_template and (getattr(student, "chat_template", None)
                          != getattr(teacher, "chat_template", None)):
        differ.append("chat template")
    s, t = _special_tokens(student), _special_tokens(teacher)
    names = sorted(k for k in s.keys() | t.keys() if s.get(k) != t.get(k))
    if names:
        differ.append("special tokens (" + ", ".join(
            f"{k} {s.get(k, 'none')} vs {t.get(k, 'none')}" for k in names) + ")")
    if not differ:
        return _ok("template", f"{who} scores the student's token ids as rendered: one chat "
                               f"template, the same special tokens")
    what = f"{who}'s {' and '.join(differ)} differ from the student's"
    if allow:
        return Finding("template", "warning", f"{what}; allowed by --allow_template_mismatch "
                                              f"(the teacher reads the student's format)")
    return _fault("template", f"{what}, so the teacher scores prompts in a format it was not "
                              f"trained on; give {who} the student's tokenizer, or pass "
                              f"--allow_template_mismatch to train anyway")


# --------------------------------------------------------------------------- temperature
def check_temperature(trainer: Any) -> list[Finding]:
    """Every teacher of ``trainer`` scores at temperature 1 (``declared_temperature``, and
    for an in-process one ``measured_temperature`` on the first training prompt)."""
    router = trainer.router
    teachers = dict(router.teachers) if router is not None else {None: trainer.teacher_scorer}
    prompt = trainer.train_problems[0].prompt
    return [_temperature_finding(teacher, "the teacher" if name is None else f"teacher {name}",
                                 trainer.tokenizer, prompt, trainer.vocab_size)
            for name, teacher in teachers.items()]


def _temperature_finding(teacher: Teacher, who: str, tokenizer: Any, prompt: str,
                         vocab_size: int) -> Finding:
    fix = ("score it at temperature 1 (raw logits; a vLLM teacher with requests at temperature "
           "1, as TeacherClient sends)")
    declared = declared_temperature(teacher)
    if declared != 1.0:
        return _fault("temperature", f"{who} scores at temperature {declared:g}, not 1, so the "
                                     f"student would learn a reshaped teacher; {fix}")
    model = getattr(teacher, "model", None)
    if not isinstance(model, nn.Module):
        return _ok("temperature", f"{who} scores at temperature 1 (what its requests ask for)")
    measured, gap = measured_temperature(teacher, model, tokenizer, prompt, vocab_size)
    if gap <= _TEMPERATURE_GAP or abs(math.log(measured)) <= math.log1p(_TEMPERATURE_SLACK):
        return _ok("temperature", f"{who} scores at temperature 1 (its scores of a prompt are "
                                  f"its model's log-probs)")
    return _fault("temperature", f"{who}'s scores of a prompt are its model's log-probs at "
                                 f"temperature {measured:.3g}, not 1 (max |Δ log p| {gap:.2g}); "
                                 f"{fix}")


def declared_temperature(teacher: Teacher) -> float:
    """The temperature ``teacher`` says it scores at: for a served teacher, what its scoring
    request asks for (vLLM's ``temperature``, which scales the scores under
    ``--logprobs-mode processed_logprobs``, or ``prompt_logprobs_temperature``); for any
    other, its ``temperature`` attribute, else 1."""
    client = getattr(teacher, "client", None)
    if client is None or not callable(getattr(client, "_score_one", None)):
        return float(getattr(teacher, "temperature", 1.0))
    sent: dict[str, Any] = {}

    class _Built(Exception):
        pass

    def capture(method: str, path: str, body: dict[str, Any] | None = None, **_: Any) -> Any:
        sent.update(body or {})
        raise _Built  # read, never sent

    client._call = capture  # the instance's, shadowing the method for this one call
    try:
        client._score_one([0, 0], 0, None)
    except _Built:
        pass
    finally:
        del client._call
    asked = [float(sent.get(k, 1.0)) for k in ("temperature", "prompt_logprobs_temperature")]
    return next((t for t in asked if t != 1.0), 1.0)


def measured_temperature(teacher: Teacher, model: nn.Module, tokenizer: Any, prompt: str,
                         vocab_size: int) -> tuple[float, float]:
    """``(temperature, gap)``: the temperature at which ``model``'s own log-probs of
    ``prompt``'s tokens best match what ``teacher.score`` gives for them (a golden-section
    search, in ``teacher``'s own chunking; 1 when they agree), and the largest difference at
    temperature 1."""
    ids = tokenize_prompts(tokenizer, [prompt])[0]
    if len(ids) < 2:
        return 1.0, 0.0
    device = next(model.parameters()).device
    seq = torch.tensor([ids], device=device)
    mask = torch.ones_like(seq)
    tokens, scored_mask = seq[:, 1:], mask[:, 1:].bool()
    with torch.no_grad():
        scored = teacher.score(seq, mask, mask, TeacherNeeds.SAMPLED).sampled(tokens, scored_mask)
        logits = model_logits(model, seq, mask, vocab_size,
                              chunk_size=getattr(teacher, "chunk_size", 0)).logits().float()

    def error(log_t: float) -> torch.Tensor:
        lp = torch.log_softmax(logits / math.exp(log_t), -1).gather(-1, tokens[..., None])
        return (lp.squeeze(-1) - scored.float()).abs()

    gap = float(error(0.0).max())
    if gap <= _TEMPERATURE_GAP:
        return 1.0, gap
    lo, hi = math.log(0.05), math.log(20.0)
    ratio = (math.sqrt(5) - 1) / 2
    for _ in range(48):
        a, b = hi - ratio * (hi - lo), lo + ratio * (hi - lo)
        if float(error(a).pow(2).mean()) < float(error(b).pow(2).mean()):
            hi = b
        else:
            lo = a
    return math.exp((lo + hi) / 2), gap


# --------------------------------------------------------------------------- rollouts
def rollout_findings(trainer: Any, n: int = PROBE_ROLLOUTS) -> list[Finding]:
    """The checks on ``n`` prompts' rollouts of the student: identity (loss and gate), and
    the top-k mass for a top-k loss."""
    problems, rollout = _probe_rollout(trainer, n)
    out = [check_identity(trainer, rollout), check_gate_identity(trainer, n)]
    topk = _topk_finding(trainer, problems, rollout)
    return out if topk is None else [*out, topk]


def _probe_rollout(trainer: Any, n: int) -> tuple[list[Problem], Rollout]:
    c = trainer.config
    problems = trainer.train_problems[:n]
    rollout = trainer.synced_engine().generate(
        [p.prompt for p in problems], max_new_tokens=trainer.max_new_tokens,
        temperature=c.temperature, top_p=c.top_p, seed=c.seed, num_samples=c.num_samples)
    return problems, rollout.to(c.device)


@contextlib.contextmanager
def _replaced(obj: Any, **values: Any) -> Iterator[None]:
    """``obj``'s attributes set to ``values`` for the duration, then put back."""
    saved = {k: getattr(obj, k) for k in values}
    for k, v in values.items():
        setattr(obj, k, v)
    try:
        yield
    finally:
        for k, v in saved.items():
            setattr(obj, k, v)


@contextlib.contextmanager
def _eval_mode(model: nn.Module) -> Iterator[None]:
    """Dropout off (two forwards of one model must agree), the mode put back after."""
    was = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was)


def _own_teacher(trainer: Any) -> ModelTeacher:
    return ModelTeacher(trainer.student, trainer.vocab_size, chunk_size=trainer.loss_chunk_size)


def check_identity(trainer: Any, rollout: Rollout) -> Finding:
    """The student scored as its own teacher, through the trainer's own micro-batch loss
    (``--loss``, its options, chunking), gives a loss and a reverse KL of 0."""
    c = trainer.config
    rows = rollout.sequences.shape[0]
    advantages = torch.zeros(rows, device=rollout.sequences.device)  # no reward signal
    tokens = max(int(rollout.completion_mask[:, 1:].sum()), 1)
    with (_replaced(trainer, teacher_scorer=_own_teacher(trainer), router=None),
          _eval_mode(trainer.student), torch.no_grad()):
        out = trainer._micro_batch_loss(rollout, slice(None), tokens, advantages)
    loss, kl = float(out.loss), float(out.metrics.get("reverse_kl", 0.0))
    if max(abs(loss), abs(kl)) <= IDENTITY_TOLERANCE:
        return _ok("identity", f"the student as its own teacher gives loss {loss:.1e} and "
                               f"reverse KL {kl:.1e} on {rows} rollouts (--loss {c.loss})")
    return _fault("identity", f"the student as its own teacher gives loss {loss:.3g} and "
                              f"reverse KL {kl:.3g} on {rows} rollouts (--loss {c.loss}; must be "
                              f"<= {IDENTITY_TOLERANCE:g}): the loss does not compare like with "
                              f"like; rerun with --dtype float32 --loss_chunk_size 0 to find "
                              f"which part, and report it")


def check_gate_identity(trainer: Any, n: int = PROBE_ROLLOUTS) -> Finding:
    """With the −KL gate: the gate at the student as its own teacher, on ``n`` of the gate
    problems, is 0 (the gate's rollouts and teacher scores are put back as they were)."""
    c = trainer.config
    if not c.gated() or c.gate != "neg_kl":
        what = "no gate" if not c.gated() else f"the {c.gate} gate reads no teacher"
        return _ok("gate identity", f"nothing to check: {what}")
    problems = trainer.gate_problems[:n]
    if not problems:
        return _ok("gate identity", "nothing to check: no gate problems on this rank")
    with _replaced(trainer, teacher_scorer=_own_teacher(trainer), gate_problems=problems,
                   _gate_sequences=None, _gate_teacher=None):
        kl = trainer.gate_reverse_kl()
    if abs(kl) <= IDENTITY_TOLERANCE:
        return _ok("gate identity", f"the student as its own teacher gives the −KL gate "
                                    f"{0.0 - kl:.1e} on {len(problems)} gate problems")
    return _fault("gate identity", f"the student as its own teacher gives the −KL gate "
                                   f"{-kl:.3g} on {len(problems)} gate problems (must be 0): "
                                   f"the gate does not compare like with like; rerun with "
                                   f"--dtype float32 --loss_chunk_size 0 to find which part, "
                                   f"and report it")


# --------------------------------------------------------------------------- top-k mass
def topk_mass(topk_logprobs: torch.Tensor, mask: torch.Tensor) -> float:
    """The mean, over the ``mask``ed positions, of the probability the top-k log-probs
    ``[B, T, k]`` hold (1 with no position)."""
    mass = topk_logprobs.float().exp().sum(-1)
    mask = mask.bool()
    return float(mass[mask].mean()) if mask.any() else 1.0


def k_for_mass(logits: NextTokenLogits | torch.Tensor, mask: torch.Tensor,
               target: float = TOPK_MASS) -> int:
    """The smallest k whose top-k probability mass, averaged over the ``mask``ed positions,
    reaches ``target``: the full distributions sorted a chunk of rows at a time."""
    logits = logits if isinstance(logits, NextTokenLogits) else NextTokenLogits(logits)
    mask = mask.bool()
    n = int(mask.sum())
    if n == 0:
        return 1

    def curve(x: torch.Tensor) -> tuple[torch.Tensor]:
        p = torch.softmax(x.float(), -1).sort(-1, descending=True).values
        return (p.cumsum(-1).sum(0),)

    with torch.no_grad():
        total = sum(c for (c,) in map_row_chunks(curve, [logits], mask))
    reached = (total / n >= target).nonzero()
    return int(reached[0]) + 1 if reached.numel() else logits.vocab_size


def check_topk_mass(topk_logprobs: torch.Tensor, mask: torch.Tensor, k: int,
                    full: NextTokenLogits | torch.Tensor | None = None,
                    target: float = TOPK_MASS) -> Finding:
    """A warning when the teacher's top-``k`` log-probs hold less than ``target`` of its
    probability on average, with the k that would reach it when its ``full`` next-token
    logits are at hand (an in-process teacher)."""
    mass = topk_mass(topk_logprobs, mask)
    if mass >= target:
        return _ok("top-k mass", f"the teacher's top-{k} log-probs hold {mass:.1%} of its "
                                 f"probability on average")
    hint = (f"k = {k_for_mass(full, mask, target)} would reach {target:.0%}" if full is not None
            else f"a larger k would reach {target:.0%} (the server's --max-logprobs bounds it)")
    return Finding("top-k mass", "warning", f"the teacher's top-{k} log-probs hold {mass:.1%} "
                   f"of its probability on average, under {target:.0%}: a top-k loss ignores "
                   f"the rest; {hint}")


def _topk_finding(trainer: Any, problems: list[Problem], rollout: Rollout) -> Finding | None:
    """``check_topk_mass`` of the run's teacher on ``rollout`` (None unless the loss reads
    top-k log-probs)."""
    needs = teacher_needs(trainer.config.loss, trainer.loss_options)  # a top-k loss: its --topk
    if needs.level != "topk":
        return None
    teacher: Teacher = trainer.teacher_scorer
    if trainer.router is not None:
        rows = [p for p in problems for _ in range(trainer.config.num_samples)]
        teacher = trainer.router.for_rows(trainer.router.names(rows))
    seq, attn, completion = rollout.sequences, rollout.attention_mask, rollout.completion_mask
    scored = teacher.score(seq, attn, completion, needs)
    full = None
    if teacher.capability.covers(TeacherNeeds.FULL):
        full = teacher.score(seq, attn, completion, TeacherNeeds.FULL).full()
    return check_topk_mass(scored.topk_logprobs, completion[:, 1:], needs.k, full)
