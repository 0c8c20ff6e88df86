"""Preflight (``lookahead-opd check``, and ``train`` before step 0): each check passes on a
sound setup and reports an injected fault in one line naming the fix."""

from __future__ import annotations

import copy
import json
import shutil

import pytest
import torch
from conftest import tiny_qwen2

pytest.importorskip("transformers")

from lookahead_opd.demo.zoo import SHIPPED_PAIRS  # noqa: E402
from lookahead_opd.integrations import cli  # noqa: E402
from lookahead_opd.integrations.opd import preflight  # noqa: E402
from lookahead_opd.integrations.opd.config import OPDConfig  # noqa: E402
from lookahead_opd.integrations.opd.engines import HFEngine  # noqa: E402
from lookahead_opd.integrations.opd.logits import NextTokenLogits, model_logits  # noqa: E402
from lookahead_opd.integrations.opd.losses import LOSSES  # noqa: E402
from lookahead_opd.integrations.opd.served import ServedTeacher, TeacherClient  # noqa: E402
from lookahead_opd.integrations.opd.tasks import ArithmeticTask  # noqa: E402
from lookahead_opd.integrations.opd.teacher import ModelTeacher, TeacherScores  # noqa: E402
from lookahead_opd.integrations.opd.tokenizer import CHARS, char_tokenizer  # noqa: E402
from lookahead_opd.integrations.opd.trainer import OPDTrainer  # noqa: E402

TOPK_LOSSES = sorted(name for name in LOSSES if name.startswith("topk_"))


@pytest.fixture(scope="module")
def tokenizer():
    return char_tokenizer()


def _trainer(tmp_path, tokenizer, *, teacher=None, **options) -> OPDTrainer:
    student = tiny_qwen2(len(tokenizer), 0, tokenizer=tokenizer)
    if teacher is None:
        teacher = tiny_qwen2(len(tokenizer), 1, tokenizer=tokenizer)
    defaults = dict(output_dir=str(tmp_path), batch_size=8, max_steps=2, max_new_tokens=4,
                    eval_every=0, eval_size=8, gate_size=8, progress=False)
    config = OPDConfig(**{**defaults, **options})
    return OPDTrainer(config, student, teacher, ArithmeticTask(), HFEngine(student, tokenizer),
                      tokenizer=tokenizer)


def _by_check(findings) -> dict[str, preflight.Finding]:
    return {f.check: f for f in findings}


def _faults(findings) -> list[preflight.Finding]:
    return [f for f in findings if f.fault]


# --------------------------------------------------------------------------- a sound setup
def test_a_sound_setup_passes_and_is_left_as_it_was(tmp_path, tokenizer):
    t = _trainer(tmp_path, tokenizer, extrapolate=True, gate="neg_kl", loss="reverse_kl")
    weights = copy.deepcopy(t.student.state_dict())
    scorer, gate = t.teacher_scorer, t.gate_problems
    found = preflight.run_preflight(t, teacher_tokenizers={None: char_tokenizer()},
                                    rollouts=True)
    checks = _by_check(found)
    assert set(checks) == {"tokenizer", "template", "temperature", "identity", "gate identity"}
    assert all(f.status == "ok" for f in found), found
    assert "digest" in checks["tokenizer"].message
    assert t.teacher_scorer is scorer and t.gate_problems == gate and t.router is None
    assert t._gate_sequences is None and t._gate_teacher is None and t.student.training
    assert all(torch.equal(v, t.student.state_dict()[k]) for k, v in weights.items())


@pytest.mark.parametrize("loss", ["reverse_kl_pg", "reverse_kl", "jsd", "drgrpo", *TOPK_LOSSES])
def test_student_as_its_own_teacher_gives_zero_for_every_loss(tmp_path, tokenizer, loss):
    t = _trainer(tmp_path, tokenizer, loss=loss, num_samples=2, loss_chunk_size=3)
    identity = _by_check(preflight.rollout_findings(t))["identity"]
    assert identity.status == "ok" and f"--loss {loss}" in identity.message, identity


