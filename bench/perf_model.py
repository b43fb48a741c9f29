"""A performance model of the GPU ``verify_block`` kernels (Triton and CUDA) on H100 and H200, from the
compiled kernels.

    python bench/perf_model.py            # (TRITON_INTERPRET unset) prints the markdown table of bench/README.md

For each case (B rows, K drafts, V = 151,936, logits in bf16 or fp32, greedy, no classifier) and each of
the two launches: the bytes it must move, its programs and waves (one wave = one program per SM), the
registers per thread, local memory (spills) and shared memory per program read from the kernel compiled
for sm_90 (``pad_kernels.triton.aot.resources``; ``pad_kernels.cuda_aot.resources`` for the CUDA kernels,
which needs nvcc), and a predicted time against the floor, before (one program per position: S = 1) and
after (the vocabulary split of ``split_plan``).

The model (assumptions, stated so that a GPU measurement can correct them; nothing here ran on a GPU): a
launch costs ``LAUNCH_US``. A program of the stats kernel streams its slice one chunk at a time (Triton:
``BLOCK_V`` = 1024 logits; CUDA: 8 logits per thread, 2048 a block), each chunk's reduction waiting for its
load, so it keeps one chunk in flight and streams at chunk bytes / ``LATENCY_US``. An SM runs as many programs at once as its registers, shared memory and
thread slots allow (read from the compiled kernel) and streams at most ``SM_SHARE`` times its share of
the HBM bandwidth. A kernel takes the longer of all its bytes at the HBM bandwidth and its busiest SM's
bytes at that SM's rate. The floor is all bytes at the HBM bandwidth plus two launches.
"""
from __future__ import annotations

import math
import os
import sys
from pathlib import Path

# The CUDA sources live in the repository, not in an installed wheel: take pad_kernels from this checkout.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

GPUS = {"H100 SXM": dict(sms=132, tbps=3.35), "H200": dict(sms=132, tbps=4.8)}
LAUNCH_US = 2.0  # per kernel launch (host launch; a captured graph pays less)
LATENCY_US = 0.6  # a global load's round trip
SM_SHARE = 2.0  # one SM streams at most this many times its share of the HBM bandwidth
SM_LIMITS = dict(registers=65536, shared=228 * 1024, threads=2048, programs=32)  # per SM, sm_90
V = 151936
# Per backend: bytes of one slice's state (Triton: max, entropy sum, 2nd and 3rd logit, the draft's max and
# sum, the divergence's cross term in fp32, the sum in fp64, argmax and rank in int64; CUDA: pad::RowStats,
# its sums in fp64) and logits in flight per stats program.
BACKENDS = {"triton": dict(state_bytes=7 * 4 + 3 * 8, chunk=1024), "cuda": dict(state_bytes=56, chunk=8 * 256)}
PLAIN_STATS = "SCALED=False, HAS_DRAFT=False, RANKED=False, HAS_ROWS=False, HAS_RR=False"  # greedy, no draft logits, no rank: the model's case
PLAIN_ACCEPT = ("HAS_CLF=False, HAS_BIAS=False, SAMPLING=False, HAS_ND=False, RULE=exact, HAS_DRAFT=False, "
                "HAS_ROWS=False, HAS_RR=False")  # the same case without a classifier


