"""Tasks: GSM8K-style data from a local file through `datasets`, answer checking, bad input."""

from __future__ import annotations

import json
import re

import pytest

pytest.importorskip("datasets")

from lookahead_opd.integrations.opd.tasks import GSM8KTask, Problem, load_task  # noqa: E402


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_gsm8k_from_a_local_jsonl(tmp_path):
    rows = [{"question": f"What is {i} + {i}?", "answer": f"{i} + {i} = {2 * i}\n#### {2 * i:,}"}
            for i in range(200, 260)]
    task = load_task(f"gsm8k:path={_write(tmp_path / 'd.jsonl', rows)}")
    assert isinstance(task, GSM8KTask)
    splits = {s: task.all_problems(s) for s in ("train", "gate", "test")}
    assert sum(len(v) for v in splits.values()) == len(rows)
    assert splits["train"] and not {p.prompt for p in splits["train"]} & {p.prompt for p in splits["test"]}
    p = splits["train"][0]
    assert "," not in p.answer and p.prompt.startswith("Question: ")
    assert task.is_correct(f"so #### {p.answer}", p)
    assert task.is_correct(f"the answer is \\boxed{{{p.answer}}}", p)
    assert not task.is_correct("#### 7", p)
    assert task.sft_text(p).endswith(p.meta["solution"])


def test_gsm8k_bad_input(tmp_path):
    with pytest.raises(ValueError, match="exactly one of"):
        GSM8KTask()
    with pytest.raises(ValueError, match="columns"):
        load_task(f"gsm8k:path={_write(tmp_path / 'x.jsonl', [{'q': 1}])}").all_problems("train")
    with pytest.raises(ValueError, match=".jsonl, .json or .parquet"):
        load_task(f"gsm8k:path={tmp_path / 'd.csv'}").all_problems("train")


def test_arithmetic_answers_and_unknown_tasks():
    task = load_task("arithmetic:ops=+-,digits=1")
    assert task.is_correct("12", Problem("5+7=", "12")) and not task.is_correct("13", Problem("5+7=", "12"))
    assert task.extract_answer("-3<eos>") == "-3"
    with pytest.raises(ValueError, match="unknown task"):
        load_task("nope")
    with pytest.raises(ValueError, match="unknown option"):
        load_task("arithmetic:size=3")


