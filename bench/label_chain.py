"""Do accepted mismatches compound? Chains of accepted draft tokens, one at a time, each continued greedily.

A search label says what one draft token does when the target then goes on greedily. Decoding accepts
several: if every accepted pivot fixed a wrong answer for good, a text's chance to stay right would fall
geometrically with the mismatches accepted; if later mismatches can steer a derailed text back, it falls
to a floor and stays there. Here each problem's greedy text (round 0) is walked as the search labeler
walks it, except that every draft token is accepted: at round r the first mismatch after the last one
(the draft teacher-forced on the current text) gets the draft's token, the target continues greedily, and
that continuation is the text of round r. The table gives per round the share of right texts, and the
transitions: right to wrong (what a label calls a pivot) and wrong back to right.

    python bench/label_chain.py --task gsm8k --split train --start 7100 --limit 7164 --rounds 8 \\
        --dtype bfloat16 --threads 2
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from pad.pivots.continuations import Continuations, Job


def draft_tokens(draft, vocab: int, prompt: list[int], text: list[int]) -> list[int]:
    """The draft's greedy token at each text position, teacher-forced on prompt + text (one forward) [len(text)]."""
    ids = torch.tensor([prompt + text[:-1]], device=next(draft.parameters()).device)
    return draft(ids).logits[0, len(prompt) - 1 :, :vocab].argmax(-1).tolist()


@torch.inference_mode()
def chains(target, draft, vocab: int, eos: set[int], prompts: list[list[int]], outcomes: list, *, rounds: int,
           max_new_tokens: int, batch: int, layer: int = -8, progress: bool = True) -> list[dict]:
    """Walk each problem's greedy text for up to ``rounds`` accepted mismatches (fewer when its text runs out
    of mismatches); continuations run as rows of one batch (``pad.pivots.continuations``, lookahead 0).

    prompts: token ids per problem; outcomes: tokens -> (answer key, correct) per problem.
    -> one dict per problem and round: problem, round (0: the greedy text), position (of the accepted
    mismatch; -1 in round 0), token_prob (p_target of the draft token; NaN in round 0), text_length,
    correct, same_answer (as the round before).
    """
    from tqdm.auto import tqdm

    engine = Continuations(target, vocab, eos, layer, batch, lookahead=0)
    texts: dict[int, list[int]] = {}
    out: list[dict] = []
    last: dict[int, dict] = {}

    def next_round(i: int, text: list[int], cache, start: int, r: int) -> None:
        if r > rounds:
            return
        tops = draft_tokens(draft, vocab, prompts[i], text)
        t = next((t for t in range(start, len(text) - 1) if tops[t] != text[t]), None)
        if t is None:  # t <= len - 2: the continuation feeds [token t - 1, draft token] after the cached columns
            return
        full, n = prompts[i] + text, len(prompts[i]) + t - 1
        prefix = None if n == 0 else tuple([x[:, :n] for x in part] for part in cache)
        engine.submit(Job(key=(i, r, t), prefix=prefix, first=[full[n], tops[t]], budget=max_new_tokens - t - 1,
                          draft_token=tops[t]))
        bar.total += 1

    for i, prompt in enumerate(prompts):
        engine.submit(Job(key=(i, 0, -1), prefix=None, first=prompt, budget=max_new_tokens))
    bar = tqdm(total=len(prompts), desc="greedy texts, then chains", unit="text", disable=not progress)
    try:
        while engine.busy:
            for done in engine.step():
                i, r, t = done.job.key
                if r == 0:
                    text = done.job.generated
                    prob = float("nan")
                else:
                    text = texts[i][:t] + [done.job.draft_token] + done.job.generated
                    prob = done.features["token_prob"]
                key, correct = outcomes[i](text)
                row = {"problem": i, "round": r, "position": t, "token_prob": prob, "text_length": len(text),
                       "correct": bool(correct), "same_answer": r == 0 or key == last[i]["key"], "key": key}
                texts[i], last[i] = text, row
                out.append(row)
                bar.update(1)
                next_round(i, text, done.cache, t + 1, r + 1)
    finally:
        engine.close()
        bar.close()
    return [{k: v for k, v in row.items() if k != "key"} for row in sorted(out, key=lambda x: (x["problem"], x["round"]))]


