"""The speed table of README.md and of docs/results.md's summary, generated from run logs.

``docs/speed_table.json`` names each row: the run log (``pad-decoding bench --out``'s ``*.runs.jsonl``), the
machine and commit it was measured on, and which of its policies are the exact ones, the relaxed ones and the
peers. Per row: the target's tokens/s, the fastest exact policy, the fastest relaxed one with its accuracy
against the target (paired over the same problems, exact McNemar 95% interval) and each peer, all as speedups
over the target measured in that log (side by side, one machine); only problems that every named policy ran
count. The table goes between ``<!-- speed-table:begin -->`` and ``<!-- speed-table:end -->`` of each file:

    python bench/readme_table.py            # rewrite both files' tables
    python bench/readme_table.py --check    # exit 1 when a file's table differs from the logs (the fast tier)
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from pad.evaluation.bench import PolicyTotals, paired_difference

ROOT = Path(__file__).resolve().parents[1]
SPEC = ROOT / "docs" / "speed_table.json"
TARGETS = (ROOT / "README.md", ROOT / "docs" / "results.md")
BEGIN, END = "<!-- speed-table:begin -->", "<!-- speed-table:end -->"
HEADER = ("| machine, dtype | task, new tokens | batch, K | target | best exact | best relaxed (accuracy - target) "
          "| peers | commit |\n|---|---|---|---|---|---|---|---|")


def records(log: Path, where: dict) -> dict[str, dict[str, dict]]:
    """policy -> problem -> its last record in ``log`` whose settings match ``where``."""
    out: dict[str, dict[str, dict]] = {}
    for line in log.read_text().splitlines():
        r = json.loads(line)
        if all(r["settings"].get(k) == v for k, v in where.items()):
            out.setdefault(r["policy"], {})[r["problem"]] = r
    return out


def row(spec: dict) -> str:
    """One table row from its spec: ``log``, ``where`` (settings the records of target and of pad's policies
    must have; the peers, transformers' rows at their own fixed K, are exempt) and ``policy_where`` (per policy,
    more settings: a log may hold a policy under two settings)."""
    runs = records(ROOT / spec["log"], spec.get("where", {}))
    for peer in spec.get("peers", []):
        runs[peer] = records(ROOT / spec["log"], {}).get(peer, {})
    for policy, where in spec.get("policy_where", {}).items():
        runs[policy] = {p: r for p, r in runs.get(policy, {}).items()
                        if all(r["settings"].get(k) == v for k, v in where.items())}
    named = ["target", *spec["exact"], *spec.get("relaxed", []), *spec.get("peers", [])]
    missing = [p for p in named if not runs.get(p)]
    if missing:
        raise ValueError(f"{spec['log']}: no runs of {', '.join(missing)} matching {spec.get('where', {})}")
    problems = sorted(set.intersection(*(set(runs[p]) for p in named)))
    machines = {runs[p][q]["settings"].get("machine") for p in named for q in problems}
    if len(machines) != 1:
        raise ValueError(f"{spec['log']}: the row's runs come from {len(machines)} machines; a row compares runs of "
                         "one machine only")

    def totals(policy):
        t = PolicyTotals()
        for p in problems:
            t.add(runs[policy][p])
        return t.row(policy)

    rows = {p: totals(p) for p in named}
    base = rows["target"]["tokens_per_s"]

    def x(policy):
        return rows[policy]["tokens_per_s"] / base

    def best(policies):
        return max(policies, key=x) if policies else None

    exact = best(spec["exact"])
    relaxed = best(spec.get("relaxed", []))
    relaxed_cell = ""
    if relaxed is not None:
        diff, low, high = paired_difference([runs[relaxed][p]["correct"] for p in problems],
                                            [runs["target"][p]["correct"] for p in problems])
        relaxed_cell = f"{relaxed} {x(relaxed):.2f}x ({100 * diff:+.1f} [{100 * low:+.1f}, {100 * high:+.1f}])"
    peers = ", ".join(f"{p} {x(p):.2f}x" for p in spec.get("peers", []))
    return (f"| {spec['machine']} | {spec['task']} ({len(problems)}), {spec['new_tokens']} | {spec['batch']}, "
            f"{spec['k']} | {base:.2f} tok/s | {exact} {x(exact):.2f}x | {relaxed_cell} | {peers} | "
            f"{spec['commit']} |")


def table() -> str:
    spec = json.loads(SPEC.read_text())
    if len(spec["rows"]) > 10:
        raise ValueError(f"{SPEC}: at most 10 rows (the README's table), got {len(spec['rows'])}")
    return "\n".join([HEADER, *(row(r) for r in spec["rows"])])


def replace_table(text: str, new: str, where: Path) -> str:
    if text.count(BEGIN) != 1 or text.count(END) != 1:
        raise ValueError(f"{where} needs one {BEGIN} ... {END} section")
    head, rest = text.split(BEGIN)
    _, tail = rest.split(END)
    return f"{head}{BEGIN}\n{new}\n{END}{tail}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="only compare: exit 1 where a table differs")
    args = parser.parse_args(argv)
    new = table()
    stale = []
    for path in TARGETS:
        text = path.read_text()
        updated = replace_table(text, new, path)
        if updated != text:
            stale.append(path)
            if not args.check:
                path.write_text(updated)
    for path in stale:
        shown = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
        print(f"{shown}: {'differs from the run logs' if args.check else 'table rewritten'}")
    return 1 if stale and args.check else 0


if __name__ == "__main__":
    sys.exit(main())
