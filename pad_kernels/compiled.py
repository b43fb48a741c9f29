"""Loading the optional compiled backends (built by setup.py when possible)."""
from __future__ import annotations

import functools
import importlib


@functools.cache
def extension(name: str):
    """``pad_kernels.<name>`` (``_cpu`` or ``_cuda``), or None if it was not built. Import torch first
    (the extension needs libc10 loaded); callers of this module always have."""
    try:
        return importlib.import_module(f"pad_kernels.{name}")
    except ImportError:
        return None
