"""How often a search label's continuation changes the answer by itself: null continuations.

A search decision puts the draft token at position t of the current text and lets the target continue
greedily; a changed answer makes the token a pivot. The continuation is computed by other forwards than
the text it branches from (a join forward of two tokens, then rows of another batch), and in bf16 a
near-tied argmax can go the other way, so some answers would change without any draft token. Here each
problem's greedy text is continued, exactly as the labeler continues it, from random positions with the
text's *own* token in place of the draft's: every changed answer is the numerics' doing, and their share
is the floor under the pivot rate of the labels (about a quarter of the decisions for the default pair).

    python bench/label_noise.py --task gsm8k --split train --start 7100 --limit 7164 --positions 3 \\
        --dtype bfloat16 --threads 2
"""
from __future__ import annotations

import argparse
import random
import sys
import time

import torch

from pad.evaluation import tasks
from pad.pivots.continuations import Continuations, Job


@torch.inference_mode()
def null_continuations(target, vocab: int, eos: set[int], prompts: list[list[int]], outcomes: list, *,
                       positions: int, max_new_tokens: int, batch: int, seed: int = 0, layer: int = -8,
                       progress: bool = True) -> list[dict]:
    """Decode each prompt's greedy text, then continue it from ``positions`` random positions t (seeded) with
    its own token at t, as the search labeler continues a decision (``pad.pivots.continuations``; lookahead 0).

    prompts: token ids per problem; outcomes: tokens -> (answer key, correct) per problem.
    -> one dict per continuation: problem, position, text_length, same_text, same_answer, correct_before.
    """
    from tqdm.auto import tqdm

    rng = random.Random(seed)
    engine = Continuations(target, vocab, eos, layer, batch, lookahead=0)
    texts: dict[int, tuple[list[int], tuple]] = {}  # problem -> (greedy text, its outcome)
    out = []
    for i, prompt in enumerate(prompts):
        engine.submit(Job(key=(i, None), prefix=None, first=prompt, budget=max_new_tokens))
    bar = tqdm(total=len(prompts), desc="greedy texts, then null continuations", unit="text", disable=not progress)
    try:
        while engine.busy:
            for done in engine.step():
                i, t = done.job.key
                bar.update(1)
                if t is None:
                    text = done.job.generated
                    texts[i] = (text, outcomes[i](text))
                    # t <= len - 2: the continuation feeds [token t - 1, token t] after the cached columns
                    # before t - 1, which the greedy job's cache holds (all but its last token).
                    spots = rng.sample(range(len(text) - 1), min(positions, max(0, len(text) - 1)))
                    bar.total += len(spots)
                    full = prompts[i] + text
                    for t in spots:
                        n = len(prompts[i]) + t - 1
                        prefix = None if n == 0 else tuple([x[:, :n] for x in part] for part in done.cache)
                        engine.submit(Job(key=(i, t), prefix=prefix, first=[full[n], full[n + 1]],
                                          budget=max_new_tokens - t - 1))
                else:
                    text, (key, correct) = texts[i]
                    new = text[: t + 1] + done.job.generated
                    out.append({"problem": i, "position": t, "text_length": len(text), "same_text": new == text,
                                "same_answer": outcomes[i](new)[0] == key, "correct_before": bool(correct)})
    finally:
        engine.close()
        bar.close()
    return sorted(out, key=lambda r: (r["problem"], r["position"]))


def summary(rows: list[dict]) -> str:
    """Shares of changed texts and answers, with exact 95% intervals, overall and by the text's correctness."""
    from pad.evaluation.bench import share_with_interval

    def share(subset, key):
        return share_with_interval(sum(not r[key] for r in subset), len(subset))

    lines = ["| continuations | text changed | answer changed |", "|---|---|---|"]
    for name, subset in (("all", rows), ("text right", [r for r in rows if r["correct_before"]]),
                         ("text wrong", [r for r in rows if not r["correct_before"]])):
        lines.append(f"| {name} | {share(subset, 'same_text')} | {share(subset, 'same_answer')} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    tasks.add_problem_arguments(ap, start=7100, limit=7164)  # default: past the labeled problems
    ap.add_argument("--positions", type=int, default=3, help="null continuations per text")
    ap.add_argument("--max-new-tokens", type=int, default=512)
    ap.add_argument("--batch", type=int, default=64, help="continuation rows decoded together")
    ap.add_argument("--target", default=None, help="registry name or folder (default: the default target)")
    ap.add_argument("--draft", default=None, help="registry name or folder (default: the default draft); only its "
                    "vocabulary is used: continuations pick tokens from the range both models score, as the labeler's")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--threads", type=int)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.positions < 1 or not 0 <= args.start < args.limit:
        ap.error("need --positions >= 1 and 0 <= --start < --limit")

    from pad.decoding.attention import use_gqa_sdpa
    from pad.decoding.hf import eos_ids, shared_vocab_size
    from pad import machine
    from pad.models.registry import DEFAULT_DRAFT, DEFAULT_TARGET, load

    if args.threads:
        torch.set_num_threads(args.threads)
    target, tokenizer = load(args.target or DEFAULT_TARGET, dtype=args.dtype)
    draft, _ = load(args.draft or DEFAULT_DRAFT, dtype=args.dtype)
    vocab = shared_vocab_size(target, draft)
    del draft
    use_gqa_sdpa(target, fused_cpu=True)  # the labeler's attention
    problems, prompts, outcomes = tasks.prompted_problems(tokenizer, args.task, args.split, args.data, args.start,
                                                          args.limit)
    began = time.perf_counter()
    rows = null_continuations(target, vocab, eos_ids(target, None), prompts, outcomes,
                              positions=args.positions, max_new_tokens=args.max_new_tokens, batch=args.batch,
                              seed=args.seed)
    print(f"{args.task} {args.split} {args.start}-{args.limit - 1}, {args.dtype}, {args.positions} null continuations "
          f"a text, batch {args.batch}, {time.perf_counter() - began:.0f} s; {machine.machine_line()}\n")
    print(summary(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
