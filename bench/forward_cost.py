"""How a target forward's cost grows with the tokens it scores: the number that decides whether
speculative decoding pays on a machine (verification feeds K+1 tokens per forward).

    python bench/forward_cost.py [--model NAME] [--dtype bfloat16] [--max-tokens 8]

Prints the median time of a forward over n new tokens (after a 64-token prefix) and its ratio to n = 1.
"""
import argparse
import platform
import statistics
import time

import torch

from pad.hf import crop_cache
from pad.registry import DEFAULT_TARGET, load


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_TARGET)
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    model, _ = load(args.model, dtype=args.dtype)
    print(f"{args.model} {args.dtype} | torch {torch.__version__} | {platform.processor() or platform.machine()}, "
          f"{torch.get_num_threads()} threads | CPU capability {torch.backends.cpu.get_cpu_capability()}")
    print("| new tokens | median ms | x one token |\n|---|---|---|")
    g = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        cache = model(torch.randint(0, 1000, (1, 64), generator=g), use_cache=True).past_key_values
        base = None
        for n in range(1, args.max_tokens + 1):
            times = []
            for _ in range(args.repeats):
                ids = torch.randint(0, 1000, (1, n), generator=g)
                start = time.perf_counter()
                model(ids, past_key_values=cache, use_cache=True, logits_to_keep=n)
                times.append(time.perf_counter() - start)
                crop_cache(cache, 64)
            median = statistics.median(times)
            base = base or median
            print(f"| {n} | {median * 1e3:.1f} | {median / base:.2f} |")


if __name__ == "__main__":
    main()
