"""Drafters: lookup and suffix proposals against brute-force references, and every drafter decoding exactly
(the target's greedy tokens) through pad.generate, batched, with stop tokens and a chosen K."""
import random

import numpy as np
import pytest
import torch

import pad
from pad.decoding.decoder import left_padded
from pad.decoding.drafters import LookupDrafter, NgramIndex, Proposal, SuffixDrafter, make_drafter, pack
from pad.decoding.speculative import source_features
from pad.decoding.drafters.suffix import SuffixCounts
from pad.decoding.rows import RowBatch
from schedules import Schedule
from tiny import greedy_from_scratch, tiny_pair


def _lookup_reference(tokens: list[int], k: int, max_n: int, min_n: int) -> list[int]:
    """Prompt lookup written from its definition: the longest suffix n-gram, its latest earlier occurrence."""
    end = len(tokens)
    for n in range(min(max_n, end), min_n - 1, -1):
        suffix = tokens[end - n:]
        for i in range(end - 2, n - 2, -1):  # occurrence ending at i < end - 1, latest first
            if tokens[i - n + 1 : i + 1] == suffix:
                return tokens[i + 1 : i + 1 + k]
    return []


@pytest.mark.parametrize("seed", range(6))
def test_lookup_matches_its_definition_as_the_context_grows(seed):
    rng = random.Random(seed)
    vocab, max_n, min_n = rng.choice([3, 5, 9]), rng.randint(1, 4), 1
    min_n = rng.randint(1, max_n)
    tokens = [rng.randrange(vocab) for _ in range(rng.randint(1, 6))]
    index = NgramIndex(tokens, max_n, min_n)
    for _ in range(40):
        k = rng.randint(1, 7)
        got, n = index.match(k)
        assert got == _lookup_reference(tokens, k, max_n, min_n)
        assert (n == 0) == (got == [])
        new = [rng.randrange(vocab) for _ in range(rng.randint(1, 3))]
        tokens += new
        index.extend(new)


def _suffix_reference(row: list[int], outputs: list[list[int]], k: int, depth: int, min_match: int,
                      min_share: float) -> list[int]:
    """The suffix walk recomputed from scratch: counts of (context of d tokens -> next) over the row and the
    remembered outputs, longest context first, the most frequent next token (ties: latest in the row, then
    the smallest id)."""
    def counts(context):
        c = {}
        for seq in [row, *outputs]:
            for i in range(len(context), len(seq)):
                if seq[i - len(context) : i] == context:
                    c[seq[i]] = c.get(seq[i], 0) + 1
        return c

    latest = {t: i for i, t in enumerate(row)}
    ctx, out = list(row), []
    while len(out) < k:
        for d in range(min(depth, len(ctx)), min_match - 1, -1):
            c = counts(ctx[len(ctx) - d:])
            if c:
                break
        else:
            break
        token = max(c, key=lambda t: (c[t], latest.get(t, -1), -t))
        if c[token] < min_share * sum(c.values()):
            break
        out.append(token)
        ctx.append(token)
    return out


@pytest.mark.parametrize("seed", range(6))
def test_suffix_walk_matches_counts_recomputed_from_scratch(seed):
    rng = random.Random(seed)
    vocab = rng.choice([3, 4, 7])
    depth, min_match, share = rng.randint(2, 5), 1, rng.choice([0.0, 0.3])
    min_match = rng.randint(1, depth)
    drafter = SuffixDrafter(max_depth=depth, min_match=min_match, min_share=share)
    outputs = [[rng.randrange(vocab) for _ in range(rng.randint(2, 12))] for _ in range(3)]
    for o in outputs:
        drafter.remember(o)
    rows = [[rng.randrange(vocab) for _ in range(rng.randint(1, 8))] for _ in range(2)]
    batch = RowBatch(rows, 50, set())
    drafter.start(batch, None, "cpu")
    for _ in range(15):
        k = rng.randint(1, 6)
        got = [tokens for tokens, _ in drafter.matches(k)]
        assert got == [_suffix_reference(r, outputs, k, depth, min_match, share) for r in rows]
        kept = [[rng.randrange(vocab) for _ in range(rng.randint(1, 3))] for _ in rows]
        drafter.commit(batch, None, [0, 0], kept)
        for r, t in zip(rows, kept):
            r += t


