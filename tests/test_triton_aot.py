"""Every Triton kernel compiles ahead of time for sm_80 and sm_90 (no GPU needed, interpreter off), and
none spills registers at the block sizes the launcher uses (read from the compiled cubins)."""
import os
import re
import subprocess
import sys

import pytest


@pytest.mark.toolchain
def test_triton_kernels_compile_for_sm80_and_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-m", "pad_kernels.triton.aot", "--arch", "80", "90"],
                          capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # Per dtype and architecture: 14 split-stats kernels (scaled or not, with the draft's logits or not, counting
    # ranks or not: 8; read by row index: 4 more, and with per-row rules 2), 6 draw kernels (per-row draft lengths
    # or not, times the three layouts: the block, by row index, by row index with per-row rules) and 60 accept
    # kernels: classifier or not, times per-row draft lengths or not, times 13 modes (greedy: exact with and
    # without the draft's logits, typical, threshold, fly, kl, topk; sampling: the same without fly); by row
    # index, with draft lengths, threshold and per-row rules (every rule compiled in), greedy or sampling, with a
    # classifier or not; for 3 dtypes and 2 architectures.
    assert "480 kernels compiled, none spills" in proc.stdout
    usage = re.findall(r": cubin \d+ bytes, (\d+) registers, local (\d+) bytes", proc.stdout)
    assert len(usage) == 480 and all(int(local) == 0 and 0 < int(regs) <= 255 for regs, local in usage)
    assert proc.stdout.count("sm_80 ") == proc.stdout.count("sm_90 ") == 240
    for rule, modes in (("exact", 5), ("typical", 2), ("threshold", 3), ("fly", 1), ("kl", 2), ("topk", 2)):
        assert proc.stdout.count(f"RULE={rule},") == 2 * 3 * 4 * modes, rule
    assert proc.stdout.count("draw_kernel[") == 2 * 3 * 6
    assert proc.stdout.count("HAS_ROWS=True") == 2 * 3 * 18 and proc.stdout.count("HAS_RR=True") == 2 * 3 * 8
    assert proc.stdout.count("HAS_DRAFT=True") == 2 * 3 * (4 + 16)


def test_split_plan_fills_the_gpu():
    from pad_kernels.splits import PROGRAMS_PER_SM, split_plan

    V = 151936
    assert split_plan(11, V, None) == (1, V)  # no GPU (the interpreter): one slice
    for positions in (5, 11, 88, 352, 2000):
        S, length = split_plan(positions, V, 132)
        assert (S - 1) * length < V <= S * length
        assert positions * S >= min(PROGRAMS_PER_SM * 132, positions * (V // 1024))  # the grid fills the GPU
        assert S == 1 or positions * (S - 1) < PROGRAMS_PER_SM * 132  # and no more slices than that takes
    assert split_plan(5, 700, None, 64) == (64, 11)  # asked for: slices of 11 logits, the last of 7


@pytest.mark.toolchain
def test_model_predicts_b1_k10_near_the_floor():
    """bench/perf_model.py on the compiled kernels (Triton's and, with nvcc, CUDA's): B = 1, K = 10, bf16 on an
    H100 runs at least 2 waves of the stats kernel and is predicted within 2x of the memory floor plus two
    launches, for both backends (the split's point: one program per position was predicted far slower)."""
    from pathlib import Path

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = Path(__file__).resolve().parents[1] / "bench" / "perf_model.py"
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert re.search(r"\| `split_stats_kernel\[bf16, SCALED=False, HAS_DRAFT=False, RANKED=False, HAS_ROWS=False, "
                     r"HAS_RR=False\]` \| \d+ \| 0 B \|", proc.stdout)
    assert re.search(r"\| `split_stats_kernel\[bf16\]` \| \d+ \| 0 B \|", proc.stdout)  # the CUDA kernels' too
    for backend in ("triton", "cuda"):
        row = next(line for line in proc.stdout.splitlines() if line.startswith(f"| {backend} | H100 SXM | bf16 | 1 | 10 |"))
        cells = [c.strip() for c in row.strip("|").split("|")]
        waves = float(re.search(r"-> \d+ \(([\d.]+)\)", cells[6]).group(1))
        before, after, floor = float(cells[8]), float(cells[9]), float(cells[10])
        assert waves >= 2 and after <= 2 * floor and before > 5 * after, backend
