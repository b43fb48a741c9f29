"""use_fast_draft (--fast-draft): a draft with a pruned output layer, int8 weights and pad's fused CPU attention
drafts other tokens than the draft as loaded, and exact decoding with it is still the target's greedy output
token for token (fp32); one new token's attention over a cache without holes takes the fused kernel and
computes what SDPA computes; the CLI's flags name the same changes a run log records."""
import argparse
import copy

import pytest
import torch

import pad
from pad.cli import _draft_changes
from pad.decoding.hf import forward_tail, returned_cache
from pad_kernels import attention
from tiny import greedy_from_scratch, tiny_model, tiny_pair

needs_kernel = pytest.mark.skipif(not attention.available(), reason="the C++ CPU extension is not built")
QWEN_VOCAB = 151936  # the shipped token frequencies are ids of this vocabulary


@needs_kernel
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_one_token_without_holes_takes_the_kernel(arch, monkeypatch):
    """A draft step at one row: no attention mask at all (transformers passes None); the kernel sees every column."""
    plain = tiny_model(arch, seed=21)
    fast = copy.deepcopy(plain)
    pad.use_gqa_sdpa(fast, fused_cpu=True)
    calls = []
    kernel = attention.gqa_attention
    monkeypatch.setattr(attention, "gqa_attention", lambda q, *a, **k: calls.append(tuple(q.shape)) or kernel(q, *a, **k))
    g = torch.Generator().manual_seed(22)
    prefix, steps = torch.randint(0, 96, (1, 17), generator=g), torch.randint(0, 96, (1, 3), generator=g)
    logits = []
    with torch.inference_mode():
        for model in (plain, fast):
            cache = returned_cache(model(prefix, use_cache=True))
            logits.append(torch.cat([forward_tail(model, steps[:, i:i + 1], 1, cache=cache).logits
                                     for i in range(3)], 1))
    assert [s[2] for s in calls] == [1] * 6  # 3 steps x 2 layers; the prefill (17 causal tokens) went to SDPA
    torch.testing.assert_close(logits[1], logits[0], rtol=1e-5, atol=1e-5)


@needs_kernel
@pytest.mark.parametrize("weights", ["int8", "int4"])
@pytest.mark.parametrize("drafter", ["model", "hybrid"])
def test_exact_decoding_with_the_fast_draft_is_the_targets_greedy_output(drafter, weights):
    """fp32, three rows of different prompt lengths: the target's own greedy tokens, from a draft that proposes
    only the most frequent tokens, with int8 weights and the fused attention (holes in its cache included)."""
    target, draft = tiny_pair("qwen2", vocab=QWEN_VOCAB, scale=0.05, seed=23)
    fast = copy.deepcopy(draft)
    settings = pad.use_fast_draft(fast, vocab=1024, weights=weights)
    assert settings == {"draft_vocab": 1024, "draft_weights": weights, "draft_attention": "fused",
                        "draft_forward": "lean"}
    assert fast.pad_weights == weights and fast.pad_vocab == 1024 and fast.pad_attention == "fused"
    assert fast.pad_forward == "lean"
    g = torch.Generator().manual_seed(24)
    frequent = pad.decoding.vocab_prune.frequent_ids(1024)
    prompts = [frequent[torch.randint(0, 1024, (n,), generator=g)].tolist() for n in (5, 9, 7)]
    want = [greedy_from_scratch(target, p, 20) for p in prompts]
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    out = pad.generate(target, fast, ids, attention_mask=mask, policy="exact", num_draft_tokens=4,
                       max_new_tokens=20, eos_token_id=[], drafter=drafter)
    assert out.sequences[:, width:].tolist() == want
    assert out.stats.drafted > 0
    with torch.inference_mode():
        got = fast(ids, attention_mask=mask).logits[:, -1]
    assert set(got.argmax(-1).tolist()) <= set(frequent.tolist())  # it proposes tokens of the subset only
    assert not torch.equal(got, draft(ids, attention_mask=mask).logits[:, -1])