# --------------------------------------------------------------------------- template, tokenizer
def test_a_teacher_tokenizer_with_another_template_is_refused_unless_allowed(tokenizer):
    config = OPDConfig()
    templated = char_tokenizer()
    templated.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    found = preflight.tokenizer_findings(config, tokenizer, {None: templated})
    (fault,) = _faults(found)
    assert fault.check == "template" and "chat template" in fault.message
    assert "--allow_template_mismatch" in fault.message and "\n" not in fault.message
    # prompts rendered plain: the template is not used, so it cannot differ
    assert not _faults(preflight.tokenizer_findings(OPDConfig(chat_template=False), tokenizer,
                                                    {None: templated}))
    allowed = preflight.tokenizer_findings(OPDConfig(allow_template_mismatch=True), tokenizer,
                                           {None: templated})
    assert not _faults(allowed) and _by_check(allowed)["template"].status == "warning"
    other_bos = char_tokenizer()
    other_bos.bos_token = "<unk>"
    (fault,) = _faults(preflight.tokenizer_findings(config, tokenizer, {None: other_bos}))
    assert fault.check == "template" and "bos_token" in fault.message


@pytest.mark.parametrize("fault", ["eos", "pad", "size", "map"])
def test_a_teacher_tokenizer_with_another_vocabulary_eos_or_pad_is_refused(tokenizer, fault):
    teacher = {"size": lambda: char_tokenizer(CHARS + "x"),
               "map": lambda: char_tokenizer(CHARS[::-1])}.get(fault, char_tokenizer)()
    if fault == "eos":
        teacher.eos_token = "<bos>"
    if fault == "pad":
        teacher.pad_token = "<eos>"
    found = _faults(preflight.tokenizer_findings(OPDConfig(), tokenizer, {None: teacher}))
    assert [f.check for f in found] == ["tokenizer"]
    message = found[0].message
    expected = {"eos": "eos token is '<bos>' (id 1)", "pad": "pad token is '<eos>'",
                "size": "differ in size", "map": "different token->id maps"}[fault]
    assert expected in message and "give the teacher the student's tokenizer" in message
    assert "\n" not in message


def test_served_teacher_and_missing_tokenizer(tokenizer):
    served = OPDConfig(teacher_url=["http://127.0.0.1:8000"])
    (ok,) = preflight.tokenizer_findings(served, tokenizer, {})
    assert ok.status == "ok" and "server probe" in ok.message
    (warning,) = preflight.tokenizer_findings(OPDConfig(teacher="t"), tokenizer, {})
    assert warning.status == "warning"


# --------------------------------------------------------------------------- temperature
class _HotTeacher(ModelTeacher):
    """A teacher scored at temperature 2: its logits halved before every score."""

    def score(self, sequences, attention_mask, completion_mask, needs):
        hot = NextTokenLogits(model_logits(self.model, sequences, attention_mask,
                                           self.vocab_size).states / 2)
        tokens, mask = sequences[:, 1:], completion_mask[:, 1:].bool()
        return TeacherScores(token_logprobs=hot.token_logprobs(tokens, mask), logits=hot)


def test_a_teacher_scored_at_temperature_2_is_refused(tmp_path, tokenizer):
    model = tiny_qwen2(len(tokenizer), 1, tokenizer=tokenizer)
    with torch.no_grad():
        model.lm_head.weight.mul_(10.0)  # a confident teacher: temperature shows plainly
    t = _trainer(tmp_path, tokenizer, teacher=_HotTeacher(model, len(tokenizer)))
    (fault,) = preflight.check_temperature(t)
    assert fault.fault and "temperature 2," in fault.message and "score it at temperature 1" \
        in fault.message
    t = _trainer(tmp_path, tokenizer, teacher=ModelTeacher(model, len(tokenizer)))
    assert preflight.check_temperature(t)[0].status == "ok"


def test_a_served_teacher_asking_for_temperature_2_is_refused():
    class HotClient(TeacherClient):
        def _score_one(self, ids, top_k, step):
            return self._call("POST", "/v1/completions", {"model": self.model, "prompt": ids,
                              "prompt_logprobs": top_k, "temperature": 2.0}, step=step)

    url = "http://127.0.0.1:9"  # nothing is sent: the request is built and read
    assert preflight.declared_temperature(ServedTeacher(TeacherClient(url), 21)) == 1.0
    hot = ServedTeacher(HotClient(url), 21)
    assert preflight.declared_temperature(hot) == 2.0
    finding = preflight._temperature_finding(hot, "the teacher", None, "", 21)
    assert finding.fault and "temperature 2, not 1" in finding.message
    assert "_call" not in vars(hot.client)  # the client is left as it was


