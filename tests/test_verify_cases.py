"""Hand-made verification blocks with exact expected tokens, run on every backend available here."""
import math

import pytest
import torch

from pad_kernels import FoldedClassifier, available_backends, verify_block

BACKENDS = available_backends("cpu")
NEG = float("-inf")


def _logits(rows):
    """rows: list over positions of {token: logit}; every other token gets -5. -> [1, K+1, 8]."""
    t = torch.full((1, len(rows), 8), -5.0)
    for i, row in enumerate(rows):
        for token, value in row.items():
            t[0, i, token] = value
    return t


@pytest.mark.parametrize("backend", BACKENDS)
def test_first_token_rejected(backend):
    logits = _logits([{3: 2.0}, {4: 2.0}, {5: 2.0}])
    res = verify_block(logits, torch.tensor([[1, 4]]), backend=backend)
    assert res.accepted.tolist() == [[False, False]]
    assert res.num_accepted.tolist() == [0] and res.next_token.tolist() == [3]
    assert res.argmax.tolist() == [[3, 4, 5]]


@pytest.mark.parametrize("backend", BACKENDS)
def test_all_accepted_gives_bonus(backend):
    logits = _logits([{3: 2.0}, {4: 2.0}, {6: 2.0}])
    res = verify_block(logits, torch.tensor([[3, 4]]), backend=backend)
    assert res.accepted.tolist() == [[True, True]]
    assert res.num_accepted.tolist() == [2] and res.next_token.tolist() == [6]


@pytest.mark.parametrize("backend", BACKENDS)
def test_accepted_is_a_prefix(backend):
    logits = _logits([{3: 2.0}, {4: 2.0}, {5: 2.0}, {6: 2.0}])
    res = verify_block(logits, torch.tensor([[3, 0, 5]]), backend=backend)  # second rejected, third would match
    assert res.accepted.tolist() == [[True, False, False]]
    assert res.num_accepted.tolist() == [1] and res.next_token.tolist() == [4]


@pytest.mark.parametrize("backend", BACKENDS)
def test_argmax_ties_take_lowest_index(backend):
    logits = _logits([{2: 1.0, 6: 1.0}, {5: 3.0, 1: 3.0, 7: 3.0}])
    res = verify_block(logits, torch.tensor([[6]]), backend=backend)
    assert res.argmax.tolist() == [[2, 1]]
    assert res.num_accepted.tolist() == [0] and res.next_token.tolist() == [2]


@pytest.mark.parametrize("backend", BACKENDS)
def test_negative_infinity_logits(backend):
    logits = torch.full((1, 2, 8), NEG)
    logits[0, 0, [1, 2]] = torch.tensor([0.0, 0.0])
    logits[0, 1, 7] = 0.0
    res = verify_block(logits, torch.tensor([[1]]), backend=backend)
    torch.testing.assert_close(res.entropy, torch.tensor([[torch.log(torch.tensor(2.0)).item(), 0.0]]))
    torch.testing.assert_close(res.token_prob, torch.tensor([[0.5]]))
    assert res.num_accepted.tolist() == [1] and res.next_token.tolist() == [7]
    # Sampling never draws a token whose logit is -inf.
    for seed in range(20):
        torch.manual_seed(seed)
        out = verify_block(logits, torch.tensor([[5]]), temperature=1.0, draft_probs=torch.full((1, 1, 8), 1 / 8),
                           backend=backend)
        assert out.num_accepted.item() == 0 and out.next_token.item() in (1, 2)


def _pivot_classifier(score):
    """A folded classifier whose pivot score is ``score`` for every input (H = 4)."""
    return FoldedClassifier(torch.zeros(6, 2), torch.zeros(2), torch.zeros(2), torch.tensor(float(score)))


