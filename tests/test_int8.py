"""use_int8_weights: a model's linear layers with int8 weights (one scale per output row) compute what an
independent dequantized reference computes, and a draft so quantized changes nothing in exact decoding: the
target decides every token (greedy, fp32: token for token; sampled: the distribution tests of the drafters)."""
import copy

import pytest
import torch
from torch import nn

import pad
from pad.decoding.hf import vocab_size
from pad.decoding import int8
from pad.decoding.int8 import Int8Linear, use_int8_weights
from tiny import greedy_from_scratch, tiny_model, tiny_pair


def test_this_torch_has_the_int8_kernel():  # every test here needs it (PyTorch's CPU builds carry it)
    assert hasattr(torch.ops.aten, "_weight_int8pack_mm")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("inputs", [72, 64])  # bf16 at 72: dense (torch's bf16 kernel wants 16 | inputs)
@pytest.mark.parametrize("rows", [(1, 3), (2, 5), (4, 8)])  # 3 and 10 rows: packed in bf16; 32: dense
def test_a_layer_computes_its_dequantized_weights(dtype, bias, inputs, rows, monkeypatch):
    """Against x @ (q * s)^T + b in fp64 from the stored int8 weights and scales, and the quantization itself
    against round(w / s) with s = max |w| / 127 per row (in fp32, as the layer computes it); the packed kernel
    runs for bf16 activations of at most PACKED_MAX_ROWS rows, a dense matmul otherwise."""
    calls = []
    real = int8.packed_mm
    monkeypatch.setattr(int8, "packed_mm", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    g = torch.Generator().manual_seed(int(bias) + 2 * (dtype == torch.bfloat16) + inputs + rows[1])
    linear = nn.Linear(inputs, 40, bias=bias).to(dtype)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(40, inputs, generator=g))
        if bias:
            linear.bias.copy_(torch.randn(40, generator=g))
    q = Int8Linear(linear)
    w = linear.weight.float()
    scales = w.abs().amax(1) / 127
    assert torch.equal(q.weight, torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8))
    assert torch.equal(q.scales, scales)
    x = torch.randn(rows[0], rows[1] + 2, inputs, generator=g).to(dtype)[:, 2:]  # strided, as a last-positions slice
    want = x.double() @ (q.weight.double() * q.scales.double()[:, None]).T + (linear.bias.double() if bias else 0)
    got = q(x)
    assert got.dtype == dtype and got.shape == (*rows, 40)
    packed = dtype == torch.bfloat16 and inputs == 64 and rows[0] * rows[1] <= int8.PACKED_MAX_ROWS
    assert calls == ([rows[0] * rows[1]] if packed else [])
    tol = {torch.float32: 1e-4, torch.bfloat16: 3e-2}[dtype]  # bf16: its output rounding (8 bits of mantissa)
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol * want.abs().max().item())
    # and close to the unquantized layer: int8 keeps about 2 decimal digits of each weight
    assert (got.double() - linear(x).double()).abs().max() < 0.05 * want.abs().max()


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@torch.inference_mode()
def test_every_linear_is_converted_and_the_model_still_predicts(arch):
    dense = tiny_model(arch, seed=3)
    if arch == "qwen2":  # an output layer tied to the input embedding, as small Qwen checkpoints have it
        dense.lm_head.weight = dense.model.embed_tokens.weight
    quant = copy.deepcopy(dense)
    linears = sum(type(m) is nn.Linear for m in dense.modules())
    assert use_int8_weights(quant) == linears > 0 and quant.pad_weights == "int8"
    assert not any(type(m) is nn.Linear for m in quant.modules()) and vocab_size(quant) == vocab_size(dense)
    ids = torch.randint(0, 96, (2, 9), generator=torch.Generator().manual_seed(5))
    a, b = dense(ids).logits, quant(ids).logits
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() > 0.8  # mostly the same top token
    assert torch.equal(quant.model.embed_tokens.weight, dense.model.embed_tokens.weight)  # the input side stays


@pytest.mark.parametrize("drafter", ["model", "hybrid"])
def test_exact_decoding_with_an_int8_draft_is_the_targets_greedy_output(drafter):
    """fp32: equal token for token to the target's own greedy decoding, every row of a batch, from a draft whose
    logits differ from the unquantized one's and whose drafts the target corrects."""
    target, draft = tiny_pair("llama", scale=0.05, seed=11)
    quant = copy.deepcopy(draft)
    use_int8_weights(quant)
    g = torch.Generator().manual_seed(12)
    ids = torch.randint(2, 96, (3, 6), generator=g)
    want = torch.tensor([greedy_from_scratch(target, row.tolist(), 24) for row in ids])
    out = pad.generate(target, quant, ids, policy="exact", num_draft_tokens=4, max_new_tokens=24, eos_token_id=[],
                       drafter=drafter)
    assert torch.equal(out.sequences[:, ids.shape[1]:], want)
    assert out.stats.drafted > 0 and out.stats.accepted < out.stats.drafted  # it drafted, and was corrected
    with torch.inference_mode():
        assert not torch.equal(quant(ids).logits, draft(ids).logits)  # the quantized draft is another draft
