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

from ..decoding.decoder import Decoder, left_pad, right_aligned
from ..decoding.rows import RowBatch


@dataclass(frozen=True)
class Start:
    length: int  # tokens of the shared sequence kept as the prefix
    token: int  # the token appended to it, whose continuation is wanted


def _cache_layers(cache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    layers = getattr(cache, "layers", None)
    if layers is None:
        raise ValueError(f"batched rollouts need a transformers DynamicCache with .layers, got {type(cache).__name__}")
    return [(layer.keys, layer.values) for layer in layers]


@torch.inference_mode()
def continue_batch(model, cache, starts: list[Start], *, vocab: int, max_new_tokens: int, eos: set[int],
                   temperature: float = 0.0, generator: torch.Generator | None = None) -> list[list[int]]:
    """Continuations after each start's token, each at most ``max_new_tokens`` long and ending at an EOS.

    ``cache`` holds the keys/values of one sequence [1, S] with S >= every start's length; it is not
    modified. Greedy when ``temperature`` is 0, else sampled from softmax(logits / temperature). The rows
    decode as one ``RowBatch`` on one ``Decoder`` (masks, positions, rows leaving as they finish).
    """
    if not starts:
        return []
    held = cache.get_seq_length()
    if any(not 0 < s.length <= held for s in starts):
        raise ValueError(f"every start length must be in [1, {held}] (the cached tokens)")
    batch = RowBatch([[s.token] for s in starts], max_new_tokens, eos)
    if max_new_tokens == 0:
        return batch.new
    dec = Decoder(model, vocab, 0)
    layers = _cache_layers(cache)
    dec.add_rows(*right_aligned([([k[0, :, : s.length] for k, _ in layers], [v[0, :, : s.length] for _, v in layers])
                                 for s in starts]))
    batch.followers.append(dec)
    batch.end_block([j for j, s in enumerate(starts) if s.token in eos])  # nothing follows an EOS
    pending = [[starts[r].token] for r in batch.live]
    while batch.live:
        ids, fed = left_pad(pending, dec.device)
        logits = dec.forward(ids, fed, keep=1)[:, -1].float()
        if temperature == 0:
            tokens = logits.argmax(-1).tolist()
        else:
            tokens = torch.multinomial(torch.softmax(logits / temperature, -1), 1, generator=generator)[:, 0].tolist()
        finished = [j for j, t in enumerate(tokens) if batch.commit(j, [t])[1]]
        keep = batch.end_block(finished)
        pending = [[tokens[j]] for j in keep]
    return batch.new
