"""exact_prefix=N: each row's first N new tokens are decided by the exact rule, later ones by the policy.

The reference is a plain loop written from that definition (no cache, whole-sequence forwards): each block
the draft proposes K greedy tokens, the target scores them, and draft position i of a row with g new tokens
is accepted by the exact rule while g + i < N, else by the threshold rule; the first rejection takes the
target's token, a fully accepted block the target's next one."""
import pytest
import torch

import pad
from tiny import tiny_pair

K, MAX_NEW, TAU = 4, 28, 0.05


@pytest.fixture(scope="module")
def models():
    """A draft that agrees about half the time, and logits spread enough that TAU relaxes some mismatches."""
    target, draft = tiny_pair("qwen2", scale=0.3, seed=3)
    with torch.no_grad():
        for m in (target, draft):
            m.lm_head.weight.mul_(8.0)
    return target, draft


def reference(target, draft, prompt: list[int], n_exact: int) -> list[int]:
    new: list[int] = []
    with torch.no_grad():
        while len(new) < MAX_NEW:
            ids = prompt + new
            drafts = []
            for _ in range(K):
                drafts.append(int(draft(torch.tensor([ids + drafts])).logits[0, -1].argmax()))
            probs = torch.softmax(target(torch.tensor([ids + drafts])).logits[0, len(ids) - 1 :].float(), -1)
            block = []
            for i, d in enumerate(drafts):
                exact = d == int(probs[i].argmax())
                if exact or (len(new) + i >= n_exact and float(probs[i, d]) >= TAU):
                    block.append(d)
                else:
                    break
            block.append(int(probs[len(block)].argmax()))
            new += block
    return new[:MAX_NEW]


def prompts():
    g = torch.Generator().manual_seed(11)
    return [torch.randint(2, 96, (int(torch.randint(2, 9, (1,), generator=g)),), generator=g).tolist()
            for _ in range(6)]


@pytest.mark.parametrize("n_exact", [0, 1, 5, 13, MAX_NEW])
def test_equals_the_reference(models, n_exact):
    target, draft = models
    rows = prompts()
    width = max(map(len, rows))
    ids = torch.tensor([[0] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    out = pad.generate(target, draft, ids, attention_mask=mask, policy=f"threshold@{TAU}", num_draft_tokens=K,
                       max_new_tokens=MAX_NEW, eos_token_id=[], exact_prefix=n_exact)
    got = out.sequences[:, width:].tolist()
    want = [reference(target, draft, r, n_exact) for r in rows]
    assert got == want
    relaxed = [s.relaxed_accepted for s in out.row_stats]
    if n_exact == 0:
        assert sum(relaxed) > 0, "the relaxed rule must accept something here, or the test cannot tell"
    if n_exact >= MAX_NEW:
        assert sum(relaxed) == 0
        exact = pad.generate(target, draft, ids, attention_mask=mask, policy="exact", num_draft_tokens=K,
                             max_new_tokens=MAX_NEW, eos_token_id=[])
        assert torch.equal(out.sequences, exact.sequences)


def test_relaxed_decisions_differ_with_the_prefix(models):
    """Some row's tokens change between N = 0 and N = 13: the prefix is not a no-op."""
    target, draft = models
    rows = prompts()
    outs = [[reference(target, draft, r, n) for r in rows] for n in (0, 13)]
    assert outs[0] != outs[1]


def test_sampled_with_the_whole_reply_exact_is_the_exact_policy(models):
    """Same seed, same draws: exact_prefix covering every token decides as the exact policy does."""
    target, draft = models
    rows = prompts()
    width = max(map(len, rows))
    ids = torch.tensor([[0] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    kw = {"attention_mask": mask, "num_draft_tokens": K, "max_new_tokens": MAX_NEW, "eos_token_id": [],
          "temperature": 0.9, "seed": 5}
    exact = pad.generate(target, draft, ids, policy="exact", **kw)
    prefixed = pad.generate(target, draft, ids, policy=f"threshold@{TAU}", exact_prefix=MAX_NEW, **kw)
    relaxed = pad.generate(target, draft, ids, policy=f"threshold@{TAU}", **kw)
    assert torch.equal(prefixed.sequences, exact.sequences)
    assert prefixed.stats.relaxed_accepted == 0 and relaxed.stats.relaxed_accepted > 0


@pytest.mark.parametrize("bad", [-1, 1.5, True, "3"])
def test_bad_exact_prefix_is_refused(models, bad):
    target, draft = models
    with pytest.raises(ValueError, match="exact_prefix"):
        pad.generate(target, draft, torch.tensor([[5, 6]]), policy="threshold@0.2", exact_prefix=bad)
