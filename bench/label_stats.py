"""What search labels say about accepted mismatches, read from the label folders alone (no model).

For the texts the target answers right (the ones an acceptance rule can lose): the pivot rate by
``p_target(token)`` (per proposal source too, where some decisions are a lookup's or a suffix match's), how
many texts meet a pivot that ``threshold@TAU`` would accept, and how pivots are spread over problems; for the
texts it answers wrong, how often a draft token turns them right; after a draft-free proposal's harmless wrong
token, how often the rest of that proposal holds another wrong token (``after_harmless``), and the pivot rate
by the decision's place in its proposal (``by_offset``). Then each single
feature's AUROC pooled over problems and within problems, beside the score that knows only how fragile a
problem is (the pivot rate of its other decisions) and any classifier's (``--classifier``), per proposal
source too. Last, the tokens per target forward a rule would make on the walked texts at each K
(``pad.pivots.replay.tokens_per_forward``) beside its replayed accuracy change: rejecting every mismatch
(exact), only the labeled pivots (a perfect classifier: the most any classifier of these labels can give)
and the ``p_target(token)`` threshold.

    python bench/label_stats.py labels/gsm8k-train-search labels/gsm8k-train-search-fp32
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from pad.evaluation.bench import share_with_interval
from pad.pivots.replay import replay_table
from pad.pivots.search import SOURCE_IDS
from pad.pivots.train import (WALKS, auroc, folder_drafter, load_shards, per_source_auroc, single_features,
                              within_problem_auroc)

P_EDGES = (0.0, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 1.0)
OFFSET_EDGES = (0, 1, 2, 4, 8)  # a draft-free decision's place in its proposal: bins [0, 1) ... [8, end)
KS = (4, 8, 16)
FRONTIER_TAUS = (0.4, 0.2, 0.1)


def problem_pivot_rate(labels: torch.Tensor, problems: torch.Tensor) -> torch.Tensor:
    """Each decision's score: the pivot rate of the other decisions of its problem (0 when it has none) [N]."""
    _, inv = problems.unique(return_inverse=True)
    count = torch.bincount(inv).double()
    pivots = torch.bincount(inv, weights=labels.double())
    return (pivots[inv] - labels.double()) / (count[inv] - 1).clamp_min(1)


def classifier_score(data: dict, folder: str) -> tuple[str, torch.Tensor]:
    """(a name, the pivot probability [N]) of the classifier in ``folder`` (``shipped``: the one shipped for the
    default pair) on the labeled decisions, from the features it reads as the folders store them."""
    from pad import PivotClassifier
    from pad.models.registry import DEFAULT_DRAFT, DEFAULT_TARGET, shipped_classifier

    path = shipped_classifier(DEFAULT_TARGET, DEFAULT_DRAFT) if folder == "shipped" else folder
    clf = PivotClassifier.load(path)
    features = torch.stack([data[n].float() for n in clf.feature_names], -1)
    with torch.no_grad():
        return f"classifier {folder}", clf.pivot_prob(data["hidden"].float(), features)


