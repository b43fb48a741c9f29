"""Replay the search labeler's walks under an acceptance rule: what a rule that accepts some mismatches
would do to the answers of labeled problems, read from the labels alone, without decoding.

Each search decision says what happens to the answer when its draft token is accepted and the target
goes on greedily (``same_answer``, ``correct_after``). A rule that accepts a harmless token keeps the
answer and goes on along the walk; a rule that rejects a token keeps the text and its answer; the first
accepted pivot changes the answer to its continuation's, and the walk tells nothing after it. The replay
assumes the mismatches after a rejected harmless token (the walk saw them on the continuation) stand for
those of the kept text, so it is a preview for choosing which thresholds to decode, not a measurement.
It also takes the first accepted pivot's answer as final, while in decoding later accepted mismatches steer
a derailed text back about as often as they derail a right one (``bench/label_chain.py``: 15% and 16% a
mismatch for the default pair), so it overstates what accepting mismatches costs.
"""
from __future__ import annotations

import torch

SIGMAS = (0.05, 0.1, 0.15, 0.2, 0.25, 0.3, 0.4, 0.5, 0.6, 0.7)  # pivot_prob <= sigma accepted
TAUS = (0.9, 0.7, 0.5, 0.4, 0.3, 0.2, 0.1, 0.05)  # p_target(token) >= tau accepted
KS = (8, 16)  # draft tokens a block, for tokens per target forward


def _problem_runs(problem: torch.Tensor) -> torch.Tensor:
    """The number of decisions of each problem, in order [P]; refuses problems whose decisions are split."""
    ids, counts = torch.unique_consecutive(problem, return_counts=True)
    if len(ids) != len(problem.unique()):
        raise ValueError("the decisions of each problem must be contiguous")
    return counts


def replay(accept: torch.Tensor, same_answer: torch.Tensor, correct_before: torch.Tensor,
           correct_after: torch.Tensor, problem: torch.Tensor) -> dict[str, torch.Tensor]:
    """Walk every problem's decisions under a rule -> per problem (in order of first appearance) [P]:
    ``correct`` (the walk's text before any change), ``replayed`` (the answer's correctness under the rule),
    ``accepted`` (mismatches accepted) and ``seen`` (mismatches met before the first accepted pivot, that
    one included).

    accept, same_answer, correct_before, correct_after, problem: [N], one entry per decision; the decisions
    of a problem are contiguous and in walk order (as ``pad.pivots.train.load_shards`` returns them).
    """
    n = problem.numel()
    if not all(t.shape == (n,) for t in (accept, same_answer, correct_before, correct_after)):
        raise ValueError("accept, same_answer, correct_before, correct_after and problem must all be [N]")
    counts = _problem_runs(problem)
    group = torch.repeat_interleave(torch.arange(len(counts)), counts)
    start = torch.cumsum(counts, 0) - counts
    stop = accept.bool() & (same_answer == 0)  # an accepted pivot: the answer changes here
    stops = torch.cumsum(stop.long(), 0)
    stops_before = stops - stop.long() - (stops - stop.long())[start][group]  # accepted pivots earlier in the problem
    seen = stops_before == 0
    P = len(counts)
    first = stop & seen  # the first accepted pivot of its problem
    replayed = correct_before[start].long().clone()
    replayed[group[first]] = correct_after[first].long()
    return {"correct": correct_before[start].long(), "replayed": replayed,
            "accepted": torch.zeros(P, dtype=torch.long).index_add_(0, group, (accept.bool() & seen).long()),
            "seen": torch.zeros(P, dtype=torch.long).index_add_(0, group, seen.long())}


