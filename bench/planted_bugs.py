"""Bugs planted one at a time: which fast-tier tests fail with each (CONTRIBUTING.md keeps the table).

Each ``bench/planted/*.patch`` is applied to this checkout (an editable install: ``pip install
--no-build-isolation -e '.[test]'``), the CPU extension rebuilt in place when the patch touches ``csrc/``, the fast
tier run from the source tree, and the patch reverted (and the extension rebuilt clean) whatever happens. A bug
that no fast-tier test catches makes the exit code 1. The files a patch touches must be unchanged beforehand.
The table goes between ``<!-- planted:begin -->`` and ``<!-- planted:end -->``.

    python bench/planted_bugs.py --write CONTRIBUTING.md        # every patch, the table into CONTRIBUTING.md
    python bench/planted_bugs.py --only 3-triton                # the patches whose names start so
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

from suite_durations import read_junit, replace_section  # bench/, this script's folder

ROOT = Path(__file__).resolve().parents[1]
PLANTED = ROOT / "bench" / "planted"


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout


def _build() -> None:
    subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--inplace"], cwd=ROOT, check=True,
                   stdout=subprocess.DEVNULL)


def touched(patch: Path) -> list[str]:
    return [line[len("+++ b/"):] for line in patch.read_text().splitlines() if line.startswith("+++ b/")]


def run_one(patch: Path, pytest_args: list[str]) -> list[str]:
    """The fast-tier tests that fail with ``patch`` applied."""
    files = touched(patch)
    if _git("status", "--porcelain", "--", *files).strip():
        raise SystemExit(f"{patch.name}: {', '.join(files)} has uncommitted changes; commit or stash them first")
    native = any(f.startswith("csrc/") for f in files)
    _git("apply", str(patch))
    try:
        if native:
            _build()
        with tempfile.TemporaryDirectory() as tmp:
            junit = Path(tmp) / "fast.xml"
            subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *pytest_args,
                            f"--junitxml={junit}"], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            return [test for test, _, failed in read_junit(junit)[0] if failed]
    finally:
        _git("apply", "-R", str(patch))
        if native:
            _build()


def describe(patch: Path) -> str:
    """The first line the patch adds: what was planted."""
    added = [line[1:].strip() for line in patch.read_text().splitlines()
             if line.startswith("+") and not line.startswith("+++")]
    return added[0] if added else "?"


HEADER = ["| bug | where planted | changed line | fast-tier tests that failed |", "|---|---|---|---|"]


def row(patch: Path, failed: list[str]) -> str:
    shown = ", ".join(f"`{t}`" for t in failed[:4]) + (f" and {len(failed) - 4} more" if len(failed) > 4 else "")
    return (f"| {patch.stem} | {', '.join(f'`{f}`' for f in touched(patch))} | "
            f"`{describe(patch).replace('|', '&#124;')}` | {len(failed)}: {shown or 'NONE'} |")


def table(rows: dict[str, str]) -> str:
    """The table of every patch's row, in the patches' order."""
    return "\n".join(HEADER + [rows[name] for name in sorted(rows)])


def rows_in(doc: str) -> dict[str, str]:
    """The rows of a table written before, by patch name (kept for the patches not run this time)."""
    return {line.split("|")[1].strip(): line for line in doc.splitlines()
            if line.startswith("| ") and (PLANTED / f"{line.split('|')[1].strip()}.patch").exists()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", help="comma-separated: run the patches whose file names start with one of these "
                                   "(--write keeps the other patches' rows)")
    ap.add_argument("--pytest-args", default="-n auto", help="more arguments for pytest (default: -n auto)")
    ap.add_argument("--write", type=Path, help="the file whose planted-bugs section is replaced (CONTRIBUTING.md)")
    args = ap.parse_args(argv)
    prefixes = tuple(args.only.split(",")) if args.only else ("",)
    patches = sorted(p for p in PLANTED.glob("*.patch") if p.name.startswith(prefixes))
    if not patches:
        ap.error(f"no patch in {PLANTED} matches")
    rows = rows_in(args.write.read_text()) if args.write and args.only else {}
    missed = []
    for patch in patches:
        failed = run_one(patch, args.pytest_args.split())
        rows[patch.stem] = row(patch, failed)
        missed += [] if failed else [patch.stem]
        print(f"{patch.stem}: {len(failed)} failed", flush=True)
    text = table(rows)
    print(text)
    if args.write:
        replace_section(args.write, "planted", text)
    if missed:
        print(f"not caught by the fast tier: {', '.join(missed)}", file=sys.stderr)
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
