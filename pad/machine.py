"""Facts of the machine: one line naming it, versions and commit, for benchmark tables; its fastest dtype;
the memory left for a long job."""
from __future__ import annotations

import os
import platform
import statistics
import subprocess
import time
from pathlib import Path


def commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             cwd=Path(__file__).parent, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    return out.stdout.strip() or "unknown"


def native_bf16(cpuinfo: str | os.PathLike = "/proc/cpuinfo") -> bool:
    """True on a GPU or a CPU with bf16 matrix instructions (AVX-512 BF16, AMX), where bf16 is fast."""
    import torch

    if torch.cuda.is_available():
        return True
    cpuinfo = Path(cpuinfo)
    if not cpuinfo.exists():
        return False
    flags = next((line.split(":", 1)[1].split() for line in cpuinfo.read_text().splitlines()
                  if line.startswith("flags")), [])
    return "avx512_bf16" in flags or "amx_bf16" in flags


def default_dtype() -> str:
    """The dtype real models decode fastest in here: bf16 with native bf16, else fp32.

    Without bf16 instructions (an AVX2 CPU) torch emulates bf16 matmuls: a one-token forward is several
    times slower than in fp32 and a (K+1)-token verify costs about K+1 one-token forwards, so speculative
    decoding cannot pay; in fp32 a 9-token forward costs a few one-token forwards.
    """
    return "bfloat16" if native_bf16() else "float32"


def available_memory(meminfo: str | os.PathLike = "/proc/meminfo",
                     cgroup: str | os.PathLike = "/sys/fs/cgroup") -> int | None:
    """Bytes this process can still take without swapping or meeting the OOM killer: the kernel's
    ``MemAvailable``, or less when a cgroup v2 limit (``memory.max`` of a container or job launcher) leaves
    less; None where neither is known (not Linux)."""
    found = []
    try:
        for line in Path(meminfo).read_text().splitlines():
            if line.startswith("MemAvailable:"):
                found.append(int(line.split()[1]) * 1024)
    except OSError:
        pass
    try:
        limit = Path(cgroup, "memory.max").read_text().strip()
        if limit != "max":
            found.append(int(limit) - int(Path(cgroup, "memory.current").read_text()))
    except (OSError, ValueError):
        pass
    return max(0, min(found)) if found else None


def release_free_memory() -> bool:
    """Give the memory freed tensors left in the C allocator back to the system (glibc's ``malloc_trim``);
    False where the C library has no such call. A long job that allocates and frees caches of many sizes
    keeps it otherwise (gigabytes for the search labeler: docs/kernels.md)."""
    import ctypes

    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return False
    trim(0)
    return True


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


def median_seconds(fn, repeats: int, warmup: int = 0) -> float:
    """The median wall time of ``repeats`` calls of ``fn()``, after ``warmup`` untimed ones."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def speed_probe(dtype: str = "bfloat16", repeats: int = 10) -> float:
    """GFLOP/s of one fixed matmul at torch's current thread count, the median of ``repeats`` timings.

    The shape, [144, 1536] @ [1536, 8960], is a batched verification step's MLP up-projection (16 rows x 9
    tokens against the default target's). Two cloud instances with the same machine line can differ by 10%
    in speed, and a job running beside a benchmark halves it; a run log keeps this figure beside each run so
    that tables built from several sessions can tell (the median, not the best, so that contention shows).
    """
    import torch

    g = torch.Generator().manual_seed(0)
    a = torch.randn(144, 1536, generator=g).to(getattr(torch, dtype))
    b = torch.randn(1536, 8960, generator=g).to(getattr(torch, dtype))
    # One warm-up call: first-call dispatch and page faults.
    return 2 * 144 * 1536 * 8960 / median_seconds(lambda: a @ b, repeats, warmup=1) / 1e9
