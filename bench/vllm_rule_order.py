"""Does a row's place on a shared engine move its tokens/s? One vLLM engine, requests choosing their rule.

``vllm_side_by_side.py --ngram`` times "vllm ngram exact" and then "vllm ngram pivot@0.3" on one ngram engine
(a second engine after an ngram one fails to start in vLLM 0.32's CPU build), whose default is pivot@0.3 with
the shipped classifier, as here. This script times the rules on
one such engine in turn, several rounds, so that a rule's speed and the order it ran in can be told apart.
Run with vLLM's CPU build, nothing else running:

    python bench/vllm_rule_order.py --task humaneval --limit 16 --batch-size 4 --rounds 2
"""
from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process: its counters
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")

from pad.evaluation import tasks  # noqa: E402
from pad.machine import machine_line  # noqa: E402
from pad.models import registry  # noqa: E402
from vllm_side_by_side import NGRAM  # noqa: E402  (the same ngram settings as the side-by-side table)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--task", default="humaneval", choices=tasks.SCORED)
    parser.add_argument("--limit", type=int, default=16, help="dev problems 0 .. limit-1")
    parser.add_argument("--batch-size", type=int, default=4, help="vLLM's max_num_seqs")
    parser.add_argument("-k", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--policies", default="exact,pivot@0.3", help="the rules, timed in this order each round")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args(argv)
    from pad.serving import engine as vllm_engine

    policies = args.policies.split(",")
    target = registry.resolve(registry.DEFAULT_TARGET, source="index-gguf")
    tokenizer = registry.load_tokenizer(registry.DEFAULT_TARGET, source="index-gguf")
    _, prompts, _ = tasks.prompted_problems(tokenizer, args.task, "dev", start=0, limit=args.limit)
    print(f"{args.task} dev 0-{args.limit - 1}, {args.dtype}, ngram {NGRAM}, K={args.k}, max_num_seqs "
          f"{args.batch_size}, {args.max_new_tokens} new tokens, greedy; {machine_line()}", flush=True)
    llm = vllm_engine.engine(target, None, speculator="ngram", speculator_args=NGRAM, num_draft_tokens=args.k,
                             pad={"policy": "pivot@0.3", "classifier": "shipped"}, dtype=args.dtype,
                             max_num_seqs=args.batch_size, max_model_len=2048)
    vllm_engine.generate(llm, prompts[:2], max_tokens=16)
    for round_ in range(1, args.rounds + 1):
        for policy in policies:
            extra = [{"pad": {"policy": policy}}] * len(prompts)
            before = vllm_engine.speculation_counts(llm)
            start = time.perf_counter()
            outputs = vllm_engine.generate(llm, prompts, max_tokens=args.max_new_tokens, extra_args=extra)
            seconds = time.perf_counter() - start
            counts = vllm_engine.speculation_counts(llm) - before
            tokens = sum(map(len, outputs))
            print(f"round {round_} {policy}: {tokens} tokens in {seconds:.1f} s = {tokens / seconds:.2f} tokens/s, "
                  f"acceptance {counts.acceptance:.1%}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
