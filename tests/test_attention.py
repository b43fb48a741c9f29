"""pad.decoding.attention: the grouped-query SDPA path and the fused CPU path give the logits of transformers'
sdpa, without repeat_kv."""
import copy

import pytest
import torch

from pad.decoding.attention import FUSED_NAME, NAME, use_gqa_sdpa
from pad_kernels import attention
from pad.decoding.hf import forward_tail, returned_cache
from tiny import tiny_model


def _ragged_forward(model, seed: int):
    """A cached prefix then 3 new tokens per row, with left padding and holes in the cache: logits [3, 3, V]."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 96, (3, 10), generator=g)
    mask = torch.ones(3, 13, dtype=torch.long)
    mask[0, :4] = 0  # left padding
    mask[1, 5:7] = 0  # holes (rejected tokens) inside the cache
    positions = (mask.cumsum(1) - 1).clamp_min(0)
    with torch.inference_mode():
        cache = returned_cache(model(ids, attention_mask=mask[:, :10], position_ids=positions[:, :10], use_cache=True))
        new = torch.randint(0, 96, (3, 3), generator=g)
        return forward_tail(model, new, 3, attention_mask=mask, position_ids=positions[:, 10:], cache=cache).logits


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_gqa_sdpa_equals_sdpa(arch, monkeypatch):
    seed = {"llama": 11, "qwen2": 12}[arch]
    plain = tiny_model(arch, seed=seed)
    assert plain.config._attn_implementation == "sdpa" and plain.model.layers[0].self_attn.num_key_value_groups == 2
    fast = copy.deepcopy(plain)
    assert use_gqa_sdpa(fast) and fast.config._attn_implementation == NAME
    want = _ragged_forward(plain, seed)
    calls = []
    sdpa = torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention",
                        lambda *a, **k: calls.append(k.get("enable_gqa", False)) or sdpa(*a, **k))
    got = _ragged_forward(fast, seed)
    # The cached prefix and the 3-token step both ran the grouped path (2 layers each), not repeat_kv.
    assert calls == [True] * 4
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not attention.available(), reason="the C++ CPU extension is not built")
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_fused_cpu_equals_sdpa(arch, monkeypatch):
    seed = {"llama": 13, "qwen2": 14}[arch]
    plain = tiny_model(arch, seed=seed)
    fast = copy.deepcopy(plain)
    assert use_gqa_sdpa(fast, fused_cpu=True) and fast.config._attn_implementation == FUSED_NAME
    want = _ragged_forward(plain, seed)
    calls = []
    kernel = attention.gqa_attention
    monkeypatch.setattr(attention, "gqa_attention", lambda q, *a, **k: calls.append(q.shape[2]) or kernel(q, *a, **k))
    got = _ragged_forward(fast, seed)
    assert calls == [10, 10, 3, 3]  # the masked prefill and the 3-token step, 2 layers each
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # Switching back to the grouped SDPA path takes the kernel out again.
    assert use_gqa_sdpa(fast) and fast.config._attn_implementation == NAME
    calls.clear()
    torch.testing.assert_close(_ragged_forward(fast, seed), want, rtol=1e-5, atol=1e-5)
    assert calls == []


def test_other_attention_left_alone():
    model = tiny_model("llama")
    model.set_attn_implementation("eager")
    assert not use_gqa_sdpa(model) and model.config._attn_implementation == "eager"
    assert not use_gqa_sdpa(model, fused_cpu=True) and model.config._attn_implementation == "eager"
