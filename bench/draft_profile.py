"""Where a draft model's time goes while it drafts: K one-token steps of the draft as ``ModelDrafter`` runs them
(``Decoder`` forwards, argmax), as loaded (SDPA, transformers' cache) and as ``--fast-draft`` runs it (int8
weights, the pruned head, pad's fused attention, a cache that grows in place), profiled with torch.profiler.

    python bench/draft_profile.py [--batch 1,16] [--prefix 512] [--steps 8] [--rows 8]

Per batch size and configuration: milliseconds per draft step (median over blocks, unprofiled) and the
profile's top operators by self CPU time with their share. With B > 1 the rows are ragged (left padding), so
the draft's forwards carry an attention mask, as in a batch.
"""
import argparse
import copy
import statistics
import time

import torch

from pad.decoding.decoder import Decoder
from pad.decoding.fast_draft import use_fast_draft
from pad.models.registry import DEFAULT_DRAFT, load


def blocks(model, rows: int, prefix: int, steps: int, grow: bool, repeats: int, profiler=None) -> float:
    """Median ms per draft step over ``repeats`` blocks of ``steps`` steps after a ``prefix``-column prefill."""
    g = torch.Generator().manual_seed(0)
    decoder = Decoder(model, model.config.vocab_size, rows, grow_in_place=grow)
    fed = torch.ones(rows, prefix, dtype=torch.bool)
    fed[1:, : prefix // 10] = False  # ragged rows: left padding
    times = []
    with torch.inference_mode():
        decoder.forward(torch.randint(0, 1000, (rows, prefix), generator=g), fed, 1)
        for _ in range(repeats):
            ids, one = torch.randint(0, 1000, (rows, 1), generator=g), torch.ones(rows, 1, dtype=torch.bool)
            start = time.perf_counter()
            for _ in range(steps):
                ids = decoder.forward(ids, one, 1)[:, -1].argmax(-1, keepdim=True)
                if profiler is not None:
                    profiler.step()
            times.append((time.perf_counter() - start) / steps)
            decoder.drop(torch.ones(rows, steps, dtype=torch.bool))  # rejected: the next block starts alike
    return statistics.median(times) * 1e3


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--draft", default=DEFAULT_DRAFT)
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--batch", default="1,16")
    parser.add_argument("--prefix", type=int, default=512)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--rows", type=int, default=8, help="operators listed per profile")
    args = parser.parse_args()
    loaded, _ = load(args.draft, dtype=args.dtype)
    fast = copy.deepcopy(loaded)
    use_fast_draft(fast)
    print(f"{args.draft} {args.dtype}, {torch.get_num_threads()} threads, CPU capability "
          f"{torch.backends.cpu.get_cpu_capability()}; {args.prefix}-column prefix, blocks of {args.steps} steps")
    for rows in [int(b) for b in args.batch.split(",")]:
        for name, model, grow in (("as loaded", loaded, False), ("--fast-draft", fast, True)):
            blocks(model, rows, args.prefix, args.steps, grow, 1)  # warm-up
            ms = blocks(model, rows, args.prefix, args.steps, grow, args.repeats)
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                blocks(model, rows, args.prefix, args.steps, grow, 2)
            events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
            total = sum(e.self_cpu_time_total for e in events)
            print(f"\nB = {rows}, draft {name}: {ms:.1f} ms a draft step")
            print("| operator | self CPU share | calls per step |\n|---|---|---|")
            for e in events[: args.rows]:
                print(f"| `{e.key}` | {e.self_cpu_time_total / total:.1%} | {e.count / (2 * args.steps):.0f} |")


if __name__ == "__main__":
    main()