def test_each_change_alone_and_what_the_cli_records(monkeypatch):
    model = tiny_model("qwen2", vocab=QWEN_VOCAB, seed=25)
    alone = dict(vocab=None, weights=None, fused_attention=False, lean=False)
    assert pad.use_fast_draft(copy.deepcopy(model), **alone) == {}
    assert pad.use_fast_draft(copy.deepcopy(model), **{**alone, "vocab": 64}) == {"draft_vocab": 64}
    assert pad.use_fast_draft(copy.deepcopy(model), **{**alone, "weights": "int8"}) == {"draft_weights": "int8"}
    assert pad.use_fast_draft(copy.deepcopy(model), **{**alone, "weights": "int4"}) == {"draft_weights": "int4"}
    assert pad.use_fast_draft(copy.deepcopy(model), **{**alone, "lean": True}) == {"draft_forward": "lean"}

    def flags(**kw):
        return argparse.Namespace(**{"fast_draft": False, "draft_vocab": None, "draft_int8": False,
                                     "draft_weights": None, "draft_attention": "sdpa", "draft_forward": "hf", **kw})

    assert _draft_changes(flags()) == {}
    full = {"draft_weights": "int8", "draft_attention": "fused", "draft_forward": "lean"}
    assert _draft_changes(flags(fast_draft=True)) == full
    assert _draft_changes(flags(fast_draft=True, draft_vocab=4096)) == {"draft_vocab": 4096, **full}
    assert _draft_changes(flags(fast_draft=True, draft_weights="int4")) == {**full, "draft_weights": "int4"}
    assert _draft_changes(flags(draft_attention="fused")) == {"draft_attention": "fused"}
    assert _draft_changes(flags(draft_forward="lean")) == {"draft_forward": "lean"}
    assert _draft_changes(flags(draft_int8=True, draft_vocab=8)) == {"draft_vocab": 8, "draft_weights": "int8"}
    assert _draft_changes(flags(draft_weights="int4")) == {"draft_weights": "int4"}
    # fp32: the packed kernels take bf16 only, so --fast-draft leaves the weights; asked for, they are quantized
    assert _draft_changes(flags(fast_draft=True, dtype="float32")) == {k: full[k] for k in full if k != "draft_weights"}
    assert _draft_changes(flags(fast_draft=True, dtype="bfloat16")) == full
    assert _draft_changes(flags(fast_draft=True, dtype="float32", draft_int8=True)) == full


def test_the_default_weights_follow_the_dtype():
    """use_fast_draft's default: int8 weights for a bf16 draft, none for an fp32 one (dense either way there)."""
    model = tiny_model("qwen2", hidden=64, seed=29)
    fp32 = pad.use_fast_draft(copy.deepcopy(model), fused_attention=False, lean=False)
    bf16 = pad.use_fast_draft(copy.deepcopy(model).to(torch.bfloat16), fused_attention=False, lean=False)
    assert fp32 == {} and bf16 == {"draft_weights": "int8"}


def test_refuses_what_it_cannot_do():
    eager = tiny_model("qwen2", seed=26)
    eager.set_attn_implementation("eager")
    with pytest.raises(ValueError, match="not sdpa"):
        pad.use_fast_draft(eager, vocab=None, weights=None)
    with pytest.raises(ValueError, match="draft weights must be one of"):
        pad.use_fast_draft(tiny_model("qwen2", seed=27), weights="int2")
    with pytest.raises(ValueError, match="choose 1 to"):
        pad.use_fast_draft(tiny_model("qwen2", seed=27), vocab=10**7)


def test_each_change_keeps_its_own_measured_costs(tmp_path, monkeypatch):
    """-k auto learns a draft's forward costs per model state: every change of the draft has its own profile."""
    from transformers import AutoModelForCausalLM

    from pad.decoding.draft_length import profile_path

    monkeypatch.setenv("PAD_CACHE", str(tmp_path / "cache"))
    tiny_model("qwen2", hidden=64, seed=28).save_pretrained(tmp_path / "draft")

    def changed(**kw):
        model = AutoModelForCausalLM.from_pretrained(tmp_path / "draft")
        pad.use_fast_draft(model, **{"weights": None, "fused_attention": False, "lean": False, **kw})
        return profile_path(model)

    paths = [changed(), changed(weights="int8"), changed(weights="int4"), changed(fused_attention=True),
             changed(lean=True), changed(weights="int8", fused_attention=True, lean=True)]
    assert None not in paths and len(set(paths)) == len(paths)
