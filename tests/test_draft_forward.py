"""The lean draft forward (--draft-forward lean) computes what transformers' forward computes on every path the
decode takes (a left-padded prefill, blocks of several tokens with holes, one-token steps, rows leaving, a
compaction), for the Llama and Qwen2 families, unquantized and with int8 / int4 weights; it holds no weights
twice; models it does not take are refused; transformers' own generate runs it too."""
import copy

import pytest
import torch
from torch import nn

import pad
from pad.decoding.decoder import Decoder, left_pad
from pad.decoding.draft_forward import LeanForward, concatenated, joinable, supports, use_lean_forward
from pad.decoding.int4 import Int4Linear
from pad.decoding.int8 import Int8Linear
from pad_kernels import attention
from tiny import greedy_from_scratch, tiny_model, tiny_pair

needs_kernel = pytest.mark.skipif(not attention.available(), reason="the C++ CPU extension is not built")


def decode_path(model, g: torch.Generator) -> list[torch.Tensor]:
    """Logits of the fed positions along a decode's calls on ``Decoder``: 3 rows of different prompt lengths,
    a block of 3 with rejected tokens (holes), one-token steps, a row leaving, a block after a compaction."""
    out = []
    with torch.inference_mode():
        d = Decoder(model, 96, 3, grow_in_place=True)
        ids, fed = left_pad([torch.randint(0, 96, (n,), generator=g).tolist() for n in (9, 4, 6)], "cpu")
        out.append(d.forward(ids, fed, ids.shape[1])[fed])
        fed = torch.ones((3, 3), dtype=torch.bool)
        out.append(d.forward(torch.randint(0, 96, (3, 3), generator=g), fed, 3).flatten(0, 1))
        d.drop(torch.tensor([[False, True], [True, True], [False, False]]))
        for _ in range(3):
            out.append(d.forward(torch.randint(0, 96, (3, 1), generator=g), torch.ones((3, 1), dtype=torch.bool), 1))
        d.select([0, 2])
        d.compact()
        out.append(d.forward(torch.randint(0, 96, (2, 2), generator=g), torch.ones((2, 2), dtype=torch.bool), 2))
    return out


@needs_kernel
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("weights", [None, "int8", "int4"])
@pytest.mark.parametrize("hidden", [64, 128])  # 64: int4's k and v are not whole row blocks, so not joined
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_lean_forward_computes_transformers_forward(arch, weights, hidden, dtype):
    """Against the same model through transformers' forward with the same weights and attention kernel (equal
    up to fp32 rounding: the joined matmuls may sum in another order), and in fp32 against the model as loaded
    (SDPA), which differs from the fused kernel in rounding only."""
    model = tiny_model(arch, hidden=hidden, seed=31).to(dtype)
    plain = copy.deepcopy(model)
    hf = copy.deepcopy(model)
    pad.use_fast_draft(hf, weights=weights, lean=False)
    lean = copy.deepcopy(model)
    assert pad.use_fast_draft(lean, weights=weights)["draft_forward"] == "lean"
    assert isinstance(lean.forward, LeanForward)
    joined = lean.forward.layers[0][1].joined is not None
    assert joined == (weights != "int4" or hidden == 128)
    paths = [decode_path(m, torch.Generator().manual_seed(32)) for m in (hf, lean, plain)]
    tol = {torch.float32: 2e-5, torch.bfloat16: 2e-2}[dtype]
    for a, b in zip(paths[0], paths[1]):
        assert torch.isfinite(b).all()
        torch.testing.assert_close(b.float(), a.float(), rtol=tol, atol=tol * a.abs().max().item())
    if dtype == torch.float32 and weights is None:
        for a, b in zip(paths[2], paths[1]):
            torch.testing.assert_close(b, a, rtol=2e-5, atol=2e-5)


