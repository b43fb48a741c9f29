"""How a target forward's cost grows with the tokens it scores: the number that decides whether
speculative decoding pays on a machine (verification feeds K+1 tokens per forward).

    python bench/forward_cost.py [--model NAME] [--dtype bfloat16] [--max-tokens 8]
    python bench/forward_cost.py --batch 1,2,4,8,16 [--tokens 9] [--prefix 512]
    python bench/forward_cost.py --cost-model [--batch 1,2,4,8,16] [--model NAME]
    python bench/forward_cost.py --draft-cost [--draft NAME] [--prefix 512] [--vocab N,...] [--compile]
    python bench/forward_cost.py --block-sweep [--batch 1,4,16] [--prefix 512]

Prints the median time of a forward over n new tokens (after a 64-token prefix) and its ratio to n = 1.
With ``--batch``: for each batch size B, a forward over B rows of one token against B rows of ``--tokens``
(a verification block of K = tokens - 1) after a ``--prefix``-column cache, each with transformers' cache
(which concatenates the new columns to a copy of the whole cache at every forward) and with one that grows
in place (``Decoder(..., grow_in_place=True)``); and what the two ways of keeping ragged rows in one cache
cost there (``pad/decoding/decoder.py``): a copy of the whole cache (unpad and re-pad every block) and a
forward whose cache has half its columns masked out (holes). The cached columns are random keys and values
(a forward's time does not depend on them; a prefill of 16 x 512 tokens takes minutes on a CPU without
native bf16).
With ``--cost-model``: the cost model of ``num_draft_tokens="auto"`` (``pad.decoding.draft_length.ForwardCost``)
checked against measurements: forwards at every B of ``--batch`` x T in 1, 2, 3, 5, 9, 13 x S in 128, 512,
then per shape the measured time, the model fitted to what a decode at the largest B probes on its own
(B = 1 and the largest B, T = 1, 2, 5, 13, S = 128; a decode probes T = 1, 2, 7, 13 at its prompt's width)
and the model fitted to the whole grid.
With ``--draft-cost``: what a draft token costs against a target forward over one token, at one row after a
``--prefix``-column cache, in one run: the target's forward, the draft's forward as loaded, with int8 or int4
weights (``pad.decoding.int8``, ``pad.decoding.int4``), with pad's fused attention, with it and the lean forward
(``pad.decoding.draft_forward``), with int8 weights and the fused attention, with the lean forward as well (the
``--fast-draft`` of the command line), the same with int4 weights, with its output layer pruned to each of the
``--vocab`` most frequent tokens (``pad.decoding.vocab_prune``), with int8 weights and each pruned head, and with
the fused attention too, each with its ratio to the target's; with ``--compile`` also the int8, fused-attention
forward under ``torch.compile`` (``--vocab ""``: no pruned heads).
With ``--block-sweep``: a verification block's forward over T = 1..64 new tokens per row at each B of
``--batch`` (default 1, 4, 16) after a ``--prefix``-column cache (random keys and values in transformers' cache,
as decoding keeps the target's): milliseconds, the ratio to T = 1 (what a block of K = T - 1 drafts costs
beyond a plain step) and milliseconds per token, the curve up to which longer blocks can pay.
"""
import argparse
import platform
import statistics
import time

import torch

from transformers import DynamicCache

from pad.decoding.decoder import growing_cache
from pad.decoding.draft_length import ForwardCost, measure
from pad.decoding.hf import crop_cache, forward_tail, kv_shape, returned_cache
from pad.machine import median_seconds
from pad.models.registry import DEFAULT_DRAFT, DEFAULT_TARGET, load


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_TARGET)
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--batch", help="comma-separated batch sizes: measure batched forwards instead")
    parser.add_argument("--tokens", type=int, default=9, help="with --batch: new tokens per row (K + 1)")
    parser.add_argument("--prefix", type=int, default=512, help="with --batch: cached columns per row")
    parser.add_argument("--cost-model", action="store_true", help="check the cost model of -k auto (see above)")
    parser.add_argument("--draft-cost", action="store_true", help="a draft token against a target forward (above)")
    parser.add_argument("--draft", default=DEFAULT_DRAFT, help="with --draft-cost: the draft model")
    parser.add_argument("--vocab", default="32768", help="with --draft-cost: the pruned heads' sizes (comma-separated)")
    parser.add_argument("--compile", action="store_true",
                        help="with --draft-cost: also the --fast-draft forward under torch.compile")
    parser.add_argument("--block-sweep", action="store_true", help="blocks of T = 1..64 tokens per row (above)")
    args = parser.parse_args()
    model, _ = load(args.model, dtype=args.dtype)
    print(f"{args.model} {args.dtype} | torch {torch.__version__} | {platform.processor() or platform.machine()}, "
          f"{torch.get_num_threads()} threads | CPU capability {torch.backends.cpu.get_cpu_capability()}")
    if args.cost_model:
        return cost_model(model, [int(b) for b in (args.batch or "1,2,4,8,16").split(",")])
    if args.draft_cost:
        return draft_cost(model, load(args.draft, dtype=args.dtype)[0], args.prefix, args.repeats,
                          [int(n) for n in args.vocab.split(",") if n], args.compile)
    if args.block_sweep:
        return block_sweep(model, [int(b) for b in (args.batch or "1,4,16").split(",")], args.prefix, args.repeats)
    if args.batch:
        return batched(model, [int(b) for b in args.batch.split(",")], args.tokens, args.prefix, args.repeats)
    print("| new tokens | median ms | x one token |\n|---|---|---|")
    g = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        cache = returned_cache(model(torch.randint(0, 1000, (1, 64), generator=g), use_cache=True))
        base = None
        for n in range(1, args.max_tokens + 1):
            times = []
            for _ in range(args.repeats):
                ids = torch.randint(0, 1000, (1, n), generator=g)
                start = time.perf_counter()
                forward_tail(model, ids, n, cache=cache, use_cache=True)
                times.append(time.perf_counter() - start)
                crop_cache(cache, 64)
            median = statistics.median(times)
            base = base or median
            print(f"| {n} | {median * 1e3:.1f} | {median / base:.2f} |")


