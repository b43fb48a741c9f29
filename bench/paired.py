"""Paired accuracy differences between the rows of a bench run log, on the problems both rows ran.

A row is a policy, and for pivot with a draft-free or hybrid drafter also who judges the draft-free
proposals: records logged with ``judge_free`` (or before the choice existed, when the classifier judged
every draft) are the row ``POLICY --judge-free``. Each pair gives the difference in points with the exact
McNemar 95% interval (``pad.evaluation.bench.paired_difference``) and the problems only one row got right.

    python bench/paired.py RUNS.jsonl --rows target,exact/hybrid,pivot@0.3/hybrid,"pivot@0.3/hybrid --judge-free"

Rows of several logs (runs of other settings on the same problems) are named after their log's folder:

    python bench/paired.py A/RUNS.jsonl B/RUNS.jsonl --rows "target [A],pivot@0.3/hybrid [B]"
"""
from __future__ import annotations

import argparse
import itertools
from pathlib import Path

from pad import jsonl
from pad.evaluation.bench import paired_difference

def row_name(record: dict) -> str:
    """The record's row: its policy, marked ``--judge-free`` where its classifier judged draft-free proposals
    (a pivot run with any drafter but the model's, whose log key holds ``judge_free`` as ``bench.run`` sets it)."""
    settings = record["settings"]
    judged = (record["policy"].startswith("pivot") and settings.get("drafter") not in (None, "model")
              and settings.get("judge_free", True))
    return record["policy"] + (" --judge-free" if judged else "")


def outcomes(records: list[dict]) -> dict[str, dict[str, bool]]:
    """row -> problem -> right; a problem logged twice for a row (other settings) is refused."""
    rows: dict[str, dict[str, bool]] = {}
    for r in records:
        if r.get("correct") is None:
            continue
        row = rows.setdefault(row_name(r), {})
        if r["problem"] in row:
            raise ValueError(f"{r['problem']} is logged twice for {row_name(r)}: give a log of one setting per row")
        row[r["problem"]] = bool(r["correct"])
    return rows


def table(rows: dict[str, dict[str, bool]], names: list[str]) -> str:
    missing = [n for n in names if n not in rows]
    if missing:
        raise ValueError(f"no scored records for {', '.join(missing)}; the log has {', '.join(sorted(rows))}")
    lines = ["| a | b | problems | a - b, points [95% CI] | only a right / only b right |", "|---|---|---|---|---|"]
    for a, b in itertools.combinations(names, 2):
        common = sorted(set(rows[a]) & set(rows[b]))
        if not common:
            continue
        x, y = [rows[a][p] for p in common], [rows[b][p] for p in common]
        d, low, high = paired_difference(x, y)
        wins = sum(u and not v for u, v in zip(x, y))
        losses = sum(v and not u for u, v in zip(x, y))
        lines.append(f"| {a} | {b} | {len(common)} | {100 * d:+.1f} [{100 * low:+.1f}, {100 * high:+.1f}] | "
                     f"{wins} / {losses} |")
    return "\n".join(lines)


def logged_rows(logs: list[Path]) -> dict[str, dict[str, bool]]:
    """The rows of one log (``outcomes``), or of several, each named ``ROW [FOLDER]`` after its log's folder."""
    if len({log.parent.name for log in logs}) != len(logs):
        raise ValueError("give logs of different folders: their rows are named after them")
    rows = {}
    for log in logs:
        got = outcomes(jsonl.read(log))
        rows.update(got if len(logs) == 1 else {f"{name} [{log.parent.name}]": row for name, row in got.items()})
    return rows


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("logs", nargs="+", type=Path, help="bench run logs (*.runs.jsonl)")
    p.add_argument("--rows", required=True, help="comma-separated rows, each pair compared in this order")
    args = p.parse_args(argv)
    print(table(logged_rows(args.logs), [n.strip() for n in args.rows.split(",") if n.strip()]))


if __name__ == "__main__":
    main()
