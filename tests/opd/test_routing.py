"""Several teachers (``--teachers … --teacher_key``): every problem's teacher resolved before
step 0, each row scored by its own teacher, per-teacher metrics."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_qwen2

pytest.importorskip("transformers")

from lookahead_opd.integrations.opd.config import OPDConfig  # noqa: E402
from lookahead_opd.integrations.opd.engines import HFEngine  # noqa: E402
from lookahead_opd.integrations.opd.routing import TeacherRouter, teacher_names  # noqa: E402
from lookahead_opd.integrations.opd.tasks import ArithmeticTask, Problem  # noqa: E402
from lookahead_opd.integrations.opd.teacher import ModelTeacher, TeacherNeeds  # noqa: E402
from lookahead_opd.integrations.opd.tokenizer import char_tokenizer  # noqa: E402
from lookahead_opd.integrations.opd.trainer import OPDTrainer  # noqa: E402


@pytest.fixture(scope="module")
def tokenizer():
    return char_tokenizer()


def _teacher(tokenizer, seed):
    return ModelTeacher(tiny_qwen2(len(tokenizer), seed, tokenizer=tokenizer).eval(),
                        len(tokenizer))


def test_teacher_names_resolve_or_fail_in_one_line():
    ps = [Problem("1+1=", "2", {"op": "+"}), Problem("2*2=", "4", {"op": "*"}), Problem("x", "y")]
    assert teacher_names(ps, "op", ["+", "*"], default="+") == ["+", "*", "+"]
    with pytest.raises(ValueError, match="1 of the 3 problems have no teacher: teacher_key 'op' is "
                                         "missing") as err:
        teacher_names(ps, "op", ["+", "*"])
    assert "--default_teacher" in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(ValueError, match="'\\*' \\(first of them\\), not one of \\+"):
        teacher_names(ps[:2], "op", ["+"])


def test_each_row_is_scored_by_its_own_teacher(tokenizer):
    a, b = _teacher(tokenizer, 1), _teacher(tokenizer, 2)
    router = TeacherRouter({"a": a, "b": b}, key="op")
    g = torch.Generator().manual_seed(0)
    seq = torch.randint(4, len(tokenizer), (5, 9), generator=g)
    attn = torch.ones_like(seq)
    comp = torch.zeros_like(seq)
    comp[:, 4:] = 1
    names = ["a", "b", "b", "a", "b"]
    for needs in (TeacherNeeds.SAMPLED, TeacherNeeds.topk(3)):
        got = router.for_rows(names).score(seq, attn, comp, needs)
        for name, teacher in (("a", a), ("b", b)):
            rows = [i for i, n in enumerate(names) if n == name]
            want = teacher.score(seq[rows], attn[rows], comp[rows], needs)
            mask = comp[rows][:, 1:].bool()
            torch.testing.assert_close(got.token_logprobs[rows][mask],
                                       want.sampled(seq[rows][:, 1:], mask)[mask])
            if needs.k:
                torch.testing.assert_close(got.topk_logprobs[rows][mask],
                                           want.topk_logprobs[mask])
    assert router.seconds["a"] > 0 and router.seconds["b"] > 0
    with pytest.raises(ValueError, match="full distribution"):
        router.check(TeacherNeeds.FULL)
    with pytest.raises(TypeError, match="for_rows"):
        router.score(seq, attn, comp, TeacherNeeds.SAMPLED)


def test_opd_run_with_several_teachers_logs_each(tokenizer, tmp_path):
    student = tiny_qwen2(len(tokenizer), 0, tokenizer=tokenizer)
    router = TeacherRouter({"+": _teacher(tokenizer, 1), "*": _teacher(tokenizer, 2)}, key="op",
                           default="+")  # "-" problems go to "+"
    config = OPDConfig(output_dir=str(tmp_path), batch_size=16, max_steps=2, learning_rate=1e-2,
                       max_new_tokens=4, eval_every=0, eval_size=16, gate_size=8,
                       progress=False, teachers=["+=a", "*=b"], teacher_key="op",
                       default_teacher="+")
    trainer = OPDTrainer(config, student, router, ArithmeticTask(ops="+-*"),
                         HFEngine(student, tokenizer), tokenizer=tokenizer)
    result = trainer.train()
    last, steps = result.metrics[-1], [m for m in result.metrics if "loss" in m]
    for name in ("+", "*"):  # 16 rows of each step: both teachers had some (seed 0)
        assert sum(m[f"seconds_teacher/{name}"] for m in steps) > 0
        assert f"eval_accuracy/{name}" in last
    kls = [m.get("reverse_kl/+") for m in result.metrics if "loss" in m]
    assert all(k is not None and k == k for k in kls)
    assert abs(last["eval_accuracy"] - sum(last[f"eval_accuracy/{n}"] * w for n, w in
               _weights(trainer).items())) < 1e-9


def _weights(trainer):
    names = trainer.router.names(trainer.eval_problems)
    return {n: names.count(n) / len(names) for n in set(names)}


def test_a_problem_without_a_teacher_fails_before_step_0(tokenizer, tmp_path):
    student = tiny_qwen2(len(tokenizer), 0, tokenizer=tokenizer)
    router = TeacherRouter({"+": _teacher(tokenizer, 1)}, key="op")
    config = OPDConfig(output_dir=str(tmp_path), batch_size=8, max_new_tokens=4, progress=False,
                       teachers=["+=a"], teacher_key="op")
    with pytest.raises(ValueError, match="training problems have no teacher"):
        OPDTrainer(config, student, router, ArithmeticTask(ops="+-"), HFEngine(student, tokenizer),
                   tokenizer=tokenizer)
