"""Where the test suite's time goes: the slowest tests of every tier, with their share of the total.

Each tier runs once with ``--junitxml`` (or its XML is given), and the table of the slowest tests (setup, call
and teardown summed per test, as JUnit XML records them) replaces the part of CONTRIBUTING.md between the
markers ``<!-- durations:begin -->`` and ``<!-- durations:end -->``:

    python bench/suite_durations.py --run --write CONTRIBUTING.md        # every tier here (the vLLM tier needs vLLM)
    python bench/suite_durations.py fast=f.xml slow=s.xml --top 30       # runs made by .ci/run (PAD_CI_JUNIT=DIR)

The table names the CPU this script runs on: run it on the machine that made the XML.

Run it with nothing else on the machine: a second job halves every figure.
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Each tier's pytest arguments, as CONTRIBUTING.md's "Tests" names them.
TIERS = {"fast": ["-m", "not slow and not toolchain"], "slow": ["-m", "slow"], "toolchain": ["-m", "toolchain"],
         "vllm": ["-m", "", "tests/vllm_plugin"]}


def read_junit(path: Path) -> tuple[list[tuple[str, float, bool]], float]:
    """(test id, seconds, failed or errored) of every test case in a JUnit XML file, in file order, and the run's
    wall seconds."""
    root = ET.parse(path).getroot()
    cases = []
    for case in root.iter("testcase"):
        module = case.get("classname", "").replace(".", "/")
        failed = case.find("failure") is not None or case.find("error") is not None
        cases.append((f"{module}.py::{case.get('name')}", float(case.get("time", 0.0)), failed))
    return cases, sum(float(suite.get("time", 0.0)) for suite in root.iter("testsuite"))


def _cpu() -> str:
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or "unknown CPU"
    name = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")), "?")
    flags = next((line.split(":", 1)[1].split() for line in info.splitlines() if line.startswith("flags")), [])
    isa = "AVX-512 BF16" if "avx512_bf16" in flags else "AVX-512" if "avx512f" in flags else \
        "AVX2" if "avx2" in flags else "no AVX2"
    return f"{os.cpu_count()}-core {name}, {isa}"


def table(tiers: dict[str, list[tuple[str, float, bool]]], walls: dict[str, float], top: int, command: str,
          commit: str) -> str:
    """Markdown: per tier its tests and seconds, then the ``top`` slowest tests of all tiers."""
    totals = {name: sum(t for _, t, _ in cases) for name, cases in tiers.items()}
    everything = sum(totals.values())
    lines = [f"Made {datetime.date.today()} on a {_cpu()}, commit {commit}, by "
             f"`{command}`. Seconds are each test's setup, call and teardown summed (pytest's JUnit XML); a "
             "tier's wall time (pytest's own, without its start-up) is shorter where its tests ran on several "
             "workers.", "",
             "| tier | tests | seconds of tests | wall seconds |", "|---|---|---|---|"]
    for name, cases in tiers.items():
        lines.append(f"| {name} | {len(cases)} | {totals[name]:.0f} | {walls[name]:.0f} |")
    lines += ["", f"The {top} slowest tests:", "", "| # | test | tier | seconds | share of its tier | share of all |",
              "|---|---|---|---|---|---|"]
    ranked = sorted(((t, test, name) for name, cases in tiers.items() for test, t, _ in cases), reverse=True)[:top]
    for i, (t, test, name) in enumerate(ranked, 1):
        lines.append(f"| {i} | `{test}` | {name} | {t:.1f} | {100 * t / totals[name]:.1f}% | "
                     f"{100 * t / everything:.1f}% |")
    return "\n".join(lines)


def replace_section(path: Path, name: str, text: str) -> None:
    """Replace what lies between ``<!-- NAME:begin -->`` and ``<!-- NAME:end -->`` in ``path`` with ``text``."""
    begin, end = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
    doc = path.read_text()
    if begin not in doc or end not in doc:
        raise SystemExit(f"{path} has no {begin} ... {end} section to replace")
    head, rest = doc.split(begin, 1)
    path.write_text(f"{head}{begin}\n{text}\n{end}{rest.split(end, 1)[1]}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("xml", nargs="*", help="TIER=junit.xml of runs made elsewhere")
    ap.add_argument("--run", action="store_true", help="run the fast, slow and toolchain tiers here (and the vLLM "
                                                       "tier where vLLM is installed)")
    ap.add_argument("--pytest-args", default="-n auto", help="more arguments for every tier's pytest (default: -n auto)")
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--commit", help="the commit the XML's runs tested (default: this checkout's)")
    ap.add_argument("--write", type=Path, help="the file whose durations section is replaced (CONTRIBUTING.md)")
    args = ap.parse_args(argv)
    tiers: dict[str, list[tuple[str, float, bool]]] = {}
    walls: dict[str, float] = {}
    for item in args.xml:
        name, _, path = item.partition("=")
        if not path:
            ap.error(f"give TIER=junit.xml, got {item!r}")
        tiers[name], walls[name] = read_junit(Path(path))
    if args.run:
        import importlib.util

        names = [n for n in TIERS if n != "vllm" or importlib.util.find_spec("vllm") is not None]
        with tempfile.TemporaryDirectory() as tmp:
            for name in names:
                xml = Path(tmp) / f"{name}.xml"
                # `pytest`, not `python -m pytest`: the installed package, not the source tree, is imported.
                proc = subprocess.run(["pytest", "-q", "-p", "no:cacheprovider", *TIERS[name], *args.pytest_args.split(),
                                       f"--junitxml={xml}"], cwd=ROOT)
                if proc.returncode != 0:
                    print(f"the {name} tier failed (exit {proc.returncode}): no table", file=sys.stderr)
                    return proc.returncode
                tiers[name], walls[name] = read_junit(xml)
    if not tiers:
        ap.error("give TIER=junit.xml files or --run")
    command = "python bench/suite_durations.py " + " ".join(argv if argv is not None else sys.argv[1:])
    commit = args.commit or subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                           cwd=ROOT).stdout.strip() or "?"
    text = table(tiers, walls, args.top, command, commit)
    print(text)
    if args.write:
        replace_section(args.write, "durations", text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
