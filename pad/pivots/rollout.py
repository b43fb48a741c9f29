"""Many continuations of one decoded text in one batch, reusing the text's KV cache (no re-prefill).

Row i continues ``seq[:, :starts[i].length] + [starts[i].token]``. Every row's prefix is a prefix of the
same sequence, so its keys and values are a slice of the cache of that sequence; rows are left-padded to
a common length, pads are masked out, and position ids carry each row's true positions. On CPUs where a
forward over B tokens costs much less than B one-token forwards (fp32 here), this is what makes
labeling by rollouts affordable.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..decoding.hf import forward_tail


@dataclass(frozen=True)
class Start:
    length: int  # tokens of the shared sequence kept as the prefix
    token: int  # the token appended to it, whose continuation is wanted


def _cache_layers(cache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    layers = getattr(cache, "layers", None)
    if layers is None:
        raise ValueError(f"batched rollouts need a transformers DynamicCache with .layers, got {type(cache).__name__}")
    return [(layer.keys, layer.values) for layer in layers]


def _padded_cache(cache, lengths: list[int]):
    """A DynamicCache of len(lengths) rows: row i holds the first lengths[i] positions, left-padded."""
    from transformers import DynamicCache

    width = max(lengths)
    data = []
    for keys, values in _cache_layers(cache):
        k = keys.new_zeros((len(lengths), keys.shape[1], width, keys.shape[3]))
        v = values.new_zeros((len(lengths), values.shape[1], width, values.shape[3]))
        for i, n in enumerate(lengths):
            k[i, :, width - n :] = keys[0, :, :n]
            v[i, :, width - n :] = values[0, :, :n]
        data.append((k, v))
    return DynamicCache(ddp_cache_data=data)


@torch.inference_mode()
def continue_batch(model, cache, starts: list[Start], *, vocab: int, max_new_tokens: int, eos: set[int],
                   temperature: float = 0.0, generator: torch.Generator | None = None) -> list[list[int]]:
    """Continuations after each start's token, each at most ``max_new_tokens`` long and ending at an EOS.

    ``cache`` holds the keys/values of one sequence [1, S] with S >= every start's length; it is not
    modified. Greedy when ``temperature`` is 0, else sampled from softmax(logits / temperature).
    """
    if not starts:
        return []
    held = cache.get_seq_length()
    if any(not 0 < s.length <= held for s in starts):
        raise ValueError(f"every start length must be in [1, {held}] (the cached tokens)")
    lengths = [s.length for s in starts]
    width, rows = max(lengths), len(starts)
    device = next(model.parameters()).device
    batch_cache = _padded_cache(cache, lengths)
    mask = torch.zeros((rows, width + 1), dtype=torch.long, device=device)
    for i, n in enumerate(lengths):
        mask[i, width - n :] = 1
    positions = torch.tensor(lengths, device=device)[:, None]
    x = torch.tensor([[s.token] for s in starts], device=device)
    out: list[list[int]] = [[] for _ in starts]
    alive = [i for i, s in enumerate(starts) if s.token not in eos]  # batch row j continues starts[alive[j]]
    if len(alive) < rows:
        batch_cache.batch_select_indices(torch.tensor(alive, dtype=torch.long, device=device))
        mask, positions, x = mask[alive], positions[alive], x[alive]
    for _ in range(max_new_tokens):
        if not alive:
            break
        logits = forward_tail(model, x, 1, attention_mask=mask, position_ids=positions, cache=batch_cache,
                              use_cache=True).logits[:, -1, :vocab].float()
        if temperature == 0:
            nxt = logits.argmax(-1)
        else:
            nxt = torch.multinomial(torch.softmax(logits / temperature, -1), 1, generator=generator)[:, 0]
        keep = []
        for j, token in enumerate(nxt.tolist()):
            out[alive[j]].append(token)
            if token not in eos:
                keep.append(j)
        mask = torch.cat([mask, mask.new_ones((mask.shape[0], 1))], 1)
        positions, x = positions + 1, nxt[:, None]
        if len(keep) < len(alive):  # finished rows leave the batch, so a long row does not carry dead ones
            idx = torch.tensor(keep, dtype=torch.long, device=device)
            batch_cache.batch_select_indices(idx)
            mask, positions, x = mask[idx], positions[idx], x[idx]
            alive = [alive[j] for j in keep]
    return out
