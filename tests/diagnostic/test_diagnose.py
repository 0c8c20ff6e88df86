"""``diagnose`` end to end on tiny random Qwen2 models: exact budget, reproducibility, known
alignments from an oracle teacher, bad input, output files, the CLI."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from conftest import tiny_qwen2

pytest.importorskip("transformers")

from transformers import Qwen2ForCausalLM  # noqa: E402

from lookahead_opd.diagnostic import (  # noqa: E402
    ContextTeacher,
    diagnose,
    min_budget,
)
from lookahead_opd.integrations.cli import main as cli_main  # noqa: E402
from lookahead_opd.integrations.opd.engines import HFEngine  # noqa: E402
from lookahead_opd.integrations.opd.tasks import ArithmeticTask, Problem, Task  # noqa: E402
from lookahead_opd.integrations.opd.tokenizer import char_tokenizer  # noqa: E402

EVEN = "02468"


class EvenStartTask(ArithmeticTask):
    """Arithmetic prompts, but a completion is correct when it starts with an even digit: a
    random student succeeds often, and P_succ at the first token is exactly 1 or 0."""

    name = "even-start"

    def is_correct(self, completion: str, problem: Problem) -> bool:
        return completion[:1] in EVEN and completion[:1] != ""


class EmptyTask(Task):
    name = "empty"

    def all_problems(self, split: str) -> list[Problem]:
        return []

    def extract_answer(self, completion: str) -> str | None:
        return None


def _model(tokenizer, seed: int) -> Qwen2ForCausalLM:
    return tiny_qwen2(len(tokenizer), seed, tokenizer=tokenizer).eval()


class Tilted(torch.nn.Module):
    """The student's logits plus ``c`` on the even digits: q ∝ p·exp(c·1[even])."""

    def __init__(self, base: torch.nn.Module, tokenizer, c: float) -> None:
        super().__init__()
        self.base = base
        self.config = base.config
        bias = torch.zeros(len(tokenizer))
        bias[[tokenizer.convert_tokens_to_ids(d) for d in EVEN]] = c
        self.register_buffer("bias", bias)

    def get_output_embeddings(self):
        return self.base.get_output_embeddings()

    def forward(self, **kw):
        out = self.base(**kw)
        out.logits = out.logits + self.bias
        return out


class CountingEngine(HFEngine):
    """Counts the rows every ``generate`` call produces."""

    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self.rows: list[int] = []

    def generate(self, prompts, **kw):
        self.rows.append(len(prompts) * kw.get("num_samples", 1))
        return super().generate(prompts, **kw)


@pytest.fixture(scope="module")
def tok():
    return char_tokenizer()


@pytest.fixture(scope="module")
def student(tok):
    """A random student that never emits pad/bos/unk (they decode to nothing, which would make
    a first-token decision's outcome depend on later tokens)."""
    model = _model(tok, 0)
    head = torch.nn.Linear(32, len(tok), bias=True)
    with torch.no_grad():
        head.weight.copy_(model.lm_head.weight)
        head.bias.zero_()
        head.bias[[tok.pad_token_id, tok.bos_token_id, tok.unk_token_id]] = -30.0
    model.lm_head = head
    return model


SMALL = dict(questions=8, samples_per_question=2, top_k=3, continuations=4, max_new_tokens=4,
             resamples=100)


def _run(student, tok, teachers, task=None, **kw):
    return diagnose(student, teachers, task or EvenStartTask(digits=1), tokenizer=tok,
                    **{"budget": 400, **SMALL, **kw})


def test_oracle_teacher_has_alignment_one_and_equal_teacher_zero_gradient(student, tok):
    teachers = {"oracle": Tilted(student, tok, 2.0), "anti": Tilted(student, tok, -2.0),
                "copy": copy.deepcopy(student)}
    r = _run(student, tok, teachers)
    assert r.counts["informative"] > 0
    s = r.summary
    # Where no candidate is a skipped special token (pad/bos/unk decode to nothing, so the
    # outcome then depends on later tokens), P_succ = 1[even] exactly and q ∝ p·exp(c·P_succ):
    # alignment is exactly ±1 (or None where no candidate is even: the tilt is then zero).
    special = {"<pad>", "<bos>", "<unk>"}
    exact = [n for n in r.informative_nodes if not special & set(n["candidate_tokens"])]
    assert len(exact) >= 3
    for n in exact:
        for name, sign in (("oracle", 1.0), ("anti", -1.0)):
            a = n["teachers"][name]["alignment"]
            assert a is None or a == pytest.approx(sign, abs=1e-6), (name, n)
    assert any(n["teachers"]["oracle"]["alignment"] is not None for n in exact)
    assert s["oracle"]["alignment"]["mean"] > 0.5 > -0.5 > s["anti"]["alignment"]["mean"]
    assert s["oracle"]["advantage"]["mean"] > 0 > s["anti"]["advantage"]["mean"]
    assert r.ranking() == ["oracle", "anti", "copy"]
    # a teacher equal to the student: zero gradient, reported as such, never NaN
    assert s["copy"]["alignment"]["mean"] is None
    assert s["copy"]["zero_gradient_nodes"] == r.counts["informative"]
    for n in r.informative_nodes:
        assert n["teachers"]["copy"]["zero_gradient"] is True
        assert n["teachers"]["copy"]["alignment"] is None
        assert n["teachers"]["copy"]["advantage"] == 0.0
    assert "nan" not in json.dumps(r.to_dict()).lower()
    # uninformative nodes are counted and kept out of the averages
    assert r.counts["nodes"] == r.counts["informative"] + r.counts["uninformative"]
    n_defined = sum(n["teachers"]["oracle"]["alignment"] is not None for n in r.informative_nodes)
    assert s["oracle"]["alignment"]["n"] == n_defined


