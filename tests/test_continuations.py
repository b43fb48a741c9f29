"""The continuation engine: continuations stay exactly greedy decoding's whatever the guessed tokens (prompt
lookup) and however joining jobs are grouped; good guesses save forwards, and joins cost the least forwards."""
import random

import pytest
import torch

from pad.decoding.hf import eos_ids
from pad.pivots.continuations import Continuations, Job, join_groups
from tiny import greedy_from_scratch, tiny_model


@pytest.fixture(scope="module")
def model():
    return tiny_model("qwen2", seed=3)


def _run(model, jobs, lookahead, batch=4, min_join=None):
    engine = Continuations(model, 96, eos_ids(model, None), -1, batch, lookahead, min_join=min_join)
    for job in jobs:
        engine.submit(job)
    out = {}
    while engine.busy:
        for done in engine.step():
            out[done.job.key] = (done.job.generated, done.cache)
    engine.close()
    return out, engine


@pytest.mark.parametrize("seed", range(3))
@torch.inference_mode()
def test_guesses_never_change_the_tokens(model, seed):
    rng = random.Random(seed)
    eos = eos_ids(model, None)
    prompts = [[rng.randrange(96) for _ in range(rng.randint(1, 8))] for _ in range(7)]
    budgets = [rng.randint(1, 24) for _ in prompts]
    want = [greedy_from_scratch(model, p, b, eos) for p, b in zip(prompts, budgets)]
    # Guesses from the right text (all agree), a shifted copy of it, and noise.
    lookups = [want[0], want[1][2:], [rng.randrange(96) for _ in range(30)], [], want[4][:5] + want[4],
               want[5][1:] + [3, 4], prompts[6]]
    jobs = [Job(key=i, prefix=None, first=p, budget=b, lookup=lk)
            for i, (p, b, lk) in enumerate(zip(prompts, budgets, lookups))]
    # Joins one by one, or only when 3 rows are free (finished rows then wait in the batch as holes).
    got, engine = _run(model, jobs, lookahead=rng.choice([1, 3, 6]), min_join=[1, 3, 3][seed])
    for i, (p, w) in enumerate(zip(prompts, want)):
        generated, (keys, _) = got[i]
        assert generated == w, i
        # The cache holds the text (rejected guesses are gone): the prompt, then all tokens but maybe the last.
        assert keys[0].shape[1] in (len(p) + len(w) - 1, len(p) + len(w)), i
    assert engine.tokens >= engine.forwards


