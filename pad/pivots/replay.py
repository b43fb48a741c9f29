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
    ids, counts = torch.unique_consecutive(problem, return_counts=True)
    if len(ids) != len(problem.unique()):
        raise ValueError("the decisions of each problem must be contiguous")
    group = torch.repeat_interleave(torch.arange(len(ids)), counts)
    start = torch.cumsum(counts, 0) - counts
    stop = accept.bool() & (same_answer == 0)  # an accepted pivot: the answer changes here
    stops = torch.cumsum(stop.long(), 0)
    stops_before = stops - stop.long() - (stops - stop.long())[start][group]  # accepted pivots earlier in the problem
    seen = stops_before == 0
    P = len(ids)
    first = stop & seen  # the first accepted pivot of its problem
    replayed = correct_before[start].long().clone()
    replayed[group[first]] = correct_after[first].long()
    return {"correct": correct_before[start].long(), "replayed": replayed,
            "accepted": torch.zeros(P, dtype=torch.long).index_add_(0, group, (accept.bool() & seen).long()),
            "seen": torch.zeros(P, dtype=torch.long).index_add_(0, group, seen.long())}


def replay_table(scores: torch.Tensor, thresholds, data: dict, problems_read: int, higher_accepts: bool = False,
                 resamples: int = 2000, seed: int = 0) -> list[dict]:
    """Per threshold: the share of mismatches accepted and the change of accuracy over ``problems_read``
    problems (those without decisions count unchanged), with a 95% percentile interval from resampling
    problems (paired: the same problems with and without the rule).

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
        r = replay(scores >= t if higher_accepts else scores <= t, *args)
        change = torch.zeros(problems_read, dtype=torch.float64)
        change[:P] = (r["replayed"] - r["correct"]).double()
        lo, hi = torch.quantile(change[draws].mean(1), torch.tensor([0.025, 0.975], dtype=torch.float64)).tolist()
        rows.append({"threshold": t, "mismatches_accepted": float(r["accepted"].sum() / r["seen"].sum().clamp_min(1)),
                     "accuracy_change": float(change.mean()), "accuracy_change_ci": [lo, hi]})
    return rows
