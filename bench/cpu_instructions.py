"""Instructions the CPU backend executes for five verification blocks, counted by callgrind.

    python bench/cpu_instructions.py [--case fp32|bf16 ...]

Wall clock on a shared VM swings by more than 10% between runs; an instruction count does not, so two
trees of the CPU backend (say a commit and the one before it, built in a worktree with
``python setup.py build_ext --inplace``) are compared by running this script in each. Each case makes
five ``verify_block(..., backend="cpu")`` calls with the classifier on one thread, under
``valgrind --tool=callgrind``, and prints the instructions counted inside ``verify_block_cpu_out``, the
C++ op (inclusive, by ``callgrind_annotate``). The cases are bench/README.md's: fp32 B=1 K=10 and bf16
B=4 K=10, V=151936, H=1536. Needs valgrind; under it the Python process runs many times slower (minutes).
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile

CASES = {"fp32": ("float32", 1), "bf16": ("bfloat16", 4)}  # dtype, B; K=10, V=151936, H=1536 for both
K, V, H, BLOCKS = 10, 151936, 1536, 5


def _blocks(case: str) -> None:
    """The measured part: five blocks of one case, run inside valgrind."""
    import torch

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from pad_kernels import verify_block
    from verify_table import make_inputs

    torch.set_num_threads(1)
    dtype, B = CASES[case]
    logits, drafts, hidden, clf = make_inputs(B, K, V, H, getattr(torch, dtype))
    for _ in range(BLOCKS):
        verify_block(logits, drafts, hidden, clf, sigma=0.5, floor=1e-4, backend="cpu")


def count(case: str) -> int:
    """Instructions executed inside the C++ op for the case's five blocks."""
    if shutil.which("valgrind") is None:
        raise SystemExit("valgrind is not installed (apt install valgrind)")
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "callgrind.out")
        cmd = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", sys.executable,
               os.path.abspath(__file__), "--inside", case]
        run = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        if run.returncode != 0:
            raise SystemExit(f"valgrind failed ({run.returncode}):\n{run.stderr[-2000:]}")
        report = subprocess.run(["callgrind_annotate", "--inclusive=yes", "--threshold=100", out],
                                capture_output=True, text=True, check=True).stdout
    # The op's own line (not one of its lambdas): its inclusive count covers everything it calls.
    counts = [int(m.group(1).replace(",", "")) for m in re.finditer(
        r"^\s*([\d,]+) .*verify_block_cpu_out\((?:(?!\{lambda).)*$", report, re.M)]
    if not counts:
        raise SystemExit("verify_block_cpu_out is not in the callgrind report (was the CPU extension built?)")
    return max(counts)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--case", nargs="+", choices=sorted(CASES), default=sorted(CASES, reverse=True))
    parser.add_argument("--inside", choices=sorted(CASES), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.inside:
        _blocks(args.inside)
        return 0
    from pad.machine import machine_line

    print(machine_line())
    print(f"| case | instructions in verify_block_cpu_out, {BLOCKS} blocks |\n|---|---|")
    for case in args.case:
        dtype, B = CASES[case]
        print(f"| {case}, B={B}, K={K}, V={V}, H={H} | {count(case) / 1e6:.1f} M |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