def resident(r: dict) -> int:
    """Programs of a kernel with resources ``r`` that one SM runs at once."""
    threads = 32 * r["warps"]
    return max(1, min(SM_LIMITS["registers"] // (r["registers"] * threads), SM_LIMITS["shared"] // max(r["shared"], 1),
                      SM_LIMITS["threads"] // threads, SM_LIMITS["programs"]))


def kernel_time_us(total_bytes: float, grid: int, program_bytes: float, in_flight: float, r: dict, gpu: dict) -> float:
    hbm = gpu["tbps"] * 1e12
    per_sm = math.ceil(grid / gpu["sms"])
    rate = min(SM_SHARE * hbm / gpu["sms"], min(per_sm, resident(r)) * in_flight / (LATENCY_US * 1e-6))
    return max(total_bytes / hbm, per_sm * program_bytes / rate) * 1e6 + LAUNCH_US


def case(B: int, K: int, itemsize: int, gpu: dict, splits: int | None, res: dict, backend: str) -> dict:
    from pad_kernels.splits import split_plan

    positions = B * (K + 1)
    S, split_len = split_plan(positions, V, gpu["sms"], splits)
    state_bytes, chunk = BACKENDS[backend]["state_bytes"], min(BACKENDS[backend]["chunk"], split_len)
    logits = positions * V * itemsize
    states = positions * S * state_bytes
    t1 = kernel_time_us(logits + states, positions * S, split_len * itemsize + state_bytes, chunk * itemsize,
                        res["stats"], gpu)
    # Accept kernel: one program per row reads its row's slice states, the draft tokens and K draft logits
    # and writes the outputs (greedy; sampling adds one pass over one position's vocabulary per row).
    out_bytes = K * 8 + (K + 1) * 16 + K * 6 + 16
    row_bytes = (K + 1) * S * state_bytes + K * itemsize + out_bytes
    t2 = kernel_time_us(B * row_bytes, B, row_bytes, min(row_bytes, 16 * 1024), res["accept"], gpu)
    floor = (logits + B * out_bytes) / (gpu["tbps"] * 1e12) * 1e6 + 2 * LAUNCH_US
    return dict(S=S, grid1=positions * S, waves1=positions * S / gpu["sms"], bytes=logits + states + B * row_bytes,
                t=t1 + t2, floor=floor)


def resources_table() -> dict:
    """Resources of the kernels the model uses, sm_90: Triton's, then CUDA's (a block is 256 threads)."""
    from pad_kernels.cuda_aot import resources as cuda_resources
    from pad_kernels.triton.aot import compile_kernel, jobs, resources

    out = {}
    for name, kernel, sig, constexprs in jobs():
        plain_accept = PLAIN_ACCEPT in name
        if ("bf16" in name or "fp32" in name) and ((name.startswith("split_stats_kernel[") and PLAIN_STATS in name) or plain_accept):
            out[name] = resources(compile_kernel(kernel, sig, constexprs, 90))
    for name, r in cuda_resources(90).items():
        if name in {f"{k}[{d}]" for k in ("split_stats_kernel", "draw_kernel") for d in ("bf16", "fp32")} | \
                {"accept_kernel[bf16, bf16]", "accept_kernel[fp32, fp32]"}:
            out[name] = dict(registers=r["registers"], local=r["stack"] + r["spill_stores"], shared=r["shared"],
                             warps=8)
    return out


def main() -> None:
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("unset TRITON_INTERPRET: the model reads the compiled kernels")
    print("| kernel (sm_90) | registers / thread | local (spills) | shared / program | warps |")
    print("|---|---|---|---|---|")
    table = resources_table()
    for name, r in table.items():
        print(f"| `{name}` | {r['registers']} | {r['local']} B | {r['shared']} B | {r['warps']} |")
    print()
    print("| kernels | GPU | dtype | B | K | S before -> after | stats grid (waves) before -> after | MB moved | "
          "predicted us before | predicted us after | floor us | after / floor |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for backend in BACKENDS:
        for gname, gpu in GPUS.items():
            for dtype, itemsize in (("bf16", 2), ("fp32", 4)):
                if backend == "triton":
                    res = {"stats": table[f"split_stats_kernel[{dtype}, {PLAIN_STATS}]"],
                           "accept": table[f"accept_kernel[{dtype}, {PLAIN_ACCEPT}]"]}
                else:
                    res = {"stats": table[f"split_stats_kernel[{dtype}]"], "accept": table[f"accept_kernel[{dtype}, {dtype}]"]}
                for B in (1, 8, 32):
                    for K in (4, 10):
                        before = case(B, K, itemsize, gpu, 1, res, backend)
                        after = case(B, K, itemsize, gpu, None, res, backend)
                        print(f"| {backend} | {gname} | {dtype} | {B} | {K} | {before['S']} -> {after['S']} | "
                              f"{before['grid1']} ({before['waves1']:.2f}) -> {after['grid1']} "
                              f"({after['waves1']:.2f}) | {after['bytes'] / 1e6:.2f} | {before['t']:.1f} | "
                              f"{after['t']:.1f} | {after['floor']:.1f} | {after['t'] / after['floor']:.2f} |")


if __name__ == "__main__":
    main()
