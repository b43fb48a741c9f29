"""Do rejections cluster, and would a draft-length choice that knows it be faster?

`-k auto` (pad.decoding.draft_length) predicts a block's tokens as if each draft were accepted independently
at the row's mean rate. This script measures what that assumption leaves on the table, on the target's own
greedy texts: it teacher-forces the target and the draft over each logged target reply (a bench run log's
``target`` rows), marks where the draft's greedy token equals the target's (what exact acceptance accepts),
and prints

- the agreement by age, the tokens since the last disagreement (clustering shows as lower agreement just
  after one);
- simulated tokens per unit of time, decoding those series in blocks, for every fixed K, for the K auto's
  model picks (independent tokens at the mean rate) and for the best K per block given the age (agreement by
  age known in hindsight: a bound on what any clustering-aware model could gain). A block of K drafts costs
  ``1 + target_slope * K`` target forwards plus ``K * draft_cost`` (B = 1: a draft forward per draft token).

    PAD_WEIGHTS=index-gguf python bench/acceptance_clusters.py bench/results/humaneval_dev_k8_bfloat16.runs.jsonl \
        --task humaneval --limit 80
"""
from __future__ import annotations

import argparse
import json

import numpy as np
import torch
from tqdm.auto import tqdm

from pad.decoding.draft_length import expected_tokens
from pad.evaluation import tasks
from pad.models import registry

AGES = 16  # ages beyond this are pooled


def agreement_series(task: str, log: str, limit: int, dtype: str) -> list[np.ndarray]:
    """Per problem [T] bool: the draft's greedy token equals the target's, along the target's greedy reply
    (cut where the logged reply first departs from the target's argmax: bf16 batch effects)."""
    problems = {p.id: p for p in tasks.load(task, "dev", limit=limit)}
    replies = {}
    for line in open(log):
        r = json.loads(line)
        if r["policy"] == "target" and r["problem"] in problems and "reply" in r:
            replies.setdefault(r["problem"], r["reply"])
    target, tokenizer = registry.load(registry.DEFAULT_TARGET, dtype=dtype)
    draft, _ = registry.load(registry.DEFAULT_DRAFT, dtype=dtype)
    out = []
    with torch.no_grad():
        for pid, text in tqdm(replies.items(), desc="teacher-force", unit="problem"):
            prompt = tasks.prompt_ids(tokenizer, task, problems[pid])[0]
            reply = torch.tensor(tokenizer.encode(text, add_special_tokens=False), dtype=prompt.dtype)
            ids = torch.cat([prompt, reply])[None]
            t = target(ids).logits[0, len(prompt) - 1 : -1].argmax(-1)
            d = draft(ids).logits[0, len(prompt) - 1 : -1].argmax(-1)
            greedy = int((t == reply).long().cumprod(0).sum())
            out.append((d == t)[:greedy].numpy())
    return out


def by_age(series: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """(agreement, count) [AGES + 1] by tokens since the last disagreement (index AGES: that many or more, and
    the reply's start)."""
    agree, count = np.zeros(AGES + 1), np.zeros(AGES + 1)
    for x in series:
        age = AGES
        for v in x:
            agree[age] += v
            count[age] += 1
            age = min(age + 1, AGES) if v else 1
    return agree / np.maximum(count, 1), count


def simulate(series: list[np.ndarray], choose, cost) -> float:
    """Tokens per unit of time decoding every series in blocks of ``choose(age)`` drafts."""
    tokens = seconds = 0.0
    for x in series:
        p, age = 0, AGES
        while p < len(x):
            k = min(choose(age), len(x) - p - 1)
            n = 0
            while n < k and x[p + n]:
                n += 1
            tokens += n + 1
            seconds += cost(k)
            age = 1 if n < k else min(age + n + 1, AGES)
            p += n + 1
    return tokens / seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("log", help="a bench run log with target rows")
    ap.add_argument("--task", required=True)
    ap.add_argument("--limit", type=int, default=80)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--draft-cost", type=float, default=0.42, help="a draft token's forward, in target forwards")
    ap.add_argument("--target-slope", type=float, default=0.01, help="a target forward's cost per extra token")
    ap.add_argument("--max-k", type=int, default=12)
    args = ap.parse_args()

    series = agreement_series(args.task, args.log, args.limit, args.dtype)
    rate, count = by_age(series)
    print(f"{len(series)} replies, {sum(map(len, series))} tokens, agreement {np.concatenate(series).mean():.3f}\n")
    print("| tokens since the last disagreement | " + " | ".join(map(str, range(1, AGES))) + f" | {AGES}+ |")
    print("|---" * (AGES + 1) + "|")
    print("| agreement | " + " | ".join(f"{r:.3f}" for r in rate[1:]) + " |")
    print("| tokens | " + " | ".join(str(int(c)) for c in count[1:]) + " |\n")

    def cost(k):
        return 1.0 + k * (args.target_slope + args.draft_cost) if k else 1.0

    def best(expected):
        return max(range(args.max_k + 1), key=lambda k: expected(k) / cost(k))

    mean = float(np.concatenate(series).mean())
    independent = best(lambda k: expected_tokens(mean, k))

    def aged_expected(age, k):
        e = p = 1.0
        for j in range(k):
            p *= rate[min(age + j, AGES)]
            e += p
        return e

    per_age = {age: best(lambda k, age=age: aged_expected(age, k)) for age in range(1, AGES + 1)}
    rows = [(f"fixed K = {k}", simulate(series, lambda age, k=k: k, cost)) for k in range(2, args.max_k + 1, 2)]
    rows.append((f"auto's model (independent at {mean:.3f}): K = {independent}",
                 simulate(series, lambda age: independent, cost)))
    rows.append(("by age, in hindsight: K = " + ",".join(str(per_age[a]) for a in range(1, AGES + 1)),
                 simulate(series, per_age.__getitem__, cost)))
    top = max(r for _, r in rows)
    print(f"draft cost {args.draft_cost}, target slope {args.target_slope} per token\n")
    print("| choice | tokens per target-forward time | x the best |\n|---|---|---|")
    for name, r in rows:
        print(f"| {name} | {r:.3f} | {r / top:.3f} |")


if __name__ == "__main__":
    main()