def test_suffix_memory_is_bounded_and_forgets_the_oldest_first():
    drafter = SuffixDrafter(max_depth=3, max_cached_tokens=10)
    outputs = [[1, 2, 3, 4], [5, 6, 7], [1, 2, 9, 9], [4, 4, 4]]
    for o in outputs:
        drafter.remember(o)
    assert drafter.cached_tokens == 10 and list(drafter.outputs) == outputs[1:]  # 4 + 3 + 4 > 10: the first goes
    fresh = SuffixCounts(3)
    for o in outputs[1:]:
        fresh.add(o, 0, len(o))
    assert drafter.global_counts.table == fresh.table  # the forgotten outputs left no count behind
    drafter.remember(list(range(11)))  # longer than the whole memory: not kept
    assert list(drafter.outputs) == outputs[1:]


def _repeating_prompts(seed: int, rows: int, vocab: int = 96) -> list[list[int]]:
    """Prompts with repeated spans, so that lookup finds matches from the first block."""
    g = torch.Generator().manual_seed(seed)
    prompts = []
    for i in range(rows):
        span = torch.randint(0, vocab, (3 + i,), generator=g).tolist()
        prompts.append(span + torch.randint(0, vocab, (2,), generator=g).tolist() + span)
    return prompts


@pytest.mark.parametrize("drafter", ["model", "lookup", "suffix", "hybrid"])
@pytest.mark.parametrize("k", [3, "schedule"])
def test_every_drafter_decodes_the_targets_greedy_tokens(drafter, k):
    target, draft = tiny_pair("llama")
    prompts = _repeating_prompts(1, 3)
    ids, mask = left_padded(prompts)
    eos = {7}
    num = Schedule([0, 4, 1, 6, 2]) if k == "schedule" else k
    out = pad.generate(target, draft if drafter in ("model", "hybrid") else None, ids, attention_mask=mask,
                       policy="exact", drafter=drafter, num_draft_tokens=num, max_new_tokens=24, eos_token_id=7)
    for i, p in enumerate(prompts):
        want = greedy_from_scratch(target, p, 24, eos)
        assert out.sequences[i, ids.shape[1] : ids.shape[1] + len(want)].tolist() == want
        assert int(out.lengths[i]) == len(want)
    s = out.stats
    assert s.new_tokens == int(out.lengths.sum()) and s.accepted <= s.drafted
    if drafter in ("lookup", "suffix"):
        assert s.draft_forwards == 0
    if drafter == "lookup":
        assert s.drafted > 0  # the repeated spans gave proposals


def test_auto_k_with_lookup_stays_exact():
    target, _ = tiny_pair("llama")
    prompts = _repeating_prompts(2, 2)
    ids, mask = left_padded(prompts)
    out = pad.generate(target, None, ids, attention_mask=mask, policy="exact", drafter="lookup",
                       num_draft_tokens="auto", max_draft_tokens=5, max_new_tokens=16)
    for i, p in enumerate(prompts):
        assert out.sequences[i, ids.shape[1]:].tolist() == greedy_from_scratch(target, p, 16)


def test_hybrid_runs_the_model_only_for_rows_without_a_long_match():
    """At B = 1 a block with a lookup match of at least min_match tokens runs no draft forward."""
    target, draft = tiny_pair("llama")
    prompt = _repeating_prompts(3, 1)[0]
    hybrid = make_drafter("hybrid", draft)
    out = pad.generate(target, draft, torch.tensor([prompt]), policy="exact", drafter=hybrid, num_draft_tokens=4,
                       max_new_tokens=20)
    assert out.sequences[0, len(prompt):].tolist() == greedy_from_scratch(target, prompt, 20)
    assert hybrid.free_blocks > 0 and hybrid.model_blocks > 0  # the first block looked up, later ones drafted
    # Each model block drafts 4 (the last may be cut by the budget); lookup blocks none.
    assert 4 * (hybrid.model_blocks - 1) < out.stats.draft_forwards <= 4 * hybrid.model_blocks


