"""Weight-only int4 linear layers (a draft model's, on the CPU): PyTorch's own int4 packed matmul.

The int8 draft (``pad.decoding.int8``) reads half of bf16's bytes per token; 4-bit weights read a quarter, and
at one row a draft forward is bound by those reads. Each group of ``GROUP`` weights of an output row has its
own scale and zero point (asymmetric, min to max in 16 steps), and ``torch.ops.aten._weight_int4pack_mm_for_cpu``
multiplies them by bf16 activations. Weights that came from a 4-bit GGUF file (the index-gguf weights,
Q4_K: groups of 32 on a 16-step grid) lose little more: most groups are already on such a grid.

Like ``Int8Linear``, more than ``PACKED_MAX_ROWS`` rows and fp32 activations multiply by the dequantized
weights, made at once here in the model's dtype (a prefill needs them at once; reading 4-bit weights back takes
seconds): an int4 layer holds its weights in both forms. Exact decoding stays exact (the target decides,
tests/test_int4.py); the draft's proposals change, so a run log records the draft's weights as int4 and
acceptance is measured (bench/README.md).
"""
from __future__ import annotations

import torch
from torch import nn

from .int8 import PackedLinear, use_packed_weights

GROUP = 32  # weights per scale and zero point: the fastest of torch's group sizes at one row, and Q4_K's own
ROW_MULTIPLE = 16  # the kernel takes a multiple of this many output rows
# As ``pad.decoding.int8.PACKED_MAX_ROWS``, for this kernel: it too is level with a dense bf16 matmul at 16 rows
# (``python bench/linear_cost.py --int4``).
PACKED_MAX_ROWS = 12


class Int4Linear(PackedLinear):
    """4-bit weights, ``weight`` [out, in / 2] uint8 in the kernel's packed layout (rows in blocks of
    ``ROW_BLOCK``), ``scales_zeros`` [out, in / GROUP, 2] bf16 (scale, zero point: a weight is (q - 8) * scale +
    zero for its 4-bit q), ``bias`` [out] or None."""

    ROW_TENSORS = ("weight", "scales_zeros", "bias")
    ROW_BLOCK = 64  # the kernel packs rows in blocks of 64 (a last, shorter block on its own)
    max_rows = PACKED_MAX_ROWS

    def __init__(self, linear: nn.Linear | None = None, *, weight: torch.Tensor | None = None,
                 scales_zeros: torch.Tensor | None = None, bias: torch.Tensor | None = None):
        """Quantize ``linear`` (its shape must be ``takes``'s), or hold the tensors as given (keywords only)."""
        if linear is not None:
            if not takes(linear):
                raise ValueError(f"an int4 layer needs in_features % {GROUP} == 0 and out_features % "
                                 f"{ROW_MULTIPLE} == 0, got {linear.in_features} -> {linear.out_features}")
            q, scales_zeros = quantize(linear.weight.detach().float())
            weight = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
            bias = None if linear.bias is None else linear.bias.detach().clone()
        if weight is None or scales_zeros is None or weight.shape[0] != scales_zeros.shape[0]:
            raise ValueError("Int4Linear takes an nn.Linear, or packed weight [out, in / 2] with scales_zeros "
                             f"[out, in / {GROUP}, 2]")
        super().__init__(weight.shape[1] * 2, {"weight": weight, "scales_zeros": scales_zeros, "bias": bias})
        if linear is not None:  # made now, from q: reading 4-bit weights back is slow (``dequantize``)
            self._dense[linear.weight.dtype] = dequantized(q, scales_zeros).to(linear.weight.dtype)

    def _kernel_scales(self, dtype: torch.dtype) -> torch.Tensor:
        # The kernel reads [in / GROUP, out, 2] and must get it contiguous (a strided view computes garbage).
        if dtype not in self._cast:
            self._cast[dtype] = self.scales_zeros.transpose(0, 1).contiguous().to(dtype)
        return self._cast[dtype]

    def packed_mm(self, rows: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int4pack_mm_for_cpu(rows, self.weight, GROUP, self._kernel_scales(rows.dtype))

    def dequantize(self) -> torch.Tensor:
        # The 4-bit values as the kernel unpacks them, read back through it: the identity (bf16) times the
        # weights with scale 1 and zero 0 gives q - 8 exactly (fast in bf16, where fp32 crawls); then the
        # groups' scales and zeros in fp32.
        unit = torch.zeros_like(self._kernel_scales(torch.bfloat16))
        unit[..., 0] = 1
        eye = torch.eye(self.in_features, dtype=torch.bfloat16)
        steps = torch.cat([torch.ops.aten._weight_int4pack_mm_for_cpu(eye[i:i + 256], self.weight, GROUP, unit)
                           for i in range(0, self.in_features, 256)]).T.float()  # [out, in]: q - 8
        return dequantized(steps + 8, self.scales_zeros)


def quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [out, in] fp32 -> (q [out, in] int32 in 0..15, scales_zeros [out, in / GROUP, 2] bf16) with w ~ (q - 8)
    * scale + zero per group: scale = (max - min) / 15 and zero = min + 8 * scale, both rounded to bf16 before q
    is chosen (q = round((w - zero) / scale) + 8, clamped), so q is the nearest step of the grid the kernel uses."""
    out, inputs = w.shape
    groups = w.view(out, inputs // GROUP, GROUP)
    low, high = groups.amin(-1), groups.amax(-1)
    scale = ((high - low) / 15).clamp_min(torch.finfo(torch.bfloat16).tiny).to(torch.bfloat16).float()
    zero = (low + 8 * scale).to(torch.bfloat16).float()
    q = (torch.round((groups - zero[..., None]) / scale[..., None]) + 8).clamp(0, 15).to(torch.int32)
    return q.view(out, inputs), torch.stack([scale, zero], -1).to(torch.bfloat16)


def dequantized(q: torch.Tensor, scales_zeros: torch.Tensor) -> torch.Tensor:
    """q [out, in] in 0..15 and scales_zeros [out, in / GROUP, 2] -> the weights [out, in] fp32: (q - 8) * scale +
    zero, as the kernel computes them."""
    scale, zero = scales_zeros.float().repeat_interleave(GROUP, 1).unbind(-1)
    return (q.float() - 8) * scale + zero


def takes(linear: nn.Linear) -> bool:
    """Whether the int4 kernel takes ``linear``'s shape."""
    return not linear.in_features % GROUP and not linear.out_features % ROW_MULTIPLE


def available() -> bool:
    """Whether this torch has the int4 packed matmul on the CPU."""
    return all(hasattr(torch.ops.aten, op) for op in ("_weight_int4pack_mm_for_cpu",
                                                       "_convert_weight_to_int4pack_for_cpu"))


def use_int4_weights(model: nn.Module) -> int:
    """Every CPU ``nn.Linear`` of ``model`` whose shape the kernel takes to an ``Int4Linear``, the rest left as
    they are (``pad.decoding.int8.use_packed_weights``). Returns the number of layers replaced (0 where torch
    lacks the kernel)."""
    if not available():
        return 0
    return use_packed_weights(model, lambda layer: Int4Linear(layer) if takes(layer) else None, "int4")
