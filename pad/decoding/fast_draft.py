"""A draft model made cheap on the CPU: what ``--fast-draft`` changes, each change also its own flag.

Where lookups miss, a block's time is mostly the draft's forwards, one per draft token. At a few rows such a
forward reads all the draft's weights once (memory-bound), and one new token's attention over a long cache in
SDPA's CPU kernel costs about as much again as the layers' matmuls at 16 rows. ``use_fast_draft`` changes:

- the linear layers to int8 weights (``pad.decoding.int8``),
- attention to pad's fused CPU kernel (``pad.decoding.attention``, ``fused_cpu=True``), which reads each
  key/value head once for every query head it serves,
- with ``vocab`` N only, the output layer to the N most frequent tokens (``pad.decoding.vocab_prune``; first,
  so that its rows are quantized as a layer of their own). Not by default: on GSM8K and HumanEval replies
  pruning cost more acceptance than it saved time (bench/README.md, "What a draft token costs").

None changes what exact decoding returns: the target decides every token (tests/test_fast_draft.py). They
change the draft's proposals a little, so a run log records each (``settings``), and ``-k auto`` keeps their
measured costs apart from the unchanged draft's.
"""
from __future__ import annotations


def use_fast_draft(model, vocab: int | None = None, int8: bool = True, fused_attention: bool = True) -> dict:
    """Apply the changes named (``vocab`` None or 0: keep the whole output layer) to ``model`` in place; returns
    what was applied as a run log's settings: ``{"draft_vocab": N, "draft_weights": "int8", "draft_attention":
    "fused"}`` (keys only for what changed). Raises ValueError where this torch or build lacks a piece asked for
    (int8: ``torch.ops.aten._weight_int8pack_mm``; fused attention: the C++ CPU extension), rather than
    running something else than asked."""
    from pad_kernels import attention as kernel

    from .attention import use_gqa_sdpa
    from .int8 import use_int8_weights
    from .vocab_prune import frequent_ids, use_pruned_head

    settings = {}
    if vocab:
        settings["draft_vocab"] = use_pruned_head(model, frequent_ids(vocab))
    if int8:
        if not use_int8_weights(model):
            raise ValueError("int8 draft weights: this torch has no int8 packed matmul "
                             "(torch.ops.aten._weight_int8pack_mm) for the draft's layers here (CPU, bf16 or fp32)")
        settings["draft_weights"] = "int8"
    if fused_attention:
        if not kernel.available():
            raise ValueError("fused draft attention: the C++ CPU extension (pad_kernels._cpu) is not built")
        if not use_gqa_sdpa(model, fused_cpu=True):
            raise ValueError("fused draft attention: the draft runs attention "
                             f"{getattr(model.config, '_attn_implementation', None)!r}, not sdpa")
        model.pad_attention = "fused"
        settings["draft_attention"] = "fused"
    return settings
