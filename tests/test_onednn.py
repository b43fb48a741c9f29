"""use_onednn_linear: every fp32 nn.Linear of a CPU model runs through oneDNN and computes what the dense
layer computes (to fp32 rounding); other dtypes are left alone."""
import copy

import pytest
import torch
from torch import nn

import pad
from pad.decoding.hf import forward_tail, returned_cache, vocab_size
from pad.decoding.onednn import use_onednn_linear
from tiny import greedy_from_scratch, tiny_model, tiny_pair


def test_this_torch_has_onednn():  # every test here needs it (x86 and arm64 builds of torch carry it)
    assert torch.backends.mkldnn.is_available()


def _linears(model) -> int:
    return sum(type(m) is nn.Linear for m in model.modules())


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@torch.inference_mode()
def test_a_converted_model_computes_the_dense_models_logits(arch):
    dense = tiny_model(arch, seed=3)
    if arch == "qwen2":  # an output layer tied to the input embedding, as small Qwen checkpoints have it
        dense.lm_head.weight = dense.model.embed_tokens.weight
        with torch.no_grad():  # and q, k, v biases (initialized to zero)
            for m in dense.modules():
                if type(m) is nn.Linear and m.bias is not None:
                    m.bias.normal_(generator=torch.Generator().manual_seed(6))
    fast = copy.deepcopy(dense)
    assert use_onednn_linear(fast) == _linears(dense) > 0
    assert _linears(fast) == 0 and vocab_size(fast) == vocab_size(dense)
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(0, 96, (3, 7), generator=g)
    a, b = dense(ids, use_cache=True), fast(ids, use_cache=True)
    torch.testing.assert_close(b.logits, a.logits, rtol=1e-5, atol=1e-5)
    step = torch.randint(0, 96, (3, 2), generator=g)  # a forward on the cache, logits of the last token only
    torch.testing.assert_close(forward_tail(fast, step, 1, cache=returned_cache(b)).logits,
                               forward_tail(dense, step, 1, cache=returned_cache(a)).logits, rtol=1e-5, atol=1e-5)
    prompt = ids[0].tolist()
    assert greedy_from_scratch(fast, prompt, 12) == greedy_from_scratch(dense, prompt, 12)


def test_other_dtypes_are_left_alone():
    model = tiny_model("llama").to(torch.bfloat16)
    assert use_onednn_linear(model) == 0
    assert _linears(model) == _linears(tiny_model("llama"))


def test_a_layer_under_two_parents_is_converted_once():
    shared = nn.Linear(8, 4)
    model = nn.ModuleDict({"a": nn.Sequential(shared), "b": nn.Sequential(shared)})
    x = torch.randn(5, 8, generator=torch.Generator().manual_seed(5))
    want = shared(x).detach()
    assert use_onednn_linear(model) == 1
    assert model["a"][0] is model["b"][0]
    torch.testing.assert_close(model["a"][0](x), want, rtol=1e-5, atol=1e-6)


def test_generate_on_converted_models_decodes_the_targets_greedy_text():
    target, draft = tiny_pair("llama", scale=0.5)
    want = [greedy_from_scratch(target, p, 16) for p in ([5, 9, 2], [7, 1])]
    for model in (target, draft):
        assert pad.use_onednn_linear(model) > 0
    ids, mask = torch.tensor([[5, 9, 2], [0, 7, 1]]), torch.tensor([[1, 1, 1], [0, 1, 1]])
    out = pad.generate(target, draft, ids, attention_mask=mask, num_draft_tokens=3, max_new_tokens=16)
    assert [out.sequences[r, 3:].tolist() for r in range(2)] == want
