"""Replaying search walks under a threshold: hand-worked walks, a plain loop as the reference on random
walks, the table's paired accuracy change, and the cross-validation report that carries it."""
import pytest
import torch

from pad.pivots import label, replay, train


def _walks(rows):
    """[(problem, score, same_answer, correct_before, correct_after)] -> (scores, data)."""
    cols = list(zip(*rows))
    data = {"problem": torch.tensor(cols[0]), "same_answer": torch.tensor(cols[2], dtype=torch.int8),
            "correct_before": torch.tensor(cols[3], dtype=torch.int8),
            "correct_after": torch.tensor(cols[4], dtype=torch.int8)}
    return torch.tensor(cols[1]), data


# Problem 7, answered right: harmless (0.1), a pivot that makes it wrong (0.3), harmless (0.2).
# Problem 3, answered wrong: a pivot that makes it right (0.05), harmless (0.4).
HAND = [(7, 0.1, 1, 1, 1), (7, 0.3, 0, 1, 0), (7, 0.2, 1, 1, 1), (3, 0.05, 0, 0, 1), (3, 0.4, 1, 0, 0)]


@pytest.mark.parametrize("sigma, replayed, accepted, seen", [
    (0.0, [1, 0], [0, 0], [3, 2]),  # nothing accepted: the target's own answers
    (0.25, [1, 1], [2, 1], [3, 1]),  # 7: the pivot rejected, both harmless accepted; 3: its pivot turns it right
    (0.35, [0, 1], [2, 1], [2, 1]),  # 7: the pivot accepted, the walk ends there
])
def test_hand_worked_walks(sigma, replayed, accepted, seen):
    scores, data = _walks(HAND)
    r = replay.replay(scores <= sigma, data["same_answer"], data["correct_before"], data["correct_after"], data["problem"])
    assert r["correct"].tolist() == [1, 0]
    assert r["replayed"].tolist() == replayed and r["accepted"].tolist() == accepted and r["seen"].tolist() == seen


def _loop(accept, same, before, after, problem):
    """The replay as a plain walk, one problem at a time."""
    out = {"correct": [], "replayed": [], "accepted": [], "seen": []}
    order = list(dict.fromkeys(problem.tolist()))
    for p in order:
        idx = [i for i in range(len(problem)) if problem[i] == p]
        correct, acc, seen = int(before[idx[0]]), 0, 0
        out["correct"].append(correct)
        for i in idx:
            seen += 1
            if accept[i]:
                acc += 1
                if same[i] == 0:
                    correct = int(after[i])
                    break
        out["replayed"].append(correct)
        out["accepted"].append(acc)
        out["seen"].append(seen)
    return out


@pytest.mark.parametrize("seed", range(4))
def test_replay_equals_a_plain_walk(seed):
    g = torch.Generator().manual_seed(seed)
    counts = torch.randint(1, 9, (30,), generator=g)
    problem = torch.repeat_interleave(torch.randperm(1000, generator=g)[:30], counts)
    n = len(problem)
    same = (torch.rand(n, generator=g) > 0.3).to(torch.int8)
    before = torch.repeat_interleave((torch.rand(30, generator=g) > 0.4).to(torch.int8), counts)
    after = torch.where(same == 1, before, (torch.rand(n, generator=g) > 0.5).to(torch.int8))
    accept = torch.rand(n, generator=g) > 0.5
    got = replay.replay(accept, same, before, after, problem)
    want = _loop(accept, same, before, after, problem)
    assert {k: v.tolist() for k, v in got.items()} == want


def test_table_counts_problems_without_decisions_as_unchanged():
    scores, data = _walks(HAND)
    rows = replay.replay_table(scores, (0.0, 0.25, 0.35), data, problems_read=4, resamples=500)
    assert [r["threshold"] for r in rows] == [0.0, 0.25, 0.35]
    assert [r["accuracy_change"] for r in rows] == [0.0, 0.25, 0.0]  # (0 + 1) / 4; (-1 + 1) / 4
    assert [r["mismatches_accepted"] for r in rows] == [0.0, 3 / 4, 3 / 3]
    # resampling 4 problems, one of them a gain: the mean of Binomial(4, 1/4) / 4, whose 2.5% and 97.5% points
    # are 0 (P(0) = 0.32) and 3/4 (P(>= 3) = 0.051)
    assert rows[1]["accuracy_change_ci"] == [0.0, 0.75]
    assert rows[0]["accuracy_change_ci"] == [0.0, 0.0]
    # p_target(token) >= tau accepts: the same walks with the order of the scores reversed
    flipped = replay.replay_table(1 - scores, (1.0, 0.75, 0.65), data, 4, higher_accepts=True, resamples=500)
    assert [r["accuracy_change"] for r in flipped] == [r["accuracy_change"] for r in rows]


