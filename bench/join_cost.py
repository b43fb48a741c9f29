"""What the search labeler's joins cost fed as one forward against fed in groups of similar inputs
(``pad.pivots.continuations.join_groups``), side by side in one run.

    python bench/join_cost.py [--dtype float32] [--threads 2] [--repeats 1]

Joins as the labeler meets them, on the default target (random tokens and random cached columns; every
job has budget 0, so a join is only its forwards):
- a new problem joining beside decisions: 7 decisions (2 tokens after 400 cached columns each) and one
  prompt of 107 tokens (the mean GSM8K train prompt);
- resumed problems, whole texts: 8 texts prefilled from scratch, the octiles' midpoints of prompt plus text
  of the 64 problems in flight in ``labels/gsm8k-train-search-fp32`` on 2026-11-27 (131 to 652 tokens,
  27,715 in all, 41,728 columns as one forward);
- resumed problems, up to their next decision: the same 8 fed as far as a resumed problem's first job
  feeds them (prompt plus text up to the position saved: 74 to 276 tokens, 10,873 in all for the 64).
Also times adding 8 rows of 300 columns to a running batch of 56 rows of 500 columns whose cache grows in
place, as the labeler's (``Decoder.add_rows``): the copy of the running cache each extra group pays.
"""
import argparse
import platform
import statistics
import time

import torch

from pad.decoding.attention import use_gqa_sdpa
from pad.decoding.decoder import Decoder
from pad.decoding.hf import eos_ids, kv_shape, text_config
from pad.machine import median_seconds
from pad.models.registry import DEFAULT_TARGET, load
from pad.pivots.continuations import JOIN_FIXED, Continuations, Job, join_groups


def _cache(model, rows: int, width: int, g) -> list[list[torch.Tensor]]:
    """Random keys and values, per layer [rows, H, width, D]."""
    layers, H, D = kv_shape(model)
    dtype = next(model.parameters()).dtype
    return [[torch.randn(rows, H, width, D, generator=g).to(dtype) for _ in range(layers)] for _ in range(2)]


def _jobs(model, scenario: str, g) -> list[Job]:
    rand = lambda n: torch.randint(0, 1000, (n,), generator=g).tolist()  # noqa: E731
    if scenario == "new problem beside decisions":
        keys, values = _cache(model, 7, 400, g)
        jobs = [Job(key=r, prefix=([k[r] for k in keys], [v[r] for v in values]), first=rand(2), budget=0)
                for r in range(7)]
        return jobs + [Job(key=7, prefix=None, first=rand(107), budget=0)]
    widths = {"resumed problems, whole texts": (275, 351, 393, 421, 440, 473, 538, 595),
              "resumed problems, up to their next decision": (102, 135, 144, 153, 168, 193, 216, 263)}[scenario]
    return [Job(key=r, prefix=None, first=rand(n), budget=0) for r, n in enumerate(widths)]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="float32", choices=("bfloat16", "float32"))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, _ = load(DEFAULT_TARGET, dtype=args.dtype)
    use_gqa_sdpa(model, fused_cpu=True)  # as the labeler runs it
    vocab, eos = text_config(model).vocab_size, eos_ids(model, None)
    print(f"{DEFAULT_TARGET} {args.dtype} | torch {torch.__version__} | {platform.processor() or platform.machine()}, "
          f"{torch.get_num_threads()} threads | CPU capability {torch.backends.cpu.get_cpu_capability()}")
    print("| join | columns fed: one forward | in groups | groups | one forward s | in groups s | ratio |")
    print("|---|---|---|---|---|---|---|")
    with torch.inference_mode():
        for scenario in ("new problem beside decisions", "resumed problems, whole texts",
                         "resumed problems, up to their next decision"):
            widths = [len(j.first) for j in _jobs(model, scenario, torch.Generator().manual_seed(0))]
            groups = join_groups(widths)
            times = []
            for fixed in (float("inf"), JOIN_FIXED):
                g = torch.Generator().manual_seed(0)

                def join():
                    engine = Continuations(model, vocab, eos, -8, 64, lookahead=0, join_fixed=fixed)
                    for job in _jobs(model, scenario, g):
                        engine.submit(job)
                    assert len(engine.step()) == len(widths)
                    engine.close()

                times.append(median_seconds(join, args.repeats))
            grouped = sum(len(grp) * max(widths[i] for i in grp) for grp in groups)
            print(f"| {scenario} | {len(widths) * max(widths)} | {grouped} | {len(groups)} | {times[0]:.1f} | "
                  f"{times[1]:.1f} | {times[0] / times[1]:.2f} |", flush=True)
        g = torch.Generator().manual_seed(1)
        running, joining = _cache(model, 56, 500, g), _cache(model, 8, 300, g)
        times = []
        for _ in range(args.repeats + 1):  # the first allocates fresh memory: not counted
            dec = Decoder(model, vocab, 0, grow_in_place=True)
            dec.add_rows(*running, torch.ones(56, 500, dtype=torch.bool))
            start = time.perf_counter()
            dec.add_rows(*joining, torch.ones(8, 300, dtype=torch.bool))
            times.append(time.perf_counter() - start)
            del dec
        print(f"\nadding 8 rows of 300 columns to 56 rows of 500: {statistics.median(times[1:]):.2f} s")


if __name__ == "__main__":
    main()
