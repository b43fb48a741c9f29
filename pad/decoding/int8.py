"""Weight-only int8 linear layers (a draft model's, on the CPU): PyTorch's own int8 packed matmul.

Where lookups miss, a block's time is mostly the draft model's forwards, one per draft token, and at a few rows
a forward is memory-bound: its weights are read once per token. Int8 weights with one scale per output row (a
half of bf16's bytes) are multiplied by bf16 activations in ``torch.ops.aten._weight_int8pack_mm``, PyTorch's
own CPU kernel; the output layer, the draft's largest matrix, goes too (what it buys: ``python
bench/forward_cost.py --draft-cost``, bench/README.md). ``pad.decoding.int4`` is the same with 4-bit weights.

Past a few rows, and with fp32 activations, a packed kernel is slower than a dense matmul: there the layer
multiplies by its dequantized weights (the same rounded values, made at the first such call and kept beside the
packed ones, so a model that prefills holds both), so a prompt's prefill keeps dense speed.

Exact decoding stays exact whatever the draft computes: the target decides every token (tests/test_int8.py).
The draft's proposals, and so the acceptance and speed, change a little; a run log records the draft's weights
(``pad-decoding bench --draft-weights int8``), so such runs are never mixed with others.
"""
from __future__ import annotations

import abc
from typing import Callable

import torch
from torch import nn


BF16_MULTIPLE = 16  # the bf16 kernel's row length must be a multiple of this; other layers multiply densely
# Rows (tokens of all sequences) up to which the packed kernel is faster than a dense bf16 matmul of the same,
# dequantized weights: at one row it reads half the bytes, but it slows with every row and is level at 16, far
# behind over a prompt (``python bench/linear_cost.py --int8``, bench/README.md). A prefill multiplies densely.
PACKED_MAX_ROWS = 12


def joined_rows(layers: list[nn.Module], parts: list[torch.Tensor | None],
                rebind: Callable[[nn.Module, torch.Tensor], None]) -> torch.Tensor | None:
    """``parts`` (one tensor per layer, output rows first, or all None) concatenated along the rows; each layer's
    part is rebound (``rebind(layer, view)``) to its rows of the result, so the rows are held once."""
    if parts[0] is None:
        return None
    whole = torch.cat(parts)
    for layer, view in zip(layers, whole.split([p.shape[0] for p in parts])):
        rebind(layer, view)
    return whole


