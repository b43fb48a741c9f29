"""The CUDA kernels compile with plain nvcc for sm_80 and sm_90 (no GPU needed) and none uses local
memory (register spills or a stack frame), read from ptxas' resource usage."""
import os
import re
import shutil
import subprocess
import sys

import pytest


@pytest.mark.toolchain
def test_cuda_kernels_compile_without_spills():
    if not (shutil.which("nvcc") or os.path.exists("/usr/local/cuda/bin/nvcc")):
        pytest.skip("nvcc is not installed here (every machine of this project has it; CI runs this test)")
    proc = subprocess.run([sys.executable, "-m", "pad_kernels.cuda_aot", "--arch", "80", "90"], capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # 3 logits dtypes: a stats and a draw kernel each, and an accept kernel per hidden dtype; 2 architectures.
    assert "30 CUDA kernels compiled, none spills" in proc.stdout
    rows = re.findall(r"^sm_(\d+) (\w+)\[[^\]]+\]: (\d+) registers, stack 0 bytes, spills 0/0 bytes", proc.stdout, re.M)
    assert len(rows) == 30 and {k for _, k, _ in rows} == {"split_stats_kernel", "accept_kernel", "draw_kernel"}
    assert all(0 < int(regs) <= 255 for _, _, regs in rows)
