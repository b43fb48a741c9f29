"""A draft model made cheap on the CPU: what ``--fast-draft`` changes, each change also its own flag.

Where lookups miss, a block's time is mostly the draft's forwards, one per draft token. At a few rows such a
forward reads all the draft's weights once (memory-bound), and one new token's attention over a long cache in
SDPA's CPU kernel costs about as much again as the layers' matmuls at 16 rows. ``use_fast_draft`` changes:

- the linear layers to int8 weights (``pad.decoding.int8``), or with ``weights="int4"`` to 4-bit ones
  (``pad.decoding.int4``); by default not in fp32, where they would buy no speed (``fast_weights``),
- attention to pad's fused CPU kernel (``pad.decoding.attention``, ``fused_cpu=True``), which reads each
  key/value head once for every query head it serves,
- the forward to a plain loop over the layers (``pad.decoding.draft_forward``, Llama / Qwen2 family), without
  transformers' per-call Python,
- with ``vocab`` N only, the output layer to the N most frequent tokens (``pad.decoding.vocab_prune``; first,
  so that its rows are quantized as a layer of their own). Not by default: on GSM8K and HumanEval replies
  pruning cost more acceptance than it saved time (bench/README.md, "What a draft token costs").

None changes what exact decoding returns: the target decides every token (tests/test_fast_draft.py). They
change the draft's proposals a little, so a run log records each (``settings``), and ``-k auto`` keeps their
measured costs apart from the unchanged draft's.
"""
from __future__ import annotations

WEIGHTS = ("int8", "int4")
FAST_WEIGHTS = "int8"  # --fast-draft's weights


def fast_weights(dtype) -> str | None:
    """The weights ``--fast-draft`` gives a draft of ``dtype`` (a torch dtype or its name): ``FAST_WEIGHTS``, but
    none in fp32, whose activations multiply quantized weights densely (the packed kernels take bf16 only):
    rounded weights there would cost acceptance and buy no speed."""
    return None if str(dtype).removeprefix("torch.") == "float32" else FAST_WEIGHTS


def use_fast_draft(model, vocab: int | None = None, weights: str | None = "auto", fused_attention: bool = True,
                   lean: bool = True) -> dict:
    """Apply the changes named to ``model`` in place: ``vocab`` N (None or 0: keep the whole output layer),
    ``weights`` "int8" or "int4" (None: unquantized; "auto": ``fast_weights`` of the model's dtype),
    ``fused_attention``, and ``lean`` (the forward of ``pad.decoding.draft_forward``, where the model's family
    has it; last, as it joins the layers as they then are). Returns what was applied as a run log's settings:
    ``{"draft_vocab": N, "draft_weights": "int8", "draft_attention": "fused", "draft_forward": "lean"}`` (keys
    only for what changed). Raises ValueError where this torch or build lacks a piece asked for (a packed matmul
    for the weights, the C++ CPU extension for the attention), rather than running something else than asked; a
    model the lean forward does not take keeps its own (no ``draft_forward`` in the settings)."""
    from pad_kernels import attention as kernel

    from .attention import use_gqa_sdpa
    from .draft_forward import use_lean_forward
    from .int4 import use_int4_weights
    from .int8 import use_int8_weights
    from .vocab_prune import frequent_ids, use_pruned_head

    if weights == "auto":
        weights = fast_weights(next(model.parameters()).dtype)
    if weights not in (None, *WEIGHTS):
        raise ValueError(f"draft weights must be one of {WEIGHTS} or None, got {weights!r}")
    settings = {}
    if vocab:
        settings["draft_vocab"] = use_pruned_head(model, frequent_ids(vocab))
    if weights:
        if not {"int8": use_int8_weights, "int4": use_int4_weights}[weights](model):
            raise ValueError(f"{weights} draft weights: this torch has no {weights} packed matmul for the draft's "
                             "layers here (CPU, bf16 or fp32)")
        settings["draft_weights"] = weights
    if fused_attention:
        if not kernel.available():
            raise ValueError("fused draft attention: the C++ CPU extension (pad_kernels._cpu) is not built")
        if not use_gqa_sdpa(model, fused_cpu=True):
            raise ValueError("fused draft attention: the draft runs attention "
                             f"{getattr(model.config, '_attn_implementation', None)!r}, not sdpa")
        model.pad_attention = "fused"
        settings["draft_attention"] = "fused"
    if lean and use_lean_forward(model):
        settings["draft_forward"] = "lean"
    return settings
