"""Side-by-side medians of every verification backend available here, as a markdown table.

    python bench/verify_table.py [--out bench/results/verify_cpu.md] [--repeats 15] [--quick]

Rows: B in {1, 4}, K in {4, 10}, V in {32000, 151936}, H in {896, 1536}, fp32 and bf16, greedy with a
classifier (128 hidden units). Columns: eager reference, torch.compile of the reference, and each fused
backend, with the ratio eager / backend. The header names the machine, versions and commit. All
backends run on the same inputs in one process, interleaved, so the ratios are fair on a busy machine.
"""
from __future__ import annotations

import argparse
import itertools
import statistics
import time
from pathlib import Path

import torch

from pad.machine import machine_line
from pad_kernels import FoldedClassifier, available_backends, verify_block
from pad_kernels.verify_ref import verify_block_ref


def make_inputs(B, K, V, H, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(B, K + 1, V, generator=g) * 3).to(dtype)
    drafts = logits[:, :K].float().argmax(-1)
    drafts[:, K // 2 :] = torch.randint(0, V, (B, K - K // 2), generator=g)
    hidden = torch.randn(B, K + 1, H, generator=g).to(dtype)
    D = 128
    clf = FoldedClassifier(torch.randn(H + 2, D, generator=g) / H**0.5, torch.zeros(D), torch.randn(D, generator=g) / D**0.5,
                           torch.tensor(0.0))
    return logits, drafts, hidden, clf


def interleaved_medians(fns: dict, repeats: int) -> dict:
    """Median ms of each function, timed in turns so that machine noise hits every backend alike."""
    for fn in fns.values():
        fn()  # warm up (and compile)
    times = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) * 1e3 for name, t in times.items()}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="also write the table to this markdown file")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--quick", action="store_true", help="only B=1, K=10, V=151936, H=1536")
    parser.add_argument("--no-compile", action="store_true", help="skip torch.compile of the reference")
    args = parser.parse_args()

    device = "cpu"
    fused = [b for b in available_backends(device) if b not in ("torch", "triton")]
    compiled = None if args.no_compile else torch.compile(verify_block_ref, dynamic=True)
    columns = ["eager reference"] + ([] if compiled is None else ["torch.compile(reference)"]) + fused
    shapes = [(1, 10, 151936, 1536)] if args.quick else list(itertools.product((1, 4), (4, 10), (32000, 151936), (896, 1536)))
    lines = [f"Machine: {machine_line()}", "",
             "| dtype | B | K | V | H | " + " | ".join(f"{c} ms" for c in columns) + " | "
             + " | ".join(f"eager / {c}" for c in columns[1:]) + " |",
             "|" + "---|" * (5 + 2 * len(columns) - 1)]
    print("\n".join(lines), flush=True)
    for dtype in (torch.float32, torch.bfloat16):
        for B, K, V, H in shapes:
            logits, drafts, hidden, clf = make_inputs(B, K, V, H, dtype)
            fns = {"eager reference": lambda: verify_block_ref(logits, drafts, hidden, clf, sigma=0.5, floor=1e-4)}
            if compiled is not None:
                fns["torch.compile(reference)"] = lambda: compiled(logits, drafts, hidden, clf, sigma=0.5, floor=1e-4)
            for b in fused:
                fns[b] = lambda b=b: verify_block(logits, drafts, hidden, clf, sigma=0.5, floor=1e-4, backend=b)
            times = interleaved_medians(fns, args.repeats)
            eager = times["eager reference"]
            row = (f"| {str(dtype).removeprefix('torch.')} | {B} | {K} | {V} | {H} | "
                   + " | ".join(f"{times[c]:.2f}" for c in columns) + " | "
                   + " | ".join(f"{eager / times[c]:.1f}x" for c in columns[1:]) + " |")
            lines.append(row)
            print(row, flush=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text("Command: `python bench/verify_table.py" + (" --quick" if args.quick else "") + "`\n\n"
                            + "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
