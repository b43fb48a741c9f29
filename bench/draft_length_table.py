"""The draft-length table from a ``pad-decoding bench`` run log: per batch size, every policy's aggregate
tokens/s, its ratio to the target alone, tokens per target forward, mean K and accuracy, with the range of
the machine's speed probe over its runs; with ``--per-batch``, also each batch's tokens/s per policy (a batch:
B consecutive problems, decoded together, every policy taking its turn on it).

    python bench/draft_length_table.py bench/results/auto/gsm8k_dev_k8_bfloat16.runs.jsonl [--per-batch]

``pad-decoding bench`` leaves a row's tokens/s out when the probes of the rows differ by more than 5% (a
run beside another job); a cloud machine's speed also drifts by that much over an hour with nothing else
running. Policies take turns on each batch of problems, so a drift reaches every row alike: this table keeps
every row and prints the probes, so that a reader can see how far they moved.
"""
import argparse
import json
import math
from collections import defaultdict

from paired import row_name  # bench/, this script's folder: pivot's rows by who judges draft-free proposals
from pad.evaluation.bench import PolicyTotals


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("log")
    parser.add_argument("--per-batch", action="store_true", help="also a table of each batch's tokens/s")
    args = parser.parse_args()
    totals: dict[int, dict[str, PolicyTotals]] = defaultdict(dict)
    records: dict[int, dict[str, dict[int, dict]]] = defaultdict(lambda: defaultdict(dict))
    seen = set()
    with open(args.log) as f:
        for line in f:
            r = json.loads(line)
            name = row_name(r)
            key = (r["settings"]["batch_size"], name, r["problem"])
            if key in seen:  # a rerun of a logged run: the first one counts, as in the bench's tables
                continue
            seen.add(key)
            totals[r["settings"]["batch_size"]].setdefault(name, PolicyTotals()).add(r)
            if args.per_batch:
                records[r["settings"]["batch_size"]][name][problem_index(r["problem"])] = r
    for batch, rows in sorted(totals.items(), reverse=True):
        problems = max(t.problems for t in rows.values())
        target = rows["target"].row("target")["tokens_per_s"] if "target" in rows else math.nan
        print(f"\nB = {batch}, {problems} problems\n")
        print("| policy | tokens/s | x target | tokens / target forward | mean K | accuracy | probe GFLOP/s |")
        print("|---|---|---|---|---|---|---|")
        for name, t in rows.items():
            row = t.row(name)
            k = row["mean_draft_length"]
            print(f"| {name} | {row['tokens_per_s']:.2f} | {row['tokens_per_s'] / target:.2f}x "
                  f"| {row['mean_accepted_length']:.2f} | {'n/a' if math.isnan(k) else f'{k:.2f}'} "
                  f"| {row['accuracy']:.1%} | {t.probe_low:.0f}-{t.probe_high:.0f} |")
        if args.per_batch and batch > 1:
            per_batch(batch, records[batch])


def problem_index(problem: str) -> int:
    """'gsm8k/dev/17' -> 17 (a task whose problems are numbered in one split: not Spec-Bench's categories)."""
    return int(problem.rsplit("/", 1)[1])


def per_batch(batch: int, rows: dict[str, dict[int, dict]]) -> None:
    """Per batch of ``batch`` consecutive problems: each policy's tokens/s and its ratio to the target's in the
    same batch, and the range of the speed probe over the batch's runs."""
    names = list(rows)
    first = min(min(problems) for problems in rows.values())
    batches = defaultdict(lambda: defaultdict(PolicyTotals))
    for name, problems in rows.items():
        for index, r in problems.items():
            batches[(index - first) // batch][name].add(r)
    print(f"\nB = {batch}, per batch of {batch}: tokens/s (x target)\n")
    print("| problems | " + " | ".join(names) + " | probe GFLOP/s |")
    print("|---|" + "---|" * len(names) + "---|")
    for b, totals in sorted(batches.items()):
        lo = first + b * batch
        tps = {name: t.row(name)["tokens_per_s"] for name, t in totals.items()}
        target = tps.get("target", math.nan)
        cells = [f"{tps[name]:.2f} ({tps[name] / target:.2f}x)" if name in tps else "" for name in names]
        low = min(t.probe_low for t in totals.values())
        high = max(t.probe_high for t in totals.values())
        print(f"| {lo}-{lo + batch - 1} | " + " | ".join(cells) + f" | {low:.0f}-{high:.0f} |")


if __name__ == "__main__":
    main()
