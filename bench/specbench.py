"""Spec-Bench per category, from a run log of ``pad-decoding bench --task specbench``.

Spec-Bench carries no answers, so per category and policy: tokens/s (the category's new tokens over its
seconds) and its ratio to the reference row's of the same category, new tokens per target forward, the range
of the speed probes its runs were timed under (``pad.machine.speed_probe``: runs timed beside another job or
on another machine show there), and for every policy against the reference row of the same log (``target``
unless ``--reference`` names another policy, such as exact with the same drafter) the share of replies
identical to the reference's and their mean token-level similarity to it (difflib's ratio over the two replies'
token ids: 1 for identical replies).

    python bench/specbench.py RUNS.jsonl [--reference POLICY] [--tokenizer NAME] [--weights index-gguf] [--out FILE.md]
"""
from __future__ import annotations

import argparse
import difflib
import sys
from collections import defaultdict
from pathlib import Path

from pad import jsonl


def category(problem_id: str) -> str:
    """``specbench/<category>/<question id>`` -> the category."""
    return problem_id.split("/")[1]


def similarity(a: list[int], b: list[int]) -> float:
    """Token-level similarity of two replies: 2 * matches / (len(a) + len(b)) (difflib), 1 for equal ones."""
    if not a and not b:
        return 1.0
    return difflib.SequenceMatcher(None, a, b, autojunk=False).ratio()


def table(records: list[dict], encode, reference: str = "target") -> list[dict]:
    """One row per (category, policy), categories in first-seen order, then an "all" row per policy.

    ``encode``: reply text -> token ids. Records of one policy and problem beyond the first are ignored."""
    seen, by = set(), defaultdict(list)
    for r in records:
        if (r["policy"], r["problem"]) not in seen:
            seen.add((r["policy"], r["problem"]))
            by[category(r["problem"]), r["policy"]].append(r)
            by["all", r["policy"]].append(r)
    refs = {r["problem"]: r["reply"] for (c, p), rs in by.items() if p == reference and c == "all" for r in rs}
    tokens: dict[str, list[int]] = {}

    def ids(text: str) -> list[int]:
        if text not in tokens:
            tokens[text] = encode(text)
        return tokens[text]

    rows = []
    for (cat, policy), rs in by.items():
        new = sum(r["new_tokens"] for r in rs)
        row = {"category": cat, "policy": policy, "problems": len(rs), "new_tokens": new,
               "tokens_per_s": new / sum(r["seconds"] for r in rs),
               "tokens_per_target_forward": new / max(sum(r["target_forwards"] for r in rs), 1)}
        paired = [(r["reply"], refs[r["problem"]]) for r in rs if r["problem"] in refs]
        if paired:
            row["identical"] = sum(a == b for a, b in paired) / len(paired)
            row["similarity"] = sum(similarity(ids(a), ids(b)) for a, b in paired) / len(paired)
        probes = [r["speed_probe"] for r in rs if r.get("speed_probe") is not None]
        if probes:
            row["probes"] = (min(probes), max(probes))
        rows.append(row)
    for row in rows:
        base = next((r for r in rows if r["category"] == row["category"] and r["policy"] == reference), None)
        if base is not None:
            row["speedup"] = row["tokens_per_s"] / base["tokens_per_s"]
    order = list(dict.fromkeys(c for c, _ in by))
    order = [c for c in order if c != "all"] + ["all"]
    return sorted(rows, key=lambda r: order.index(r["category"]))


def markdown(rows: list[dict], reference: str = "target") -> str:
    lines = [f"| category | policy | problems | new tokens | tokens/s | x {reference} | tokens / target forward | "
             f"identical to {reference} | similarity to {reference} | probe GFLOP/s |", "|" + "---|" * 10]
    for r in rows:
        same = f"{r['identical']:.0%}" if "identical" in r else "n/a"
        sim = f"{r['similarity']:.3f}" if "similarity" in r else "n/a"
        speedup = f"{r['speedup']:.2f}x" if "speedup" in r else "n/a"
        probes = "n/a" if "probes" not in r else f"{r['probes'][0]:.0f}-{r['probes'][1]:.0f}"
        lines.append(f"| {r['category']} | {r['policy']} | {r['problems']} | {r['new_tokens']} | "
                     f"{r['tokens_per_s']:.2f} | {speedup} | {r['tokens_per_target_forward']:.2f} | {same} | {sim} | "
                     f"{probes} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("log", type=Path, help="the run log (RUNS.jsonl) of a specbench bench")
    parser.add_argument("--reference", default="target",
                        help="the policy every row is compared with (default: target), e.g. exact/suffix")
    parser.add_argument("--tokenizer", help="tokenizer for the similarity (default: the log's target)")
    parser.add_argument("--weights", help="where registry models come from (as pad-decoding's --weights)")
    parser.add_argument("--out", type=Path, help="also write the table here")
    args = parser.parse_args(argv)
    records = jsonl.read(args.log)
    if not records:
        print(f"{args.log} holds no runs", file=sys.stderr)
        return 2
    if not any(r["policy"] == args.reference for r in records):
        print(f"{args.log} holds no runs of the reference {args.reference!r}; its policies: "
              f"{', '.join(dict.fromkeys(r['policy'] for r in records))}", file=sys.stderr)
        return 2
    from pad.models.registry import load_tokenizer

    tokenizer = load_tokenizer(args.tokenizer or records[0]["settings"]["target"], source=args.weights)
    text = markdown(table(records, lambda s: tokenizer(s, add_special_tokens=False).input_ids, args.reference),
                    args.reference)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
