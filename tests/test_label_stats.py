"""bench/label_stats.py on a hand-made search folder: every figure counted by hand."""
import importlib.util
from pathlib import Path

import pytest
import torch

from pad.pivots import label, train

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "label_stats.py"
_spec = importlib.util.spec_from_file_location("label_stats", SCRIPT)
label_stats = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(label_stats)


def _folder(out, sources=None, drafter=None):
    """Three problems: two right texts (a: pivots at p 0.3 and 0.02; b: none) and a wrong one (c: one of its
    two decisions turns it right). ``sources``: per problem, each decision's proposal source (else the model's)."""
    writer = label.LabelWriter(out, (0, 1), {"task": "synthetic", "target": "t", "draft": "d", "layer": -2,
                                             "method": "search", **({"drafter": drafter} if drafter else {})})
    problems = {  # p_target(token), same_answer, correct_before, correct_after per decision; text length
        "a": ([0.3, 0.15, 0.02], [0, 1, 0], 1, [0, 1, 0], 10),
        "b": ([0.45, 0.25], [1, 1], 1, [1, 1], 6),
        "c": ([0.1, 0.35], [0, 1], 0, [1, 0], 5),
    }
    for i, (pid, (p, same, before, after, length)) in enumerate(problems.items()):
        n = len(p)
        t = {"hidden": torch.randn(n, 4).half(), "token_prob": torch.tensor(p).half(),
             "entropy": torch.rand(n).half(), "draft_prob": torch.rand(n).half(), "draft_entropy": torch.rand(n).half(),
             "position": torch.arange(n, dtype=torch.int32), "same_answer": torch.tensor(same, dtype=torch.int8),
             "correct_before": torch.full((n,), before, dtype=torch.int8),
             "correct_after": torch.tensor(after, dtype=torch.int8), "mismatches": torch.tensor([n], dtype=torch.int32),
             "generated": torch.tensor([length], dtype=torch.int32)}
        t["label"] = (1 - t["same_answer"]).to(torch.int8)
        if sources is not None:
            t["source"] = torch.tensor(sources[pid], dtype=torch.int8)
            t["match"] = torch.where(t["source"] > 0, 3, 0).to(torch.int32)
            t["offset"] = torch.where(t["source"] > 0, torch.arange(n), -1).to(torch.int32)
        writer.write(i, pid, t, 1.0)


