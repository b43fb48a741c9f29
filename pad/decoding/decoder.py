"""One model, its KV cache and the columns of that cache each row of a batch attends to.

Rows of a batch commit different numbers of tokens per block, so their cached lengths become ragged. Two
ways keep such a batch in one cache without re-prefill: (a) keep the cache rectangular and mask the
columns a row must not see (left padding, rejected draft tokens) with a 2D attention mask plus explicit
position ids, compacting now and then; (b) unpad and re-left-pad every row after every block, a copy of
the whole cache per block. We use (a): a block then costs no copy at all; rejected columns that every row
shares at the end are cropped at once (so at B = 1 no hole ever exists and a forward takes no mask, as
before), and the rest are gathered out by ``compact`` only when that would halve the cache's width, so
attention runs over at most about twice the columns of the longest row, a small part of a forward that
is dominated by reading the weights, where (b) would copy the whole cache every block (measured in
docs/kernels.md: a copy costs about a tenth of a block's forward, masked columns nothing measurable).

Models are used through their public API only: ``attention_mask`` (2D, one entry per cache column plus
the new tokens), ``position_ids`` (each row's own positions) and transformers' ``DynamicCache``
(``crop``, ``batch_select_indices``, and its layers' ``keys`` / ``values`` for compaction).
"""
from __future__ import annotations

import functools

import torch

from .hf import crop_cache, forward_tail, returned_cache

# Compact when that narrows the cache by more than this share of its columns (and it is wider than 16).
COMPACT_AT = 0.5
# Spare columns a cache that grows in place reserves when it reallocates: at least this many, or an eighth.
GROW_SPARE = 64


def growing_cache(keys_values=()):
    """A DynamicCache whose layers grow in place (``growing_layer_class``), holding ``keys_values``: per
    layer (keys, values) [B, H, S, D]. None where this transformers has no ``DynamicLayer`` (before 4.54)."""
    from transformers import DynamicCache

    layer_class = growing_layer_class()
    if layer_class is None:
        return None
    cache = DynamicCache()
    cache.layer_class_to_replicate = layer_class  # the argument of Cache.__init__ that DynamicCache fixes
    for i, (keys, values) in enumerate(keys_values):
        cache.update(keys, values, i)
    return cache