@pytest.mark.parametrize("backend", BACKENDS)
def test_pivot_override_and_floor(backend):
    # Draft token 1 has p = e^0 / (e^2 + e^0 + 6 e^-5) ~ 0.119 at position 0; the target prefers 3.
    logits = _logits([{3: 2.0, 1: 0.0}, {4: 2.0}, {5: 2.0}])
    drafts = torch.tensor([[1, 4]])
    hidden = torch.randn(1, 3, 4)
    low = _pivot_classifier(-2.0)  # pivot_prob = sigmoid(-2) ~ 0.119
    res = verify_block(logits, drafts, hidden, low, sigma=0.5, floor=1e-4, backend=backend)
    assert res.accepted.tolist() == [[True, True]] and res.pivot_accepted.tolist() == [[True, False]]
    assert res.num_accepted.tolist() == [2] and res.next_token.tolist() == [5]
    torch.testing.assert_close(res.pivot_prob, torch.sigmoid(torch.tensor([[-2.0, -2.0]])))
    # sigma below the pivot probability: the exact rule decides.
    res = verify_block(logits, drafts, hidden, low, sigma=0.1, floor=1e-4, backend=backend)
    assert res.num_accepted.tolist() == [0] and res.next_token.tolist() == [3]
    # The floor: p(1) ~ 0.119 is below a floor of 0.2, so no override.
    res = verify_block(logits, drafts, hidden, low, sigma=0.5, floor=0.2, backend=backend)
    assert res.num_accepted.tolist() == [0] and res.pivot_accepted.tolist() == [[False, False]]
    # A confident pivot (pivot_prob ~ 0.88) is rejected at sigma 0.5.
    res = verify_block(logits, drafts, hidden, _pivot_classifier(2.0), sigma=0.5, backend=backend)
    assert res.num_accepted.tolist() == [0]


@pytest.mark.parametrize("backend", BACKENDS)
def test_no_draft_tokens_picks_next_token(backend):
    res = verify_block(_logits([{6: 1.0}]), torch.empty(1, 0, dtype=torch.long), backend=backend)
    assert res.num_accepted.tolist() == [0] and res.next_token.tolist() == [6]
    assert res.accepted.shape == (1, 0)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("how", ["greedy", "pivot", "kl", "sampling"])
def test_empty_batch_gives_empty_results(backend, how):
    """B = 0 (a batch whose rows have all finished) verifies nothing: empty outputs of the right shapes."""
    from pad_kernels import AcceptRule
    from pad_kernels.types import empty_result

    K, V = 3, 8
    kwargs = {"pivot": dict(hidden=torch.zeros(0, K + 1, 4), classifier=_pivot_classifier(0.0), sigma=0.5),
              "kl": dict(draft_logits=torch.zeros(0, K, V), rule=AcceptRule("kl", 0.5, 1.0)),
              "sampling": dict(temperature=1.0, draft_probs=torch.zeros(0, K, V))}.get(how, {})
    res = verify_block(torch.zeros(0, K + 1, V), torch.zeros(0, K, dtype=torch.long), backend=backend, **kwargs)
    for name, got, want in zip(res._fields, res, empty_result(0, K, "cpu")):
        assert got.shape == want.shape and got.dtype == want.dtype, name


@pytest.mark.parametrize("backend", BACKENDS)
def test_sampling_accepts_when_target_likes_the_token_more(backend):
    """u * q(d) <= p(d): with p(d) >= q(d) the draft token is always accepted, whatever u is."""
    logits = _logits([{2: 3.0}, {2: 3.0}])
    q = torch.full((1, 1, 8), 1 / 8)
    res = verify_block(logits, torch.tensor([[2]]), temperature=1.0, draft_probs=q,
                       uniforms=torch.tensor([[0.999]]), exponentials=torch.ones(1, 8), backend=backend)
    assert res.num_accepted.tolist() == [1]
    assert res.next_token.tolist() == [2]  # bonus: exponentials all 1, so the argmax of p


def _p_and_entropy(logits_row):
    """p and the entropy of one position, in fp64 from the test's own formula."""
    p = torch.softmax(logits_row.double(), -1)
    return p, float(-(torch.where(p > 0, p * p.log(), 0.0)).sum())


