"""One line naming the machine, versions and commit, for benchmark tables."""
from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path


def commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             cwd=Path(__file__).parent, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    return out.stdout.strip() or "unknown"


def machine_line(with_commit: bool = True) -> str:
    import torch
    import transformers

    cpu = platform.processor() or platform.machine()
    if Path("/proc/cpuinfo").exists():
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
    return (f"{cpu}, {os.cpu_count()} cores, {torch.get_num_threads()} torch threads, CPU capability "
            f"{torch.backends.cpu.get_cpu_capability()}, {device}; Python {platform.python_version()}, "
            f"torch {torch.__version__}, transformers {transformers.__version__}"
            + (f"; commit {commit()}" if with_commit else ""))