@functools.cache
def growing_layer_class():
    """transformers' ``DynamicLayer`` with spare columns: its keys and values are views of the first n
    columns of larger buffers, and an update writes the new columns after them, where ``DynamicLayer``
    concatenates (a copy of the whole cache per forward: with 64 rows of 1,000 columns, 1.8 GB per forward
    of the default target, plus the page faults of fresh allocations that large). Anything that replaces
    the keys and values (row selection, compaction, new rows) is taken over at the next update with one
    copy into new buffers; cropping keeps the views and the buffers."""
    try:
        from transformers.cache_utils import DynamicLayer
    except ImportError:
        return None

    class GrowingLayer(DynamicLayer):
        buffers = None  # (keys, values) [B, H, capacity, D]

        def _fits(self, key_states: torch.Tensor, n: int) -> bool:
            if self.buffers is None or self.keys.dim() != 4:
                return False
            k, v = self.buffers
            return (self.keys.data_ptr() == k.data_ptr() and self.values.data_ptr() == v.data_ptr()
                    and self.keys.stride() == k.stride() and self.keys.shape[:2] == k.shape[:2]
                    and key_states.shape[:2] == k.shape[:2] and key_states.dtype == k.dtype
                    and n + key_states.shape[2] <= k.shape[2])

        def update(self, key_states, value_states, *args, **kwargs):
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            n = self.get_seq_length()
            end = n + key_states.shape[2]
            if not self._fits(key_states, n):
                B, H, _, D = key_states.shape
                capacity = end + max(GROW_SPARE, end // 8)
                buffers = tuple(x.new_empty((B, H, capacity, D)) for x in (key_states, value_states))
                if n:
                    buffers[0][:, :, :n], buffers[1][:, :, :n] = self.keys, self.values
                self.buffers = buffers
            k, v = self.buffers
            k[:, :, n:end], v[:, :, n:end] = key_states, value_states
            self.keys, self.values = k[:, :, :end], v[:, :, :end]
            return self.keys, self.values

        def batch_select_indices(self, indices: torch.Tensor) -> None:
            super().batch_select_indices(indices)
            drop_stale_buffers(self)

    return GrowingLayer


def drop_stale_buffers(layer) -> None:
    """Free a growing layer's buffers once its keys and values were replaced (row selection, compaction,
    new rows) rather than at its next update: until then they would hold the whole batch's cache a second
    time (2.3 GB for 64 rows of 620 columns of the default target in fp32)."""
    buffers = getattr(layer, "buffers", None)
    if buffers is not None and layer.keys.data_ptr() != buffers[0].data_ptr():
        layer.buffers = None


def left_pad(rows: list[list[int]], device, pad: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Token lists -> (ids [B, T] on ``device``, fed [B, T] bool on the host): right-aligned, holes (``pad``,
    False) in front."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    fed = torch.zeros((len(rows), width), dtype=torch.bool)
    for i, r in enumerate(rows):
        if r:
            ids[i, width - len(r):] = torch.tensor(r, dtype=torch.long)
            fed[i, width - len(r):] = True
    return ids.to(device), fed


def right_aligned(prefixes: list) -> tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor]:
    """Per-row cached prefixes -> the arguments of ``Decoder.add_rows``: per layer keys and values [R, H, W, D]
    with row r's prefix in its last columns (zeros before), and valid [R, W] (host bool). ``prefixes[r]``:
    (keys, values), per layer [H, n_r, D], or None for a row without one; at least one row has one."""
    like = next(p for p in prefixes if p is not None)
    widths = [0 if p is None else p[0][0].shape[1] for p in prefixes]
    width, rows = max(widths), len(prefixes)
    keys, values = [], []
    for layer in range(len(like[0])):
        H, _, D = like[0][layer].shape
        k = like[0][layer].new_zeros((rows, H, width, D))
        v = like[1][layer].new_zeros((rows, H, width, D))
        for r, (p, w) in enumerate(zip(prefixes, widths)):
            if w:
                k[r, :, width - w :], v[r, :, width - w :] = p[0][layer], p[1][layer]
        keys.append(k)
        values.append(v)
    valid = torch.arange(width)[None, :] >= width - torch.tensor(widths)[:, None]
    return keys, values, valid


def left_padded(rows: list[list[int]], pad: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Token lists -> (input_ids [B, P], attention_mask [B, P]) as ``pad.generate`` takes them: left-padded
    with ``pad``."""
    ids, fed = left_pad(rows, "cpu", pad)
    return ids, fed.long()


class Decoder:
    """A model with a KV cache of B rows; ``valid`` [B, S] says which cache columns each row attends to.

    ``valid`` lives on the model's device (masks and positions are built there) and mirrored on the host
    (``valid_host``), where crop and compaction are decided without a device-to-host sync.
    """

    def __init__(self, model, vocab: int, rows: int, grow_in_place: bool = False):
        """``grow_in_place``: keep the cache in ``growing_cache`` layers (new columns are written in place, not
        concatenated); worth it for wide batches of few new tokens a forward (the search labeler)."""
        self.model = model
        self.vocab = vocab
        self.device = next(model.parameters()).device
        self.grow_in_place = grow_in_place and growing_layer_class() is not None
        self.cache = growing_cache() if self.grow_in_place else None
        self.valid_host = torch.zeros((rows, 0), dtype=torch.bool)  # [B, S]
        self.valid = self.valid_host.to(self.device)
        self.tokens_fed = torch.zeros(rows, dtype=torch.long)  # real tokens fed per row (holes excluded)
        self.compactions = 0

    @property
    def width(self) -> int:
        """Columns of the cache (attended or holes): what a forward's attention runs over."""
        return self.valid_host.shape[1]

    def forward(self, ids: torch.Tensor, fed: torch.Tensor, keep: int) -> torch.Tensor:
        """Feed ``ids`` [B, T] on the device; ``fed`` [B, T] (host bool) is False for a hole, a column no
        one will attend to. Returns logits [B, keep, vocab] of the last ``keep`` columns."""
        fed_dev = fed.to(self.device)
        # Each row's own positions: attended columns before it, then its fed tokens (a hole repeats one).
        positions = (self.valid.sum(1, keepdim=True) + fed_dev.cumsum(1) - 1).clamp_min(0)
        self.valid_host = torch.cat([self.valid_host, fed], 1)
        self.valid = torch.cat([self.valid, fed_dev], 1)
        # Without holes the mask changes nothing: leave it out, so the model takes its plain causal path.
        mask = None if bool(self.valid_host.all()) else self.valid.long()
        out = forward_tail(self.model, ids, keep, attention_mask=mask, position_ids=positions,
                           cache=self.cache, use_cache=True)
        self.cache = returned_cache(out)
        self.tokens_fed += fed.sum(1)
        return out.logits[..., : self.vocab]

    def drop(self, holes: torch.Tensor) -> None:
        """Stop attending to columns of the last T: ``holes`` [B, T] host bool (rejected draft tokens)."""
        T = holes.shape[1]
        if T:
            self.valid_host[:, -T:] &= ~holes
            self.valid[:, -T:] &= ~holes.to(self.device)
        used = self.valid_host.any(0).nonzero()
        end = int(used.max()) + 1 if used.numel() else 0
        if end < self.valid_host.shape[1]:  # columns no row attends to at the end: crop them
            crop_cache(self.cache, end)
            self.valid_host, self.valid = self.valid_host[:, :end], self.valid[:, :end]
        # Compaction narrows the cache to its longest row: worth a copy only when that cuts enough columns.
        # (Counting every hole would also count the left padding of shorter rows, which no compaction
        # removes, and compact again after every block.)
        width = self.valid_host.shape[1]
        narrower = width - int(self.valid_host.sum(1).max()) if self.valid_host.shape[0] else 0
        if narrower and width > 16 and narrower > COMPACT_AT * width:
            self.compact()

    def select(self, rows: list[int]) -> None:
        """Keep only batch rows ``rows`` (indices), in that order (finished rows leave the batch)."""
        index = torch.tensor(rows, dtype=torch.long)
        if self.cache is not None:  # None: nothing fed yet (a draft that every block so far left out)
            self.cache.batch_select_indices(index.to(self.device))
        self.valid_host, self.valid = self.valid_host[index], self.valid[index.to(self.device)]
        self.tokens_fed = self.tokens_fed[index]
        self.drop(torch.zeros((len(rows), 0), dtype=torch.bool))

    def compact(self) -> None:
        """Gather each row's attended columns to the right end of a cache as wide as the longest row."""
        counts = self.valid_host.sum(1)
        width = int(counts.max())
        # Row b's attended columns in order (a stable sort puts them first), right-aligned; holes read column 0.
        order = torch.argsort((~self.valid_host).to(torch.int8), dim=1, stable=True)[:, :width]
        shift = width - counts
        j = torch.arange(width)[None, :]
        valid = j >= shift[:, None]
        src = torch.where(valid, torch.gather(order, 1, (j - shift[:, None]).clamp_min(0)), 0).to(self.device)
        for layer in self.cache.layers:
            B, H, _, D = layer.keys.shape
            index = src[:, None, :, None].expand(B, H, width, D)
            layer.keys = torch.gather(layer.keys, 2, index)
            layer.values = torch.gather(layer.values, 2, index)
            drop_stale_buffers(layer)
        self.valid_host, self.valid = valid, valid.to(self.device)
        self.compactions += 1

    def add_rows(self, keys: list[torch.Tensor], values: list[torch.Tensor], valid: torch.Tensor) -> None:
        """Append R rows with their own cache: per layer ``keys`` / ``values`` [R, H, W, D] and ``valid`` [R, W]
        (host bool). Rows stay right-aligned: the narrower side gets holes on the left."""
        from transformers import DynamicCache

        rows, width = valid.shape
        if self.cache is None or self.valid_host.shape[0] == 0:
            data = list(zip(keys, values))
            self.cache = growing_cache(data) if self.grow_in_place else DynamicCache(ddp_cache_data=data)
            self.valid_host, self.valid = valid.clone(), valid.to(self.device)
            self.tokens_fed = torch.zeros(rows, dtype=torch.long)
            return
        total = max(width, self.valid_host.shape[1])

        def left(t: torch.Tensor, n: int, dim: int) -> torch.Tensor:
            if n == 0:
                return t
            shape = list(t.shape)
            shape[dim] = n
            return torch.cat([t.new_zeros(shape), t], dim)

        grow, extra = total - self.valid_host.shape[1], total - width
        for layer, k, v in zip(self.cache.layers, keys, values):
            layer.keys = torch.cat([left(layer.keys, grow, 2), left(k.to(layer.keys), extra, 2)], 0)
            layer.values = torch.cat([left(layer.values, grow, 2), left(v.to(layer.values), extra, 2)], 0)
            drop_stale_buffers(layer)
        self.valid_host = torch.cat([left(self.valid_host, grow, 1), left(valid, extra, 1)], 0)
        self.valid = self.valid_host.to(self.device)
        self.tokens_fed = torch.cat([self.tokens_fed, torch.zeros(rows, dtype=torch.long)])

    def row_cache(self, j: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Batch row j's attended columns, in order: per layer keys and values [H, n, D] (copies)."""
        cols = self.valid_host[j].nonzero().flatten().to(self.device)
        keys = [layer.keys[j].index_select(1, cols) for layer in self.cache.layers]
        values = [layer.values[j].index_select(1, cols) for layer in self.cache.layers]
        return keys, values