def test_bad_walks():
    scores, data = _walks(HAND + [(7, 0.1, 1, 1, 1)])  # problem 7 again after problem 3
    with pytest.raises(ValueError, match="contiguous"):
        replay.replay(scores <= 0.5, data["same_answer"], data["correct_before"], data["correct_after"], data["problem"])
    scores, data = _walks(HAND)
    with pytest.raises(ValueError, match="problems_read"):
        replay.replay_table(scores, (0.5,), data, problems_read=1)
    with pytest.raises(ValueError, match=r"\[N\]"):
        replay.replay(scores[:3] <= 0.5, data["same_answer"], data["correct_before"], data["correct_after"], data["problem"])


def test_cross_validation_replays_search_folders(tmp_path):
    """A search-like folder (both outcomes stored) gets a replay table in the report; the pivot rows replay the
    out-of-fold scores: a threshold that accepts everything loses every right answer with a pivot."""
    g = torch.Generator().manual_seed(5)
    writer = label.LabelWriter(tmp_path, (0, 1), {"task": "synthetic", "target": "t", "draft": "d", "layer": -2})
    direction = torch.randn(8, generator=g)
    for i in range(30):
        hidden = torch.randn(6, 8, generator=g)
        pivot = (hidden @ direction > 0.5).to(torch.int8)
        before = torch.full((6,), i % 2, dtype=torch.int8)
        writer.write(i, f"p{i}", {
            "hidden": hidden.half(), "token_prob": torch.rand(6, generator=g).half(),
            "entropy": torch.rand(6, generator=g).half(), "label": pivot, "same_answer": 1 - pivot,
            "correct_before": before, "correct_after": torch.where(pivot == 1, 1 - before, before),
            "mismatches": torch.tensor([6], dtype=torch.int32), "position": 4 * torch.arange(6, dtype=torch.int32) + i % 3,
            "generated": torch.tensor([25 + i], dtype=torch.int32)}, 1.0)
    data, meta = train.load_shards([tmp_path])
    assert all(k in data for k in train.OUTCOMES + train.WALKS)
    cv = train.cross_validate(data, meta, train.TrainConfig(model="linear", bootstrap=200), folds=3, progress=False)
    rows = {r["threshold"]: r for r in cv["replay"]["pivot@sigma"]}
    assert cv["replay"]["problems"] == 30 and set(rows) == set(replay.SIGMAS)
    accepted = [r["mismatches_accepted"] for r in cv["replay"]["pivot@sigma"]]
    assert accepted == sorted(accepted)  # a larger sigma accepts more
    every = replay.replay_table(torch.zeros(len(data["problem"])), (0.0,), data, 30)[0]
    right_with_pivot = sum(1 for i in range(30) if i % 2 and bool((data["label"][data["problem"] == data["problem"][
        6 * i]] == 1).any()))
    wrong_with_pivot = sum(1 for i in range(30) if not i % 2 and bool((data["label"][data["problem"] == data["problem"][
        6 * i]] == 1).any()))
    assert every["accuracy_change"] == pytest.approx((wrong_with_pivot - right_with_pivot) / 30)
    assert "threshold@0.5" in train.report_markdown({**_report_stub(), "cross_validation": cv})
    # Tokens per forward on the walked texts, block by block: every decision rejected, only the pivots, and
    # each threshold's own rejections.
    walks = cv["replay"]["tokens_per_forward"]
    tokens = sum(25 + i for i in range(30))
    for k in replay.KS:
        every = sum(_decode_blocks({4 * j + i % 3 for j in range(6)}, 25 + i, k) for i in range(30))
        pivots = sum(_decode_blocks({4 * j + i % 3 for j in range(6) if data["label"][6 * i + j]}, 25 + i, k)
                     for i in range(30))
        assert walks["exact"][str(k)] == pytest.approx(tokens / every)
        assert walks["perfect classifier"][str(k)] == pytest.approx(tokens / pivots)
        assert rows[0.05]["tokens_per_forward"][str(k)] <= rows[0.7]["tokens_per_forward"][str(k)]
    assert "| exact | | | | " in train.report_markdown({**_report_stub(), "cross_validation": cv})


