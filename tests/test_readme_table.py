"""README.md's speed table (and docs/results.md's summary) are bench/readme_table.py's output from the run logs
named in docs/speed_table.json: no figure there is typed by hand, and the README stays a two-minute read."""
import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def readme_table():
    spec = importlib.util.spec_from_file_location("readme_table", ROOT / "bench" / "readme_table.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_tables_are_the_generators_output(capsys):
    assert readme_table().main(["--check"]) == 0, capsys.readouterr().out


def test_a_figure_edited_by_hand_fails_the_check(tmp_path, monkeypatch, capsys):
    module = readme_table()
    readme = (ROOT / "README.md").read_text()
    table = readme[readme.index(module.BEGIN):readme.index(module.END)]
    cell = next(c for c in table.split("|") if c.strip().endswith("tok/s"))  # the first row's target speed
    edited = tmp_path / "README.md"
    edited.write_text(readme.replace(cell, cell.replace(".", "0.", 1), 1))
    monkeypatch.setattr(module, "TARGETS", (edited,))
    monkeypatch.setattr(module, "ROOT", ROOT)
    assert module.main(["--check"]) == 1
    assert "differs from the run logs" in capsys.readouterr().out


def test_the_readme_is_short_and_its_table_small():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 150
    module = readme_table()
    rows = [line for line in readme[readme.index(module.BEGIN):readme.index(module.END)].splitlines()
            if line.startswith("| ") and not line.startswith("| machine")]
    assert 1 <= len(rows) <= 10
