"""num_draft_tokens="auto": the cost model's fit, the chooser's argmax, and decoding with a K chosen per block
(exact stays exact, decisions are those of a fixed K, K = 0 blocks keep both caches consistent)."""
import itertools
import math

import numpy as np
import pytest
import torch

import pad
from pad.decoding import draft_length as dl
from pad.decoding.draft_length import AutoDraftLength, ForwardCost, RowAcceptance, expected_tokens, nnls
from pad.decoding.decoder import left_padded as _batch
from schedules import Recorder, Schedule
from test_generate_batch import _alone
from test_generate_pivot import _classifier
from tiny import ARCHS, tiny_pair


def _rows(g, n, vocab, longest=15):
    return [torch.randint(0, vocab, (int(torch.randint(1, longest, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def _new(out, ids):
    P = ids.shape[1]
    return [out.sequences[r, P : P + int(out.lengths[r])].tolist() for r in range(ids.shape[0])]


# --- the cost model ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(6))
def test_nnls_equals_the_best_nonnegative_subset_solution(seed):
    """Lawson-Hanson against the definition: the least-squares solution of every subset of columns whose
    coefficients are all >= 0, best residual wins."""
    rng = np.random.default_rng(seed)
    m, n = 12, 5
    a = rng.normal(size=(m, n))
    b = a @ rng.normal(size=n) + 0.3 * rng.normal(size=m)
    best = (np.sum(b ** 2), np.zeros(n))
    for size in range(1, n + 1):
        for cols in itertools.combinations(range(n), size):
            x = np.zeros(n)
            x[list(cols)] = np.linalg.lstsq(a[:, cols], b, rcond=None)[0]
            residual = np.sum((a @ x - b) ** 2)
            if (x >= 0).all() and residual < best[0]:
                best = (residual, x)
    got = nnls(a, b)
    assert (got >= 0).all()
    assert np.sum((a @ got - b) ** 2) == pytest.approx(best[0], rel=1e-9, abs=1e-12)
    np.testing.assert_allclose(got, best[1], atol=1e-8)


def _planted(b, t, s, c, knee):
    n = b * t
    return c[0] + c[1] * b + c[2] * n + c[3] * max(0, n - knee) + c[4] * b * s + c[5] * n * s


@pytest.mark.parametrize("seed", range(4))
def test_forward_cost_recovers_a_planted_model(seed):
    """Times made by the model's own form (random non-negative coefficients, a knee of KNEES) are predicted
    at shapes it never saw."""
    rng = np.random.default_rng(seed)
    c = rng.uniform(0, 1, 6) * np.array([0.2, 0.003, 0.002, 0.009, 1e-5, 1e-6])
    c[rng.integers(0, 6)] = 0.0  # a term the machine does not have
    knee = int(rng.choice([4, 16, 32]))
    cost = ForwardCost()
    for b, t, s in itertools.product((1, 2, 5, 16), (1, 2, 5, 9, 13), (40, 300)):
        cost.add(b, t, s, _planted(b, t, s, c, knee))
    for b, t, s in ((3, 4, 120), (8, 7, 200), (12, 1, 500), (1, 11, 64)):
        assert cost.predict(b, t, s) == pytest.approx(_planted(b, t, s, c, knee), rel=1e-6)
    assert cost.knee == knee or np.allclose(c[3], 0.0)
    again = ForwardCost.from_dict(cost.to_dict())  # a saved profile predicts the same
    assert again.predict(8, 7, 200) == pytest.approx(cost.predict(8, 7, 200), rel=1e-12)


def test_forward_cost_ignores_unusable_times_and_predicts_nan_without_data():
    cost = ForwardCost()
    assert math.isnan(cost.predict(1, 1, 10))
    for seconds in (0.0, -1.0, math.nan, math.inf):
        cost.add(1, 1, 10, seconds)
    assert len(cost) == 0
    cost.add(1, 1, 10, 0.5)
    assert cost.predict(1, 1, 10) == pytest.approx(0.5)


@pytest.mark.parametrize("seed", range(3))
def test_forward_cost_keeps_probed_shapes_through_a_long_run_of_one_shape(seed):
    """Thousands of K = 0 blocks (T = 1) leave the probed T > 1 shapes in the fit: K > 0 is still predicted
    from them and ``covers`` stays true, so no call probes again."""
    rng = np.random.default_rng(seed)
    c = rng.uniform(0.1, 1, 6) * np.array([0.2, 0.003, 0.002, 0.009, 1e-5, 1e-6])
    cost = ForwardCost()
    for b, t in itertools.product((1, 16), (1, 2, 5, 9)):
        cost.add(b, t, 300, _planted(b, t, 300, c, 4), anchor=True)
    for i in range(3 * dl.MAX_OBSERVATIONS):
        s = 300 + int(rng.integers(0, 200))
        cost.add(16, 1, s, _planted(16, 1, s, c, 4))
    assert all(cost.covers(b, t) for b, t in itertools.product((1, 16), (2, 5, 9)))
    for t in (2, 5, 9):
        assert cost.predict(16, t, 300) == pytest.approx(_planted(16, t, 300, c, 4), rel=1e-6)
    again = 2 * _planted(16, 5, 300, c, 4)
    cost.add(16, 5, 300, again, anchor=True)  # a shape probed again: the latest counts, not both
    assert len(cost.anchors) == 8 and cost.anchors[(16, 5, 300)] == again


def test_auto_probes_a_shape_once_per_process(monkeypatch):
    """A second call after a long run of plain target steps finds its probes still there."""
    target, _ = tiny_pair("qwen2")
    probes = []
    real = dl.probe
    monkeypatch.setattr(dl, "probe", lambda model, cost, rows, tokens, columns: (
        probes.append((rows, tuple(tokens))), real(model, cost, rows, tokens, columns)))
    auto, cost = AutoDraftLength(4), ForwardCost()
    auto.target_cost = cost
    auto.bind(target, None, 3, 8)
    assert probes and all(cost.covers(b, t) for b in (1, 3) for t in (1, 2, 3, 5))
    first = len(probes)
    for i in range(2 * dl.MAX_OBSERVATIONS):
        cost.add(3, 1, 8 + i % 40, 1e-3)
    auto.bind(target, None, 3, 8)
    assert len(probes) == first


# --- acceptance and the chooser ---------------------------------------------------------------------------------


@pytest.mark.parametrize("a", [0.0, 0.3, 0.9, 1.0])
def test_expected_tokens_is_the_mean_of_a_simulated_block(a):
    rng = np.random.default_rng(1)
    for k in (0, 1, 4, 8):
        accepted = np.argmin(np.concatenate([rng.random((20000, k)) < a, np.zeros((20000, 1), bool)], 1), 1)
        assert expected_tokens(a, k) == pytest.approx(1 + accepted.mean(), abs=0.06)
        assert expected_tokens(a, k) == pytest.approx(sum(a ** i for i in range(k + 1)))


def test_row_acceptance_counts_judged_positions_only():
    acc = RowAcceptance(3, prior=0.5)
    acc.update([2, 4, 0], [4, 4, 4])  # row 0: 2 accepted then a rejection; row 1: all 4; row 2: rejected first
    acc.update([1, 3, 0], [1, 4, 4])
    accepted, rejected = np.array([3, 7, 0]), np.array([1, 1, 2])
    pooled = (accepted.sum() + dl.PRIOR_TRIALS * 0.5) / (accepted.sum() + rejected.sum() + dl.PRIOR_TRIALS)
    want = (accepted + dl.PRIOR_TRIALS * pooled) / (accepted + rejected + dl.PRIOR_TRIALS)
    np.testing.assert_allclose(acc.estimates(), want)
    acc.select([2, 0])  # row 1 leaves: its trials stay in the pool
    np.testing.assert_allclose(acc.estimates(), want[[2, 0]])
    assert acc.new_trials() == (10.0, 4.0)


class _Planted:
    """A cost model of planted seconds per (rows, tokens)."""

    def __init__(self, table):
        self.table = table

    def predict(self, rows, tokens, columns):
        return self.table[tokens]


@pytest.mark.parametrize("seed", range(8))
def test_chooser_picks_the_argmax_of_planted_costs_and_acceptances(seed):
    rng = np.random.default_rng(seed)
    kmax = 10
    # Target seconds grow with the tokens fed, by a random convex-ish profile; the draft's per token.
    steps = np.sort(rng.uniform(0.0, 0.08, kmax + 1))
    target = {t: 0.2 + float(np.sum(steps[: t - 1])) for t in range(1, kmax + 2)}
    draft = {1: float(rng.uniform(0.005, 0.12))}
    acceptance = rng.uniform(0.2, 0.99, int(rng.integers(1, 9)))
    chooser = AutoDraftLength(kmax, target_cost=_Planted(target), draft_cost=_Planted(draft), min_gain=0.0)
    chooser.overhead = 0.01

    def rate(k):  # expected tokens per second of the batch, written out
        tokens = sum(sum(a ** i for i in range(k + 1)) for a in acceptance)
        return tokens / (target[k + 1] + k * draft[1] + 0.01)

    want = max(range(kmax + 1), key=rate)
    drafting = lambda k: k * draft[1]  # noqa: E731 (the drafter's predicted seconds)
    k, seconds = chooser.choose(acceptance, drafting, 100)
    assert k == want and seconds == pytest.approx(target[k + 1] + k * draft[1] + 0.01)
    k, _ = chooser.choose(acceptance, drafting, 100, limit=2)
    assert k == max(range(3), key=rate)


@pytest.mark.parametrize("seed", range(4))
def test_chooser_counts_only_the_drafts_a_row_can_propose(seed):
    """A draft-free drafter proposes only what it found: the chooser's expected tokens use min(K, cap)."""
    rng = np.random.default_rng(seed)
    kmax = 8
    target = {t: 0.2 + 0.02 * (t - 1) for t in range(1, kmax + 2)}
    acceptance = rng.uniform(0.3, 0.99, 4)
    caps = rng.integers(0, kmax + 1, 4)
    chooser = AutoDraftLength(kmax, target_cost=_Planted(target), min_gain=0.0)

    def rate(k):
        return sum(sum(a ** i for i in range(min(k, c) + 1)) for a, c in zip(acceptance, caps)) / target[k + 1]

    k, _ = chooser.choose(acceptance, lambda k: 0.0, 100, caps=caps)
    assert k == max(range(int(caps.max()) + 1), key=rate)


@pytest.mark.parametrize("gain", [0.05, 0.3])
def test_chooser_speculates_only_beyond_its_own_prediction_error(gain):
    """K > 0 only where its predicted rate beats a plain step's by more than min_gain; with min_gain None, by
    the mean relative error of the blocks it predicted (PRIOR_MIN_GAIN before 4 of them)."""
    target = {t: 1.0 + 0.05 * (t - 1) for t in range(1, 6)}
    acceptance = [0.3] * 2
    rates = [sum(sum(a ** i for i in range(k + 1)) for a in acceptance) / (target[k + 1] + 0.02 * k)
             for k in range(5)]
    best = max(range(1, 5), key=lambda k: rates[k])
    chooser = AutoDraftLength(4, target_cost=_Planted(target), min_gain=gain)
    k, _ = chooser.choose(acceptance, lambda k: 0.02 * k, 100)
    assert k == (best if rates[best] > rates[0] * (1 + gain) else 0)
    auto = AutoDraftLength(4, target_cost=_Planted(target))
    assert auto.gain_needed() == dl.PRIOR_MIN_GAIN
    auto.errors.extend([0.1, 0.3, 0.2, 0.2])
    assert auto.gain_needed() == pytest.approx(0.2)


def test_chooser_waits_for_speculation_to_pay_for_the_drafts_prefill():
    """A draft 300 tokens behind costs one long forward once: worth it for many tokens left, not for few."""
    target = {t: 0.2 + 0.01 * (t - 1) for t in range(1, 10)}
    draft = {1: 0.02, 300: 2.0}
    chooser = AutoDraftLength(8, target_cost=_Planted(target), draft_cost=_Planted(draft))
    drafting = lambda k: k * draft[1]  # noqa: E731
    catch_up = draft[300] - draft[1]
    assert chooser.choose([0.9] * 4, drafting, 100, catch_up=catch_up, remaining=1000)[0] > 0
    assert chooser.choose([0.9] * 4, drafting, 100, catch_up=catch_up, remaining=5)[0] == 0
    # Without the draft behind, the same few tokens left are worth speculating.
    assert chooser.choose([0.9] * 4, drafting, 100, remaining=5)[0] > 0


class _Batch:
    """The part of a RowBatch the chooser reads: its rows, their prompts and budgets."""

    def __init__(self, rows, budget=100):
        self.prompts, self._budget = [[1, 2]] * rows, budget

    def __len__(self):
        return len(self.prompts)

    def budget(self, j):
        return self._budget


class _Sourced:
    """A drafter whose rows propose from named sources; with ``options``, each option its own sources,
    per-token draft seconds and caps."""

    name, has_logits = "sourced", False

    def __init__(self, plans):
        self.plans, self.option = plans, next(iter(plans))

    def options(self):
        return tuple(self.plans)

    def all_sources(self):
        return tuple(sorted({s for sources, _, _ in self.plans.values() for s in sources}))

    def use(self, option, acceptance=None, k=None):
        self.option, self.k = option, k  # k: the draft length its sources would be weighed at

    def sources(self, k):
        return self.plans[self.option][0]

    def seconds(self, k, rows):
        return k * self.plans[self.option][1]

    def available(self, k):
        return [min(k, c) for c in self.plans[self.option][2]]


def test_each_source_has_its_own_acceptance():
    """Rows that proposed from the model and rows that looked up are counted in separate pools: a rejected
    lookup does not lower the model's estimate (each pool as a RowAcceptance fed only its rows' blocks)."""
    target = {t: 0.2 + 0.01 * t for t in range(1, 10)}
    auto = AutoDraftLength(8, target_cost=_Planted(target))
    drafter = _Sourced({"mixed": (["model", "lookup", "model"], 0.01, [8, 8, 8])})
    owner = torch.nn.Linear(1, 1)  # the target whose earlier calls' trials are remembered
    auto.start(_Batch(3), owner, drafter, ("exact",))
    model, lookup = RowAcceptance(3, auto.prior_acceptance), RowAcceptance(3, auto.prior_acceptance)
    for accepted, verified in (([4, 0, 2], [4, 5, 4]), ([3, 1, 4], [3, 6, 4])):
        auto.next(_Batch(3), drafter, 100, 1, 8)
        auto.observe(accepted, verified, 0.3)
        model.update([accepted[0], 0, accepted[2]], [verified[0], 0, verified[2]])
        lookup.update([0, accepted[1], 0], [0, verified[1], 0])
    np.testing.assert_allclose(auto.estimates(["model", "lookup", "model"]),
                               [model.estimates()[0], lookup.estimates()[1], model.estimates()[2]])
    np.testing.assert_allclose(auto.estimates(["lookup"] * 3), lookup.estimates())
    assert auto.estimates(["model"] * 3)[1] > auto.estimates(["lookup"] * 3)[1]
    auto.select([0, 2])  # row 1 leaves: its trials stay in its pool
    lookup.select([0, 2])
    np.testing.assert_allclose(auto.estimates(["lookup", "lookup"]), lookup.estimates())
    auto.finish()
    auto.start(_Batch(1), owner, drafter, ("exact",))  # a later call starts from both pools' trials
    prior = auto.prior_acceptance
    np.testing.assert_allclose(auto.estimates(["lookup"]), RowAcceptance(1, prior, (1.0, 2.0)).estimates())
    np.testing.assert_allclose(auto.estimates(["model"]), RowAcceptance(1, prior, (13.0, 1.0)).estimates())


@pytest.mark.parametrize("free_has_match", [True, False])
def test_auto_takes_the_option_whose_best_k_is_fastest_once_every_source_was_tried(free_has_match):
    """Option "mixed" drafts (model and lookup rows) at 0.05 s a token, "free" at nothing but only where it
    found a match. The first block is mixed whatever "free" would predict (the model's source untried);
    once both sources have trials, auto takes "free" where it has a match and "mixed" where it proposes
    nothing, each at that option's best K. Options are told the K of the last block that drafted (the
    largest before any)."""
    target = {t: 0.2 + 0.01 * t for t in range(1, 10)}
    auto = AutoDraftLength(8, target_cost=_Planted(target), min_gain=0.0)
    caps = [8, 8] if free_has_match else [0, 0]
    drafter = _Sourced({"mixed": (["model", "lookup"], 0.05, [8, 8]), "free": (["lookup"] * 2, 0.0, caps)})
    auto.start(_Batch(2), torch.nn.Linear(1, 1), drafter, ("exact",))
    k, _ = auto.next(_Batch(2), drafter, 100, 1, 8)
    assert drafter.option == "mixed" and k > 0 and drafter.k == 8
    auto.observe([k, k], [k, k], 0.3)  # both rows accepted all: both sources tried, estimates stay high
    first, (k, _) = k, auto.next(_Batch(2), drafter, 100, 1, 8)
    want = "free" if free_has_match else "mixed"
    assert drafter.option == want and drafter.k == first
    rates = auto.rates(auto.estimates(drafter.sources(8)), lambda k: drafter.seconds(k, 2), 100,
                       caps=drafter.available(8), remaining=100)
    assert k == int(np.nanargmax(rates)) > 0


def test_bad_draft_lengths_are_refused():
    target, draft = tiny_pair("llama")
    ids = torch.tensor([[1, 2, 3]])
    for bad in ("often", 0, -2, 2.5, True):
        with pytest.raises(ValueError, match="num_draft_tokens"):
            pad.generate(target, draft, ids, num_draft_tokens=bad, max_new_tokens=2)
    with pytest.raises(ValueError, match="max_draft_tokens"):
        pad.generate(target, draft, ids, num_draft_tokens=4, max_draft_tokens=8, max_new_tokens=2)
    with pytest.raises(ValueError, match="max_draft_tokens"):
        pad.generate(target, draft, ids, num_draft_tokens="auto", max_draft_tokens=0, max_new_tokens=2)


# --- decoding with a K per block --------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("batch", [1, 3, 8])
def test_exact_with_auto_k_equals_target_greedy(arch, batch):
    target, draft = tiny_pair(arch)
    vocab = target.config.vocab_size
    g = torch.Generator().manual_seed(batch + len(arch))
    rows = _rows(g, batch, vocab)
    eos = _alone(target, rows[0], 9, None)[8]  # row 0 ends at its 9th token, the others may run to the budget
    expected = [_alone(target, r, 30, eos) for r in rows]
    ids, mask = _batch(rows)
    # The real chooser (its K follows this machine's timings), and a schedule with K = 0 blocks among others.
    for chooser in (Recorder(6), Schedule([0, 3, 1, 0, 0, 5, 2, 6])):
        out = pad.generate(target, draft, ids, attention_mask=mask, policy="exact", num_draft_tokens=chooser,
                           max_new_tokens=30, eos_token_id=eos)
        assert _new(out, ids) == expected, f"{type(chooser).__name__}: {chooser.chosen}"
        assert sum(out.stats.draft_lengths.values()) == len(chooser.chosen) == max(
            s.target_forwards for s in out.row_stats)
        assert out.stats.draft_lengths == {k: chooser.chosen.count(k) for k in set(chooser.chosen)}
    assert 0 in chooser.chosen and out.stats.mean_draft_length == pytest.approx(np.mean(chooser.chosen))


def test_auto_reports_its_choices_and_predictions():
    target, draft = tiny_pair("qwen2")
    ids, mask = _batch([[1, 2, 3, 4], [5, 6]])
    out = pad.generate(target, draft, ids, attention_mask=mask, num_draft_tokens="auto", max_draft_tokens=5,
                       max_new_tokens=24)
    s = out.stats
    assert set(s.draft_lengths) <= set(range(6)) and sum(s.draft_lengths.values()) >= 24 // 6
    assert s.predicted_time > 0 and 0 < s.timed_blocks_time <= s.wall_time and s.block_time_error >= 0
    assert "mean K" in s.summary() and "predicted" in s.summary()
    back = pad.GenerationStats.from_dict(__import__("json").loads(__import__("json").dumps(s.to_dict())))
    assert back.draft_lengths == s.draft_lengths
    fixed = pad.generate(target, draft, ids, attention_mask=mask, num_draft_tokens=3, max_new_tokens=24).stats
    assert set(fixed.draft_lengths) <= {0, 1, 2, 3} and fixed.timed_blocks_time == 0
    assert fixed.draft_lengths.get(3, 0) >= 1


@pytest.mark.parametrize("policy", ["pivot", "threshold@0.012", "typical@0.2,0.3", "fly@0.1,2"])
def test_relaxed_rules_decide_as_a_fixed_k(policy):
    """A constant schedule of K is the fixed-K call, token for token and count for count; a recorded auto run
    replayed as a schedule decides the same again (the decisions depend on K only, never on timings)."""
    target, draft = tiny_pair("llama", scale=0.3)
    clf = _classifier(target, 2) if policy == "pivot" else None
    g = torch.Generator().manual_seed(11)
    ids, mask = _batch(_rows(g, 4, target.config.vocab_size))
    args = dict(attention_mask=mask, policy=policy, classifier=clf, sigma=0.5, max_new_tokens=25)
    counters = ("target_forwards", "draft_forwards", "drafted", "accepted", "relaxed_accepted", "new_tokens")
    for k in (1, 4):
        fixed = pad.generate(target, draft, ids, num_draft_tokens=k, **args)
        scheduled = pad.generate(target, draft, ids, num_draft_tokens=Schedule([k]), **args)
        assert torch.equal(fixed.sequences, scheduled.sequences)
        for a, b in zip(fixed.row_stats, scheduled.row_stats):
            assert [getattr(a, c) for c in counters] == [getattr(b, c) for c in counters]
    assert sum(s.relaxed_accepted for s in fixed.row_stats) > 0  # the rule really relaxed something
    recorded = Recorder(6)
    auto = pad.generate(target, draft, ids, num_draft_tokens=recorded, **args)
    replay = pad.generate(target, draft, ids, num_draft_tokens=Schedule(recorded.chosen), **args)
    assert torch.equal(auto.sequences, replay.sequences)
    for a, b in zip(auto.row_stats, replay.row_stats):
        assert [getattr(a, c) for c in counters] == [getattr(b, c) for c in counters]


def test_sampled_auto_is_reproducible_with_a_seed():
    target, draft = tiny_pair("gpt2")
    ids, mask = _batch([[1, 2, 3], [4, 5, 6, 7, 8]])
    a, b = (pad.generate(target, draft, ids, attention_mask=mask, num_draft_tokens=Schedule([0, 2, 4]),
                         temperature=0.9, seed=3, max_new_tokens=20) for _ in range(2))
    assert torch.equal(a.sequences, b.sequences)