# --------------------------------------------------------------------------- identity
def test_an_identity_violation_is_a_fault(tmp_path, tokenizer, monkeypatch):
    t = _trainer(tmp_path, tokenizer, extrapolate=True, gate="neg_kl", loss="reverse_kl")
    score = ModelTeacher.score

    def off(self, sequences, attention_mask, completion_mask, needs):  # student != teacher
        out = score(self, sequences, attention_mask, completion_mask, needs)
        out.logits = NextTokenLogits(out.logits.logits() * 1.5)
        return out

    monkeypatch.setattr(ModelTeacher, "score", off)
    found = _by_check(preflight.rollout_findings(t))
    for check in ("identity", "gate identity"):
        assert found[check].fault and "must be" in found[check].message, found[check]
        assert "--dtype float32 --loss_chunk_size 0" in found[check].message


# --------------------------------------------------------------------------- top-k mass
def test_topk_mass_and_the_k_that_reaches_it():
    probs = torch.tensor([0.5, 0.25, 0.125, 0.0625, 0.0625])  # top-2 0.75, top-3 0.875, ...
    logits = probs.log().expand(1, 3, 5).clone()
    top = logits.topk(2, -1).values
    mask = torch.tensor([[1, 1, 0]])
    assert preflight.topk_mass(top, mask) == pytest.approx(0.75)
    assert preflight.k_for_mass(logits, mask, 0.9) == 4 and preflight.k_for_mass(logits, mask,
                                                                                 0.5) == 1
    warned = preflight.check_topk_mass(top, mask, 2, full=logits)
    assert warned.status == "warning" and "top-2" in warned.message and "75.0%" in warned.message
    assert "k = 4 would reach 90%" in warned.message
    served = preflight.check_topk_mass(top, mask, 2)
    assert "a larger k" in served.message
    assert preflight.check_topk_mass(logits.topk(4, -1).values, mask, 4).status == "ok"


@pytest.mark.skipif(not TOPK_LOSSES, reason="no top-k loss in this tree")
def test_a_topk_loss_reads_the_mass_of_the_teachers_top_k(tmp_path, tokenizer):
    t = _trainer(tmp_path, tokenizer, loss=TOPK_LOSSES[0], topk=1)  # a near-uniform teacher
    mass = _by_check(preflight.rollout_findings(t))["top-k mass"]
    assert mass.status == "warning" and "top-1" in mass.message and "k = " in mass.message
    plain = _trainer(tmp_path, tokenizer, loss="reverse_kl")
    assert "top-k mass" not in _by_check(preflight.rollout_findings(plain))


# --------------------------------------------------------------------------- the command
@pytest.fixture(scope="module")
def pair():
    (folder,) = [p for p in SHIPPED_PAIRS.iterdir() if (p / "build.json").is_file()]
    return {"student": str(folder / "student"), "teacher": str(folder / "teacher")}


def _args(command, pair, output_dir, *extra):
    return [command, "--student", pair["student"], "--teacher", pair["teacher"],
            "--output_dir", str(output_dir), "--batch_size", "8", "--max_steps", "2",
            "--eval_every", "0", "--eval_size", "8", "--max_new_tokens", "4", "--no_progress",
            *extra]


def test_check_command_exits_0_when_clean_and_2_on_a_fault(tmp_path, capsys, pair):
    assert cli.main(_args("check", pair, tmp_path / "a", "--preflight_rollouts")) == 0
    captured = capsys.readouterr()
    shown = captured.out
    for check in ("tokenizer", "template", "temperature", "identity"):
        assert f"ok: {check}: " in shown, shown
    assert "no fault" in shown and "lookahead-opd check" not in captured.err
    assert not (tmp_path / "a").exists()  # a check writes nothing

    teacher = tmp_path / "teacher"  # the shipped teacher with a chat template of its own
    shutil.copytree(pair["teacher"], teacher)
    config = json.loads((teacher / "tokenizer_config.json").read_text())
    config["chat_template"] = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    (teacher / "tokenizer_config.json").write_text(json.dumps(config))
    bad = {**pair, "teacher": str(teacher)}
    for command in ("check", "train"):
        assert cli.main(_args(command, bad, tmp_path / command)) == 2
        err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
        assert len(err) == 1 and err[0].startswith(f"lookahead-opd {command}: template: "), err
        assert "--allow_template_mismatch" in err[0]
    assert not (tmp_path / "train" / "metrics.jsonl").exists()  # stopped before step 0
    assert cli.main(_args("check", bad, tmp_path / "c", "--allow_template_mismatch")) == 0
    assert "warning: template" in capsys.readouterr().err
