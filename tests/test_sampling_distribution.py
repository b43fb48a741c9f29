"""Lossless sampling: with policy="exact" and temperature > 0 the output is distributed as the target's.

Goodness of fit is a chi-square test (scipy) over seeded samples; each test also runs with the residual
deliberately replaced by the target distribution itself, a classic bug, and must then detect it.
"""
import pytest
import torch
from scipy.stats import chisquare
from transformers import TemperatureLogitsWarper, TopPLogitsWarper

import pad
import pad_kernels.verify_ref as ref
from pad_kernels import AcceptRule, verify_block
from tiny import tiny_model

ALPHA = 1e-3  # a correct sampler fails one check in a thousand runs; the wrong residual gives p < 1e-20


def _p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Chi-square p-value of observed counts against probabilities; cells expected below 5 are pooled."""
    counts, probs = counts.double().flatten(), probs.double().flatten()
    probs = probs / probs.sum()  # fp32 probabilities sum to 1 only within 1e-7
    n = counts.sum()
    assert counts[probs == 0].sum() == 0, "a token with zero probability was emitted"
    small = probs * n < 5
    obs = torch.cat([counts[~small], counts[small].sum()[None]])
    exp = torch.cat([probs[~small], probs[small].sum()[None]]) * n
    keep = exp > 0
    return float(chisquare(obs[keep].numpy(), exp[keep].numpy()).pvalue)


def _wrong_residual(p, q):
    return p


def _first_two_tokens_of_block(rows: int, seed: int, rule=AcceptRule(), with_draft_logits=False):
    """Run one verification block on ``rows`` independent rows with fixed target and draft distributions
    (``with_draft_logits``: the draft's logits passed to the op too, which then also computes the divergence).

    Returns (counts of the first emitted token [V], counts of the second given the first was a draft
    token [V], p_1 [V], p_2 [V]).
    """
    g = torch.Generator().manual_seed(seed)
    K, V, T = 3, 8, 0.7
    logits = torch.randn(K + 1, V, generator=g) * 2
    draft_logits = torch.randn(K, V, generator=g) * 2 * T
    q = torch.softmax(draft_logits / T, -1)  # far from p, so rejections are common
    target_logits = logits.expand(rows, K + 1, V).contiguous()
    draft_probs = q.expand(rows, K, V).contiguous()
    draft_tokens = torch.multinomial(q, rows, replacement=True, generator=g).t().contiguous()  # [rows, K]
    uniforms = torch.rand(rows, K, generator=g)
    exponentials = torch.empty(rows, V).exponential_(generator=g)
    extra = dict(draft_logits=draft_logits.expand(rows, K, V).contiguous()) if with_draft_logits else {}
    res = verify_block(target_logits, draft_tokens, temperature=T, draft_probs=draft_probs, rule=rule,
                       uniforms=uniforms, exponentials=exponentials, backend="torch", **extra)
    n = res.num_accepted
    first = torch.where(n >= 1, draft_tokens[:, 0], res.next_token)
    second = torch.where(n >= 2, draft_tokens[:, 1], res.next_token)[n >= 1]
    p = torch.softmax(logits / T, -1)
    return torch.bincount(first, minlength=V), torch.bincount(second, minlength=V), p[0], p[1]


# exact, exact with the draft's logits passed to the op as well, and the divergence rules at their exact-equal
# settings (which read the draft's logits or the target's ranks and must then still never relax).
CASES = [(AcceptRule(), False), (AcceptRule(), True), (AcceptRule.kl(float("inf"), 0.0), True),
         (AcceptRule.topk(0, 1.0), False)]


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("rule,with_draft_logits", CASES, ids=["exact", "exact-draft-logits", "kl", "topk"])
def test_block_acceptance_and_residual_are_lossless(seed, rule, with_draft_logits, monkeypatch):
    c1, c2, p1, p2 = _first_two_tokens_of_block(40_000, seed, rule, with_draft_logits)
    assert _p_value(c1, p1) > ALPHA
    assert _p_value(c2, p2) > ALPHA
    monkeypatch.setattr(ref, "residual_probs", _wrong_residual)
    c1, _, p1, _ = _first_two_tokens_of_block(40_000, seed, rule, with_draft_logits)
    assert _p_value(c1, p1) < ALPHA


def _target_joint(target, prompt, temperature, top_p):
    """Exact probability of the first two new tokens under the target's own sampling, via HF's warpers."""
    warpers = [TemperatureLogitsWarper(temperature), TopPLogitsWarper(top_p)]

    def dist(ids):
        scores = target(ids).logits[:, -1].float()
        for w in warpers:
            scores = w(ids, scores)
        return torch.softmax(scores, -1)[0]

    with torch.no_grad():
        p1 = dist(prompt)
        V = p1.shape[0]
        rows = [p1[t] * dist(torch.cat([prompt, torch.tensor([[t]])], 1)) for t in range(V)]
    return torch.stack(rows)  # [V, V]


def _generated_pairs(target, draft, prompt, samples, backend=None, copies=2000, drafter=None):
    """Counts [V * V] of the first two new tokens over ``samples`` draws, taken as batches of ``copies`` rows
    of the prompt: every row draws its own random numbers (tests/test_generate_batch.py checks that rows of
    a batch sample independently, each as alone), so one call gives ``copies`` draws."""
    V = target.config.vocab_size
    counts = torch.zeros(V * V, dtype=torch.long)
    P = prompt.shape[1]
    for seed in range(samples // copies):
        out = pad.generate(target, draft, prompt.expand(copies, -1), policy="exact", num_draft_tokens=2,
                           max_new_tokens=2, temperature=0.8, top_p=0.9, seed=seed, backend=backend,
                           drafter=drafter).sequences
        counts += torch.bincount(out[:, P] * V + out[:, P + 1], minlength=V * V)
    return counts


@pytest.fixture(scope="module")
def small_vocab_pair():
    return tiny_model("llama", 8, hidden=16, layers=1, seed=3), tiny_model("llama", 8, hidden=16, layers=1, seed=4)


def test_generate_samples_like_the_target(small_vocab_pair, monkeypatch):
    target, draft = small_vocab_pair
    prompt = torch.tensor([[1, 5, 2]])
    joint = _target_joint(target, prompt, 0.8, 0.9)
    # The default backend (the fused CPU one where built; the test of every backend's identical tokens
    # covers the others), then the reference with its residual broken on purpose.
    assert _p_value(_generated_pairs(target, draft, prompt, 20_000), joint) > ALPHA
    monkeypatch.setattr(ref, "residual_probs", _wrong_residual)
    assert _p_value(_generated_pairs(target, draft, prompt, 20_000, backend="torch"), joint) < ALPHA


@pytest.mark.parametrize("drafter", ["lookup", "hybrid"])
def test_draft_free_proposals_sample_like_the_target(small_vocab_pair, monkeypatch, drafter):
    """A lookup proposal is a draft drawn with probability one: exact sampling must still give the target's
    distribution (the prompt repeats "1 5", so the first block drafts [2, 1] from it in every row)."""
    target, draft = small_vocab_pair
    prompt = torch.tensor([[1, 5, 2, 1, 5]])
    joint = _target_joint(target, prompt, 0.8, 0.9)
    assert _p_value(_generated_pairs(target, draft, prompt, 20_000, drafter=drafter), joint) > ALPHA
    monkeypatch.setattr(ref, "residual_probs", _wrong_residual)
    assert _p_value(_generated_pairs(target, draft, prompt, 20_000, backend="torch", drafter=drafter), joint) < ALPHA


def test_a_pruned_draft_samples_like_the_target(small_vocab_pair, monkeypatch):
    """A draft scoring only half the vocabulary (FR-Spec: ``use_pruned_head``, the others at -inf) proposes from
    a distribution over that half: rejection sampling must still give the target's distribution."""
    import copy

    from pad.decoding.vocab_prune import use_pruned_head

    target, draft = small_vocab_pair
    pruned = copy.deepcopy(draft)
    use_pruned_head(pruned, torch.tensor([0, 2, 4, 6]))
    prompt = torch.tensor([[1, 5, 2]])
    joint = _target_joint(target, prompt, 0.8, 0.9)
    assert _p_value(_generated_pairs(target, pruned, prompt, 20_000), joint) > ALPHA
    monkeypatch.setattr(ref, "residual_probs", _wrong_residual)
    assert _p_value(_generated_pairs(target, pruned, prompt, 20_000, backend="torch"), joint) < ALPHA


def test_no_top_p_work_when_top_p_is_one(monkeypatch):
    from pad.decoding.sampling import sampling_probs, warp_logits

    logits = torch.randn(2, 50)
    assert warp_logits(logits, 0.7, 1.0) is logits

    def no_sort(*args, **kwargs):
        raise AssertionError("top-p sorted the vocabulary although top_p is 1")

    monkeypatch.setattr(torch.Tensor, "sort", no_sort)
    torch.testing.assert_close(sampling_probs(logits, 0.7, 1.0), torch.softmax(logits / 0.7, -1))
