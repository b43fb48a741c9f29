"""Decoder(grow_in_place=True): the cache layers write new columns in place, and every operation of the
Decoder (forward with holes, crop, row selection, compaction, new rows, a row's cache) gives exactly what
the plain DynamicCache gives."""
import torch

from pad.decoding.decoder import Decoder, growing_layer_class, left_pad
from tiny import tiny_model


def _script(decoder: Decoder, g: torch.Generator) -> list[torch.Tensor]:
    """A fixed sequence of the Decoder's operations; returns every logits tensor and row cache it made."""
    out = []

    def feed(rows):
        ids, fed = left_pad(rows, "cpu")
        out.append(decoder.forward(ids, fed, keep=ids.shape[1]))

    def tokens(n):
        return torch.randint(0, 96, (n,), generator=g).tolist()

    lengths = [5, 9, 7]
    keys = [torch.randn(3, 2, 9, 8, generator=g) for _ in range(2)]
    values = [torch.randn(3, 2, 9, 8, generator=g) for _ in range(2)]
    valid = torch.tensor([[c >= 9 - n for c in range(9)] for n in lengths])
    decoder.add_rows(keys, values, valid)
    for step in range(12):
        feed([tokens(1 + (step + r) % 3) for r in range(len(decoder.valid_host))])
        holes = torch.rand(decoder.valid_host.shape[0], 3, generator=g) < 0.4  # rejected guesses
        holes[:, 0] = False
        decoder.drop(holes)
        if step == 4:
            decoder.select([2, 0])
        if step == 6:
            decoder.compact()
        if step == 8:
            k = [torch.randn(1, 2, 4, 8, generator=g) for _ in range(2)]
            v = [torch.randn(1, 2, 4, 8, generator=g) for _ in range(2)]
            decoder.add_rows(k, v, torch.ones(1, 4, dtype=torch.bool))
        out += [x for part in decoder.row_cache(0) for x in part]
    return out


def test_same_results_as_the_plain_cache():
    model = tiny_model("llama", seed=21)
    with torch.inference_mode():
        plain = _script(Decoder(model, 96, 0), torch.Generator().manual_seed(3))
        growing = Decoder(model, 96, 0, grow_in_place=True)
        got = _script(growing, torch.Generator().manual_seed(3))
    assert len(got) == len(plain)
    for a, b in zip(got, plain):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert all(type(layer) is growing_layer_class() for layer in growing.cache.layers)


def test_steps_write_in_place():
    model = tiny_model("llama", seed=22)
    decoder = Decoder(model, 96, 2, grow_in_place=True)
    g = torch.Generator().manual_seed(4)
    with torch.inference_mode():
        ids, fed = left_pad([torch.randint(0, 96, (n,), generator=g).tolist() for n in (6, 4)], "cpu")
        decoder.forward(ids, fed, keep=1)
        layer = decoder.cache.layers[0]
        base, capacity = layer.keys.data_ptr(), layer.buffers[0].shape[2]
        assert capacity > 6  # spare columns after the first forward
        for _ in range(capacity - 6):  # one column a step fills the spare columns without a copy
            decoder.forward(torch.randint(0, 96, (2, 1), generator=g), torch.ones(2, 1, dtype=torch.bool), keep=1)
            assert layer.keys.data_ptr() == base and layer.keys.shape[2] <= capacity
        decoder.forward(torch.randint(0, 96, (2, 1), generator=g), torch.ones(2, 1, dtype=torch.bool), keep=1)
        assert layer.keys.data_ptr() != base and layer.buffers[0].shape[2] > capacity  # full: reallocated


def test_replaced_buffers_are_freed_at_once():
    """Row selection, compaction and new rows replace the keys and values: the buffers they were views of
    must be freed then, not held (a second copy of the whole cache) until the layer's next update."""
    import gc
    import weakref

    model = tiny_model("llama", seed=23)
    decoder = Decoder(model, 96, 3, grow_in_place=True)
    g = torch.Generator().manual_seed(5)
    with torch.inference_mode():
        ids, fed = left_pad([torch.randint(0, 96, (n,), generator=g).tolist() for n in (6, 4, 5)], "cpu")
        decoder.forward(ids, fed, keep=1)
        k = [torch.randn(1, 2, 4, 8, generator=g) for _ in range(2)]
        v = [torch.randn(1, 2, 4, 8, generator=g) for _ in range(2)]
        operations = {"select": lambda: decoder.select([2, 0]), "compact": decoder.compact,
                      "add_rows": lambda: decoder.add_rows(k, v, torch.ones(1, 4, dtype=torch.bool))}
        for name, operation in operations.items():
            step = torch.randint(0, 96, (decoder.valid_host.shape[0], 1), generator=g)
            decoder.forward(step, torch.ones_like(step, dtype=torch.bool), keep=1)  # keys are buffer views again
            refs = [weakref.ref(b) for layer in decoder.cache.layers for b in layer.buffers]
            operation()
            gc.collect()
            assert all(r() is None for r in refs), name
        step = torch.randint(0, 96, (decoder.valid_host.shape[0], 1), generator=g)
        decoder.forward(step, torch.ones_like(step, dtype=torch.bool), keep=1)
        assert all(layer.keys.data_ptr() == layer.buffers[0].data_ptr() for layer in decoder.cache.layers)
