"""fp32 linear layers through oneDNN on the CPU.

torch sends an fp32 ``nn.Linear`` on the CPU to MKL, whose kernels on an AMD EPYC with AVX2 run far below
the machine's peak at the skinny shapes of decoding (a few to a hundred rows of one token). oneDNN, part
of every x86 torch build, does not (measured in docs/kernels.md).

The sums run in another order than MKL's, so results differ in rounding (about 1e-6 of the output's
scale), which can flip a near-tied argmax: fine for the search labeler, whose decisions are taken on the
text at hand whichever kernel computed it, but a decode path whose runs are logged would need a new
``DECODE_VERSION``.
"""
from __future__ import annotations

import torch
from torch import nn


class OneDNNLinear(nn.Module):
    """An fp32 ``nn.Linear`` whose weight lives in oneDNN's layout: [..., in] -> [..., out], dense in and out."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.register_buffer("weight", linear.weight.detach().to_mkldnn())
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().to_mkldnn())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten.mkldnn_linear(x.to_mkldnn(), self.weight, self.bias).to_dense()


def use_onednn_linear(model: nn.Module) -> int:
    """Replace every fp32 ``nn.Linear`` of a model on the CPU with a ``OneDNNLinear`` (the weight moves to
    oneDNN's layout; the dense copy is dropped unless something else holds it, such as an input embedding
    tied to the output layer).

    Returns the number of layers replaced: 0 for a model in another dtype or on another device, or where
    torch lacks oneDNN.
    """
    if not torch.backends.mkldnn.is_available():
        return 0
    swaps = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
             if type(child) is nn.Linear and child.weight.dtype == torch.float32 and child.weight.device.type == "cpu"]
    converted = {}  # a layer registered under two parents is converted once
    for parent, name, child in swaps:
        if id(child) not in converted:
            converted[id(child)] = OneDNNLinear(child)
        setattr(parent, name, converted[id(child)])
    return len(converted)