def _report_stub():
    return {"model": "linear", "l2": 1.0, "problems": {"train": 1, "heldout": 1}, "positions": {"train": 1, "heldout": 1},
            "pivots": {"train": 1, "heldout": 1}, "heldout_auroc": 0.5, "best_heldout_loss": 0.7, "sigmas": []}


def _decode_blocks(rejected: set, length: int, k: int) -> int:
    """Forwards of speculative decoding on one text, a block at a time: k draft tokens, kept up to the first
    rejected one (replaced by the target's token), or all k and the target's next token."""
    s = forwards = 0
    while s < length:
        forwards += 1
        j = 0
        while j < k and s + j < length and s + j not in rejected:
            j += 1
        s += j + 1  # the kept draft tokens and the target's token after them
    return forwards


@pytest.mark.parametrize("rejected, length, k, forwards", [
    ([1, 6], 10, 3, 4),  # [0 x] [2 3 4 +5] [x] [7 8 9]
    ([3], 8, 3, 2),  # the rejected position is a block's own target token: [0 1 2 +3] [4 5 6 +7]
    ([], 9, 8, 1),  # nothing rejected: one block of 8 and the target's token
    ([0, 1, 2], 3, 4, 3),  # every token rejected: one a forward
])
def test_tokens_per_forward_hand_worked(rejected, length, k, forwards):
    position = torch.tensor(sorted(set(rejected) | {length - 1}))  # and an accepted decision at the end
    reject = torch.tensor([p in rejected for p in position.tolist()])
    got = replay.tokens_per_forward(reject, position, torch.full((len(position),), length), torch.zeros(len(position)), k)
    assert got == pytest.approx(length / forwards)


@pytest.mark.parametrize("seed", range(4))
def test_tokens_per_forward_equals_block_decoding(seed):
    g = torch.Generator().manual_seed(100 + seed)
    rows, tokens, forwards = [], 0, {k: 0 for k in (1, 4, 8, 16)}
    for p in torch.randperm(1000, generator=g)[:25].tolist():
        length = int(torch.randint(1, 120, (1,), generator=g))
        count = int(torch.randint(1, min(length, 20) + 1, (1,), generator=g))
        positions = torch.randperm(length, generator=g)[:count].sort().values.tolist()
        reject = (torch.rand(count, generator=g) < 0.4).tolist()
        rows += [(p, pos, length, r) for pos, r in zip(positions, reject)]
        tokens += length
        for k in forwards:
            forwards[k] += _decode_blocks({pos for pos, r in zip(positions, reject) if r}, length, k)
    problem, position, length, reject = (torch.tensor(c) for c in zip(*rows))
    for k, f in forwards.items():
        assert replay.tokens_per_forward(reject, position, length, problem, k) == pytest.approx(tokens / f)


def test_tokens_per_forward_refuses_bad_walks():
    one = torch.ones(2, dtype=torch.bool)
    with pytest.raises(ValueError, match="rise"):
        replay.tokens_per_forward(one, torch.tensor([3, 2]), torch.tensor([5, 5]), torch.zeros(2), 4)
    with pytest.raises(ValueError, match="rise"):
        replay.tokens_per_forward(one, torch.tensor([1, 5]), torch.tensor([5, 5]), torch.zeros(2), 4)
    with pytest.raises(ValueError, match="contiguous"):
        replay.tokens_per_forward(torch.ones(3, dtype=torch.bool), torch.tensor([1, 1, 2]), torch.full((3,), 5),
                                  torch.tensor([0, 1, 0]), 4)
    with pytest.raises(ValueError, match="k must"):
        replay.tokens_per_forward(one, torch.tensor([1, 2]), torch.tensor([5, 5]), torch.zeros(2), 0)
