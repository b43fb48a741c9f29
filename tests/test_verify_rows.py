"""Per-row acceptance (``row_rules``) and logits read by row index (``logit_rows``): every fused backend against
the reference, and the reference against independent definitions (each row decided alone, ``exact_prefix``
as ``keep_exact_prefix`` composes it, the gathered block with ``num_drafts``)."""
import pytest
import torch

from pad.decoding.speculative import keep_exact_prefix
from pad_kernels import AcceptRule, verify_block, verify_block_ref
from pad_kernels.types import pack_row_rules
from test_verify_backends import KERNELS, assert_matches, fp64_truth, make_case, run_backend

# One row each: its rule, sigma, exact_until, and whether it samples (in a call with temperature > 0).
ROWS = [(AcceptRule(), 0.0, 0, True), (AcceptRule.typical(0.3, 0.05), 0.0, 2, True),
        (AcceptRule.threshold(0.05), 0.0, 0, False), (AcceptRule(), 0.5, 0, True),
        (AcceptRule.topk(3, 0.3), 0.0, 1, False), (AcceptRule.kl(0.5), 0.3, 3, True),
        (AcceptRule.fly(0.05, 2), 0.0, 0, False), (AcceptRule.threshold(0.05), 0.5, 9, True)]


def rows_case(sampling, seed, B=len(ROWS), K=5, V=1271, H=64):
    args, kwargs = make_case(B, K, V, H, torch.float32, sampling, seed, draft_logits=True)
    rules = [r for r, _, _, _ in ROWS[:B]]
    sampled = [s and sampling and r.name != "fly" for r, _, _, s in ROWS[:B]]
    packed = pack_row_rules(rules, [s for _, s, _, _ in ROWS[:B]], [u for _, _, u, _ in ROWS[:B]], sampled)
    return args, kwargs, packed, sampled


@pytest.mark.parametrize("backend", KERNELS)
@pytest.mark.parametrize("sampling", [False, True], ids=["greedy", "sampling"])
def test_row_rules_match_reference(backend, sampling):
    args, kwargs, packed, _ = rows_case(sampling, seed=50 + sampling)
    expected = verify_block_ref(*args, **kwargs, row_rules=packed)
    got = run_backend(backend, *args, **kwargs, row_rules=packed)
    assert_matches(got, expected, fp64_truth(*args, **kwargs), torch.float32)
    assert expected.pivot_accepted.any(), "some row must relax for the test to mean something"


@pytest.mark.parametrize("sampling", [False, True], ids=["greedy", "sampling"])
def test_row_rules_are_each_row_decided_alone(sampling):
    """Row b of one call equals a call on row b alone with its settings as scalars (a greedy row of a sampled
    call: its logits scaled by the call's temperature, decided greedily), composed with the exact decision by
    ``keep_exact_prefix`` where it has an exact prefix."""
    args, kwargs, packed, sampled = rows_case(sampling, seed=60 + sampling)
    logits, drafts, hidden, clf = args
    got = verify_block(*args, **kwargs, row_rules=packed, backend="torch")
    T = kwargs.get("temperature", 0.0)
    for b, (rule, sigma, until, _) in enumerate(ROWS):
        one = dict(floor=kwargs["floor"], draft_logits=kwargs["draft_logits"][b:b + 1])
        row = logits[b:b + 1]
        if sampled[b]:
            one.update({k: kwargs[k][b:b + 1] for k in ("draft_probs", "uniforms", "exponentials")}, temperature=T)
        elif T > 0:
            row, one["draft_logits"] = row / T, one["draft_logits"] / T
        relaxed = verify_block(row, drafts[b:b + 1], hidden[b:b + 1], clf, sigma=sigma, rule=rule, backend="cpu",
                               **one)
        exact = verify_block(row, drafts[b:b + 1], backend="cpu", **one)
        want = keep_exact_prefix(relaxed, exact, torch.tensor([until]))
        for name in ("pivot_accepted", "num_accepted", "next_token"):  # keep_exact_prefix sets these
            assert torch.equal(getattr(got, name)[b:b + 1], getattr(want, name)), (b, name)
        assert torch.equal(got.accepted[b], torch.arange(drafts.shape[1]) < want.num_accepted[0])
    assert got.pivot_accepted.any()


def vllm_layout(sampling, seed, counts=(3, 0, 5, 5, 2, 4), V=1271, H=64):
    """A serving engine's packed logits: request b's counts[b] draft rows one after another, no bonus rows,
    and a stray row at the end that no position reads; logit_rows [B, K+1] into them (-1 from counts[b] on)."""
    B, K = len(counts), max(counts)
    args, kwargs = make_case(B, K, V, H, torch.float32, sampling, seed)
    kwargs.pop("draft_logits", None)
    logits, drafts, hidden, clf = args
    rows, flat, flat_q = torch.full((B, K + 1), -1), [], []
    for b, k in enumerate(counts):
        rows[b, :k] = torch.arange(len(flat), len(flat) + k)
        flat += list(logits[b, :k])
        if sampling:
            flat_q += list(kwargs["draft_probs"][b, :k])
    flat.append(torch.zeros(V))
    packed = dict(kwargs, num_drafts=torch.tensor(counts))
    if sampling:
        packed["draft_probs"] = torch.stack(flat_q + [torch.zeros(V)])
    return (torch.stack(flat), drafts, hidden, clf), packed, rows, args, kwargs


