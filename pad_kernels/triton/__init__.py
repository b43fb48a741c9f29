"""Triton kernels of pad_kernels (imported lazily: triton is optional)."""
