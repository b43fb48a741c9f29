"""Task utilities: GSM8K answer extraction and the sandboxed HumanEval runner."""
import json
import time
from decimal import Decimal

from pathlib import Path

import pytest

from pad import tasks

DATA = Path(__file__).parent / "data"


@pytest.mark.parametrize(
    "text,expected",
    [
        ("She pays 3 * 4 = 12 dollars.\n#### 12", "12"),
        ("#### $1,234,567", "1234567"),
        ("The total is 18.00 dollars.\n#### 18.00", "18"),
        ("So the answer is 42.", "42"),
        ("#### -5", "-5"),
        ("He has 5 apples and 3 pears, 8 in all.\n#### 8\n", "8"),
        ("First 10, then 20.\n#### 30 apples, which is 30 in total", "30"),
        ("#### 7\nWait, recheck: #### 9", "9"),  # the last '####' wins
        ("#### (no number)\nso 15 it is", "15"),  # no number after '####': the last number anywhere
        ("Half is .5 of it", "0.5"),
        ("costs $2.50, and 12.5% tax", "12.5"),
    ],
)
def test_gsm8k_extraction(text, expected):
    assert tasks.extract_answer(text) == Decimal(expected)


def test_gsm8k_correct_and_reference():
    assert tasks.gsm8k_reference("blah <<2*3=6>>6\n#### 1,200") == "1200"
    assert tasks.gsm8k_correct("so #### 1200.0", "1200")
    assert not tasks.gsm8k_correct("so #### 1201", "1200")
    assert not tasks.gsm8k_correct("no numbers here", "3")


def test_gsm8k_data_loads():
    problems = tasks.load("gsm8k", path=DATA / "gsm8k_sample.jsonl", limit=4)
    assert len(problems) == 4 and all(p.reference.lstrip("-").replace(".", "").isdigit() for p in problems)


@pytest.fixture(scope="module")
def humaneval():
    return tasks.load("humaneval", path=DATA / "humaneval_sample.jsonl")


def _canonical(problem):
    for line in (DATA / "humaneval_sample.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if rec["task_id"] == problem.id:
            return rec["canonical_solution"]
    raise KeyError(problem.id)


def test_humaneval_canonical_passes_and_wrong_fails(humaneval):
    for problem in humaneval:
        assert tasks.humaneval_correct(problem, _canonical(problem))
        assert not tasks.humaneval_correct(problem, "    return None\n")


def test_humaneval_infinite_loop_is_killed(humaneval):
    start = time.monotonic()
    assert not tasks.humaneval_correct(humaneval[0], "    while True:\n        pass\n", timeout=2.0)
    assert time.monotonic() - start < 6.0


def test_humaneval_has_no_network(humaneval):
    code = "    import socket\n    socket.create_connection(('127.0.0.1', 9))\n    return True\n"
    assert not tasks.humaneval_correct(humaneval[0], code)


def test_humaneval_full_function_reply(humaneval):
    problem = humaneval[0]
    reply = "Here it is:\n```python\n" + problem.question + _canonical(problem) + "```\nDone."
    assert tasks.correct("humaneval", problem, reply)


def test_bad_task_and_missing_file(tmp_path):
    with pytest.raises(ValueError, match="unknown task"):
        tasks.load("mmlu")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        tasks.load("gsm8k", path=tmp_path / "nope.jsonl")