def summary(rows: list[dict], tau: float = 0.2) -> str:
    """Per round: texts, right ones (of the problems right and wrong in round 0), and the transitions from
    the round before, with exact 95% intervals; then the transitions of rounds 1 on pooled, split by the
    problem's round 0 and by the accepted token's p_target against ``tau``, and how many derailed problems
    that were right end right."""
    from pad.evaluation.bench import clopper_pearson

    def share(x: int, m: int) -> str:
        if not m:
            return "n/a"
        lo, hi = clopper_pearson(x, m)
        return f"{x}/{m} = {x / m:.1%} [{lo:.1%}, {hi:.1%}]"

    start = {r["problem"]: r["correct"] for r in rows if r["round"] == 0}
    prev = {(r["problem"], r["round"]): r["correct"] for r in rows}
    lines = ["| round | texts | right (right in round 0) | right (wrong in round 0) | right -> wrong | wrong -> right |",
             "|---|---|---|---|---|---|"]
    pooled = [0, 0, 0, 0]  # right->wrong, from right, wrong->right, from wrong
    for rnd in range(max((r["round"] for r in rows), default=-1) + 1):
        now = [r for r in rows if r["round"] == rnd]
        a = [r for r in now if start[r["problem"]]]
        b = [r for r in now if not start[r["problem"]]]
        cells = [str(rnd), str(len(now)), share(sum(r["correct"] for r in a), len(a)), share(sum(r["correct"] for r in b), len(b))]
        if rnd == 0:
            cells += ["", ""]
        else:
            was_right = [r for r in now if prev[(r["problem"], rnd - 1)]]
            was_wrong = [r for r in now if not prev[(r["problem"], rnd - 1)]]
            counts = [sum(not r["correct"] for r in was_right), len(was_right), sum(r["correct"] for r in was_wrong), len(was_wrong)]
            pooled = [p + c for p, c in zip(pooled, counts)]
            cells += [share(counts[0], counts[1]), share(counts[2], counts[3])]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", f"Rounds 1 on, pooled: right -> wrong {share(pooled[0], pooled[1])}, "
                  f"wrong -> right {share(pooled[2], pooled[3])}."]
    steps = [(start[r["problem"]], prev[(r["problem"], r["round"] - 1)], r) for r in rows if r["round"] > 0]
    for name, first in (("right", True), ("wrong", False)):
        was_right = [r for s0, before, r in steps if s0 == first and before]
        was_wrong = [r for s0, before, r in steps if s0 == first and not before]
        lines.append(f"Problems {name} in round 0: right -> wrong {share(sum(not r['correct'] for r in was_right), len(was_right))}, "
                     f"wrong -> right {share(sum(r['correct'] for r in was_wrong), len(was_wrong))}.")
    for name, keep in ((f">= {tau:g}", lambda p: p >= tau), (f"< {tau:g}", lambda p: p < tau)):
        derailing = [r for _, before, r in steps if before and keep(r["token_prob"])]
        lines.append(f"Accepted mismatches with p_target(token) {name} on right texts: right -> wrong "
                     f"{share(sum(not r['correct'] for r in derailing), len(derailing))}.")
    last = {}
    for r in rows:
        if r["round"] >= last.get(r["problem"], r)["round"]:
            last[r["problem"]] = r
    derailed = [p for p, ok in start.items() if ok and any(not r["correct"] for r in rows if r["problem"] == p)]
    lines.append(f"Problems right in round 0 that were ever wrong: {len(derailed)}; right in their last round: "
                 f"{sum(last[p]['correct'] for p in derailed)}.")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--task", default="gsm8k")
    ap.add_argument("--split", default="train")
    ap.add_argument("--data", help="JSONL file of the task (default: the data folder)")
    ap.add_argument("--start", type=int, default=7100, help="first problem (default: past the labeled ones)")
    ap.add_argument("--limit", type=int, default=7164, help="problems up to this index")
    ap.add_argument("--rounds", type=int, default=8, help="mismatches accepted per text at most")
    ap.add_argument("--max-new-tokens", type=int, default=512)
    ap.add_argument("--batch", type=int, default=64, help="continuation rows decoded together")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--threads", type=int)
    ap.add_argument("--out", help="also write the rows here (JSONL)")
    ap.add_argument("--summarize", metavar="FILE", help="only print the tables of rows written before with --out")
    args = ap.parse_args(argv)
    if args.summarize:
        with open(args.summarize) as f:
            print(summary([json.loads(line) for line in f if line.strip()]))
        return 0
    if args.rounds < 1 or not 0 <= args.start < args.limit:
        ap.error("need --rounds >= 1 and 0 <= --start < --limit")

    from pad.decoding.attention import use_gqa_sdpa
    from pad.decoding.hf import eos_ids, shared_vocab_size
    from pad.evaluation import machine, tasks
    from pad.models.registry import DEFAULT_DRAFT, DEFAULT_TARGET, load

    if args.threads:
        torch.set_num_threads(args.threads)
    target, tokenizer = load(DEFAULT_TARGET, dtype=args.dtype)
    draft, _ = load(DEFAULT_DRAFT, dtype=args.dtype)
    use_gqa_sdpa(target, fused_cpu=True)  # the labeler's attention
    problems = tasks.load(args.task, args.split, args.data, limit=args.limit)[args.start:]
    prompts = [tasks.prompt_ids(tokenizer, args.task, p)[0].tolist() for p in problems]
    outcomes = [lambda tokens, p=p: tasks.outcome(args.task, p, tokenizer.decode(tokens, skip_special_tokens=True))
                for p in problems]
    began = time.perf_counter()
    rows = chains(target, draft, shared_vocab_size(target, draft), eos_ids(target, None), prompts, outcomes,
                  rounds=args.rounds, max_new_tokens=args.max_new_tokens, batch=args.batch)
    if args.out:
        with open(args.out, "w") as f:
            f.writelines(json.dumps({**r, "problem": problems[r["problem"]].id, "token_prob": None if r["round"] == 0
                                     else r["token_prob"]}, allow_nan=False) + "\n" for r in rows)
    print(f"{args.task} {args.split} {args.start}-{args.limit - 1}, {args.dtype}, up to {args.rounds} accepted mismatches "
          f"a text, batch {args.batch}, {time.perf_counter() - began:.0f} s; {machine.machine_line()}\n")
    print(summary(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
