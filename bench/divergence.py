"""Where each lost problem's reply first leaves the target's, from a ``pad-decoding bench`` run log: for every
problem the target alone solves and a policy does not, the first token at which the policy's reply differs
from the target's, with the target's own probabilities of both tokens there (one fp32 forward over the
prompt and the common prefix) and whether the policy's token and the next one occur together earlier in
the context (a copy, as a lookup proposes). A near tie (both tokens about equally likely) is the rounding
of bf16 forwards taking the other branch; a policy token the target gives little probability is a draft
its rule accepted against the target.

    python bench/divergence.py LOG --task gsm8k --policies exact/model,pivot@0.3/hybrid --weights index-gguf

Replies are retokenized from their text, so a divergence inside a word that tokenizes differently on its
own is reported at the nearest token boundary.
"""
import argparse
from collections import defaultdict
from pathlib import Path

import torch

from paired import row_name  # bench/, this script's folder: pivot's rows by who judges draft-free proposals
from pad import jsonl
from pad.evaluation import tasks
from pad.models.registry import load


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first index where token lists a and b differ (None: one is a prefix of the other)."""
    return next((j for j in range(min(len(a), len(b))) if a[j] != b[j]), None)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("log")
    parser.add_argument("--task", default="gsm8k", choices=["gsm8k", "humaneval"], help="the log's task")
    parser.add_argument("--split", default="dev", help="the log's split")
    parser.add_argument("--policies", required=True, help="comma-separated rows of the log (bench/paired.py's "
                                                          "names: a pivot row that judged lookup proposals "
                                                          "is 'POLICY --judge-free')")
    parser.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--weights", default=None, help="where the target's weights come from (pad.models.registry)")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    runs: dict[str, dict[str, dict]] = defaultdict(dict)
    for r in jsonl.read(Path(args.log)):
        runs[row_name(r)][r["problem"]] = r
    policies = args.policies.split(",")
    for p in ["target", *policies]:
        if p not in runs:
            raise SystemExit(f"{args.log} has no runs of {p!r}; it has {', '.join(sorted(runs))}")
    model, tokenizer = load(args.target, dtype="float32", source=args.weights)
    problems = {p.id: p for p in tasks.load(args.task, args.split)}
    print("| policy | problem | token | target's token (p) | policy's token (p) | copy |")
    print("|---|---|---|---|---|---|")
    for policy in policies:
        for pid in problems:  # in file order
            t, r = runs["target"].get(pid), runs[policy].get(pid)
            if t is None or r is None or not (t["correct"] and not r["correct"]):
                continue
            a = tokenizer(t["reply"], add_special_tokens=False).input_ids
            b = tokenizer(r["reply"], add_special_tokens=False).input_ids
            i = first_difference(a, b)
            if i is None:
                continue
            ids = torch.cat([tasks.prompt_ids(tokenizer, args.task, problems[pid])[0],
                             torch.tensor(a[:i], dtype=torch.long)])
            with torch.no_grad():
                probs = model(ids[None]).logits[0, -1].float().softmax(-1)
            context = ids.tolist()
            copy = any(context[j:j + 2] == b[i:i + 2] for j in range(len(context) - 1))
            target_token, policy_token = (repr(tokenizer.decode(x[i])).replace("|", "\\|") for x in (a, b))
            print(f"| {policy} | {pid} | {i} | {target_token} ({probs[a[i]]:.4f}) | {policy_token} ({probs[b[i]]:.4f}) "
                  f"| {'yes' if copy else 'no'} |")


if __name__ == "__main__":
    main()