def one_token_ms(model, prefix: int, repeats: int, warmup: int = 0) -> float:
    """Median ms of a forward over one new token at one row after a ``prefix``-token cache (after ``warmup``
    untimed ones)."""
    g = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        cache = returned_cache(model(torch.randint(0, 1000, (1, prefix), generator=g), use_cache=True))
        ids = torch.randint(0, 1000, (1, 1), generator=g)

        def step():
            forward_tail(model, ids, 1, cache=cache, use_cache=True)
            crop_cache(cache, prefix)

        return median_seconds(step, repeats, warmup) * 1e3


def draft_cost(target, draft, prefix: int, repeats: int, vocabs: list[int], compiled: bool = False) -> None:
    import copy

    from pad.decoding.fast_draft import use_fast_draft

    def variant(vocab, weights, fused=False, lean=False):
        model = copy.deepcopy(draft)
        use_fast_draft(model, vocab=vocab, weights=weights, fused_attention=fused, lean=lean)
        return model

    rows = [("target, one token", one_token_ms(target, prefix, repeats)),
            ("draft as loaded, one token", one_token_ms(draft, prefix, repeats)),
            ("draft with int8 weights, one token", one_token_ms(variant(None, "int8"), prefix, repeats)),
            ("draft with int4 weights, one token", one_token_ms(variant(None, "int4"), prefix, repeats)),
            ("draft with the fused attention, one token", one_token_ms(variant(None, None, True), prefix, repeats)),
            ("draft with the fused attention and the lean forward, one token",
             one_token_ms(variant(None, None, True, True), prefix, repeats)),
            ("draft with int8 weights and the fused attention, one token",
             one_token_ms(variant(None, "int8", True), prefix, repeats)),
            ("the same with the lean forward (--fast-draft), one token",
             one_token_ms(variant(None, "int8", True, True), prefix, repeats)),
            ("draft with int4 weights, the fused attention and the lean forward (--fast-draft --draft-weights "
             "int4), one token", one_token_ms(variant(None, "int4", True, True), prefix, repeats))]
    if compiled:  # the forward compiled whole (dynamic shapes); transformers' cache update breaks the graph
        model = variant(None, "int8", True)
        model.forward = torch.compile(model.forward, dynamic=True)
        rows.append(("draft with int8 weights and the fused attention under torch.compile(dynamic=True), one token "
                     "(after 5 untimed)",
                     one_token_ms(model, prefix, repeats, warmup=5)))
    for n in vocabs:
        rows.append((f"draft scoring the {n} most frequent tokens, one token",
                     one_token_ms(variant(n, None), prefix, repeats)))
        rows.append((f"draft scoring the {n} most frequent tokens, int8 weights, one token",
                     one_token_ms(variant(n, "int8"), prefix, repeats)))
        rows.append((f"draft scoring the {n} most frequent tokens, int8 weights, fused attention, one token",
                     one_token_ms(variant(n, "int8", True), prefix, repeats)))
    print(f"one row, {prefix}-column cache, median of {repeats}")
    print("| forward | ms | x the target's |\n|---|---|---|")
    for name, ms in rows:
        print(f"| {name} | {ms:.1f} | {ms / rows[0][1]:.3f} |")