@pytest.mark.parametrize("backend", BACKENDS)
def test_typical_accepts_just_above_its_bound_and_rejects_just_below(backend):
    from pad_kernels import AcceptRule

    logits = _logits([{3: 2.0, 1: 1.0}, {4: 2.0}])
    p, H = _p_and_entropy(logits[0, 0])
    p1 = float(p[1])  # the draft token 1 is not the argmax (3): the exact rule rejects it
    drafts = torch.tensor([[1]])
    for rule, accepted in ((AcceptRule.typical(p1 - 1e-4, 1e6), True),  # epsilon binds
                           (AcceptRule.typical(p1 + 1e-4, 1e6), False),
                           (AcceptRule.typical(1.0, (p1 - 1e-4) * math.exp(H)), True),  # delta * exp(-H) binds
                           (AcceptRule.typical(1.0, (p1 + 1e-4) * math.exp(H)), False)):
        res = verify_block(logits, drafts, rule=rule, backend=backend)
        assert res.accepted.tolist() == [[accepted]] and res.pivot_accepted.tolist() == [[accepted]], rule
        assert res.num_accepted.tolist() == [int(accepted)] and res.next_token.tolist() == [4 if accepted else 3]


@pytest.mark.parametrize("backend", BACKENDS)
def test_threshold_accepts_at_tau(backend):
    from pad_kernels import AcceptRule

    logits = torch.full((1, 2, 8), NEG)
    logits[0, 0, [1, 3]] = 0.0  # p = 1/2 exactly for tokens 1 and 3 (argmax 1: draft 3 is a mismatch)
    logits[0, 1, 6] = 0.0
    above = torch.nextafter(torch.tensor(0.5), torch.tensor(1.0)).item()  # the next fp32: settings are fp32
    for tau, accepted in ((0.5, True), (above, False), (0.25, True)):
        res = verify_block(logits, torch.tensor([[3]]), rule=AcceptRule.threshold(tau), backend=backend)
        assert res.token_prob.tolist() == [[0.5]]
        assert res.accepted.tolist() == [[accepted]] and res.next_token.tolist() == [6 if accepted else 1], tau


def _fly_rows(rows):
    """rows: per batch row, per position 'h' (a mismatch at high top-3 entropy: three tied tokens 1 < 2 < 3,
    draft 2), 'l' (a mismatch at low top-3 entropy: token 3 far ahead, draft 2) or 'm' (a match, draft 3 of
    a lone leader); plus a bonus position. -> logits [B, K+1, 8], drafts [B, K]."""
    spec = {"h": ({1: 2.0, 2: 2.0, 3: 2.0}, 2), "l": ({3: 12.0, 2: 0.0}, 2), "m": ({3: 4.0}, 3)}
    logits = torch.cat([_logits([spec[c][0] for c in row] + [{5: 3.0}]) for row in rows])
    drafts = torch.tensor([[spec[c][1] for c in row] for row in rows])
    return logits, drafts


@pytest.mark.parametrize("backend", BACKENDS)
def test_fly_window_and_gate(backend):
    from pad_kernels import AcceptRule

    rows = ["hmmmm",  # a mismatch followed by window - 1 = 2 matches: accepted, and the rest
            "hmhmm",  # a second mismatch inside the window rejects the first
            "mmmhm",  # a mismatch whose window runs past the block (4 + 3 - 1 > 5): rejected in this block
            "lmmmm",  # a mismatch at low top-3 entropy: rejected outright
            "mhmmm",  # a mismatch at position 2 with its window inside: accepted
            "mmhmm"]  # position 3 + 3 - 1 = 5 <= 5: accepted
    logits, drafts = _fly_rows(rows)
    res = verify_block(logits, drafts, rule=AcceptRule.fly(gate=0.3, window=3), backend=backend)
    assert res.num_accepted.tolist() == [5, 0, 3, 0, 5, 5]
    assert res.next_token.tolist() == [5, 1, 1, 3, 5, 5]
    assert res.pivot_accepted.long().tolist() == [[1, 0, 0, 0, 0], [0] * 5, [0] * 5, [0] * 5, [0, 1, 0, 0, 0],
                                                  [0, 0, 1, 0, 0]]
    # Three tokens of about 1/3 each (the other five hold ~1e-3 each): about ln 3; one dominant token: ~0.
    assert res.top3_entropy[0, 0] == pytest.approx(math.log(3), abs=0.02) and res.top3_entropy[3, 0] < 0.01
    # A gate above the tied tokens' top-3 entropy rejects them all: fly then equals exact.
    res = verify_block(logits, drafts, rule=AcceptRule.fly(gate=1.2, window=3), backend=backend)
    assert res.num_accepted.tolist() == [0, 0, 3, 0, 1, 2]
    # Window 1: any mismatch that passes the gate is accepted.
    res = verify_block(logits, drafts, rule=AcceptRule.fly(gate=0.3, window=1), backend=backend)
    assert res.num_accepted.tolist() == [5, 5, 5, 0, 5, 5]