def test_budget_is_exact_and_continuations_shared(student, tok):
    engine = CountingEngine(student, tok)
    budget = 100
    r = diagnose(student, {"a": Tilted(student, tok, 1.0), "b": Tilted(student, tok, -1.0)},
                 EvenStartTask(digits=1), tokenizer=tok, engine=engine, budget=budget, **SMALL)
    student_rows, continuation_rows = engine.rows[0], sum(engine.rows[1:])
    assert student_rows == SMALL["questions"] * SMALL["samples_per_question"]
    assert continuation_rows == r.rollouts_used <= budget
    # more nodes were available, so the plan stopped only because the next did not fit
    assert r.counts["candidate_nodes"] > r.counts["nodes"]
    assert budget - r.rollouts_used < min_budget(SMALL["top_k"], SMALL["continuations"])
    assert sum(sum(n["counts"]) for n in r.nodes) == r.rollouts_used
    # a second teacher costs no rollouts: the same number with one teacher
    engine.rows.clear()
    diagnose(student, {"a": Tilted(student, tok, 1.0)}, EvenStartTask(digits=1), tokenizer=tok,
             engine=engine, budget=budget, **SMALL)
    assert sum(engine.rows[1:]) == continuation_rows


def test_reproducible_with_a_seed(student, tok):
    teachers = {"t": _model(tok, 5), "self": "self:solution"}
    a = _run(student, tok, teachers, seed=3)
    b = _run(student, tok, teachers, seed=3)
    c = _run(student, tok, teachers, seed=4)
    assert a.nodes == b.nodes and a.summary == b.summary
    assert a.nodes != c.nodes


def test_bad_input_fails_before_any_rollout(student, tok):
    engine = CountingEngine(student, tok)
    other_tok = char_tokenizer("0123456789abc")
    other = _model(other_tok, 1)
    cases = [
        ({"t": (other, other_tok)}, EvenStartTask(digits=1), {}, "tokenizer"),
        ({"t": _model(tok, 1)}, EmptyTask(), {}, "no test problems"),
        ({"t": _model(tok, 1)}, EvenStartTask(digits=1), {"budget": 15}, "too small for one node"),
        (["self:bogus"], EvenStartTask(digits=1), {}, "unknown self-teacher context"),
        ({}, EvenStartTask(digits=1), {}, "at least one teacher"),
    ]
    for teachers, task, extra, message in cases:
        with pytest.raises(ValueError, match=message):
            diagnose(student, teachers, task, tokenizer=tok, engine=engine,
                     **{"budget": 400, **SMALL, **extra})
    assert engine.rows == []


def test_context_teacher_reads_the_context(student, tok):
    task = ArithmeticTask(digits=1)
    problems = task.problems("test", 3, seed=0)
    teacher = ContextTeacher.for_task(student, tok, task, problems, "solution")
    engine = HFEngine(student, tok)
    r = engine.generate([p.prompt for p in problems], max_new_tokens=3, seed=0)
    got = teacher(input_ids=r.sequences, attention_mask=r.attention_mask).logits
    for b, p in enumerate(problems):
        valid = r.sequences[b][r.attention_mask[b].bool()].tolist()
        ctx = tok(task.sft_text(p) + " ", add_special_tokens=False)["input_ids"]
        full = torch.tensor([[valid[0], *ctx, *valid[1:]]])
        want = student(input_ids=full).logits[0, len(ctx) + 1:]
        pos = r.attention_mask[b].nonzero().flatten()[1:]
        assert torch.allclose(got[b, pos], want, atol=1e-5)
    with pytest.raises(ValueError, match="no registered prompt"):
        teacher(input_ids=torch.tensor([[tok.bos_token_id, 5, 6]]))