class PackedLinear(nn.Module, metaclass=abc.ABCMeta):
    """A linear layer with packed, weight-only quantized weights: [..., in] -> [..., out] in the activations'
    dtype. Up to ``max_rows`` rows of bf16 activations go through the packed kernel (``packed_mm``); more rows,
    and fp32 activations, are multiplied by the dequantized weights, made once per dtype.

    Every tensor named in ``ROW_TENSORS`` has the output rows as its first dim, so layers of one kind side by
    side are one layer of their tensors concatenated (``joined``), where each but the last has a multiple of
    ``ROW_BLOCK`` rows (a kernel may pack rows in blocks)."""

    ROW_TENSORS: tuple[str, ...] = ()
    ROW_BLOCK = 1
    max_rows = PACKED_MAX_ROWS

    def __init__(self, in_features: int, tensors: dict):
        super().__init__()
        self.in_features = in_features
        self.out_features = tensors[self.ROW_TENSORS[0]].shape[0]
        for name in self.ROW_TENSORS:
            self.register_buffer(name, tensors[name])
        self.forget()

    def forget(self) -> None:
        """Drop what was derived from the tensors (after they were replaced)."""
        self._cast: dict[torch.dtype, object] = {}  # the kernel's extra inputs per activation dtype, made once
        self._dense: dict[torch.dtype, torch.Tensor] = {}  # the dequantized weights [out, in] per dtype, made once

    @classmethod
    def joinable(cls, layers: list[nn.Module]) -> bool:
        """Whether ``joined`` takes ``layers``: all of this class, each but the last of whole ``ROW_BLOCK`` blocks."""
        return all(type(p) is cls for p in layers) and not any(p.out_features % cls.ROW_BLOCK for p in layers[:-1])

    @classmethod
    def joined(cls, layers: list["PackedLinear"]) -> "PackedLinear":
        """One layer computing ``layers`` (this class, one input) side by side, [..., in] -> [..., sum of outs]:
        their tensors (and dequantized weights) concatenated, each layer's own becoming views of the new layer's,
        so nothing is held twice. Each but the last must have a multiple of ``ROW_BLOCK`` rows."""
        if not cls.joinable(layers):
            raise ValueError(f"only {cls.__name__} layers of whole {cls.ROW_BLOCK}-row blocks are joined")
        whole = {name: joined_rows(layers, [getattr(p, name) for p in layers],
                                   lambda layer, view, n=name: setattr(layer, n, view))
                 for name in cls.ROW_TENSORS}
        dense = {dtype: joined_rows(layers, [p._dense[dtype] for p in layers],
                                    lambda layer, view, d=dtype: layer._dense.__setitem__(d, view))
                 for dtype in set.intersection(*(set(p._dense) for p in layers))}
        for layer in layers:
            layer._cast = {}  # made from the old tensors
            layer._dense = {d: layer._dense[d] for d in dense}
        out = cls(**whole)
        out._dense.update(dense)
        return out

    def kernel_takes(self) -> bool:
        """Whether the packed kernel takes this layer's shape."""
        return True

    def packed(self, x: torch.Tensor) -> bool:
        """Whether ``x`` [..., in] goes through the packed kernel."""
        return (x.dtype == torch.bfloat16 and self.kernel_takes()
                and x.numel() // self.in_features <= self.max_rows)

    @abc.abstractmethod
    def dequantize(self) -> torch.Tensor:
        """The weights as a dense fp32 [out, in] matrix."""

    @abc.abstractmethod
    def packed_mm(self, rows: torch.Tensor) -> torch.Tensor:
        """rows [M, in] bf16 @ the weights^T -> [M, out], no bias, on the packed kernel."""

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """The weights as a dense [out, in] matrix in ``dtype``."""
        if dtype not in self._dense:
            self._dense[dtype] = self.dequantize().to(dtype)
        return self._dense[dtype]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # As rows of a matrix: a strided 3-D input (the output layer's last positions) would make torch
        # multiply batch by batch, copying the weights once per batch entry.
        rows = x.reshape(-1, self.in_features)
        bias = None if self.bias is None else self.bias.to(x.dtype)
        if self.packed(x):
            out = self.packed_mm(rows)
            out = out if bias is None else out + bias
        else:
            out = nn.functional.linear(rows, self.dequantized(x.dtype), bias)
        return out.reshape(*x.shape[:-1], self.out_features)


class Int8Linear(PackedLinear):
    """int8 weights [out, in] with one scale per output row (symmetric, max-abs / 127), ``scales`` [out] fp32,
    ``bias`` [out] or None. ``Int8Linear(linear)`` quantizes an ``nn.Linear``; ``Int8Linear(weight=...,
    scales=..., bias=...)`` holds such tensors as given."""

    ROW_TENSORS = ("weight", "scales", "bias")

    def __init__(self, linear: nn.Linear | None = None, *, weight: torch.Tensor | None = None,
                 scales: torch.Tensor | None = None, bias: torch.Tensor | None = None):
        if linear is not None:
            w = linear.weight.detach().float()
            scales = w.abs().amax(1).clamp_min(torch.finfo(torch.float32).tiny) / 127.0
            weight = torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8)
            bias = None if linear.bias is None else linear.bias.detach().clone()
        if weight is None or weight.dtype != torch.int8 or scales is None or scales.shape != weight.shape[:1]:
            raise ValueError("Int8Linear takes an nn.Linear, or int8 weight [out, in] with scales [out]")
        super().__init__(weight.shape[1], {"weight": weight, "scales": scales, "bias": bias})

    def kernel_takes(self) -> bool:
        return not self.in_features % BF16_MULTIPLE

    def dequantize(self) -> torch.Tensor:
        return self.weight.float() * self.scales[:, None]

    def packed_mm(self, rows: torch.Tensor) -> torch.Tensor:
        scales = self._cast.get(rows.dtype)
        if scales is None:
            scales = self._cast[rows.dtype] = self.scales.to(rows.dtype)
        return packed_mm(rows, self.weight, scales)


def packed_mm(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """PyTorch's packed int8 matmul: x [M, in] (bf16) @ (weight [out, in] int8 * scales [out])^T -> [M, out]."""
    return torch.ops.aten._weight_int8pack_mm(x, weight, scales)


def available() -> bool:
    """Whether this torch has the int8 packed matmul on the CPU."""
    return hasattr(torch.ops.aten, "_weight_int8pack_mm")


def use_packed_weights(model: nn.Module, quantize: Callable[[nn.Linear], PackedLinear | None], name: str) -> int:
    """Replace every CPU ``nn.Linear`` (bf16 or fp32) of ``model`` that ``quantize`` takes (it returns None for
    a layer it leaves as it is) with its packed layer, the output layer too (a layer registered under two parents
    is converted once; an input embedding tied to the output layer keeps its own weights). Marks the model
    (``model.pad_weights = name``) so that its measured forward costs are kept apart from the unquantized
    model's. Returns the number of layers replaced."""
    swaps = [(parent, attr, child) for parent in model.modules() for attr, child in parent.named_children()
             if type(child) is nn.Linear and child.weight.device.type == "cpu"
             and child.weight.dtype in (torch.float32, torch.bfloat16)]
    converted = {}
    for parent, attr, child in swaps:
        if id(child) not in converted:
            converted[id(child)] = quantize(child)
        if converted[id(child)] is not None:
            setattr(parent, attr, converted[id(child)])
    done = sum(layer is not None for layer in converted.values())
    if done:
        model.pad_weights = name
    return done


def use_int8_weights(model: nn.Module) -> int:
    """Every CPU ``nn.Linear`` of ``model`` to an ``Int8Linear`` (``use_packed_weights``). Returns the number of
    layers replaced (0 where torch lacks the kernel)."""
    return use_packed_weights(model, Int8Linear, "int8") if available() else 0
