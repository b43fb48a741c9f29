"""The defaults agree with each other and with what ships: the draft length, the labeling method of the
shipped classifier, one sigma in every example, the license, the dependency floors."""
import inspect
import json
import re
import tomllib
from pathlib import Path

import pad
from pad.cli import build_parser
from pad.decoding.policy import DEFAULT_SIGMA
from pad.models.registry import DEFAULT_DRAFT, DEFAULT_TARGET, shipped_classifier

ROOT = Path(__file__).parent.parent


def _default(command: str, dest: str):
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command").choices[command]
    return sub.get_default(dest)


def test_one_draft_length_everywhere():
    k = inspect.signature(pad.generate).parameters["num_draft_tokens"].default
    assert _default("generate", "num_draft_tokens") == k == _default("bench", "num_draft_tokens")


def test_label_method_is_the_one_the_shipped_classifier_learned_from():
    report = json.loads((shipped_classifier(DEFAULT_TARGET, DEFAULT_DRAFT) / "report.json").read_text())
    assert _default("label", "method") == report["label_meta"]["method"] == "search"


def test_every_example_uses_the_default_sigma():
    """README examples and the command line's help name pivot with the default sigma only."""
    assert _default("generate", "sigma") == DEFAULT_SIGMA
    assert inspect.signature(pad.generate).parameters["sigma"].default == DEFAULT_SIGMA
    parser = build_parser()
    helps = [a.help or "" for sub in next(a for a in parser._actions if a.dest == "command").choices.values()
             for a in sub._actions]
    for text in [(ROOT / "README.md").read_text(), *helps]:
        for value in re.findall(r"pivot@([0-9.]+)", text) + re.findall(r"\bsigma=([0-9.]+)", text):
            assert float(value.rstrip(".")) == DEFAULT_SIGMA, text[:200]


def test_the_license_pyproject_names_is_there():
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert meta["license"] == "MIT"
    assert (ROOT / "LICENSE").read_text().startswith("MIT License")


def test_dependency_floors_are_the_versions_ci_proves():
    """pyproject's floors are the versions CI installs (.ci/run: torch==2.13.0, transformers==5.19.0), the
    lowest this suite has passed on; torch 2.5 and transformers 4.54 were tried and fail."""
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    deps = {re.split(r"[<>=!~ ]", d, 1)[0]: d for d in meta["dependencies"]}
    ci = (ROOT / ".ci" / "run").read_text()
    for name, floor in (("torch", "2.13"), ("transformers", "5.19")):
        assert deps[name].startswith(f"{name}>={floor}"), deps[name]
        assert f"{name}=={floor}.0" in ci, f".ci/run does not install {name} at its floor {floor}"


def test_ci_runs_the_readmes_test_command():
    """.ci/run sets up and runs the fast tier as the README's test command does, step by step (CI adds only -q
    to pip, the floor of transformers and a JUnit file), before the other tiers."""
    readme = (ROOT / "README.md").read_text()
    command = readme.split("Set up and pass the tests", 1)[1].split("```bash\n", 1)[1].split("\n```", 1)[0]
    steps = command.split(" && ")
    assert steps[-1].startswith("PAD_REQUIRE_SANDBOX=1 PAD_REQUIRE_CPU_EXTENSION=1 pytest -q -n auto")
    assert " -m " not in steps[-1]  # the fast tier: pyproject's addopts
    ci = [line.replace(" -q", "") for line in (ROOT / ".ci" / "run").read_text().splitlines()
          if line and not line.lstrip().startswith("#")]
    at = 0
    for step in steps:
        step = step.replace(" -q", "")
        found = [i for i, line in enumerate(ci) if i >= at and step in line]
        assert found, f".ci/run has no line running the README's step {step!r} after line {at}"
        at = found[0]
    assert ci[at].endswith("--junitxml=\"$junit/fast.xml\"") and "-m" not in ci[at]
    assert any(" -m slow " in line for line in ci[at:]) and any(" -m toolchain " in line for line in ci[at:])


def test_every_package_ships_in_the_wheel():
    """A subpackage missing from pyproject's list imports in a checkout and fails in an installed wheel."""
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {str(p.parent.relative_to(ROOT)).replace("/", ".") for top in ("pad", "pad_kernels")
             for p in (ROOT / top).rglob("__init__.py")}
    assert found == listed
