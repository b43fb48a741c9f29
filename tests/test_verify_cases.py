"""Hand-made verification blocks with exact expected tokens, run on every backend available here."""
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
def test_sampling_accepts_when_target_likes_the_token_more(backend):
    """u * q(d) <= p(d): with p(d) >= q(d) the draft token is always accepted, whatever u is."""
    logits = _logits([{2: 3.0}, {2: 3.0}])
    q = torch.full((1, 1, 8), 1 / 8)
    res = verify_block(logits, torch.tensor([[2]]), temperature=1.0, draft_probs=q,
                       uniforms=torch.tensor([[0.999]]), exponentials=torch.ones(1, 8), backend=backend)
    assert res.num_accepted.tolist() == [1]
    assert res.next_token.tolist() == [2]  # bonus: exponentials all 1, so the argmax of p