@torch.inference_mode()
def test_right_guesses_save_forwards_and_keep_the_cache_right(model):
    eos = eos_ids(model, None)
    prompt = [5, 17, 42]
    want = greedy_from_scratch(model, prompt, 30, eos)
    plain, e0 = _run(model, [Job(key=0, prefix=None, first=prompt, budget=30)], lookahead=0)
    guessed, e4 = _run(model, [Job(key=0, prefix=None, first=prompt, budget=30, lookup=want)], lookahead=4)
    assert plain[0][0] == guessed[0][0] == want
    assert e0.forwards == len(want) - 1 and e4.forwards <= -(-(len(want) - 1) // 5) + 1
    # A continuation from the guessed run's cache equals one from a fresh prefill of the same text.
    keys, values = guessed[0][1]
    n = len(prompt) + len(want) - 1
    prefix = ([k[:, :n] for k in keys], [v[:, :n] for v in values])
    follow, _ = _run(model, [Job(key=1, prefix=prefix, first=[want[-1]], budget=6)], lookahead=0)
    assert follow[1][0] == greedy_from_scratch(model, prompt + want, 6, eos)


@torch.inference_mode()
def test_joins_wait_for_free_rows(model):
    eos = eos_ids(model, None)
    prompts = [[i + 1, 2 * i + 3] for i in range(6)]
    budgets = [3, 20, 4, 20, 5, 20]  # three short rows finish first, one after another
    jobs = [Job(key=i, prefix=None, first=p, budget=b) for i, (p, b) in enumerate(zip(prompts, budgets))]
    got, engine = _run(model, jobs, lookahead=0, batch=4, min_join=3)
    assert {i: got[i][0] for i in got} == {i: greedy_from_scratch(model, p, b, eos)
                                           for i, (p, b) in enumerate(zip(prompts, budgets))}
    # Rows 0-3 join at once; jobs 4 and 5 join together once three rows are free, not one by one.
    assert engine.joins == 2


def _partitions(items):
    """Every split of ``items`` into non-empty groups (the reference for ``join_groups``)."""
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for split in _partitions(rest):
        yield [[first], *split]
        for g in range(len(split)):
            yield [*split[:g], [first, *split[g]], *split[g + 1 :]]


@pytest.mark.parametrize("seed", range(6))
def test_join_groups_cost_the_least_of_all_splits(seed):
    rng = random.Random(seed)
    widths = [rng.choice([2, 2, 3, rng.randint(2, 300)]) for _ in range(rng.randint(1, 7))]
    fixed = rng.choice([0, 16, 32, 100])
    cost = lambda groups: sum(fixed + len(g) * max(widths[i] for i in g) for g in groups)  # noqa: E731
    groups = join_groups(widths, fixed)
    assert sorted(i for g in groups for i in g) == list(range(len(widths)))
    assert cost(groups) == min(cost(p) for p in _partitions(list(range(len(widths)))))
    assert [max(widths[i] for i in g) for g in groups] == sorted(max(widths[i] for i in g) for g in groups)


def test_join_groups_by_hand():
    # Seven decisions (2 columns) and a new prompt of 100: 8 x 100 = 800 as one forward, 32 + 14 + 32 + 100 apart.
    assert join_groups([2, 2, 2, 100, 2, 2, 2, 2], 32) == [[0, 1, 2, 4, 5, 6, 7], [3]]
    assert join_groups([2, 2, 2, 100, 2, 2, 2, 2], float("inf")) == [[0, 1, 2, 4, 5, 6, 7, 3]]
    assert join_groups([5, 9], 0) == [[0], [1]] and join_groups([], 32) == []


@torch.inference_mode()
def test_joins_of_unlike_inputs_go_in_groups(model):
    """Two-token jobs and long ones that join together are fed as two forwards, and every row still decodes
    exactly as greedy decoding from scratch; finished jobs come back in the order they were submitted."""
    eos = eos_ids(model, None)
    rng = random.Random(7)
    prompts = [[rng.randrange(96) for _ in range(n)] for n in (2, 60, 2, 2, 55, 2)]
    budgets = [0, 0, 5, 9, 7, 0]  # budget 0: only fed, finished at the join
    want = [greedy_from_scratch(model, p, b, eos) if b else [] for p, b in zip(prompts, budgets)]
    engine = Continuations(model, 96, eos, -1, 6, lookahead=0, join_fixed=8)
    for i, (p, b) in enumerate(zip(prompts, budgets)):
        engine.submit(Job(key=i, prefix=None, first=p, budget=b))
    first = engine.step()
    assert engine.joins == 2 and [f.job.key for f in first] == [0, 1, 5]
    got = {f.job.key: f.job.generated for f in first}
    while engine.busy:
        got.update({f.job.key: f.job.generated for f in engine.step()})
    engine.close()
    assert got == dict(enumerate(want))
    # One forward for all of them when a forward's fixed cost is taken as unbounded.
    engine = Continuations(model, 96, eos, -1, 6, lookahead=0, join_fixed=float("inf"))
    for i, (p, b) in enumerate(zip(prompts, budgets)):
        engine.submit(Job(key=i, prefix=None, first=p, budget=b))
    engine.step()
    engine.close()
    assert engine.joins == 1


def test_bad_lookahead_is_refused(model):
    with pytest.raises(ValueError, match="lookahead"):
        Continuations(model, 96, set(), -1, 4, lookahead=-1)
    with pytest.raises(ValueError, match="min_join"):
        Continuations(model, 96, set(), -1, 4, min_join=5)
    with pytest.raises(ValueError, match="join_fixed"):
        Continuations(model, 96, set(), -1, 4, join_fixed=-1)


@torch.inference_mode()
def test_compaction_only_when_it_narrows_the_cache(model):
    """Left padding of short rows is no reason to compact (no compaction removes it); holes that widen the
    longest row past twice its text are."""
    from pad.decoding.decoder import Decoder, left_pad

    dec = Decoder(model, 96, 3)
    ids, fed = left_pad([[1], [2], list(range(3, 43))], "cpu")  # 78 of 120 cells are padding
    dec.forward(ids, fed, keep=1)
    dec.drop(torch.zeros((3, 0), dtype=torch.bool))
    assert dec.compactions == 0 and dec.valid_host.shape[1] == 40
    for _ in range(2):  # the long row feeds 12 tokens and keeps 1 of them, twice: 22 holes in its 64 columns
        ids, fed = left_pad([[5] * 12, [5] * 12, [6] * 12], "cpu")
        dec.forward(ids, fed, keep=1)
        holes = torch.zeros((3, 12), dtype=torch.bool)
        holes[2, 1:] = True
        dec.drop(holes)
    assert dec.compactions == 0 and dec.valid_host.shape[1] == 64
    ids, fed = left_pad([[5] * 24, [5] * 24, [6] * 24], "cpu")  # every row keeps only the last of 24
    dec.forward(ids, fed, keep=1)
    holes = torch.zeros((3, 24), dtype=torch.bool)
    holes[:, :23] = True
    dec.drop(holes)  # the longest row holds 43 of 88 columns: compacted to 43
    assert dec.compactions == 1 and dec.valid_host.shape[1] == 43
    assert dec.valid_host.sum(1).tolist() == [26, 26, 43] and dec.valid_host[2].all()
