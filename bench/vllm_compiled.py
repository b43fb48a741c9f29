"""vLLM with pad's pivot policy, eager against compiled (torch.compile of the target, vLLM's default), on CPUs.

The default pair (index-gguf weights), GSM8K dev problems, greedy, the draft_model speculator, both engines in
this process one after the other, each warmed up on two prompts first; prints tokens/s, acceptance and
whether the two engines wrote the same tokens. Run with vLLM's CPU build, nothing else running:

    python bench/vllm_compiled.py --limit 8 --batch-size 8 --max-new-tokens 128
"""
from __future__ import annotations

import argparse
import gc
import os
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process: its counters
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")

from pad.evaluation import tasks  # noqa: E402
from pad.machine import machine_line  # noqa: E402
from pad.models import registry  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--limit", type=int, default=8, help="GSM8K dev problems 0 .. limit-1")
    parser.add_argument("--batch-size", type=int, default=8, help="vLLM's max_num_seqs")
    parser.add_argument("-k", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--policy", default="pivot@0.3")
    args = parser.parse_args(argv)
    from pad.serving import engine as vllm_engine

    target = registry.resolve(registry.DEFAULT_TARGET, source="index-gguf")
    draft = registry.resolve(registry.DEFAULT_DRAFT, source="index-gguf")
    tokenizer = registry.load_tokenizer(registry.DEFAULT_TARGET, source="index-gguf")
    _, prompts, _ = tasks.prompted_problems(tokenizer, "gsm8k", "dev", start=0, limit=args.limit)
    print(f"GSM8K dev 0-{args.limit - 1}, {args.dtype}, K={args.k}, max_num_seqs {args.batch_size}, "
          f"{args.max_new_tokens} new tokens, greedy, {args.policy}; {machine_line()}")
    tokens = {}
    for mode, eager in (("eager", True), ("compiled", False)):
        start = time.perf_counter()
        llm = vllm_engine.engine(target, draft, num_draft_tokens=args.k, dtype=args.dtype,
                                 pad={"policy": args.policy, "classifier": "shipped"}, enforce_eager=eager,
                                 max_num_seqs=args.batch_size, max_model_len=2048)
        vllm_engine.generate(llm, prompts[:2], max_tokens=16)
        ready = time.perf_counter() - start
        before = vllm_engine.speculation_counts(llm)
        start = time.perf_counter()
        out = vllm_engine.generate(llm, prompts, max_tokens=args.max_new_tokens)
        seconds = time.perf_counter() - start
        counts = vllm_engine.speculation_counts(llm) - before
        tokens[mode] = out
        n = sum(map(len, out))
        print(f"{mode}: start and warm-up {ready:.0f} s; {n} tokens in {seconds:.1f} s = {n / seconds:.2f} tokens/s; "
              f"acceptance {counts.acceptance:.1%}")
        del llm
        gc.collect()
    same = sum(a == b for a, b in zip(tokens["eager"], tokens["compiled"]))
    print(f"same tokens on {same} of {len(prompts)} problems")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
