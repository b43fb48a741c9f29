"""The accuracy/speed frontier of one task from the run logs of several ``pad-decoding bench`` commands
(one log per K): every policy and setting at every K on one table and one figure, each with its accuracy
difference from the target alone on the same problems (exact McNemar 95% interval).

    python bench/frontier.py bench/results/gsm8k_dev_k8_bfloat16.runs.jsonl \\
        bench/results/gsm8k_dev_k16_bfloat16.runs.jsonl --limit 200 --batch-size 16 \\
        --out bench/results --stem gsm8k_dev_200_frontier_bfloat16

Reads the logs only (no weights). A (K, policy) is listed when the logs hold its runs of every one of the
first ``--limit`` problems under the current decode path, the given dtype, token budget and batch size, with a
fixed draft length (no ``--draft-stop``) and, for pivot policies, the classifier given (default: the shipped
one); the rest are named as incomplete. Several classifiers (``--classifier A,B``) join the logs of drafters
judged by classifiers of their own (lookup and suffix by one, hybrid by another) on one table; a pivot policy
run with two of them is refused, never mixed.
The target, draft and hf-target do not depend on K: their runs are taken from whichever log has them.

Sampled runs (``pad-decoding bench --temperature T --seed S``) make their own table with ``--temperature T
--seeds 0,1,2``: a policy is listed when it has every problem at every seed; its accuracy is the mean over the
seeds, and its difference from the reference (default exact, the lossless one when sampling) takes the t
interval over problems of each problem's share of right answers (its seeds pooled).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from pad.decoding.generate import DECODE_VERSION
from pad import jsonl
from pad.evaluation import bench, tasks

K_FREE = ("target", "draft", "hf-target")


def collect(records: list[dict], problems: list[str], *, dtype: str, max_new_tokens: int, batch_size: int,
            classifiers: tuple[str, ...], sampling: tuple[float, float] | None = None,
            seeds: tuple[int, ...] = (None,)) -> tuple[dict, dict, set]:
    """-> ({(label, k): {(problem, seed): record}} of the complete groups, {label: runs found} of the others,
    machine lines). A group is a policy at one K (K-free policies: one group). Greedy runs (``sampling``
    None, seed None) or the runs sampled at ``sampling`` = (temperature, top_p) with each of ``seeds``.
    ``classifiers``: the checksums a pivot run's classifier must be one of; one policy at one K run with two of
    them raises ValueError."""
    wanted = {(p, seed) for p in problems for seed in seeds}
    groups: dict[tuple[str, int | None], dict[tuple, dict]] = {}
    judged: dict[tuple[str, int | None], set] = {}
    for r in records:
        s = r["settings"]
        how = None if "temperature" not in s else (s["temperature"], s["top_p"])
        run = (r["problem"], s.get("seed"))
        if (run not in wanted or how != sampling or s.get("decode") != DECODE_VERSION or s.get("dtype") != dtype
                or s.get("max_new_tokens") != max_new_tokens or "draft_stop" in s
                or s.get("batch_size") != (1 if r["policy"] == "hf-assisted" else batch_size)
                or (r["policy"].startswith("pivot") and s.get("classifier") not in classifiers)):
            continue
        key = (r["policy"], None if r["policy"] in K_FREE else s["k"])
        if r["policy"].startswith("pivot"):
            judged.setdefault(key, set()).add(s.get("classifier"))
            if len(judged[key]) > 1:
                raise ValueError(f"{_label(*key)} was run with the classifiers {', '.join(sorted(judged[key]))}: "
                                 "give only one of them")
        groups.setdefault(key, {}).setdefault(run, r)  # the first run of a problem (and seed) counts
    complete = {key: runs for key, runs in groups.items() if len(runs) == len(wanted)}
    partial = {_label(*key): len(runs) for key, runs in groups.items() if key not in complete}
    weights = {repr(r["settings"].get("weights")) for runs in complete.values() for r in runs.values()}
    if len(weights) > 1:
        raise ValueError(f"the logs mix runs of different weights: {sorted(weights)}")
    machines = {r["settings"]["machine"] for runs in complete.values() for r in runs.values()}
    return complete, partial, machines


def _label(policy: str, k: int | None) -> str:
    return policy if k is None else f"{policy} K={k}"


def frontier_rows(complete: dict, problems: list[str], seeds: tuple = (None,), reference: str = "target") -> list[dict]:
    """One ``bench.summary_rows`` row per group, target first, then by K and the order of the logs; each row
    pools its runs over ``seeds``, and with several seeds a problem's outcome is its share of right answers
    (the accuracy differences then take the t interval over problems). Differences are against ``reference``;
    replies are compared run by run (each problem at each seed)."""
    order = sorted(complete, key=lambda key: (key[0] != "target", key[1] or 0))
    totals, correct, replies = {}, {}, {}
    for key in order:
        name = _label(*key)
        t = totals[name] = bench.PolicyTotals()
        for p in problems:
            for seed in seeds:
                t.add(complete[key][p, seed])
        outcomes = [[bool(complete[key][p, seed]["correct"]) for seed in seeds] for p in problems]
        correct[name] = [o[0] if len(seeds) == 1 else sum(o) / len(o) for o in outcomes]
        texts = [complete[key][p, seed].get("reply") for p in problems for seed in seeds]
        if None not in texts:  # runs logged before replies were: not compared
            replies[name] = texts
    return bench.summary_rows(totals, correct, reference, replies)


def choose(rows: list[dict], rules: list[str], per_rule: int, reference: str, within: float = 0.02) -> list[str]:
    """The settings of each rule (a policy's name before ``@``: kl, topk, typical, ...) to report, from its
    ``frontier_rows`` ranked by acceptance: the most accepting one whose accuracy is at least the ``reference``
    row's minus ``within``, then the next more accepting ones, then less accepting ones, ``per_rule`` in all.
    When none is within, the least accepting ones. Returns policy names (the row labels without " K=...")."""
    accuracy = next(r["accuracy"] for r in rows if r["policy"] == reference)
    chosen = []
    for rule in rules:
        settings = sorted((r for r in rows if r["policy"].split(" K=")[0].split("@")[0] == rule),
                          key=lambda r: r["acceptance_rate"])
        if not settings:
            raise ValueError(f"no complete row of the rule {rule} to choose from")
        within_reach = [i for i, r in enumerate(settings) if r["accuracy"] >= accuracy - within - 1e-12]
        first = within_reach[-1] if within_reach else 0
        order = [*range(first, len(settings)), *range(first - 1, -1, -1)]
        chosen += [settings[i]["policy"].split(" K=")[0] for i in order[:per_rule]]
    return chosen


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("logs", nargs="+", type=Path, help="run logs of pad-decoding bench (*.runs.jsonl)")
    ap.add_argument("--task", help="gsm8k or humaneval (default: read from the logs' names)")
    ap.add_argument("--split", default="dev")
    ap.add_argument("--data", help="JSONL file of the task (default: the data folder, see pad.evaluation.tasks)")
    ap.add_argument("--limit", type=int, required=True, help="the first N problems of the split")
    ap.add_argument("--start", type=int, default=0, help="skip the problems before this index (as pad-decoding bench)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--max-new-tokens", type=int, default=512)
    ap.add_argument("--batch-size", type=int, default=1)
    ap.add_argument("--classifier", help="checksum of the pivot policies' classifier (default: the shipped one); "
                                         "comma-separated, several (the drafters' logs, each judged by its own)")
    ap.add_argument("--temperature", type=float, default=0.0, help="the sampled runs at this temperature (0: greedy)")
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--seeds", default="0", help="with --temperature: the seeds pooled (comma-separated)")
    ap.add_argument("--reference", default=None, help="the policy the accuracy differences are against (default: "
                                                      "target when greedy, exact when sampling)")
    ap.add_argument("--choose", help="comma-separated rules (kl,topk,...): end with the line 'chosen: ...' of "
                                     "their settings picked against --reference (see choose)")
    ap.add_argument("--per-rule", type=int, default=1, help="with --choose: settings per rule")
    ap.add_argument("--out", type=Path, help="folder for the table (.md, .csv) and the figure (.png)")
    ap.add_argument("--stem", help="file name stem (default: <task>_<split>_<limit>_frontier_<dtype>; with "
                    "--start, <start>-<last> in place of <limit>)")
    args = ap.parse_args(argv)
    task = args.task or args.logs[0].name.split("_")[0]
    classifier = args.classifier
    if classifier is None:
        from pad.models.registry import DEFAULT_DRAFT, DEFAULT_TARGET, shipped_classifier
        from pad.models.classifier import PivotClassifier

        classifier = PivotClassifier.load(shipped_classifier(DEFAULT_TARGET, DEFAULT_DRAFT)).checksum()
    classifiers = tuple(classifier.split(","))
    records = [r for log in args.logs for r in jsonl.read(log)]
    if not 0 <= args.start < args.limit:
        ap.error(f"--start must be at least 0 and below --limit ({args.limit}), got {args.start}")
    problems = [p.id for p in tasks.load(task, args.split, args.data, limit=args.limit)[args.start:]]
    if not problems:
        ap.error(f"the {task} {args.split} data has no problems from index {args.start} on")
    span = f"{args.start}-{args.start + len(problems) - 1}"
    sampling = (args.temperature, args.top_p) if args.temperature > 0 else None
    seeds = tuple(int(s) for s in args.seeds.split(",")) if sampling else (None,)
    reference = args.reference or ("exact" if sampling else "target")
    if args.per_rule < 1:
        ap.error(f"--per-rule must be at least 1, got {args.per_rule}")
    try:
        complete, partial, machines = collect(records, problems, dtype=args.dtype, max_new_tokens=args.max_new_tokens,
                                              batch_size=args.batch_size, classifiers=classifiers, sampling=sampling,
                                              seeds=seeds)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if not complete:
        print(f"no policy has runs of all {len(problems)} problems in these logs; found: {partial}", file=sys.stderr)
        return 1
    # The reference by its row label ("exact K=8") or its policy, when that is at one K only.
    matches = [_label(*key) for key in complete if reference in (key[0], _label(*key))]
    if len(matches) != 1:
        print(f"the reference {reference} names {len(matches)} complete rows ({', '.join(matches) or 'none'}): "
              "give one row's label", file=sys.stderr)
        return 1
    reference = matches[0]
    rows = frontier_rows(complete, problems, seeds, reference)
    command = "python bench/frontier.py " + " ".join(argv if argv is not None else sys.argv[1:])
    how = (f"sampled at temperature {args.temperature:g}, top-p {args.top_p:g}, seeds {args.seeds} (fly is greedy "
           "by definition: no row)" if sampling else "greedy")
    header = (f"{task} {args.split}, problems {span}, {args.dtype}, max {args.max_new_tokens} new "
              f"tokens, {how}, batches of {args.batch_size}; pivot classifier {', '.join(classifiers)}\n\n"
              f"Command: `{command}`\n\nMachines: " + "; ".join(sorted(machines)))
    if partial:
        header += "\n\nIncomplete, not listed: " + ", ".join(f"{k} ({n}/{len(problems) * len(seeds)})"
                                                          for k, n in partial.items())
    print(bench.markdown(rows, header))
    if args.out:
        stem = args.stem or (f"{task}_{args.split}_{span if args.start else len(problems)}_frontier_{args.dtype}"
                             + (f"_t{args.temperature:g}" if sampling else ""))
        for path in bench.write(rows, args.out, stem, header, plot=True):
            print(f"wrote {path}")
    if args.choose:
        try:
            print("chosen: " + ",".join(choose(rows, args.choose.split(","), args.per_rule, reference)))
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
