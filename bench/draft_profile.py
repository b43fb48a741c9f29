"""Where a draft model's time goes while it drafts: K one-token steps of the draft as ``ModelDrafter`` runs them
(``Decoder`` forwards, argmax), as loaded (SDPA, transformers' cache) and as ``--fast-draft`` runs it (int8
weights, or ``--weights int4``; pad's fused attention; the lean forward; a cache that grows in place), profiled
with torch.profiler.

    python bench/draft_profile.py [--batch 1,16] [--prefix 512] [--steps 8] [--rows 8] [--weights int4]

Per batch size and configuration: milliseconds per draft step (median over blocks, unprofiled), then the draft
steps of two more blocks under the profiler (the prefill left out): the top ATen operators by self CPU time,
milliseconds per step, and the rest of a step's wall time, which no ATen operator took (Python, transformers'
code, and pad's fused attention, a C++ call outside ATen's dispatcher). With B > 1 the rows are ragged (left
padding), so the draft's forwards carry an attention mask, as in a batch.
"""
import argparse
import contextlib
import copy
import statistics
import time

import torch

from pad.decoding.decoder import Decoder
from pad.decoding.fast_draft import FAST_WEIGHTS, WEIGHTS, use_fast_draft
from pad.models.registry import DEFAULT_DRAFT, load


def blocks(model, rows: int, prefix: int, steps: int, grow: bool, repeats: int, profile: bool = False):
    """Median ms per draft step over ``repeats`` blocks of ``steps`` steps after a ``prefix``-column prefill, and
    with ``profile`` the profiler that watched the steps (else None)."""
    g = torch.Generator().manual_seed(0)
    decoder = Decoder(model, model.config.vocab_size, rows, grow_in_place=grow)
    fed = torch.ones(rows, prefix, dtype=torch.bool)
    fed[1:, : prefix // 10] = False  # ragged rows: left padding
    times = []
    with torch.inference_mode():
        decoder.forward(torch.randint(0, 1000, (rows, prefix), generator=g), fed, 1)
        watch = (torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) if profile
                 else contextlib.nullcontext())
        with watch:
            for _ in range(repeats):
                ids, one = torch.randint(0, 1000, (rows, 1), generator=g), torch.ones(rows, 1, dtype=torch.bool)
                start = time.perf_counter()
                for _ in range(steps):
                    ids = decoder.forward(ids, one, 1)[:, -1].argmax(-1, keepdim=True)
                times.append((time.perf_counter() - start) / steps)
                decoder.drop(torch.ones(rows, steps, dtype=torch.bool))  # rejected: the next block starts alike
    return statistics.median(times) * 1e3, watch if profile else None


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--draft", default=DEFAULT_DRAFT)
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--batch", default="1,16")
    parser.add_argument("--prefix", type=int, default=512)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--rows", type=int, default=8, help="operators listed per profile")
    parser.add_argument("--weights", choices=WEIGHTS, default=FAST_WEIGHTS, help="the fast draft's weights")
    args = parser.parse_args()
    loaded, _ = load(args.draft, dtype=args.dtype)
    fast = copy.deepcopy(loaded)
    use_fast_draft(fast, weights=args.weights)
    print(f"{args.draft} {args.dtype}, {torch.get_num_threads()} threads, CPU capability "
          f"{torch.backends.cpu.get_cpu_capability()}; {args.prefix}-column prefix, blocks of {args.steps} steps")
    for rows in [int(b) for b in args.batch.split(",")]:
        for name, model, grow in (("as loaded", loaded, False), (f"--fast-draft, {args.weights}", fast, True)):
            blocks(model, rows, args.prefix, args.steps, grow, 1)  # warm-up
            ms, _ = blocks(model, rows, args.prefix, args.steps, grow, args.repeats)
            profiled, prof = blocks(model, rows, args.prefix, args.steps, grow, 2, profile=True)
            events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
            per_step = [(e.key, e.self_cpu_time_total / 1e3 / (2 * args.steps), e.count / (2 * args.steps))
                        for e in events]
            print(f"\nB = {rows}, draft {name}: {ms:.1f} ms a draft step ({profiled:.1f} ms profiled)")
            print("| operator | ms per step | calls per step |\n|---|---|---|")
            for key, op_ms, calls in per_step[: args.rows]:
                print(f"| `{key}` | {op_ms:.2f} | {calls:.0f} |")
            print(f"| no ATen operator (Python, transformers, pad's attention kernel) | "
                  f"{profiled - sum(m for _, m, _ in per_step):.2f} | |")


if __name__ == "__main__":
    main()
