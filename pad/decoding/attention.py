"""Grouped-query attention without copying keys and values, for batched forwards with a mask.

transformers' ``sdpa`` attention repeats every key/value head for each query head it serves
(``repeat_kv``) whenever a forward feeds more than one token with a 2D attention mask, which is every
verification block of a batch and every guessed step of the search labeler. For the default target (12
query heads over 2 key/value heads) that writes and reads six copies of the whole cache per layer (measured
in docs/kernels.md). ``use_gqa_sdpa(model)`` switches a model to the
same attention with ``enable_gqa=True`` in those forwards; everything else goes to transformers' own
``sdpa`` function unchanged. Same mask, same scale, same kernel family: only the copy is gone.

``use_gqa_sdpa(model, fused_cpu=True)`` goes one step further on the CPU: forwards of a few new tokens per
row over a masked cache, and of one token per row over any cache (a draft model's steps), run
``pad_kernels.attention.gqa_attention`` (a C++ kernel that reads each key/value head once for all the query
heads and tokens it serves), the rest as above. Its fp32 sums differ from SDPA's in rounding only, which in
bf16 can flip a near-tied argmax, so the target keeps SDPA in the decode that run logs record (switching it is
a new ``DECODE_VERSION``); the search labeler, whose decisions are taken on the text at hand whichever kernel
computed it, and a draft model under ``pad.use_fast_draft``, whose proposals the target checks, take the
fused one.
"""
from __future__ import annotations

import torch

NAME = "pad_sdpa_gqa"
FUSED_NAME = "pad_cpu_gqa"


def gqa_sdpa_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                       is_causal=None, **kwargs):
    """query [B, Hq, T, D], key/value [B, Hkv, S, D], attention_mask [B, 1, T, S] or None -> ([B, T, Hq, D], None)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    groups = getattr(module, "num_key_value_groups", 1)
    plain = (groups == 1 or attention_mask is None or query.shape[2] == 1
             or any(kwargs.get(k) is not None for k in ("position_bias", "cache", "softcap")))
    if plain:  # nothing is copied on these paths (or they need transformers' handling)
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask,
                                                           dropout_p=dropout, scale=scaling, enable_gqa=True)
    return out.transpose(1, 2).contiguous(), None


def fused_cpu_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                        is_causal=None, **kwargs):
    """``pad_kernels.attention.gqa_attention`` where it takes the inputs (CPU, a bool mask, G * T small),
    else ``gqa_sdpa_attention``. Shapes as ``gqa_sdpa_attention``."""
    from pad_kernels import attention

    special = any(kwargs.get(k) is not None for k in ("position_bias", "cache", "softcap", "sinks", "s_aux"))
    if attention_mask is None and query.shape[2] == 1:  # one new token without holes: it sees every column
        attention_mask = torch.ones((query.shape[0], 1, 1, key.shape[2]), dtype=torch.bool, device=query.device)
    if (dropout == 0.0 and not special and attention.available()
            and attention.supports(query, key, value, attention_mask)):
        scale = query.shape[-1] ** -0.5 if scaling is None else scaling
        return attention.gqa_attention(query, key, value, attention_mask, scale), None
    return gqa_sdpa_attention(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                              is_causal=is_causal, **kwargs)


def use_gqa_sdpa(model, fused_cpu: bool = False) -> bool:
    """Switch ``model`` from ``sdpa`` to ``gqa_sdpa_attention``, or with ``fused_cpu`` to
    ``fused_cpu_attention`` (both build their masks as ``sdpa`` does; either switches to the other).

    Returns True when switched; a model on another attention implementation is left as it is.
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    if getattr(model.config, "_attn_implementation", None) not in ("sdpa", NAME, FUSED_NAME):
        return False
    name, function = (FUSED_NAME, fused_cpu_attention) if fused_cpu else (NAME, gqa_sdpa_attention)
    AttentionInterface.register(name, function)
    AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    model.set_attn_implementation(name)
    return True