def test_rule_settings_are_checked():
    from pad_kernels import AcceptRule

    logits, drafts = torch.randn(1, 3, 8), torch.tensor([[1, 2]])
    for rule, match in ((AcceptRule.typical(1.5, 0.3), "typical needs"), (AcceptRule.threshold(-0.1), "threshold"),
                        (AcceptRule.fly(0.3, 0), "whole window"), (AcceptRule.fly(0.3, 2.5), "whole window"),
                        (AcceptRule("nucleus"), "named one of"), ("typical", "AcceptRule")):
        with pytest.raises(ValueError, match=match):
            verify_block(logits, drafts, rule=rule)
    with pytest.raises(ValueError, match="greedy decoding only"):
        verify_block(logits, drafts, rule=AcceptRule.fly(), temperature=0.7, draft_probs=torch.rand(1, 2, 8))


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_row_that_stopped_drafting_gets_its_bonus_token(backend):
    logits = _logits([{3: 2.0}, {4: 2.0}, {5: 2.0}, {6: 2.0}])
    drafts = torch.tensor([[3, 4, 5]] * 3)  # all three match the target
    res = verify_block(logits.expand(3, -1, -1).contiguous(), drafts, num_drafts=torch.tensor([3, 1, 0]),
                       backend=backend)
    assert res.num_accepted.tolist() == [3, 1, 0] and res.next_token.tolist() == [6, 4, 3]
    assert res.accepted.tolist() == [[True] * 3, [True, False, False], [False] * 3]
    with pytest.raises(ValueError, match="num_drafts must lie in"):
        verify_block(logits, drafts[:1], num_drafts=torch.tensor([4]), backend=backend)
    with pytest.raises(ValueError, match="num_drafts must be int64"):
        verify_block(logits, drafts[:1], num_drafts=torch.tensor([1, 2]), backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_kl_divergence_and_its_bound(backend):
    """p = (1/2, 1/2), q = (3/4, 1/4) over two live tokens: KL(p || q) = ln 2 - ln 3 / 2 ~ 0.1438; the rule
    accepts the mismatch at epsilon just above it, rejects just below, and keeps the exact rule where the
    target's top-1 probability (1/2) is not below top1."""
    from pad_kernels import AcceptRule

    logits = torch.full((1, 2, 8), NEG)
    logits[0, 0, [1, 3]] = 0.0  # argmax 1: the draft token 3 is a mismatch
    logits[0, 1, 6] = 0.0
    draft_logits = torch.full((1, 1, 8), NEG)
    draft_logits[0, 0, 1], draft_logits[0, 0, 3] = math.log(3.0), 0.0
    kl = math.log(2.0) - math.log(3.0) / 2
    for rule, accepted in ((AcceptRule.kl(kl + 1e-4), True), (AcceptRule.kl(kl - 1e-4), False),
                           (AcceptRule.kl(1.0, 0.5), False), (AcceptRule.kl(1.0, 0.51), True),
                           (AcceptRule.kl(1.0, 0.0), False)):
        res = verify_block(logits, torch.tensor([[3]]), rule=rule, draft_logits=draft_logits, backend=backend)
        assert res.divergence[0, 0].item() == pytest.approx(kl, abs=1e-6)
        assert res.accepted.tolist() == [[accepted]] and res.pivot_accepted.tolist() == [[accepted]], rule
        assert res.next_token.tolist() == [6 if accepted else 1], rule
    # Without the draft's logits the divergence is -1 and the kl rule cannot run.
    assert verify_block(logits, torch.tensor([[3]]), backend=backend).divergence.tolist() == [[-1.0]]
    with pytest.raises(ValueError, match="pass draft_logits"):
        verify_block(logits, torch.tensor([[3]]), rule=AcceptRule.kl(1.0), backend=backend)
    # A token the target can emit and the draft never would: KL is +inf, never within a bound.
    draft_logits[0, 0, 3] = NEG
    res = verify_block(logits, torch.tensor([[3]]), rule=AcceptRule.kl(1e30), draft_logits=draft_logits,
                       backend=backend)
    assert res.divergence[0, 0].item() == float("inf") and res.num_accepted.tolist() == [0]


@pytest.mark.parametrize("backend", BACKENDS)
def test_topk_rank_ties_and_delta(backend):
    """Tokens 1, 2, 4 share the top logit (p = 0.3 each, ranks 0, 1, 2 by index), token 5 is fourth
    (p = 0.1): topk accepts a draft token ranked below k whose p is within delta of the top-1's."""
    from pad_kernels import AcceptRule

    logits = torch.full((1, 2, 8), NEG)
    logits[0, 0, [1, 2, 4]] = math.log(3.0)
    logits[0, 0, 5] = 0.0
    logits[0, 1, 6] = 0.0
    for draft, rule, accepted in ((4, AcceptRule.topk(3, 0.0), True),  # rank 2 < 3, p equal to the top-1's
                                  (4, AcceptRule.topk(2, 1.0), False),  # rank 2: not among the first two
                                  (2, AcceptRule.topk(2, 0.0), True),
                                  (5, AcceptRule.topk(4, 0.19), False),  # 0.1 < 0.3 - 0.19
                                  (5, AcceptRule.topk(4, 0.21), True),
                                  (5, AcceptRule.topk(3, 1.0), False),  # rank 3
                                  (2, AcceptRule.topk(1, 1.0), False),  # k = 1: the argmax (token 1) only
                                  (2, AcceptRule.topk(0, 1.0), False)):
        res = verify_block(logits, torch.tensor([[draft]]), rule=rule, backend=backend)
        assert res.accepted.tolist() == [[accepted]], (draft, rule)
        assert res.next_token.tolist() == [6 if accepted else 1], (draft, rule)


def test_divergence_rule_settings_are_checked():
    from pad_kernels import AcceptRule

    logits, drafts = torch.randn(1, 3, 8), torch.tensor([[1, 2]])
    for rule, match in ((AcceptRule.kl(-0.1), "kl needs"), (AcceptRule.kl(0.5, 1.5), "kl needs"),
                        (AcceptRule.topk(-1, 0.1), "topk needs"), (AcceptRule("topk", 2.5, 0.1), "whole k"),
                        (AcceptRule.topk(2, -0.1), "topk needs")):
        with pytest.raises(ValueError, match=match):
            verify_block(logits, drafts, rule=rule, draft_logits=torch.randn(1, 2, 8))
    for bad, match in ((torch.randn(1, 3, 8), "draft_logits must be"),
                       (torch.randn(1, 2, 8, dtype=torch.float64), "draft_logits must be")):
        with pytest.raises(ValueError, match=match):
            verify_block(logits, drafts, rule=AcceptRule.kl(0.5), draft_logits=bad)


@pytest.mark.parametrize("backend", available_backends("cpu"))
def test_bad_classifier_bias_raises(backend):
    """classifier_bias is checked before any backend runs: fp32 [B, K, D], and only beside a classifier."""
    g = torch.Generator().manual_seed(5)
    logits, drafts = torch.randn(2, 4, 8, generator=g), torch.tensor([[1, 2, 3], [4, 5, 6]])
    hidden = torch.randn(2, 4, 6, generator=g)
    clf = FoldedClassifier(torch.randn(8, 5, generator=g), torch.randn(5, generator=g), torch.randn(5, generator=g),
                           torch.tensor(0.1))
    for bad, match in ((torch.randn(2, 3, 4), r"classifier_bias must be fp32 \[B, K, D\] = \[2, 3, 5\]"),
                       (torch.randn(2, 4, 5), "classifier_bias must be"),
                       (torch.randn(2, 3, 5, dtype=torch.float64), "classifier_bias must be")):
        with pytest.raises(ValueError, match=match):
            verify_block(logits, drafts, hidden, clf, sigma=0.5, classifier_bias=bad, backend=backend)
    with pytest.raises(ValueError, match="pass the classifier too"):
        verify_block(logits, drafts, classifier_bias=torch.randn(2, 3, 5), backend=backend)