def test_stats_of_a_hand_made_folder(tmp_path, capsys):
    _folder(tmp_path)
    data, _ = train.load_shards([tmp_path])
    s = label_stats.stats(data, taus=(0.2, 0.4))
    assert (s["problems"], s["right"], s["decisions"], s["pivots"]) == (3, 2, 7, 3)
    assert (s["right_decisions"], s["right_pivots"]) == (5, 2)
    by_p = {lo: (x, m) for lo, _, x, m in s["by_p"]}
    assert by_p == {0.0: (1, 1), 0.05: (0, 0), 0.1: (0, 1), 0.2: (0, 1), 0.3: (1, 1), 0.4: (0, 1), 0.5: (0, 0)}
    assert s["meet"] == {0.2: 1, 0.4: 0}  # a meets its pivot at 0.3
    assert s["pivots_per_right"] == [1, 0, 1] and s["top_quarter_share"] == (2, 2)
    assert (s["wrong_decisions"], s["wrong_to_right"]) == (2, 1)
    # Pivots have p 0.3, 0.02 (a) and 0.1 (c); pooled, 1 - p ranks 10 of 12 pairs right (pair-counted by hand),
    # within problems a: 0.3 vs 0.15 lost, 0.02 vs 0.15 won; c: 0.1 vs 0.35 won -> 2 of 3.
    pooled, within = s["auroc"]["1 - p_target(token)"]
    assert abs(pooled - 10 / 12) < 1e-9 and abs(within - 2 / 3) < 1e-9
    # Other decisions' pivot rate: a 1/2 (or 2/2 for its non-pivot), b 0, c 0/1 or 1/1.
    torch.testing.assert_close(label_stats.problem_pivot_rate(data["label"].long(), data["problem"]).float(),
                               torch.tensor([0.5, 1.0, 0.5, 0.0, 0.0, 0.0, 1.0]))
    assert label_stats.main([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "Right texts: 2/5 = 40.0% [" in out and "| [0.3, 0.4) | 1/1 = 100.0% [" in out
    assert "Wrong texts: 1/2 = 50.0% [" in out and "| problem's pivot rate (other decisions) |" in out
    assert "| perfect classifier | 57.1% | +0.0 [+0.0, +0.0] | 2.62 (" in out  # K = 4: 21 tokens in 8 forwards


def test_pivot_rates_per_proposal_source(tmp_path, capsys):
    """a's first and last decisions (both pivots) came from a lookup, the rest from the model: the per-source
    table counts each source's right-text decisions per p_target bin; a folder of the model's alone has none."""
    _folder(tmp_path / "mixed", sources={"a": [1, 0, 1], "b": [0, 0], "c": [0, 1]})
    data, _ = train.load_shards([tmp_path / "mixed"])
    by = {name: {lo: (x, m) for lo, _, x, m in rows if m} for name, rows in label_stats.stats(data)["by_source"].items()}
    assert by == {"model": {0.1: (0, 1), 0.2: (0, 1), 0.4: (0, 1)}, "lookup": {0.0: (1, 1), 0.3: (1, 1)}}
    # Lookup's one harmless decision (c's last) ends its walk: nothing wrong after it.
    assert label_stats.stats(data)["after_harmless"] == {"lookup": (0, 0, 1, 1)}
    # Lookup's right-text decisions: a's first (offset 0) and last (offset 2), both pivots; c's is a wrong text's.
    assert label_stats.stats(data)["by_offset"] == {"lookup": [(0, 1, 1, 1), (1, 2, 0, 0), (2, 4, 1, 1),
                                                               (4, 8, 0, 0), (8, None, 0, 0)]}
    assert label_stats.main([str(tmp_path / "mixed")]) == 0
    out = capsys.readouterr().out
    assert "| p_target(token) | model | lookup |" in out and "| all | 0/3 = 0.0% [" in out
    assert "| matching proposal tokens before it | lookup |" in out
    assert "| 0 | 1/1 = 100.0% [" in out and "| 2-3 | 1/1 = 100.0% [" in out and "| 8 or more | n/a |" in out
    assert "| lookup | 0/1 = 0.0% [0.0%, 97.5%] | 0/1 = 0.0% [0.0%, 97.5%] | 1/1 = 100.0% [2.5%, 100.0%] |" in out
    _folder(tmp_path / "model")
    model = label_stats.stats(train.load_shards([tmp_path / "model"])[0])
    assert model["by_source"] == {} and model["after_harmless"] == {} and model["by_offset"] == {}


def test_what_follows_a_harmless_draft_free_mismatch():
    """The next decision of a walk is in the same proposal when its offset grew by as much as its position:
    right after (the next token wrong too) or later; otherwise, or at a walk's end, nothing wrong followed."""
    walks = [  # (walk, source, position, offset, same_answer) per decision, in walk order
        (1, 1, 3, 0, 1), (1, 1, 4, 1, 1), (1, 1, 9, 6, 1), (1, 1, 20, 0, 1),  # next, later, none (new proposal), end
        (2, 2, 2, 0, 1), (2, 2, 3, 0, 0),  # the next decision starts a proposal of its own; a pivot is not counted
        (3, 0, 1, -1, 1), (3, 0, 2, -1, 1),  # the model's decisions: not a proposal's
    ]
    data = {name: torch.tensor(col) for name, col in
            zip(("problem", "source", "position", "offset", "same_answer"), zip(*walks))}
    assert label_stats.after_harmless(data) == {"lookup": (1, 1, 2, 4), "suffix": (0, 0, 1, 1)}


def test_pivot_rate_by_place_in_the_proposal():
    """Each draft-free source's decisions within the mask, binned by offset (the last bin open); the model's
    decisions (offset -1) and those outside the mask are not counted."""
    rows = [  # (source, offset, label, in the mask)
        (1, 0, 1, True), (1, 0, 0, True), (1, 1, 1, True), (1, 3, 0, True), (1, 9, 0, True), (1, 15, 1, True),
        (1, 5, 1, False), (2, 7, 1, True), (2, 4, 0, True), (0, -1, 1, True)]
    source, offset, y, mask = zip(*rows)
    data = {"source": torch.tensor(source), "offset": torch.tensor(offset), "label": torch.tensor(y)}
    got = label_stats.by_offset(data, torch.tensor(mask))
    assert got == {"lookup": [(0, 1, 1, 2), (1, 2, 1, 1), (2, 4, 0, 1), (4, 8, 0, 0), (8, None, 1, 2)],
                   "suffix": [(0, 1, 0, 0), (1, 2, 0, 0), (2, 4, 0, 0), (4, 8, 1, 2), (8, None, 0, 0)]}


def test_a_classifiers_auroc_per_proposal_source(tmp_path, capsys):
    """--classifier scores the decisions from the features it reads; each score's AUROC is given per source
    that has pivots and harmless decisions. A linear classifier of p_target alone ranks like 1 - p_target."""
    from pad import PivotClassifier

    _folder(tmp_path / "mixed", sources={"a": [1, 0, 1], "b": [1, 1], "c": [1, 1]})
    clf = PivotClassifier(4, kind="linear")
    with torch.no_grad():
        clf.linear.weight.zero_()
        clf.linear.weight[0, 4] = -3.0  # the p_target(token) column
    clf.save(tmp_path / "clf")
    data, _ = train.load_shards([tmp_path / "mixed"])
    name, score = label_stats.classifier_score(data, str(tmp_path / "clf"))
    s = label_stats.stats(data, scores={name: score})
    # Lookup's pivots have p 0.3, 0.02 (a), 0.1 (c), its harmless decisions 0.45, 0.25 (b), 0.35 (c): 1 - p
    # ranks 8 of the 9 pairs (0.3 below 0.25).
    assert list(s["auroc_by_source"]) == ["lookup"]  # the model's one decision is harmless: no AUROC there
    assert s["auroc_by_source"]["lookup"]["1 - p_target(token)"] == pytest.approx(8 / 9)
    assert s["auroc_by_source"]["lookup"][name] == pytest.approx(8 / 9)
    assert s["auroc"][name][0] == pytest.approx(s["auroc"]["1 - p_target(token)"][0])
    assert label_stats.main([str(tmp_path / "mixed"), "--classifier", str(tmp_path / "clf")]) == 0
    assert f"| {name} | 0.889 |" in capsys.readouterr().out


def test_frontier_of_a_hand_made_folder(tmp_path):
    _folder(tmp_path)
    data, meta = train.load_shards([tmp_path])
    rows = {r["rule"]: r for r in label_stats.frontier(data, meta["problems_read"], ks=(4,), taus=(0.2,), resamples=200)}
    assert list(rows) == ["exact", "perfect classifier", "threshold@0.2"]
    # Decisions sit at positions 0, 1, 2 of texts of 10, 6 and 5 tokens (21 in all). K = 4, blocks:
    # exact, every decision rejected: a [x][x][x][3-7][8 9], b [x][x][2-5], c [x][x][2-4]: 11 forwards.
    # perfect, a's positions 0 and 2 and c's 0 rejected: a [x][1 x][3-7][8 9], b [0-5], c [x][1-4]: 8 forwards,
    # the 4 harmless of 7 decisions accepted and no answer changed.
    # threshold@0.2 accepts p >= 0.2: a's first decision, a pivot (a turns wrong, its walk ends: 1 seen),
    # both of b's, c's second (harmless): 4 of 5 seen; rejected a 1, 2 and c 0: a [0 x][x][3-7][8 9], b [0-5],
    # c [x][1-4]: 8 forwards.
    assert rows["exact"]["tokens_per_forward"] == {"4": pytest.approx(21 / 11)}
    assert (rows["exact"]["accepted"], rows["exact"]["accuracy_change"]) == (0.0, 0.0)
    assert rows["perfect classifier"]["tokens_per_forward"] == {"4": pytest.approx(21 / 8)}
    assert rows["perfect classifier"]["accepted"] == pytest.approx(4 / 7)
    assert rows["perfect classifier"]["accuracy_change"] == 0.0
    assert rows["threshold@0.2"]["tokens_per_forward"] == {"4": pytest.approx(21 / 8)}
    assert rows["threshold@0.2"]["accepted"] == pytest.approx(4 / 5)
    assert rows["threshold@0.2"]["accuracy_change"] == pytest.approx(-1 / 3)


def test_frontier_per_drafter_of_folders_of_several(tmp_path, capsys):
    """The same problems walked by two drafters are two walks each: the replay takes one drafter at a time."""
    _folder(tmp_path / "lookup", sources={"a": [1, 1, 1], "b": [1, 1], "c": [1, 1]}, drafter="lookup")
    _folder(tmp_path / "suffix", sources={"a": [2, 2, 2], "b": [2, 2], "c": [2, 2]}, drafter="suffix")
    assert label_stats.main([str(tmp_path / "lookup"), str(tmp_path / "suffix")]) == 0
    out = capsys.readouterr().out
    assert "(lookup's proposals; replayed" in out and "(suffix's proposals; replayed" in out
    assert out.count("| perfect classifier | 57.1% | +0.0 [+0.0, +0.0] | 2.62 (") == 2  # as one folder alone
