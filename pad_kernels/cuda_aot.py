"""Compile the CUDA kernels (``csrc/cuda/verify_block.cu``, torch-free) for sm_80 and sm_90 with plain
``nvcc`` and read what each compiled kernel uses (no GPU needed):

    python -m pad_kernels.cuda_aot [--arch 80 90]

Prints one line per kernel and architecture (registers per thread, stack frame, spill stores and loads,
static shared memory per block, from ``ptxas --resource-usage``) and exits non-zero when nvcc fails or a
kernel spills registers or needs a stack frame (local memory).
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SOURCE = os.path.join(ROOT, "csrc", "cuda", "verify_block.cu")
TYPES = {"f": "fp32", "6__half": "fp16", "13__nv_bfloat16": "bf16"}  # Itanium-mangled template arguments


def _kernel_name(mangled: str) -> str:
    """``accept_kernel[bf16, fp32]`` from the mangled entry name (logits type, then hidden type)."""
    kernel = re.search(r"(split_stats_kernel|accept_kernel|draw_kernel)I", mangled)
    args = []
    rest = mangled[kernel.end():]
    while rest and not rest.startswith("E"):
        sub = re.match(r"S\d*_", rest)  # a substitution: here only ever the hidden type repeating the logits'
        if sub:
            args.append(args[0])
            rest = rest[sub.end():]
            continue
        code = next(c for c in TYPES if rest.startswith(c))
        args.append(TYPES[code])
        rest = rest[len(code):]
    return f"{kernel.group(1)}[{', '.join(args)}]"


def resources(arch: int) -> dict[str, dict]:
    """Per kernel: registers, stack (bytes), spill_stores, spill_loads (bytes), shared (bytes per block)."""
    if not os.path.isfile(SOURCE):
        raise FileNotFoundError(f"{SOURCE} is not there: the CUDA sources ship with the repository, not the wheel; "
                                "run this from a source checkout")
    nvcc = shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc"
    proc = subprocess.run([nvcc, "-c", SOURCE, "-I", os.path.join(ROOT, "csrc", "include"), "-std=c++17", "-O3",
                           "-o", os.devnull, "-gencode", f"arch=compute_{arch},code=sm_{arch}", "--resource-usage"],
                          capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"nvcc failed for sm_{arch}:\n{proc.stderr[-3000:]}")
    out, name = {}, None
    for line in proc.stderr.splitlines():
        if m := re.search(r"Function properties for (\S+)", line):
            name = _kernel_name(m.group(1))
        elif m := re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line):
            out[name] = dict(stack=int(m.group(1)), spill_stores=int(m.group(2)), spill_loads=int(m.group(3)))
        elif (m := re.search(r"Used (\d+) registers.*?(\d+) bytes smem", line)) and name in out:
            out[name].update(registers=int(m.group(1)), shared=int(m.group(2)))
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="compile the CUDA kernels and read their resources")
    parser.add_argument("--arch", type=int, nargs="+", default=[80, 90])
    args = parser.parse_args(argv)
    count = 0
    for arch in args.arch:
        for name, r in resources(arch).items():
            print(f"sm_{arch} {name}: {r['registers']} registers, stack {r['stack']} bytes, spills "
                  f"{r['spill_stores']}/{r['spill_loads']} bytes, shared {r['shared']} bytes")
            if r["stack"] or r["spill_stores"] or r["spill_loads"]:
                print(f"sm_{arch} {name}: uses local memory", file=sys.stderr)
                return 1
            count += 1
    print(f"{count} CUDA kernels compiled, none spills")
    return 0


if __name__ == "__main__":
    sys.exit(main())