def replay_table(scores: torch.Tensor, thresholds, data: dict, problems_read: int, higher_accepts: bool = False,
                 resamples: int = 2000, seed: int = 0, ks=()) -> list[dict]:
    """Per threshold: the share of mismatches accepted and the change of accuracy over ``problems_read``
    problems (those without decisions count unchanged), with a 95% percentile interval from resampling
    problems (paired: the same problems with and without the rule); with ``ks``, also the tokens per target
    forward at each K on the walked texts (``tokens_per_forward``; data then needs ``position`` and
    ``text_length``), keyed by ``str(k)``.

    scores [N]: a token is accepted when ``scores <= threshold`` (pivot_prob, sigma), or ``>=`` with
    ``higher_accepts`` (p_target(token), tau). data: ``same_answer``, ``correct_before``, ``correct_after``,
    ``problem``, each [N].
    """
    args = (data["same_answer"], data["correct_before"], data["correct_after"], data["problem"])
    P = len(data["problem"].unique())
    if problems_read < P:
        raise ValueError(f"problems_read ({problems_read}) is below the problems with decisions ({P})")
    draws = torch.randint(0, problems_read, (resamples, problems_read), generator=torch.Generator().manual_seed(seed))
    rows = []
    for t in thresholds:
        accept = scores >= t if higher_accepts else scores <= t
        r = replay(accept, *args)
        change = torch.zeros(problems_read, dtype=torch.float64)
        change[:P] = (r["replayed"] - r["correct"]).double()
        lo, hi = torch.quantile(change[draws].mean(1), torch.tensor([0.025, 0.975], dtype=torch.float64)).tolist()
        rows.append({"threshold": t, "mismatches_accepted": float(r["accepted"].sum() / r["seen"].sum().clamp_min(1)),
                     "accuracy_change": float(change.mean()), "accuracy_change_ci": [lo, hi]})
        if ks:
            rows[-1]["tokens_per_forward"] = {str(k): tokens_per_forward(
                ~accept, data["position"], data["text_length"], data["problem"], k) for k in ks}
    return rows


def tokens_per_forward(reject: torch.Tensor, position: torch.Tensor, text_length: torch.Tensor,
                       problem: torch.Tensor, k: int) -> float:
    """Tokens per target forward that speculative decoding with ``k`` draft tokens a block would make on the
    walked texts when a rule rejects the draft tokens at ``reject`` and accepts every other mismatch.

    A walk's final text holds every mismatch the walk decided, and between them the draft agrees with the
    text, so a block verifies ``k`` draft tokens in one forward and keeps them up to the first rejected one,
    whose place takes the target's token, or all ``k`` and the target's next token. Rejecting every decision
    stands for exact speculation (the walk's text instead of the target's greedy one), rejecting exactly the
    pivots for a perfect classifier (a block's bonus token may differ from the walk where a harmless
    mismatch sits there; the count ignores that), so the ratio of the two previews how far any classifier of
    these labels can raise tokens per forward. A rule that accepts a pivot would decode another text from
    there on; the count goes on along the walk's (a preview, as the replay's answers are). The total over
    all problems: tokens / forwards.

    reject, position, text_length, problem: [N], one entry per decision, each problem's decisions contiguous
    and in walk order (as ``pad.pivots.train.load_shards`` returns them); position is the decision's index
    in the generated text, text_length the final text's length (the same for all decisions of a problem).
    """
    n = problem.numel()
    if not all(t.shape == (n,) for t in (reject, position, text_length)):
        raise ValueError("reject, position, text_length and problem must all be [N]")
    if k < 1:
        raise ValueError(f"k must be at least 1, got {k}")
    counts = _problem_runs(problem)
    tokens = forwards = 0
    for first, count in zip((torch.cumsum(counts, 0) - counts).tolist(), counts.tolist()):
        length = int(text_length[first])
        positions = position[first : first + count].tolist()
        rejected = [p for p, r in zip(positions, reject[first : first + count].tolist()) if r]
        if any(not 0 <= p < length for p in positions) or rejected != sorted(set(rejected)):
            raise ValueError(f"problem {int(problem[first])}: positions must rise within [0, text_length)")
        s = 0  # the next position to decode
        for r in rejected:
            if r - s >= k:  # whole blocks before r: k draft tokens and the target's next one each
                full = (r - s - k) // (k + 1) + 1
                forwards, s = forwards + full, s + full * (k + 1)
            if s <= r:  # the block holding r keeps r - s draft tokens and the target's token at r
                forwards, s = forwards + 1, r + 1
        forwards += -(-(length - s) // (k + 1))
        tokens += length
    return tokens / max(1, forwards)
