"""Weight-only int8 linear layers (a draft model's, on the CPU): PyTorch's own int8 packed matmul.

Where lookups miss, a block's time is mostly the draft model's forwards, one per draft token, and at a few rows
a forward is memory-bound: its weights are read once per token. Int8 weights with one scale per output row (a
half of bf16's bytes) are multiplied by bf16 activations in ``torch.ops.aten._weight_int8pack_mm``, PyTorch's
own CPU kernel; the output layer, the draft's largest matrix, goes too (what it buys: ``python
bench/forward_cost.py --draft-cost``, bench/README.md).

Past a few rows, and with fp32 activations, the packed kernel is slower than a dense matmul: there the layer
multiplies by its dequantized weights (the same int8-rounded values, made at the first such call and kept
beside the int8 ones, so a model that prefills holds both), so a prompt's prefill keeps dense speed.

Exact decoding stays exact whatever the draft computes: the target decides every token (tests/test_int8.py).
The draft's proposals, and so the acceptance and speed, change a little; a run log records the draft's weights
as int8 (``pad-decoding bench --draft-weights int8``), so such runs are never mixed with others.
"""
from __future__ import annotations

import torch
from torch import nn


BF16_MULTIPLE = 16  # the bf16 kernel's row length must be a multiple of this; other layers multiply densely
# Rows (tokens of all sequences) up to which the packed kernel is faster than a dense bf16 matmul of the same,
# dequantized weights: at one row it reads half the bytes, but it slows with every row and is level at 16, far
# behind over a prompt (``python bench/linear_cost.py --int8``, bench/README.md). A prefill multiplies densely.
PACKED_MAX_ROWS = 12


class Int8Linear(nn.Module):
    """An ``nn.Linear`` with int8 weights [out, in] and one scale per output row (symmetric, max-abs / 127):
    [..., in] -> [..., out] in the activations' dtype (bf16 or fp32).

    Up to ``PACKED_MAX_ROWS`` rows of bf16 activations go through PyTorch's packed int8 kernel; more rows, and
    fp32 activations (for which that kernel is an order of magnitude slower than a dense matmul), are multiplied
    by the dequantized weights, made once per dtype: the same int8-rounded weights either way."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        w = linear.weight.detach().float()
        scales = w.abs().amax(1).clamp_min(torch.finfo(torch.float32).tiny) / 127.0
        self.register_buffer("weight", torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8))
        self.register_buffer("scales", scales)
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().clone())
        self._cast: dict[torch.dtype, torch.Tensor] = {}  # the scales in each activation dtype, made once
        self._dense: dict[torch.dtype, torch.Tensor] = {}  # the dequantized weights [out, in] per dtype, made once

    def packed(self, x: torch.Tensor) -> bool:
        """Whether ``x`` [..., in] goes through the packed int8 kernel."""
        return (x.dtype == torch.bfloat16 and not self.in_features % BF16_MULTIPLE
                and x.numel() // self.in_features <= PACKED_MAX_ROWS)

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """The weights as a dense [out, in] matrix in ``dtype`` (int8 values times their row's scale)."""
        if dtype not in self._dense:
            self._dense[dtype] = (self.weight.float() * self.scales[:, None]).to(dtype)
        return self._dense[dtype]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # As rows of a matrix: a strided 3-D input (the output layer's last positions) would make torch
        # multiply batch by batch, copying the weights once per batch entry.
        rows = x.reshape(-1, self.in_features)
        bias = None if self.bias is None else self.bias.to(x.dtype)
        if self.packed(x):
            scales = self._cast.get(x.dtype)
            if scales is None:
                scales = self._cast[x.dtype] = self.scales.to(x.dtype)
            out = packed_mm(rows, self.weight, scales)
            out = out if bias is None else out + bias
        else:
            out = nn.functional.linear(rows, self.dequantized(x.dtype), bias)
        return out.reshape(*x.shape[:-1], self.out_features)


def packed_mm(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """PyTorch's packed int8 matmul: x [M, in] (bf16) @ (weight [out, in] int8 * scales [out])^T -> [M, out]."""
    return torch.ops.aten._weight_int8pack_mm(x, weight, scales)


def available() -> bool:
    """Whether this torch has the int8 packed matmul on the CPU."""
    return hasattr(torch.ops.aten, "_weight_int8pack_mm")


def use_int8_weights(model: nn.Module) -> int:
    """Replace every CPU ``nn.Linear`` (bf16 or fp32) of ``model`` with an ``Int8Linear``, the output layer too
    (a layer registered under two parents is converted once; an input embedding tied to the output layer keeps
    its own weights). Marks the model (``model.pad_int8 = True``) so that its measured forward costs are kept
    apart from the unquantized model's. Returns the number of layers replaced (0 where torch lacks the kernel).
    """
    if not available():
        return 0
    swaps = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
             if type(child) is nn.Linear and child.weight.device.type == "cpu"
             and child.weight.dtype in (torch.float32, torch.bfloat16)]
    converted = {}
    for parent, name, child in swaps:
        if id(child) not in converted:
            converted[id(child)] = Int8Linear(child)
        setattr(parent, name, converted[id(child)])
    if converted:
        model.pad_int8 = True
    return len(converted)