def stats(data: dict, taus=(0.2, 0.4), scores: dict | None = None) -> dict:
    """data: ``load_shards`` of search folders -> the figures ``markdown`` prints; ``scores``: more pivot scores
    [N] (a classifier's) beside the single features."""
    y, p, prob = data["label"].long(), data["token_prob"].float(), data["problem"]
    right = data["correct_before"] == 1
    ids, inv = prob.unique(return_inverse=True)

    def per(mask):  # decisions of each problem within mask [P]
        return torch.zeros(len(ids), dtype=torch.long).index_add_(0, inv[mask], torch.ones_like(inv[mask]))

    right_problems = per(right) > 0
    pivots = per(right & (y == 1))[right_problems]
    out = {"problems": len(ids), "right": int(right_problems.sum()), "decisions": len(y), "pivots": int(y.sum()),
           "right_decisions": int(right.sum()), "right_pivots": int(y[right].sum()),
           "by_p": [(lo, hi, int((y[m] == 1).sum()), int(m.sum()))
                    for lo, hi in zip(P_EDGES, P_EDGES[1:]) for m in [right & (p >= lo) & (p < hi)]],
           "meet": {tau: int((per(right & (y == 1) & (p >= tau))[right_problems] > 0).sum()) for tau in taus},
           "pivots_per_right": torch.bincount(pivots).tolist(),
           "wrong_decisions": int((~right).sum()), "wrong_to_right": int((data["correct_after"][~right] == 1).sum())}
    # The same table per proposal source (pad.pivots.search.SOURCE_IDS), where any decision is not the model's.
    sources = data["source"].long()
    out["by_source"] = {} if (sources == SOURCE_IDS["model"]).all() else {
        name: [(lo, hi, int((y[m] == 1).sum()), int(m.sum()))
               for lo, hi in zip(P_EDGES, P_EDGES[1:]) for m in [right & (sources == i) & (p >= lo) & (p < hi)]]
        for name, i in SOURCE_IDS.items() if (sources == i).any()}
    top = pivots.sort(descending=True).values
    quarter = max(1, len(top) // 4)
    out["top_quarter_share"] = (int(top[:quarter].sum()), int(top.sum()))
    every = {**single_features(data), **(scores or {})}
    out["auroc"] = {name: (auroc(s, y), within_problem_auroc(s, y, prob)[0]) for name, s in every.items()}
    # Each score's AUROC over each source's decisions (where that source has pivots and harmless ones).
    out["auroc_by_source"] = {name: r["auroc"] for name, r in per_source_auroc(every, data).items()
                              if 0 < r["pivots"] < r["positions"]}
    out["after_harmless"] = after_harmless(data) if "offset" in data else {}
    out["by_offset"] = by_offset(data, right) if "offset" in data else {}
    # Within a problem this score only leaks each decision's own label (left out of its rate): no within figure.
    out["auroc"]["problem's pivot rate (other decisions)"] = (auroc(problem_pivot_rate(y, prob), y), None)
    return out


def after_harmless(data: dict) -> dict:
    """Per draft-free source: what follows a harmless decision (a wrong proposal token that keeps the answer,
    which a relaxed rule would accept) in the rest of its proposal -> {source: (next token wrong too, a later
    token wrong, none wrong after it, harmless decisions)}. The next decision of the same walk lies in the same
    proposal when its offset grew by as much as its position; none wrong after it means the rest of the
    proposal fitted the text or the proposal ended there (the folders do not keep its length)."""
    same, source = data["same_answer"].tolist(), data["source"].tolist()
    position, offset, walk = data["position"].tolist(), data["offset"].tolist(), data["problem"].tolist()
    counts: dict[int, list[int]] = {}
    for i, (harmless, s) in enumerate(zip(same, source)):
        if not harmless or s == SOURCE_IDS["model"]:
            continue
        c = counts.setdefault(s, [0, 0, 0, 0])
        c[3] += 1
        j = i + 1
        step = position[j] - position[i] if j < len(walk) and walk[j] == walk[i] else 0
        if step > 0 and offset[j] - offset[i] == step:
            c[0 if step == 1 else 1] += 1
        else:
            c[2] += 1
    names = {i: name for name, i in SOURCE_IDS.items()}
    return {names[s]: tuple(c) for s, c in sorted(counts.items())}


def by_offset(data: dict, mask: torch.Tensor) -> dict:
    """Per draft-free source: pivots and decisions within ``mask`` (the right texts') per bin of the decision's
    place in its proposal (``OFFSET_EDGES``) -> {source: [(low, high or None, pivots, decisions)]}. A decision at
    offset i came after i matching tokens of its proposal; decoding at K drafts at most K, so only offsets below
    K come up there."""
    y, offset, source = data["label"].long(), data["offset"].long(), data["source"].long()
    edges = (*OFFSET_EDGES, None)
    out = {}
    for name, i in SOURCE_IDS.items():
        if name == "model" or not (source == i).any():
            continue
        rows = []
        for lo, hi in zip(edges, edges[1:]):
            m = mask & (source == i) & (offset >= lo) & (offset < hi if hi is not None else True)
            rows.append((lo, hi, int((y[m] == 1).sum()), int(m.sum())))
        out[name] = rows
    return out


def frontier(data: dict, problems_read: int, ks=KS, taus=FRONTIER_TAUS, resamples: int = 2000) -> list[dict]:
    """Per rule (exact, perfect classifier, threshold@tau): the share of mismatches accepted, the replayed
    accuracy change with its 95% interval over ``problems_read`` problems (``replay_table``) and the tokens
    per target forward at each K on the walked texts (needs ``WALKS``)."""
    y = data["label"].bool()
    rules = {"exact": torch.zeros_like(y), "perfect classifier": ~y,
             **{f"threshold@{t:g}": data["token_prob"].float() >= t for t in taus}}
    rows = []
    for name, accept in rules.items():
        # replay_table accepts scores <= threshold: 0 for an accepted mismatch, 1 for a rejected one.
        r = replay_table((~accept).float(), (0.5,), data, problems_read, resamples=resamples, ks=ks)[0]
        rows.append({"rule": name, "accepted": r["mismatches_accepted"], "accuracy_change": r["accuracy_change"],
                     "accuracy_change_ci": r["accuracy_change_ci"], "tokens_per_forward": r["tokens_per_forward"]})
    return rows


def frontier_markdown(rows: list[dict]) -> str:
    ks = list(rows[0]["tokens_per_forward"])
    exact = rows[0]["tokens_per_forward"]
    lines = ["| rule | mismatches accepted | accuracy change [95% CI] | "
             + " | ".join(f"tokens / forward, K = {k} (x exact)" for k in ks) + " |", "|---" * (3 + len(ks)) + "|"]
    for r in rows:
        lo, hi = r["accuracy_change_ci"]
        lines.append(f"| {r['rule']} | {r['accepted']:.1%} | {100 * r['accuracy_change']:+.1f} [{100 * lo:+.1f}, "
                     f"{100 * hi:+.1f}] | " + " | ".join(f"{v:.2f} ({v / exact[k]:.2f}x)"
                                                      for k, v in r["tokens_per_forward"].items()) + " |")
    return "\n".join(lines)


def markdown(s: dict, criterion: str) -> str:
    n_right = s["right"]
    lines = [f"{s['problems']} problems with decisions ({n_right} right texts, {s['problems'] - n_right} wrong), "
             f"{s['decisions']} decisions, {s['pivots']} pivots ({criterion}).", "",
             f"Right texts: {share_with_interval(s['right_pivots'], s['right_decisions'])} of decisions are pivots.", "",
             "| p_target(token) | pivots / decisions on right texts [95% CI] |", "|---|---|"]
    lines += [f"| [{lo:g}, {hi:g}) | {share_with_interval(x, m)} |" for lo, hi, x, m in s["by_p"]]
    if s["by_source"]:
        names = list(s["by_source"])
        lines += ["", "Per proposal source (pivots / decisions on right texts [95% CI]):", "",
                  "| p_target(token) | " + " | ".join(names) + " |", "|---" * (1 + len(names)) + "|"]
        for row, (lo, hi, _, _) in enumerate(s["by_p"]):
            lines.append(f"| [{lo:g}, {hi:g}) | " + " | ".join(share_with_interval(*s["by_source"][n][row][2:])
                                                              for n in names) + " |")
        totals = {n: [sum(r[k] for r in s["by_source"][n]) for k in (2, 3)] for n in names}
        lines.append("| all | " + " | ".join(share_with_interval(*totals[n]) for n in names) + " |")
    if s["after_harmless"]:
        lines += ["", "After a harmless wrong token of a draft-free proposal, the rest of that proposal:", "",
                  "| source | the next token wrong too | a later token wrong | none wrong after it |",
                  "|---|---|---|---|"]
        lines += [f"| {name} | " + " | ".join(share_with_interval(x, n) for x in (nxt, later, none)) + " |"
                  for name, (nxt, later, none, n) in s["after_harmless"].items()]
    if s["by_offset"]:
        names = list(s["by_offset"])
        lines += ["", "By a draft-free decision's place in its proposal (pivots / decisions on right texts [95% CI]):",
                  "", "| matching proposal tokens before it | " + " | ".join(names) + " |",
                  "|---" * (1 + len(names)) + "|"]
        for row, (lo, hi, _, _) in enumerate(s["by_offset"][names[0]]):
            where = str(lo) if hi == lo + 1 else f"{lo}-{hi - 1}" if hi is not None else f"{lo} or more"
            lines.append(f"| {where} | " + " | ".join(share_with_interval(*s["by_offset"][n][row][2:])
                                                      for n in names) + " |")
    lines += [""] + [f"Right texts that meet a pivot with p_target(token) >= {tau:g} on their walk: "
                     f"{share_with_interval(k, n_right)}." for tau, k in s["meet"].items()]
    hist = s["pivots_per_right"]
    top, total = s["top_quarter_share"]
    lines += ["", f"Pivots per right text: none on {hist[0] if hist else 0}, at most {len(hist) - 1}; the quarter of right "
                  f"texts with the most hold {top} of {total}.",
              "", f"Wrong texts: {share_with_interval(s['wrong_to_right'], s['wrong_decisions'])} of decisions turn the "
                  "answer right.",
              "", "| score | AUROC pooled | AUROC within problems |", "|---|---|---|"]
    lines += [f"| {name} | {a:.3f} | {'n/a' if w is None else f'{w:.3f}'} |" for name, (a, w) in s["auroc"].items()]
    if s["auroc_by_source"]:
        names = list(s["auroc_by_source"])
        lines += ["", "| score | " + " | ".join(f"AUROC on {n}'s decisions" for n in names) + " |",
                  "|---" * (1 + len(names)) + "|"]
        lines += [f"| {score} | " + " | ".join(f"{s['auroc_by_source'][n][score]:.3f}" for n in names) + " |"
                  for score in s["auroc_by_source"][names[0]]]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dirs", nargs="+", help="search label folders")
    ap.add_argument("--criterion", default="same-answer", choices=("same-answer", "correct"))
    ap.add_argument("--classifier", action="append", default=[],
                    help="also score the decisions with this classifier folder (shipped: the default pair's); "
                         "repeatable")
    args = ap.parse_args(argv)
    data, meta = load_shards(args.dirs, criterion=args.criterion)
    if "correct_before" not in data:
        ap.error("these folders hold no outcomes: label them with --method search")
    print(f"{meta['problems_read']} problems read from {', '.join(args.dirs)}")
    scores = dict(classifier_score(data, folder) for folder in args.classifier)
    print(markdown(stats(data, scores=scores), args.criterion))
    if all(k in data for k in WALKS):
        # A problem walked by several drafters is several walks: the replay takes one drafter's folders at a time.
        by_drafter: dict[str, list[str]] = {}
        for folder in args.dirs:
            by_drafter.setdefault(folder_drafter(json.loads((Path(folder) / "meta.json").read_text())),
                                  []).append(folder)
        for drafter, folders in by_drafter.items():
            one, one_meta = (data, meta) if len(by_drafter) == 1 else load_shards(folders, criterion=args.criterion)
            print(f"\nTokens per target forward on the walked texts ({drafter}'s proposals; replayed, not decoded):\n")
            print(frontier_markdown(frontier(one, one_meta["problems_read"])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
