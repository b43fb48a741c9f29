"""bench/suite_durations.py and bench/planted_bugs.py: the tables they write, from JUnit XML made here."""
import importlib.util
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench"


def _load(name):
    sys.path.insert(0, str(BENCH))  # planted_bugs imports suite_durations from its folder
    try:
        spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(BENCH))


def _junit(path, cases, wall):
    """cases: (classname, name, seconds, failed)."""
    body = "".join(f'<testcase classname="{c}" name="{n}" time="{t}">' + ("<failure message='x'/>" if bad else "")
                   + "</testcase>" for c, n, t, bad in cases)
    path.write_text(f'<testsuites><testsuite name="pytest" time="{wall}">{body}</testsuite></testsuites>')
    return path


def test_durations_table_ranks_tests_and_shares(tmp_path):
    durations = _load("suite_durations")
    fast = _junit(tmp_path / "f.xml", [("tests.test_a", "test_x[1]", 3.0, False), ("tests.test_a", "test_y", 1.0, False)], 2.5)
    slow = _junit(tmp_path / "s.xml", [("tests.test_b", "test_z", 6.0, False)], 6.1)
    doc = tmp_path / "doc.md"
    doc.write_text("before\n<!-- durations:begin -->\nold\n<!-- durations:end -->\nafter\n")
    assert durations.main([f"fast={fast}", f"slow={slow}", "--top", "2", "--write", str(doc)]) == 0
    text = doc.read_text()
    assert text.startswith("before\n<!-- durations:begin -->\n") and text.endswith("<!-- durations:end -->\nafter\n")
    assert "old" not in text
    assert "| fast | 2 | 4 | 2 |" in text and "| slow | 1 | 6 | 6 |" in text
    rows = [line for line in text.splitlines() if line.startswith("| 1 ") or line.startswith("| 2 ")]
    # Shares: 6 of the slow tier's 6 and of all 10 seconds; 3 of the fast tier's 4.
    assert rows == ["| 1 | `tests/test_b.py::test_z` | slow | 6.0 | 100.0% | 60.0% |",
                    "| 2 | `tests/test_a.py::test_x[1]` | fast | 3.0 | 75.0% | 30.0% |"]
    assert "test_y" not in text  # past --top


def test_failures_and_the_planted_table_keeps_the_rows_of_patches_not_run(tmp_path):
    planted = _load("planted_bugs")
    junit = _junit(tmp_path / "f.xml", [("tests.test_a", "test_x", 1.0, True), ("tests.test_a", "test_y", 1.0, False),
                                        ("tests.test_b", "test_z[2]", 1.0, True)], 3.0)
    durations = _load("suite_durations")
    cases, wall = durations.read_junit(junit)
    assert [test for test, _, failed in cases if failed] == ["tests/test_a.py::test_x", "tests/test_b.py::test_z[2]"]
    assert wall == 3.0
    patches = sorted(planted.PLANTED.glob("*.patch"))
    assert len(patches) >= 2
    first, second = patches[:2]
    old = planted.table({first.stem: planted.row(first, ["t.py::a"]), second.stem: planted.row(second, [])})
    assert "1: `t.py::a`" in old and "0: NONE" in old
    rows = planted.rows_in(old)
    rows[second.stem] = planted.row(second, ["t.py::b", "t.py::c"])  # the second rerun: the first row kept
    new = planted.table(rows)
    assert new.splitlines()[2] == old.splitlines()[2] and "2: `t.py::b`, `t.py::c`" in new.splitlines()[3]


def test_every_planted_bug_still_applies():
    """Each patch applies to the code it plants into (or is applied: bench/planted_bugs.py runs this tier so)."""
    planted = _load("planted_bugs")
    root = BENCH.parent
    for patch in sorted(planted.PLANTED.glob("*.patch")):
        forward = subprocess.run(["git", "apply", "--check", str(patch)], cwd=root, capture_output=True)
        applied = subprocess.run(["git", "apply", "--check", "-R", str(patch)], cwd=root, capture_output=True)
        assert forward.returncode == 0 or applied.returncode == 0, (patch.name, forward.stderr)
