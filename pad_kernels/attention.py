"""Grouped-query attention for steps that feed a few new tokens per row over a long cache.

``gqa_attention`` runs the C++ CPU kernel (``csrc/cpu/gqa_attention_cpu.cpp``): one task per (row,
key/value head) reads that head's cached keys and values once for all G * T queries it serves (G query
heads, T new tokens), in fp32 whatever the input dtype, and skips column tiles no query of the task may
see. SDPA's CPU kernels read the cache once per query head with T queries each (speed: docs/kernels.md).
``gqa_attention_ref`` is the spec.
"""
from __future__ import annotations

import torch

from . import compiled

MAX_QUERIES = 512  # G * T per key/value head the kernel takes (the C++ kMaxM)


def gqa_attention_ref(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor,
                      scale: float) -> torch.Tensor:
    """The spec, in fp32: softmax(scale * q . k over the columns ``mask`` allows) . v per query head, the
    query head h served by key/value head h // G; a query allowed no column gets zeros.

    query [B, Hq, T, D], key / value [B, Hkv, S, D], mask [B, 1, T, S] bool (True: may attend)
    -> [B, T, Hq, D] in the query's dtype (the layout transformers' attention functions return).
    """
    G = query.shape[1] // key.shape[1]
    k = key.float().repeat_interleave(G, dim=1)
    v = value.float().repeat_interleave(G, dim=1)
    scores = torch.einsum("bhtd,bhsd->bhts", query.float(), k) * scale
    scores = scores.masked_fill(~mask, float("-inf"))
    weights = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # a row of only -inf: NaN -> 0
    return torch.einsum("bhts,bhsd->bthd", weights, v).to(query.dtype)


def available() -> bool:
    """The CPU extension with this kernel was built."""
    ext = compiled.extension("_cpu")
    return ext is not None and hasattr(ext, "gqa_attention_out")


def supports(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None) -> bool:
    """Whether ``gqa_attention`` takes these inputs (else use SDPA): CPU tensors of one floating dtype, a
    bool mask [B, 1, T, S], a head dim that is a multiple of 4 and contiguous, G * T <= MAX_QUERIES."""
    if mask is None or mask.dtype != torch.bool or mask.dim() != 4 or query.dim() != 4 or key.dim() != 4:
        return False
    B, Hq, T, D = query.shape
    _, Hkv, S, _ = key.shape
    return (query.device.type == "cpu" and key.device.type == "cpu" and value.device.type == "cpu"
            and query.dtype in (torch.float32, torch.bfloat16, torch.float16)
            and key.dtype == query.dtype and value.dtype == query.dtype and key.shape == value.shape
            and key.shape[0] == B and key.shape[3] == D
            and Hkv > 0 and Hq % Hkv == 0 and (Hq // Hkv) * T <= MAX_QUERIES and D % 4 == 0
            and tuple(mask.shape) == (B, 1, T, S) and mask.device.type == "cpu"
            and query.stride(3) == 1 and key.stride(3) == 1 and value.stride(3) == 1)


def gqa_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor, scale: float,
                  *, out: torch.Tensor | None = None) -> torch.Tensor:
    """``gqa_attention_ref`` on the C++ CPU kernel (see ``supports``); ``out`` [B, T, Hq, D] contiguous
    receives the result when given (tests poison it first)."""
    if not available():
        raise RuntimeError("the C++ CPU extension (pad_kernels._cpu) with gqa_attention is not built")
    if not supports(query, key, value, mask):
        raise ValueError(f"gqa_attention does not take query {tuple(query.shape)} {query.dtype}, key "
                         f"{tuple(key.shape)}, mask {None if mask is None else (tuple(mask.shape), mask.dtype)}")
    B, Hq, T, D = query.shape
    if out is None:
        out = torch.empty((B, T, Hq, D), dtype=query.dtype)
    compiled.extension("_cpu").gqa_attention_out(query, key, value, mask, float(scale), out)
    return out
