"""A model's fp32 linear layers on the CPU: torch's default (MKL) against oneDNN
(``pad.decoding.onednn.OneDNNLinear``, what ``use_onednn_linear`` puts in), side by side in one run; with
``--int8``, its bf16 linear layers dense against PyTorch's packed int8 kernel (``pad.decoding.int8.packed_mm``),
the rows up to which ``Int8Linear`` takes that kernel (``PACKED_MAX_ROWS``); with ``--int4``, the same for
``Int4Linear`` (``pad.decoding.int4``, its layers as ``Int4Linear`` holds them).

    python bench/linear_cost.py [--model NAME] [--rows 1,16,64,107] [--threads 2] [--repeats 5]
    python bench/linear_cost.py --int8 --model qwen2.5-coder-0.5b-instruct --rows 1,2,4,8,16,32
    python bench/linear_cost.py --int4 --model qwen2.5-coder-0.5b-instruct --rows 1,2,4,8,16,32

For each number of rows (one token each, as a decode step or the search labeler's running batch): the
median time of every linear layer of one forward (each shape once, weighted by how many blocks have it,
plus the output layer), on random weights of the model's shapes, read from its config (no weights load).
"""
import argparse
import platform

import torch
from torch import nn
from transformers import AutoConfig

from pad.decoding.int4 import Int4Linear
from pad.decoding.int8 import packed_mm
from pad.decoding.onednn import OneDNNLinear

from pad.machine import median_seconds
from pad.models.registry import DEFAULT_TARGET, resolve


def shapes(cfg) -> list[tuple[int, int, bool, int]]:
    """(in, out, bias, count) of every linear layer of a Qwen2/Llama-style decoder."""
    cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    H, I, L = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers
    heads, kv = cfg.num_attention_heads, getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    D = getattr(cfg, "head_dim", None) or H // heads
    bias = bool(getattr(cfg, "attention_bias", cfg.model_type == "qwen2"))
    return [(H, heads * D, bias, L), (H, kv * D, bias, 2 * L), (heads * D, H, False, L), (H, I, False, 2 * L),
            (I, H, False, L), (H, cfg.vocab_size, False, 1)]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_TARGET)
    parser.add_argument("--rows", default="1,16,64,107", help="comma-separated numbers of rows")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--int8", action="store_true", help="bf16 dense against the packed int8 kernel (above)")
    parser.add_argument("--int4", action="store_true", help="bf16 dense against the packed int4 kernel (above)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    cfg = AutoConfig.from_pretrained(resolve(args.model))
    if args.int8:
        return int8_against_dense(args, cfg)
    if args.int4:
        return int4_against_dense(args, cfg)

    def pair(i, o, bias, rows, g):
        dense = nn.Linear(i, o, bias=bias)
        onednn = OneDNNLinear(dense)
        x = torch.randn(rows, 1, i, generator=g)
        return lambda: dense(x), lambda: onednn(x)

    side_by_side(args, cfg, "float32", ("MKL", "oneDNN", "ratio"), pair, lambda a, b: a / b, digits=0)


def int8_against_dense(args, cfg) -> None:
    def pair(i, o, _, rows, g):
        w = torch.randn(o, i, generator=g)
        scales = w.abs().amax(1) / 127
        q = torch.round(w / scales[:, None]).to(torch.int8)
        dense, scales = w.bfloat16(), scales.bfloat16()
        x = torch.randn(rows, i, generator=g).bfloat16()
        return lambda: x @ dense.T, lambda: packed_mm(x, q, scales)

    side_by_side(args, cfg, "bf16", ("dense bf16", "packed int8", "int8 / dense"), pair, lambda a, b: b / a, digits=1)


def int4_against_dense(args, cfg) -> None:
    def pair(i, o, _, rows, g):
        layer = Int4Linear(nn.Linear(i, o, bias=False))
        dense = layer.dequantize().bfloat16()
        x = torch.randn(rows, i, generator=g).bfloat16()
        return lambda: x @ dense.T, lambda: layer.packed_mm(x)

    side_by_side(args, cfg, "bf16", ("dense bf16", "packed int4", "int4 / dense"), pair, lambda a, b: b / a, digits=1)


def side_by_side(args, cfg, dtype: str, names: tuple, pair, ratio, digits: int) -> None:
    """Per number of rows, one forward's worth of both ways of every linear layer (``pair(in, out, bias, rows,
    generator)`` -> the two calls), each shape weighted by how many blocks have it; a table row each."""
    print(f"{args.model} {dtype} linear layers | torch {torch.__version__} | "
          f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads | "
          f"CPU capability {torch.backends.cpu.get_cpu_capability()}")
    print(f"| rows | {names[0]}, ms | {names[1]}, ms | {names[2]} |\n|---|---|---|---|")
    g = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for rows in [int(r) for r in args.rows.split(",")]:
            total = [0.0, 0.0]
            for i, o, bias, count in shapes(cfg):
                for j, call in enumerate(pair(i, o, bias, rows, g)):
                    total[j] += count * median_seconds(call, args.repeats, warmup=1)
            print(f"| {rows} | {total[0] * 1e3:.{digits}f} | {total[1] * 1e3:.{digits}f} | "
                  f"{ratio(*total):.2f} |", flush=True)

if __name__ == "__main__":
    main()
