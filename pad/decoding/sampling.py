"""The sampled distribution: temperature and top-p applied to logits, as every decode path draws."""
from __future__ import annotations

import torch


def warp_logits(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """Mask (to -inf) the tokens outside the top-p nucleus of ``softmax(logits / temperature)``.

    logits [..., V]; returned unscaled, so ``verify_block`` applies the temperature itself. The most likely
    token is always kept; greedy decoding (temperature 0) ignores top_p.
    """
    if temperature == 0 or top_p >= 1.0:
        return logits
    probs = torch.softmax(logits.float() / temperature, -1)
    sorted_probs, order = probs.sort(-1, descending=True)
    # Drop a token when the tokens ranked above it already hold top_p of the mass.
    drop_sorted = (sorted_probs.cumsum(-1) - sorted_probs) >= top_p
    drop = drop_sorted.scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def sampling_probs(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """The distribution sampled at ``temperature`` > 0 with top-p: logits [..., V] -> probs [..., V] fp32."""
    return torch.softmax(warp_logits(logits, temperature, top_p).float() / temperature, -1)