@needs_kernel
@pytest.mark.parametrize("weights", [None, "int8", "int4"])
def test_no_weights_are_held_twice_and_transformers_forward_still_works(weights):
    model = tiny_model("qwen2", hidden=128, seed=33)
    pad.use_fast_draft(model, weights=weights, lean=False)
    before = copy.deepcopy(model)
    assert use_lean_forward(model)
    attn = model.model.layers[1].self_attn
    qkv = model.forward.layers[1][1].joined
    for name in ("weight", "bias"):  # q, k, v: consecutive row ranges of the joined layer's tensors
        whole = getattr(qkv, name)
        parts = [getattr(p, name) for p in (attn.q_proj, attn.k_proj, attn.v_proj)]
        row = whole.stride(0) * whole.element_size()
        starts = [0, parts[0].shape[0], parts[0].shape[0] + parts[1].shape[0]]
        assert [p.data_ptr() for p in parts] == [whole.data_ptr() + s * row for s in starts]
    if weights == "int4":  # its dequantized weights, made with it, are joined the same way
        dense = qkv.dequantized(torch.float32)
        parts = [p.dequantized(torch.float32) for p in (attn.q_proj, attn.k_proj, attn.v_proj)]
        assert [p.untyped_storage().data_ptr() for p in parts] == [dense.untyped_storage().data_ptr()] * 3
    ids = torch.randint(0, 96, (2, 7), generator=torch.Generator().manual_seed(34))
    with torch.inference_mode():
        own = type(model).forward(model, input_ids=ids).logits  # transformers' forward over the views
        torch.testing.assert_close(own, before(ids).logits, rtol=0, atol=0)
        torch.testing.assert_close(model(ids).logits, own, rtol=2e-5, atol=2e-5)


def test_join_takes_only_layers_of_one_kind():
    """``concatenated`` joins layers of one kind (nn.Linear all with or all without biases, or packed layers of
    one class in whole row blocks) and refuses the rest rather than drop a bias or misalign packed rows."""
    g = torch.Generator().manual_seed(40)
    plain = [nn.Linear(32, n) for n in (16, 8)]
    x = torch.randn(3, 32, generator=g)
    with torch.no_grad():
        want = torch.cat([p(x) for p in plain], -1)
        torch.testing.assert_close(concatenated(plain)(x), want, rtol=0, atol=0)
    mixed = [nn.Linear(32, 16), nn.Linear(32, 8, bias=False)]
    assert not joinable(mixed)
    with pytest.raises(ValueError, match="biases"):
        concatenated(mixed)
    int4 = [Int4Linear(nn.Linear(64, n)) for n in (32, 64)]  # 32 rows: not a whole block
    assert not joinable(int4) and joinable(int4[::-1])
    with pytest.raises(ValueError, match="64-row blocks"):
        concatenated(int4)
    assert not joinable([Int8Linear(nn.Linear(64, 16)), nn.Linear(64, 16)])


def test_refuses_models_it_does_not_compute():
    gpt2 = tiny_model("gpt2", seed=35)
    assert "gpt2" in supports(gpt2) and not use_lean_forward(gpt2)
    assert not hasattr(gpt2, "pad_forward")
    sliding = tiny_model("qwen2", seed=36)
    sliding.config.layer_types = ["sliding_attention", "full_attention"]
    assert "sliding" in supports(sliding)
    with pytest.raises(ValueError, match="sliding"):
        LeanForward(sliding)
    biased = tiny_model("qwen2", seed=37)
    biased.model.layers[0].mlp.up_proj = nn.Linear(32, 64, bias=True)
    assert "biases" in supports(biased)
    assert "draft_forward" not in pad.use_fast_draft(sliding, weights=None)  # it keeps transformers' forward


def test_transformers_generate_runs_the_lean_draft():
    """The hf-assisted baseline of ``pad-decoding bench`` hands the same draft to transformers' assisted
    generation: its greedy output is still the target's, and the lean forward drafted."""
    target, draft = tiny_pair("qwen2", scale=0.05, seed=38)
    assert use_lean_forward(draft)
    calls = []
    lean = draft.forward
    draft.forward = lambda *a, **k: calls.append(1) or lean(*a, **k)
    ids = torch.randint(0, 96, (1, 7), generator=torch.Generator().manual_seed(39))
    want = greedy_from_scratch(target, ids[0].tolist(), 20)
    out = target.generate(ids, assistant_model=draft, max_new_tokens=20, do_sample=False, eos_token_id=None,
                          pad_token_id=0)
    assert out[0, 7:].tolist() == want and calls
