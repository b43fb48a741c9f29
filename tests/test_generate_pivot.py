"""policy="pivot": sigma=0 is the exact policy, sigma=1/floor=0 takes every draft token, and acceptance
grows with sigma."""
import pytest
import torch

import pad
from pad.decoding.hf import LayerCapture
from pad_kernels import FoldedClassifier, verify_block
from tiny import tiny_pair

MAX_NEW = 24


def _classifier(target, seed):
    """A random classifier, standardized on the target's hidden states, whose pivot probabilities spread
    over (0, 1) with median 0.5."""
    torch.manual_seed(seed)
    H = target.config.hidden_size
    clf = pad.PivotClassifier(H, layer=-1)
    ids = torch.randint(0, target.config.vocab_size, (1, 64))
    capture = LayerCapture(target, clf.layer)
    capture.keep = ids.shape[1]
    with torch.no_grad():
        probs = torch.softmax(target(ids).logits[0].float(), -1)
        hidden = capture.value[0]
        capture.remove()
        features = torch.stack([probs.max(-1).values, -(probs * probs.log()).sum(-1)], -1)
        clf.input_mean[:H], clf.input_scale[:H] = hidden.mean(0), hidden.std(0)
        clf.mlp[2].weight.mul_(5.0)
        logits = clf(hidden, features)
        clf.mlp[2].bias[1] -= (logits[:, 1] - logits[:, 0]).median()
    return clf.eval()


@pytest.fixture(scope="module")
def setup():
    target, draft = tiny_pair("qwen2", scale=0.3)
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, 96, (1, int(torch.randint(2, 9, (1,), generator=g))), generator=g) for _ in range(12)]
    return target, draft, _classifier(target, 0), prompts


def test_sigma_zero_is_exact(setup):
    target, draft, clf, prompts = setup
    for prompt in prompts:
        exact = pad.generate(target, draft, prompt, policy="exact", num_draft_tokens=4, max_new_tokens=MAX_NEW)
        pivot = pad.generate(target, draft, prompt, policy="pivot", classifier=clf, sigma=0.0,
                             num_draft_tokens=4, max_new_tokens=MAX_NEW)
        assert torch.equal(pivot.sequences, exact.sequences)
        assert pivot.stats.relaxed_accepted == 0


@pytest.mark.parametrize("k", [3, MAX_NEW])
def test_sigma_one_floor_zero_takes_every_draft_token(setup, k):
    target, draft, clf, prompts = setup
    for prompt in prompts:
        out = pad.generate(target, draft, prompt, policy="pivot", classifier=clf, sigma=1.0, floor=0.0,
                           num_draft_tokens=k, max_new_tokens=MAX_NEW)
        assert out.stats.accepted == out.stats.drafted
        own = draft.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                             max_new_tokens=MAX_NEW, min_new_tokens=MAX_NEW, pad_token_id=0)
        if k >= MAX_NEW:
            # One block drafts the whole budget, so no target bonus token is emitted: the draft's greedy output.
            assert torch.equal(out.sequences, own)
        else:
            # Every position the draft proposed holds the draft's greedy choice; bonus tokens are the target's.
            P = prompt.shape[1]
            seq = out.sequences[0]
            for i in range(MAX_NEW):
                if (i + 1) % (k + 1) != 0:
                    nxt = draft(seq[None, : P + i]).logits[0, -1].argmax()
                    assert seq[P + i] == nxt


def _new_token_probs(target, out, P):
    """The new tokens [N] of a one-row output, their target probabilities [N] and whether each is the target's
    choice [N], from one full target forward from scratch."""
    with torch.no_grad():
        probs = torch.softmax(target(out.sequences).logits[0, P - 1 : -1].float(), -1)  # [N, V]
    new = out.sequences[0, P:]
    return new, probs.gather(-1, new[:, None]).squeeze(-1), new == probs.argmax(-1)


def test_floor_keeps_unlikely_draft_tokens_out(setup):
    """sigma = 1 with a floor: a draft token is taken when it is the target's choice or p_target(token) >= floor,
    so every new token is one or the other (a full target forward from scratch), and the floor rejects some
    draft tokens that sigma = 1 alone takes. The floor is the median p_target of the tokens sigma = 1 and floor 0
    take against the target's choice (the tiny models' probabilities are all near 1/V)."""
    target, draft, clf, prompts = setup
    kwargs = dict(policy="pivot", classifier=clf, sigma=1.0, num_draft_tokens=4, max_new_tokens=MAX_NEW)
    taken = []
    for prompt in prompts:
        _, p, chosen = _new_token_probs(target, pad.generate(target, draft, prompt, floor=0.0, **kwargs),
                                        prompt.shape[1])
        taken += p[~chosen].tolist()
    floor = float(torch.tensor(taken).median())
    rejected = relaxed = 0
    for prompt in prompts:
        out = pad.generate(target, draft, prompt, floor=floor, **kwargs)
        rejected += out.stats.drafted - out.stats.accepted
        relaxed += out.stats.relaxed_accepted
        _, p, chosen = _new_token_probs(target, out, prompt.shape[1])
        assert (chosen | (p >= floor)).all(), (floor, p[~chosen].tolist())
    assert rejected > 0 and relaxed > 0


def test_acceptance_grows_with_sigma(setup):
    target, draft, clf, prompts = setup
    rates, pivot_counts = [], []
    for sigma in (0.0, 0.2, 0.4, 0.6, 0.8, 1.0):
        drafted = accepted = pivots = 0
        for prompt in prompts:
            s = pad.generate(target, draft, prompt, policy="pivot", classifier=clf, sigma=sigma, floor=0.0,
                             num_draft_tokens=4, max_new_tokens=MAX_NEW).stats
            drafted, accepted, pivots = drafted + s.drafted, accepted + s.accepted, pivots + s.relaxed_accepted
        rates.append(accepted / drafted)
        pivot_counts.append(pivots)
    assert rates == sorted(rates), rates
    assert rates[0] < 0.6 < rates[-1] == 1.0
    assert pivot_counts[0] == 0 < pivot_counts[-1]


def test_block_acceptance_is_monotone_in_sigma():
    """For one fixed block, raising sigma can only lengthen the accepted prefix."""
    g = torch.Generator().manual_seed(0)
    B, K, V, H, D = 64, 6, 50, 16, 8
    logits = torch.randn(B, K + 1, V, generator=g)
    draft_tokens = torch.randint(0, V, (B, K), generator=g)
    hidden = torch.randn(B, K + 1, H, generator=g)
    folded = _random_folded(H, D, g)
    previous = torch.zeros(B, dtype=torch.long)
    for sigma in torch.linspace(0, 1, 11).tolist():
        n = verify_block(logits, draft_tokens, hidden, folded, sigma=sigma, floor=0.01).num_accepted
        assert (n >= previous).all()
        previous = n
    assert previous.sum() > 0


def _random_folded(H, D, g):
    return FoldedClassifier(torch.randn(H + 2, D, generator=g), torch.randn(D, generator=g),
                            torch.randn(D, generator=g), torch.randn((), generator=g))