@pytest.mark.parametrize("backend", KERNELS)
@pytest.mark.parametrize("sampling", [False, True], ids=["greedy", "sampling"])
@pytest.mark.parametrize("per_row", [False, True], ids=["one-rule", "row-rules"])
def test_logit_rows_match_reference(backend, sampling, per_row):
    """Positions without a row: NaN statistics, argmax -1, next token -1 where the prefix ends there (a row
    whose drafts are all accepted: the engine's own bonus token goes there)."""
    flat, kwargs, rows, _, _ = vllm_layout(sampling, seed=70 + sampling)
    if per_row:  # with a classifier bias too: per position (b, i), wherever its logits lie
        _, _, packed, _ = rows_case(sampling, seed=0, B=rows.shape[0])
        kwargs["row_rules"] = packed
        B, K = flat[1].shape
        kwargs["classifier_bias"] = torch.randn(B, K, flat[3].w1.shape[1], generator=torch.Generator().manual_seed(71))
    else:
        kwargs["rule"] = AcceptRule.threshold(0.05)
    expected = verify_block_ref(*flat, **kwargs, logit_rows=rows)
    got = run_backend(backend, *flat, **kwargs, logit_rows=rows)
    missing = rows < 0
    assert (expected.next_token == -1).any() and (expected.next_token >= 0).any()
    assert (expected.argmax[missing] == -1).all() and expected.entropy[missing].isnan().all()
    # NaN exactly where the reference has it; elsewhere the tolerance of test_verify_backends against fp64.
    truth = fp64_truth(flat[0][rows.clamp_min(0)], *flat[1:], **kwargs)
    blank = {}
    for name, g, e in zip(expected._fields, got, expected):
        if e.is_floating_point():
            assert torch.equal(g.isnan(), e.isnan()), name
            at = missing if e.shape == missing.shape else missing[:, :-1]
            blank[name] = (g.masked_fill(at, 0.0), e.masked_fill(at, 0.0))
            truth[name] = truth[name].masked_fill(at, 0.0)
    got, expected = (type(expected)(*(blank[n][k] if n in blank else t for n, t in zip(expected._fields, r)))
                     for k, r in enumerate((got, expected)))
    assert_matches(got, expected, truth, torch.float32)


@pytest.mark.parametrize("sampling", [False, True], ids=["greedy", "sampling"])
def test_logit_rows_decide_as_the_padded_block(sampling):
    """The reference read by row index decides as the [B, K+1, V] block with num_drafts does, but for the
    next token where the block's bonus row would be read (none here: -1)."""
    flat, kwargs, rows, block_args, block_kwargs = vllm_layout(sampling, seed=80 + sampling)
    by_rows = verify_block(*flat, **kwargs, logit_rows=rows, rule=AcceptRule.threshold(0.05), backend="cpu")
    block = verify_block(*block_args, **block_kwargs, num_drafts=kwargs["num_drafts"],
                         rule=AcceptRule.threshold(0.05), backend="cpu")
    assert torch.equal(by_rows.num_accepted, block.num_accepted)
    at_bonus = block.num_accepted == kwargs["num_drafts"]
    assert torch.equal(by_rows.next_token[~at_bonus], block.next_token[~at_bonus])
    assert (by_rows.next_token[at_bonus] == -1).all() and at_bonus.any() and (~at_bonus).any()


@pytest.mark.parametrize("bad,message", [
    (lambda rows: rows.float(), "logit_rows must be int64"),
    (lambda rows: rows[:, :-1], "logit_rows must be int64"),
    (lambda rows: rows.masked_fill(rows == 0, 10**6), "logit_rows must lie in"),
    (lambda rows: torch.where(torch.arange(rows.shape[1]) == 0, -1, rows), "every draft position"),
])
def test_bad_logit_rows_raise(bad, message):
    flat, kwargs, rows, _, _ = vllm_layout(False, seed=90)
    with pytest.raises(ValueError, match=message):
        verify_block(*flat, **kwargs, logit_rows=bad(rows))


def test_bad_row_rules_raise():
    args, kwargs, packed, _ = rows_case(False, seed=91)
    with pytest.raises(ValueError, match="row_rules must be fp32"):
        verify_block(*args, **kwargs, row_rules=packed[:, :5])
    bad = packed.clone()
    bad[0, 0] = 9
    with pytest.raises(ValueError, match="no rule code"):
        verify_block(*args, **kwargs, row_rules=bad)
    bad = packed.clone()
    bad[0, 5] = 1.0  # a sampled row in a greedy call
    with pytest.raises(ValueError, match="sampled row needs temperature"):
        verify_block(*args, **kwargs, row_rules=bad)
