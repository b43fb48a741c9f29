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
        --dtype bfloat16 --threads 2 --out bench/results/label_chain_gsm8k_train_7100-7163_bfloat16.jsonl
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from pad.evaluation import tasks
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
    from pad.evaluation.bench import share_with_interval

    def right(subset):  # the share of right texts in subset
        return share_with_interval(sum(r["correct"] for r in subset), len(subset))

    def wrong(subset):
        return share_with_interval(sum(not r["correct"] for r in subset), len(subset))

    start = {r["problem"]: r["correct"] for r in rows if r["round"] == 0}
    before = {(r["problem"], r["round"]): r["correct"] for r in rows}
    # Rounds 1 on: (right in round 0, right the round before, row).
    steps = [(start[r["problem"]], before[(r["problem"], r["round"] - 1)], r) for r in rows if r["round"] > 0]
    lines = ["| round | texts | right (right in round 0) | right (wrong in round 0) | right -> wrong | wrong -> right |",
             "|---|---|---|---|---|---|"]
    for rnd in range(max((r["round"] for r in rows), default=-1) + 1):
        now = [r for r in rows if r["round"] == rnd]
        cells = [str(rnd), str(len(now)), right([r for r in now if start[r["problem"]]]),
                 right([r for r in now if not start[r["problem"]]])]
        here = [(was, r) for _, was, r in steps if r["round"] == rnd]
        cells += [wrong([r for was, r in here if was]), right([r for was, r in here if not was])] if rnd else ["", ""]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", f"Rounds 1 on, pooled: right -> wrong {wrong([r for _, was, r in steps if was])}, "
                  f"wrong -> right {right([r for _, was, r in steps if not was])}."]
    for name, first in (("right", True), ("wrong", False)):
        mine = [(was, r) for s0, was, r in steps if s0 == first]
        lines.append(f"Problems {name} in round 0: right -> wrong {wrong([r for was, r in mine if was])}, "
                     f"wrong -> right {right([r for was, r in mine if not was])}.")
    for name, keep in ((f">= {tau:g}", lambda p: p >= tau), (f"< {tau:g}", lambda p: p < tau)):
        lines.append(f"Accepted mismatches with p_target(token) {name} on right texts: right -> wrong "
                     f"{wrong([r for _, was, r in steps if was and keep(r['token_prob'])])}.")
    last = {}
    for r in rows:
        if r["round"] >= last.get(r["problem"], r)["round"]:
            last[r["problem"]] = r
    derailed = {r["problem"] for r in rows if start[r["problem"]] and not r["correct"]}
    lines.append(f"Problems right in round 0 that were ever wrong: {len(derailed)}; right in their last round: "
                 f"{sum(last[p]['correct'] for p in derailed)}.")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    tasks.add_problem_arguments(ap, start=7100, limit=7164)  # default: past the labeled problems
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
    from pad import machine
    from pad.models.registry import DEFAULT_DRAFT, DEFAULT_TARGET, load

    if args.threads:
        torch.set_num_threads(args.threads)
    target, tokenizer = load(DEFAULT_TARGET, dtype=args.dtype)
    draft, _ = load(DEFAULT_DRAFT, dtype=args.dtype)
    use_gqa_sdpa(target, fused_cpu=True)  # the labeler's attention
    problems, prompts, outcomes = tasks.prompted_problems(tokenizer, args.task, args.split, args.data, args.start,
                                                          args.limit)
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
