"""Grouped-query attention of a few new tokens per row: SDPA against the fused CPU kernel, side by side.

    python bench/attention_cost.py [--shapes 64x3x700,16x9x700,1x9x700,64x1x700] [--model NAME]

For each shape B x T x S (rows, new tokens per row, cached columns) prints the median time of one layer's
attention with the default target's heads (12 query heads over 2 key/value heads, head dim 128, bf16):
transformers' grouped SDPA path (``pad.decoding.attention.gqa_sdpa_attention``) and
``pad_kernels.attention.gqa_attention``; then, unless ``--no-model``, a whole forward of the model over
the same shape on a random cache (no prefill: the cache is filled with random keys and values), with
the rows' left padding drawn at random (0 to 40% of the columns, as in a ragged batch), once on each
attention path. The search labeler runs 64 rows x 3 tokens (``--batch 64 --lookahead 2``), batched
decoding 16 rows x 9 tokens (K = 8).
"""
import argparse
import platform

import torch

from pad.decoding.attention import use_gqa_sdpa
from pad.decoding.hf import crop_cache, forward_tail, text_config
from pad.machine import median_seconds
from pad_kernels.attention import gqa_attention


def _median_ms(fn, repeats: int) -> float:
    return median_seconds(fn, repeats, warmup=1) * 1e3


def _mask(B: int, T: int, S: int, g) -> torch.Tensor:
    """[B, S + T] long: each row's first 0-40% of the cached columns are left padding."""
    mask = torch.ones(B, S + T, dtype=torch.long)
    for b, pad in enumerate(torch.randint(0, int(0.4 * S) + 1, (B,), generator=g).tolist()):
        mask[b, :pad] = 0
    mask[0, 0] = 0  # at least one hole, so that the forward takes a mask
    return mask


def layer_times(B, T, S, repeats, g):
    Hq, Hkv, D = 12, 2, 128
    q = torch.randn(B, T, Hq, D, generator=g).bfloat16().transpose(1, 2)
    k = torch.randn(B, Hkv, S + T, D, generator=g).bfloat16()
    v = torch.randn(B, Hkv, S + T, D, generator=g).bfloat16()
    m2 = _mask(B, T, S, g).bool()
    mask = m2[:, None, None, :] & torch.ones(T, S + T, dtype=torch.bool).tril(S)[None, None]
    sdpa = _median_ms(lambda: torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, scale=D**-0.5, enable_gqa=True).transpose(1, 2).contiguous(), repeats)
    fused = _median_ms(lambda: gqa_attention(q, k, v, mask, D**-0.5), repeats)
    return sdpa, fused


def model_times(model, B, T, S, repeats, g):
    from transformers import DynamicCache

    cfg = text_config(model)
    Hkv, D = cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads
    dtype = next(model.parameters()).dtype
    layers = [(torch.randn(B, Hkv, S, D, generator=g).to(dtype), torch.randn(B, Hkv, S, D, generator=g).to(dtype))
              for _ in range(cfg.num_hidden_layers)]
    mask = _mask(B, T, S, g)
    positions = (mask.cumsum(1) - 1).clamp_min(0)[:, S:]
    ids = torch.randint(0, 1000, (B, T), generator=g)
    cache = DynamicCache(ddp_cache_data=layers)
    out = []
    for fused in (False, True):
        use_gqa_sdpa(model, fused_cpu=fused)

        def forward():
            forward_tail(model, ids, T, cache=cache, use_cache=True, attention_mask=mask, position_ids=positions)
            crop_cache(cache, S)

        out.append(_median_ms(forward, repeats))
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="64x3x700,16x9x700,1x9x700,64x1x700", help="BxTxS, comma-separated")
    parser.add_argument("--model", help="registry name of the model (default: the default target)")
    parser.add_argument("--no-model", action="store_true", help="time the attention op only")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]
    model = None
    if not args.no_model:
        from pad.models.registry import DEFAULT_TARGET, load

        model, _ = load(args.model or DEFAULT_TARGET, dtype="bfloat16")
    print(f"bf16 | torch {torch.__version__} | {platform.processor() or platform.machine()}, "
          f"{torch.get_num_threads()} threads | CPU capability {torch.backends.cpu.get_cpu_capability()}")
    head = "| B x T x S | one layer: SDPA ms | fused ms | ratio |"
    print(head + (" forward: SDPA ms | fused ms | ratio |" if model else ""))
    print("|---" * (head.count("|") - 1 + (3 if model else 0)) + "|")
    g = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for B, T, S in shapes:
            sdpa, fused = layer_times(B, T, S, args.repeats, g)
            row = f"| {B} x {T} x {S} | {sdpa:.2f} | {fused:.2f} | {sdpa / fused:.2f} |"
            if model:
                a, b = model_times(model, B, T, S, max(3, args.repeats // 2), g)
                row += f" {a:.0f} | {b:.0f} | {a / b:.2f} |"
            print(row, flush=True)


if __name__ == "__main__":
    main()