def test_hybrid_free_option_takes_every_match_and_mixed_only_long_ones():
    """Mixed: a row's lookup proposal where its match is >= min_match tokens, else the model; free: every row
    its lookup proposal, however short the match (nothing without one). The options tell auto K the rows'
    sources apart, a match shorter than min_match (or none) being a source of its own."""
    _, draft = tiny_pair("llama")
    rows = [[5, 9, 8, 3, 5], [1, 2, 3, 4, 1, 2, 3], [10, 11, 12]]  # a 1-gram match, a 3-gram match, none
    hybrid = make_drafter("hybrid", draft)  # min_match 2, lookup n-grams 1..3
    hybrid.start(RowBatch(rows, 20, set()), pad.decoding.drafters.Sampling(), torch.device("cpu"))
    assert hybrid.options() == ("mixed", "free") and hybrid.option == "mixed"
    assert hybrid.sources(3) == ["model", "lookup", "model"] and hybrid.available(3) == [3, 3, 3]
    hybrid.use("free")
    assert hybrid.sources(3) == ["lookup-short", "lookup", "lookup-short"] and hybrid.available(3) == [3, 3, 0]
    assert hybrid.catch_up(3) == 0.0
    proposal = hybrid.propose(None, 3)  # no model forward: every row looked up
    assert proposal.tokens.tolist() == [[9, 8, 3], [4, 1, 2], [0, 0, 0]] and proposal.lengths.tolist() == [3, 3, 0]
    assert proposal.forwards == [0, 0, 0] and hybrid.free_blocks == 1 and hybrid.model_blocks == 0
    with pytest.raises(ValueError, match="unknown option 'model'"):
        hybrid.use("model")


def test_hybrid_mixed_sends_a_long_match_to_the_model_where_it_expects_more_tokens():
    """Given each source's per-row acceptance, mixed keeps a long match on the lookup only where its proposal
    (at most k tokens) is expected to give at least as many tokens as the model's k drafts; short matches and
    rows without one take the model whatever."""
    _, draft = tiny_pair("llama")
    # a 1-gram match, two long ones proposing 3 tokens, a long one proposing 2 ("4 5" followed by "4 5")
    rows = [[5, 9, 8, 3, 5], [1, 2, 3, 4, 1, 2, 3], [7, 8, 9, 7, 8, 9], [4, 5, 4, 5]]
    hybrid = make_drafter("hybrid", draft)
    hybrid.start(RowBatch(rows, 20, set()), pad.decoding.drafters.Sampling(), torch.device("cpu"))
    assert hybrid.all_sources() == ("model", "lookup")
    assert hybrid.available(3) == [3, 3, 3, 2]
    estimates = {"model": np.array([0.2, 0.8, 0.5, 0.8]), "lookup": np.array([0.9, 0.3, 0.5, 0.9])}

    def per_row(sources):
        return np.array([estimates[s][j] for j, s in enumerate(sources)])

    # Last row at k = 3: the lookup's 1 + .9 + .81 = 2.71 tokens against the model's 1 + .8 + .64 + .512.
    hybrid.use("mixed", per_row, 3)
    assert hybrid.sources(3) == ["model", "model", "lookup", "model"]
    hybrid.use("mixed", per_row, 1)  # at k = 1 the cap does not bind: 1.9 against 1.8
    assert hybrid.sources(3) == ["model", "model", "lookup", "lookup"]
    hybrid.select([1, 2, 3])  # the per-row preference follows the rows that stay
    assert hybrid.sources(3) == ["model", "lookup", "lookup"]
    hybrid.use("mixed")  # no estimates: by match length alone
    assert hybrid.sources(3) == ["lookup", "lookup", "lookup"]
    with pytest.raises(ValueError, match="draft length k"):
        hybrid.use("mixed", per_row)


class _Constant:
    """A drafter of one's own: always proposes the same tokens (mostly wrong), one row shorter than K."""

    name, has_logits = "constant", False

    def start(self, batch, sampling, device, needs_logits=False):
        self.device = device

    def propose(self, batch, k):
        return pack([([5] * (k - (j % 2)), 0) for j in range(len(batch))], k, self.device, source=0)

    def commit(self, batch, proposal, accepted, kept):
        pass

    def select(self, keep):
        pass

    def seconds(self, k, rows):
        return 0.0

    def finish(self, batch):
        pass


def test_a_drafter_of_ones_own_and_ragged_proposals():
    target, _ = tiny_pair("llama")
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9]]
    ids, mask = left_padded(prompts)
    out = pad.generate(target, None, ids, attention_mask=mask, drafter=_Constant(), num_draft_tokens=3,
                       max_new_tokens=10)
    for i, p in enumerate(prompts):
        assert out.sequences[i, ids.shape[1]:].tolist() == greedy_from_scratch(target, p, 10)
    packed = pack([([1], 3), ([], 0)], 2, "cpu", source=2)
    assert packed.sources == [2, 2] and packed.matches == [3, 0] and packed.free == [True, True]


