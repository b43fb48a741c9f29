"""Loading the optional compiled backends (built by setup.py when possible)."""
from __future__ import annotations

import functools
import importlib
import os


@functools.cache
def extension(name: str):
    """``pad_kernels.<name>`` (``_cpu`` or ``_cuda``), or None if it was not built. Import torch first
    (the extension needs libc10 loaded); callers of this module always have. The CPU backend's instruction
    set is taken from ``PAD_CPU_ISA`` (auto, avx512, avx2, baseline) when it is first loaded."""
    try:
        module = importlib.import_module(f"pad_kernels.{name}")
    except ImportError:
        return None
    if name == "_cpu" and hasattr(module, "set_isa"):
        try:
            module.set_isa(os.environ.get("PAD_CPU_ISA", "auto"))
        except ValueError as e:
            raise ValueError(f"PAD_CPU_ISA: {e}") from None
    return module