def cost_model(model, sizes: list[int]) -> None:
    grid = measure(model, sizes, [1, 2, 3, 5, 9, 13], [128, 512])
    largest = max(sizes)
    probed = ForwardCost(o for o in grid.observations if o[0] in (1, largest) and o[1] in (1, 2, 5, 13) and o[2] == 128)
    probed.fit()
    grid.fit()
    print(f"knee: probed fit {probed.knee:g} tokens, grid fit {grid.knee:g} tokens")
    print("| B | T | S | measured ms | probed fit ms | error | grid fit ms | error |")
    print("|---|---|---|---|---|---|---|---|")
    errors = {"probed": [], "grid": []}
    for b, t, s, seconds in grid.observations:
        p1, p2 = probed.predict(b, t, s), grid.predict(b, t, s)
        errors["probed"].append(abs(p1 / seconds - 1))
        errors["grid"].append(abs(p2 / seconds - 1))
        print(f"| {b} | {t} | {s} | {seconds * 1e3:.1f} | {p1 * 1e3:.1f} | {p1 / seconds - 1:+.1%} | {p2 * 1e3:.1f} "
              f"| {p2 / seconds - 1:+.1%} |", flush=True)
    for name, e in errors.items():
        print(f"{name} fit: mean |error| {statistics.mean(e):.1%}, largest {max(e):.1%}")


def _median_ms(fn, repeats: int) -> float:
    return median_seconds(fn, repeats) * 1e3


def random_cache(model, rows: int, columns: int, g: torch.Generator) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer random (keys, values) [rows, H, columns, D] in the model's dtype: a forward's time does not depend
    on them, and a prefill that long takes minutes on a CPU."""
    layers, heads, head_dim = kv_shape(model)
    dtype = next(model.parameters()).dtype
    return [tuple(torch.randn(rows, heads, columns, head_dim, generator=g).to(dtype) for _ in "kv")
            for _ in range(layers)]


SWEEP_TOKENS = (1, 2, 3, 5, 9, 13, 17, 25, 33, 49, 65)


def block_sweep(model, sizes: list[int], prefix: int, repeats: int) -> None:
    print(f"prefix {prefix} cached columns per row; median of {repeats}")
    print("| B | T | ms | x T = 1 | ms per token |\n|---|---|---|---|---|")
    g = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for B in sizes:
            cache = DynamicCache(ddp_cache_data=random_cache(model, B, prefix, g))
            base = None
            for t in SWEEP_TOKENS:
                ids = torch.randint(0, 1000, (B, t), generator=g)

                def forward():
                    forward_tail(model, ids, t, cache=cache, use_cache=True)
                    crop_cache(cache, prefix)

                forward()  # a new shape's first forward also sets kernels up
                ms = _median_ms(forward, repeats)
                base = base or ms
                print(f"| {B} | {t} | {ms:.1f} | {ms / base:.2f} | {ms / (B * t):.2f} |", flush=True)


def batched(model, sizes: list[int], tokens: int, prefix: int, repeats: int) -> None:
    print(f"prefix {prefix} cached columns per row; a block feeds {tokens} tokens per row")
    print(f"| B | B x 1 token, ms | grown in place, ms | B x {tokens} tokens, ms | grown in place, ms | ratio "
          f"| ms per row and block | cache copy, ms | half the cache masked, ms |\n|---|---|---|---|---|---|---|---|---|")
    g = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for B in sizes:
            data = random_cache(model, B, prefix, g)
            cache, grown = DynamicCache(ddp_cache_data=data), growing_cache(data)

            def forward(n, mask=None, cache=cache):
                ids = torch.randint(0, 1000, (B, n), generator=g)
                forward_tail(model, ids, n, cache=cache, use_cache=True, attention_mask=mask)
                crop_cache(cache, prefix)

            one = _median_ms(lambda: forward(1), repeats)
            one_grown = _median_ms(lambda: forward(1, cache=grown), repeats)
            block = _median_ms(lambda: forward(tokens), repeats)
            block_grown = _median_ms(lambda: forward(tokens, cache=grown), repeats)
            # Unpad and re-pad: every layer's keys and values gathered into a fresh cache, once per block.
            index = torch.arange(prefix)[None, None, :, None]

            def copy():
                for layer in cache.layers:
                    i = index.expand(B, layer.keys.shape[1], prefix, layer.keys.shape[3])
                    torch.gather(layer.keys, 2, i), torch.gather(layer.values, 2, i)

            copied = _median_ms(copy, repeats)
            holes = torch.ones((B, prefix + tokens), dtype=torch.long)
            holes[:, : prefix : 2] = 0  # every other cached column is a hole
            masked = _median_ms(lambda: forward(tokens, holes), repeats)
            print(f"| {B} | {one:.1f} | {one_grown:.1f} | {block:.1f} | {block_grown:.1f} | {block / one:.2f} "
                  f"| {block / B:.1f} | {copied:.1f} | {masked:.1f} |", flush=True)


if __name__ == "__main__":
    main()