class _MarkedConstant(_Constant):
    """_Constant whose rows say whether they came without a draft model (``Proposal.free``, from its
    ``sources``): ``free``."""

    def __init__(self, free: list[bool]):
        self.free = free

    def propose(self, batch, k):
        proposal = super().propose(batch, k)
        proposal.sources = [1 if self.free[r] else 0 for r in batch.live]
        return proposal


def test_pivot_leaves_draft_free_rows_to_the_exact_rule_unless_told_to_judge_them():
    """sigma = 1 with floor 0 passes every draft the classifier judges: rows marked draft-free still decode the
    target's greedy tokens, the others take every draft; with judge_free every row takes every draft."""
    target, _ = tiny_pair("llama")
    clf = pad.PivotClassifier(target.config.hidden_size, layer=-1).eval()
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9]]
    ids, mask = left_padded(prompts)
    free = [True, False, True]
    out = pad.generate(target, None, ids, attention_mask=mask, policy="pivot", classifier=clf, sigma=1.0, floor=0.0,
                       drafter=_MarkedConstant(free), num_draft_tokens=3, max_new_tokens=10)
    for i, p in enumerate(prompts):
        s = out.row_stats[i]
        if free[i]:
            assert out.sequences[i, ids.shape[1]:].tolist() == greedy_from_scratch(target, p, 10)
            assert s.relaxed_accepted == 0
        else:
            assert s.accepted == s.drafted and s.relaxed_accepted > 0
    judged = pad.generate(target, None, ids, attention_mask=mask, policy="pivot", classifier=clf, sigma=1.0,
                          floor=0.0, drafter=_MarkedConstant(free), num_draft_tokens=3, max_new_tokens=10,
                          judge_free=True)
    assert all(s.accepted == s.drafted for s in judged.row_stats) and judged.stats.relaxed_accepted > 0


def test_source_features_are_the_labels():
    """Per draft position, what the labels record (pad.pivots.search): the model's rows (0, 0, 0, -1), a
    lookup's or suffix's (its flag, the row's match, the place in the proposal)."""
    proposal = Proposal(torch.zeros((3, 3), dtype=torch.long), sources=[0, 1, 2], matches=[0, 4, 2])
    got = source_features(proposal, ("from_lookup", "from_suffix", "match", "offset"))
    want = torch.tensor([[[0, 0, 0, -1]] * 3, [[1, 0, 4, 0], [1, 0, 4, 1], [1, 0, 4, 2]],
                         [[0, 1, 2, 0], [0, 1, 2, 1], [0, 1, 2, 2]]], dtype=torch.float32)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    torch.testing.assert_close(source_features(proposal, ("offset", "match")), want[..., [3, 2]], rtol=0, atol=0)
    model = source_features(Proposal(torch.zeros((2, 2), dtype=torch.long)), ("from_lookup", "offset"))
    assert model.tolist() == [[[0.0, -1.0]] * 2] * 2


def test_a_classifier_of_sources_judges_each_row_by_where_its_drafts_came_from():
    """A linear classifier that calls every draft a pivot unless it came from a lookup (its from_lookup weight):
    with judge_free, the lookup rows take every draft and the model's rows decode the target's greedy tokens."""
    target, _ = tiny_pair("llama")
    names = ("token_prob", "entropy", "from_lookup", "from_suffix", "match", "offset")
    clf = pad.PivotClassifier(target.config.hidden_size, layer=-1, kind="linear", feature_names=names).eval()
    with torch.no_grad():
        clf.linear.weight.zero_()
        clf.linear.weight[0, target.config.hidden_size + 2] = -40.0
        clf.linear.bias.fill_(20.0)
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9]]
    ids, mask = left_padded(prompts)
    free = [True, False, True]
    out = pad.generate(target, None, ids, attention_mask=mask, policy="pivot", classifier=clf, sigma=0.5, floor=0.0,
                       drafter=_MarkedConstant(free), num_draft_tokens=3, max_new_tokens=10, judge_free=True)
    for i, p in enumerate(prompts):
        s = out.row_stats[i]
        if free[i]:
            assert s.accepted == s.drafted and s.relaxed_accepted > 0
        else:
            assert out.sequences[i, ids.shape[1]:].tolist() == greedy_from_scratch(target, p, 10)
            assert s.relaxed_accepted == 0