def test_longadd_solutions_round_trip_and_are_20_to_80_tokens():
    from lookahead_opd.integrations.opd.tokenizer import char_tokenizer

    tok = char_tokenizer()
    for digits in (3, 4, 7):
        task = load_task(f"longadd:digits={digits},count=500")
        problems = [p for s in ("train", "gate", "test") for p in task.all_problems(s)]
        assert len({p.prompt for p in problems}) == 500
        for p in problems:
            completion = task.sft_text(p)[len(p.prompt):]
            ids = tok(completion, add_special_tokens=False)["input_ids"]
            assert tok.unk_token_id not in ids and tok.decode(ids) == completion
            assert 20 <= len(ids) <= 80 and len(ids) + 1 <= task.max_new_tokens  # + EOS
            assert task.is_correct(completion, p)
            a, b = (int(x) for x in p.prompt[:-1].split("+"))
            assert int(p.answer) == a + b
            # The worked steps are the columns' sums with the carry of the column before.
            carry = 0
            for i, step in enumerate(completion.split(" ")[:digits]):
                lhs, s = step.split("=")
                x, y, c = (int(v) for v in lhs.split("+"))
                assert (x, y, c) == (a // 10**i % 10, b // 10**i % 10, carry) and int(s) == x + y + c
                carry = int(s) // 10


def test_longadd_grades_only_the_final_answer():
    task = load_task("longadd:digits=3")
    p = Problem("247+520=", "767")
    assert task.sft_text(p) == "247+520=7+0+0=7 4+2+0=6 2+5+0=7 (767)"
    assert task.is_correct("7+0+0=7 4+2+0=6 2+5+0=7 (767)", p)
    assert task.is_correct("garbled steps (767)", p)  # exact match on the answer, not the steps
    assert not task.is_correct("7+0+0=7 4+2+0=6 2+5+0=7 (768)", p)
    assert not task.is_correct("7+0+0=7 4+2+0=6 2+5+0=7 767", p)  # no answer given
    assert task.extract_answer("(0767)") == "767" and task.extract_answer("") is None


def test_longadd_bad_input():
    with pytest.raises(ValueError, match="digits must be in 3..7"):
        load_task("longadd:digits=2")
    with pytest.raises(ValueError, match="count must be in 100.."):
        load_task("longadd:count=5")
    with pytest.raises(ValueError, match="max_new_tokens must be >= 0"):
        load_task("longadd:max_new_tokens=-1")
    with pytest.raises(ValueError, match="expected int"):
        load_task("longadd:digits=four")
    with pytest.raises(ValueError, match="unknown option 'ops'"):
        load_task("longadd:ops=+")
    from lookahead_opd.integrations.opd.tasks.longadd import worked_addition

    with pytest.raises(ValueError, match="operands must be in 0..999"):
        worked_addition(1000, 1, 3)


def test_word_problems_are_seeded_graded_and_worked():
    from lookahead_opd.integrations.opd.tasks import WordProblemTask

    task = load_task("wordproblems:count=300,ops=agph")
    assert isinstance(task, WordProblemTask) and task.max_new_tokens == 96
    again = load_task("wordproblems:count=300,ops=agph")
    other = load_task("wordproblems:count=300,ops=agph,seed=1")
    assert task.all_problems("test") == again.all_problems("test") != other.all_problems("test")
    problems = [p for s in ("train", "gate", "test") for p in task.all_problems(s)]
    assert len({p.prompt for p in problems}) == 300
    for p in problems:
        solution = p.meta["solution"]
        assert task.is_correct(solution, p), (p.prompt, solution)
        assert task.sft_text(p) == p.prompt + " " + solution
        # every step's arithmetic in the worked solution is right
        for a, op, b, c in re.findall(r"(\d+) ([-+*/]) (\d+) = (\d+)", solution):
            assert {"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b),
                    "/": int(a) // int(b)}[op] == int(c)
    p = problems[0]
    wrong = str(int(p.answer) + 1)
    assert task.is_correct(f"so {wrong} - 1 = {p.answer}. The answer is {p.answer}.", p)
    assert not task.is_correct(f"{p.answer} apples. The answer is {wrong}.", p)
    assert not task.is_correct("I do not know.", p)
    with pytest.raises(ValueError, match="steps must be in 1..4"):
        load_task("wordproblems:steps=5")
    with pytest.raises(ValueError, match="ops must be"):
        load_task("wordproblems:ops=ax")


def test_word_problems_mix_difficulties_only_when_asked():
    """min_steps draws each problem's operation count; without it the problems are unchanged."""
    def counts(spec: str) -> set[int]:  # operations per problem, read off the worked solutions
        return {len(re.findall(r" = ", p.meta["solution"]))
                for p in load_task(spec).all_problems("train")}

    assert counts("wordproblems:count=300") == {2}
    assert counts("wordproblems:count=300,min_steps=1") == {1, 2}
    assert counts("wordproblems:count=300,steps=3,min_steps=3") == {3}
    assert (load_task("wordproblems:count=300,min_steps=0").all_problems("test")
            == load_task("wordproblems:count=300").all_problems("test"))
    with pytest.raises(ValueError, match="min_steps must be in 0..steps=2"):
        load_task("wordproblems:min_steps=3")


def test_chat_template_renders_prompts_and_leaves_grading_alone():
    from lookahead_opd.integrations.opd.tasks import ChatTemplateTask, with_chat_template
    from lookahead_opd.integrations.opd.tokenizer import char_tokenizer

    task = load_task("wordproblems:count=200")
    plain_tok = char_tokenizer()
    assert with_chat_template(task, plain_tok) is task  # no chat template: unchanged

    class Templated:
        chat_template = "yes"

        def apply_chat_template(self, messages, tokenize, add_generation_prompt):
            assert not tokenize and add_generation_prompt and len(messages) == 1
            return f"<user>{messages[0]['content']}</user><bot>"

    assert with_chat_template(task, Templated(), enabled=False) is task
    chat = with_chat_template(task, Templated())
    assert isinstance(chat, ChatTemplateTask) and chat.max_new_tokens == task.max_new_tokens
    for split in ("train", "test"):
        for raw, p in zip(task.all_problems(split), chat.all_problems(split), strict=True):
            assert p.prompt == f"<user>{raw.prompt}</user><bot>" and p.answer == raw.answer
            assert p.meta["plain_prompt"] == raw.prompt
    p = chat.problems("test", 1)[0]
    assert chat.is_correct(p.meta["solution"], p) and chat.reward("The answer is -1.", p) == 0.0
    assert chat.sft_text(p) == p.prompt + " " + p.meta["solution"]
