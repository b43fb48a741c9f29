"""use_pruned_head: a draft scoring only a subset of its vocabulary (FR-Spec) computes the full head's logits on
the subset and -inf elsewhere, proposes tokens of the subset only, and changes nothing in exact decoding
(greedy here; sampled: tests/test_sampling_distribution.py). The shipped frequencies rank special tokens first."""
import copy

import pytest
import torch

import pad
from pad.decoding.hf import vocab_size
from pad.decoding.vocab_prune import frequent_ids, use_pruned_head
from tiny import greedy_from_scratch, tiny_model, tiny_pair


@torch.inference_mode()
def test_the_pruned_head_scores_its_subset_as_the_full_head_does():
    full = tiny_model("qwen2", seed=5)
    pruned = copy.deepcopy(full)
    ids = torch.tensor([3, 7, 50, 8, 95, 7])  # unsorted, with a repeat
    assert use_pruned_head(pruned, ids) == 5 and pruned.pad_vocab == 5 and vocab_size(pruned) == vocab_size(full)
    x = torch.randint(0, 96, (2, 6), generator=torch.Generator().manual_seed(1))
    a, b = full(x).logits, pruned(x).logits
    keep = torch.zeros(96, dtype=torch.bool)
    keep[ids] = True
    torch.testing.assert_close(b[..., keep], a[..., keep], rtol=1e-6, atol=1e-6)  # a narrower matmul's rounding
    assert (b[..., ~keep] == float("-inf")).all()
    assert torch.equal(pruned.model.embed_tokens.weight, full.model.embed_tokens.weight)
    with pytest.raises(ValueError, match="subset"):
        use_pruned_head(copy.deepcopy(full), torch.tensor([0, 96]))


@pytest.mark.parametrize("int8", [False, True], ids=["pruned", "pruned-and-int8"])
def test_exact_decoding_with_a_pruned_draft_is_the_targets_greedy_output(int8):
    """fp32: token for token the target's greedy decoding, every row; the draft proposed only subset tokens, and
    some of the target's tokens lie outside the subset (so the target's correction tokens were needed)."""
    target, draft = tiny_pair("llama", scale=0.05, seed=21)
    ids = torch.arange(0, 96, 2)  # the even tokens
    use_pruned_head(draft, ids)
    if int8:
        pad.use_int8_weights(draft)
    g = torch.Generator().manual_seed(22)
    prompt = torch.randint(2, 96, (3, 5), generator=g)
    want = torch.tensor([greedy_from_scratch(target, row.tolist(), 20) for row in prompt])
    seen = []

    class Watch(torch.nn.Module):  # the tokens the draft proposed: the argmax of its logits
        def forward(self, module, args, out):
            seen.append(out.logits[..., -1, :].argmax(-1))

    hook = draft.register_forward_hook(Watch().forward)
    out = pad.generate(target, draft, prompt, policy="exact", num_draft_tokens=4, max_new_tokens=20, eos_token_id=[])
    hook.remove()
    assert torch.equal(out.sequences[:, prompt.shape[1]:], want)
    assert all((t % 2 == 0).all() for t in seen) and (want % 2 == 1).any()
    assert out.stats.drafted > 0


def test_the_shipped_frequencies():
    from pad.models.registry import DEFAULT_TARGET  # noqa: F401 - the pair they were counted for

    top = frequent_ids(1000)
    assert len(set(top.tolist())) == 1000 and (top >= 0).all() and (top < 151936).all()
    assert 151643 in top.tolist()  # <|endoftext|>, a special token: ranked first whatever its count
    with pytest.raises(ValueError, match="choose 1 to"):
        frequent_ids(10**7)