@pytest.mark.parametrize("drafter", ["lookup", "hybrid"])
def test_pivot_with_a_lookup_judges_only_the_draft_models_drafts(drafter):
    """Through the shipped drafters: pivot at sigma = 1, floor 0 with lookup is exact/lookup (the target's greedy
    tokens) unless judge_free; hybrid's lookup rows stay exact, so only blocks that ran the model relax."""
    target, draft = tiny_pair("llama")
    clf = pad.PivotClassifier(target.config.hidden_size, layer=-1).eval()
    prompts = _repeating_prompts(4, 3)
    ids, mask = left_padded(prompts)
    model = draft if drafter == "hybrid" else None

    def run(judge_free):
        hybrid = make_drafter(drafter, model)
        out = pad.generate(target, model, ids, attention_mask=mask, policy="pivot", classifier=clf, sigma=1.0,
                           floor=0.0, drafter=hybrid, num_draft_tokens=4, max_new_tokens=16, judge_free=judge_free)
        return out, hybrid

    out, used = run(False)
    if drafter == "lookup":
        for i, p in enumerate(prompts):
            assert out.sequences[i, ids.shape[1]:].tolist() == greedy_from_scratch(target, p, 16)
        assert out.stats.relaxed_accepted == 0 and out.stats.drafted > 0
    else:  # the model's drafts are all taken; a block of lookup rows only takes what the target would
        assert used.model_blocks > 0 and out.stats.relaxed_accepted > 0
        assert out.stats.accepted < out.stats.drafted
    judged, _ = run(True)
    assert judged.stats.accepted == judged.stats.drafted and judged.stats.relaxed_accepted > 0


def test_drafter_errors_are_clear():
    target, draft = tiny_pair("llama")
    ids = torch.tensor([[1, 2, 3]])
    with pytest.raises(ValueError, match="reads the draft's distribution.*'lookup'"):
        pad.generate(target, None, ids, policy="kl@0.5", drafter="lookup")
    with pytest.raises(ValueError, match="unknown drafter 'ngram'"):
        pad.generate(target, draft, ids, drafter="ngram")
    with pytest.raises(ValueError, match="drafter 'hybrid' needs a draft model"):
        pad.generate(target, None, ids, drafter="hybrid")
    with pytest.raises(ValueError, match="needs a draft model"):
        pad.generate(target, None, ids, policy="exact")
    with pytest.raises(ValueError, match="draft_stop .* drafter 'lookup' runs none"):
        pad.generate(target, None, ids, drafter="lookup", draft_stop=0.5)
    with pytest.raises(ValueError, match="decodes with one model"):
        pad.generate(target, None, ids, policy="target", drafter="lookup")
    with pytest.raises(TypeError, match="drafter must be one of"):
        pad.generate(target, None, ids, drafter=3)
    with pytest.raises(ValueError, match="min_ngram"):
        LookupDrafter(max_ngram=1, min_ngram=2)
    with pytest.raises(ValueError, match="judge_free lets the pivot classifier.*'exact' has no classifier"):
        pad.generate(target, None, ids, policy="exact", drafter="lookup", judge_free=True)
    with pytest.raises(ValueError, match="judge_free must be True or False"):
        pad.generate(target, None, ids, policy="exact", drafter="lookup", judge_free=1)


def test_the_shipped_drafters_and_lengths_follow_their_protocols():
    from pad.decoding.draft_length import AutoDraftLength, DraftLength, FixedDraftLength
    from pad.decoding.drafters import Drafter

    target, draft = tiny_pair("llama")
    for name in ("model", "lookup", "suffix", "hybrid"):
        assert isinstance(make_drafter(name, draft, target=target), Drafter)
    assert isinstance(_Constant(), Drafter)
    assert isinstance(FixedDraftLength(3), DraftLength) and isinstance(AutoDraftLength(), DraftLength)
    assert make_drafter("suffix", target=target) is make_drafter("suffix", target=target)  # one memory per target


def test_draft_free_drafters_say_their_source():
    """A lookup's and a suffix match's proposals carry their source; a free drafter of one's own (another name)
    is taken for a lookup, so it stays draft-free (pivot leaves it to the exact rule unless judge_free)."""
    class Mine(LookupDrafter):
        name = "mine"

    class Rows(list):  # two live rows and their prompts, what a drafter reads of a RowBatch
        prompts = [[1, 2, 3, 1, 2], [4, 5, 4, 5, 4]]

    for drafter, source in ((LookupDrafter(), 1), (SuffixDrafter(), 2), (Mine(), 1)):
        drafter.start(Rows([0, 1]), None, torch.device("cpu"))
        proposal = drafter.propose(Rows([0, 1]), 3)
        assert proposal.sources == [source, source] and proposal.free == [True, True], drafter.name
        assert proposal.matches == [n for _, n in drafter.matches(3)]