@pytest.mark.slow
def test_report_files(student, tok, tmp_path):
    r = _run(student, tok, {"oracle": Tilted(student, tok, 2.0), "self:answer": "self:answer"})
    paths = r.save(tmp_path)
    for name in ("report.json", "nodes.jsonl", "alignment_by_depth.png",
                 "alignment_by_outcome.png", "per_question.png", "report.html"):
        assert (tmp_path / name).stat().st_size > 0, name
    data = json.loads((tmp_path / "report.json").read_text())
    assert data["ranking"][0] == "oracle" and data["rollouts_used"] == r.rollouts_used
    rows = (tmp_path / "nodes.jsonl").read_text().splitlines()
    assert len(rows) == 2 * r.counts["nodes"]
    html = (tmp_path / "report.html").read_text()
    assert html.count("data:image/png;base64,") == 3 and "oracle" in html
    assert set(paths) >= {"report.json", "report.html"}


def _save(model, tokenizer, path):
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def test_cli(tok, tmp_path, capsys):
    s = _save(_model(tok, 0), tok, tmp_path / "student")
    t = _save(_model(tok, 2), tok, tmp_path / "teacher")
    out = tmp_path / "out"
    rc = cli_main(["diagnose", "--student", s, "--teacher", t, "--teacher", "self:solution",
                   "--task", "arithmetic:digits=1", "--questions", "4", "--budget", "120",
                   "--top_k", "3", "--continuations", "4", "--resamples", "50",
                   "--output_dir", str(out), "--no_progress"])
    assert rc == 0, capsys.readouterr().err
    assert "self:solution" in capsys.readouterr().out
    data = json.loads((out / "report.json").read_text())
    assert sorted(data["teachers"]) == ["self:solution", "teacher"]  # a path: its last part
    assert data["config"]["teachers"]["teacher"] == t
    assert data["rollouts_used"] <= 120 and (out / "report.html").is_file()

    other_tok = char_tokenizer("0123456789abcdef")
    bad = _save(_model(other_tok, 3), other_tok, tmp_path / "bad")
    capsys.readouterr()
    for args, message in (
        (["--teacher", bad], "does not share the student's tokenizer"),
        (["--teacher", "self:nothing"], "unknown self-teacher context"),
        (["--teacher", t, "--budget", "3"], "too small for one node"),
    ):
        rc = cli_main(["diagnose", "--student", s, "--task", "arithmetic:digits=1",
                       "--output_dir", str(tmp_path / "x"), *args])
        err = capsys.readouterr().err.strip()
        assert rc == 2 and message in err and len(err.splitlines()) == 1, err


def test_loss_choice_changes_the_distillation_gradient_only(student, tok):
    teachers = {"t": _model(tok, 7)}
    rkl = _run(student, tok, teachers, loss="reverse_kl")
    jsd1 = _run(student, tok, teachers, loss="jsd", jsd_beta=1.0)  # β = 1 is the reverse KL
    fkl = _run(student, tok, teachers, loss="forward_kl")
    assert [n["p_succ"] for n in rkl.nodes] == [n["p_succ"] for n in fkl.nodes]
    a = [n["teachers"]["t"]["alignment"] for n in rkl.informative_nodes]
    assert a == [n["teachers"]["t"]["alignment"] for n in jsd1.informative_nodes]
    assert a != [n["teachers"]["t"]["alignment"] for n in fkl.informative_nodes]
    assert rkl.summary["t"]["advantage"] == fkl.summary["t"]["advantage"]


def test_context_teacher_drives_opd_training(tok, tmp_path):
    from lookahead_opd.integrations.opd.config import OPDConfig
    from lookahead_opd.integrations.opd.trainer import OPDTrainer

    task = ArithmeticTask(digits=1)
    student = _model(tok, 0)
    frozen = copy.deepcopy(student)
    problems = [p for s in ("train", "gate", "test") for p in task.all_problems(s)]
    teacher = ContextTeacher.for_task(frozen, tok, task, problems, "solution")
    config = OPDConfig(output_dir=str(tmp_path), batch_size=8, max_steps=2, learning_rate=1e-2,
                       max_new_tokens=3, eval_every=0, eval_size=8, gate_size=4, progress=False)
    before = [p.clone() for p in student.parameters()]
    OPDTrainer(config, student, teacher, task, HFEngine(student, tok), tokenizer=tok).train()
    assert any(not torch.equal(a, b) for a, b in zip(before, student.parameters(), strict=True))
    assert all(p.requires_grad for p in student.parameters())  # only the copy was frozen
