"""Tasks: GSM8K-style data from a local file through `datasets`, answer checking, bad input."""

from __future__ import annotations

import json

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
