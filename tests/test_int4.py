"""use_int4_weights: a model's linear layers with 4-bit weights (a scale and zero point per 32 weights of a row)
compute what an independent dequantized reference computes, on the packed kernel and densely; weights already on
such a grid come back exactly; a converted model still predicts. Exact decoding with an int4 draft is the target's
greedy output token for token (tests/test_fast_draft.py, with the other changes of --fast-draft)."""
import copy

import pytest
import torch
from torch import nn

from pad.decoding import int4
from pad.decoding.hf import vocab_size
from pad.decoding.int4 import Int4Linear, use_int4_weights
from tiny import tiny_model


def test_this_torch_has_the_int4_kernel():  # every test here needs it (PyTorch's CPU builds carry it)
    assert int4.available()


def grid_reference(w: torch.Tensor) -> torch.Tensor:
    """The dequantized weights [out, in] in fp64, from the rule written out: per group of 32 weights of a row,
    scale = bf16((max - min) / 15), zero = bf16(min + 8 scale), q = clamp(round((w - zero) / scale) + 8, 0, 15),
    weight = (q - 8) scale + zero."""
    out = torch.empty(w.shape, dtype=torch.float64)
    for r in range(w.shape[0]):
        for g0 in range(0, w.shape[1], 32):
            group = w[r, g0:g0 + 32].float()
            scale = ((group.max() - group.min()) / 15).to(torch.bfloat16).double()
            zero = (group.min() + 8 * scale.float()).to(torch.bfloat16).double()
            q = (torch.round((group.double() - zero) / scale) + 8).clamp(0, 15)
            out[r, g0:g0 + 32] = (q - 8) * scale + zero
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [(1, 3), (2, 5), (4, 8)])  # 3 and 10 rows: packed in bf16; 32: dense
def test_a_layer_computes_its_dequantized_weights(dtype, bias, rows, monkeypatch):
    calls = []
    real = Int4Linear.packed_mm
    monkeypatch.setattr(Int4Linear, "packed_mm", lambda self, x: calls.append(x.shape[0]) or real(self, x))
    g = torch.Generator().manual_seed(int(bias) + 2 * (dtype == torch.bfloat16) + rows[1])
    linear = nn.Linear(96, 48, bias=bias).to(dtype)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(48, 96, generator=g))
        if bias:
            linear.bias.copy_(torch.randn(48, generator=g))
    q = Int4Linear(linear)
    want_w = grid_reference(linear.weight.detach())
    torch.testing.assert_close(q.dequantize().double(), want_w, rtol=0, atol=1e-6)
    x = torch.randn(rows[0], rows[1] + 2, 96, generator=g).to(dtype)[:, 2:]  # strided, as a last-positions slice
    want = x.double() @ want_w.T + (linear.bias.double() if bias else 0)
    got = q(x)
    assert got.dtype == dtype and got.shape == (*rows, 48)
    packed = dtype == torch.bfloat16 and rows[0] * rows[1] <= int4.PACKED_MAX_ROWS
    assert calls == ([rows[0] * rows[1]] if packed else [])
    tol = {torch.float32: 1e-4, torch.bfloat16: 3e-2}[dtype]  # bf16: its output rounding (8 bits of mantissa)
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol * want.abs().max().item())
    # and near the unquantized layer: 16 steps per group keep about one decimal digit of each weight
    assert (got.double() - linear(x).double()).abs().max() < 0.25 * want.abs().max()


def test_weights_on_a_16_step_grid_come_back_exactly():
    """A 4-bit GGUF checkpoint's groups lie on such a grid already: nothing more is lost (bf16-exact steps)."""
    g = torch.Generator().manual_seed(5)
    steps = torch.randint(0, 16, (32, 64), generator=g).float()
    steps[:, ::32], steps[:, 1::32] = 0, 15  # every group spans the whole grid
    low = torch.randint(-8, 0, (32, 2), generator=g).float().repeat_interleave(32, 1) / 4
    linear = nn.Linear(64, 32, bias=False)
    with torch.no_grad():
        linear.weight.copy_(low + steps / 16)
    assert torch.equal(Int4Linear(linear).dequantize(), linear.weight.detach())


def test_refuses_shapes_the_kernel_does_not_take():
    with pytest.raises(ValueError, match="in_features % 32"):
        Int4Linear(nn.Linear(48, 32))
    with pytest.raises(ValueError, match="out_features % 16"):
        Int4Linear(nn.Linear(64, 40))


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@torch.inference_mode()
def test_every_linear_the_kernel_takes_is_converted_and_the_model_still_predicts(arch):
    dense = tiny_model(arch, vocab=96, hidden=64, seed=3)
    if arch == "qwen2":  # an output layer tied to the input embedding, as small Qwen checkpoints have it
        dense.lm_head.weight = dense.model.embed_tokens.weight
    quant = copy.deepcopy(dense)
    linears = [m for m in dense.modules() if type(m) is nn.Linear]
    takes = sum(int4.takes(m) for m in linears)
    assert 0 < takes == len(linears)  # hidden 64, 4 heads, 2 key/value heads, vocab 96: all fit
    assert use_int4_weights(quant) == takes and quant.pad_weights == "int4"
    assert not any(type(m) is nn.Linear for m in quant.modules()) and vocab_size(quant) == vocab_size(dense)
    ids = torch.randint(0, 96, (2, 9), generator=torch.Generator().manual_seed(5))
    a, b = dense(ids).logits, quant(ids).logits
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() > 0.6  # mostly the same top token
    assert torch.equal(quant.model.embed_tokens.weight, dense.model.embed_tokens.weight)  # the input side stays


def test_layers_the_kernel_does_not_take_stay_as_they_are():
    model = nn.Sequential(nn.Linear(64, 32), nn.Linear(32, 48), nn.Linear(48, 40))
    assert use_int4_weights(model) == 2
    assert [type(m).__name__ for m in model] == ["Int4Linear", "Int4Linear", "Linear"]
