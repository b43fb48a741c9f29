"""Training recovers a planted separable label, keeps the best held-out checkpoint and writes a report."""
import json

import pytest
import torch

import pad
from pad.cli import main
from pad.pivots import label, train


def _planted(out, problems=40, per_problem=25, H=16, seed=0, prefix="a", drafter=None):
    """Shards like pad label writes, where the label is a linear function of the hidden state (``drafter``:
    a search folder of that drafter's proposals)."""
    g = torch.Generator().manual_seed(seed)
    meta = {"task": "synthetic", "target": "t", "draft": "d", "layer": -2}
    writer = label.LabelWriter(out, (0, 1), meta if drafter is None else {**meta, "drafter": drafter})
    direction = torch.randn(H, generator=torch.Generator().manual_seed(123))  # the same plane in every folder
    for i in range(problems):
        hidden = torch.randn(per_problem, H, generator=g) * 3 + 1.0
        labels = (hidden @ direction > direction.sum()).to(torch.int8)
        writer.write(i, f"{prefix}{i}", {
            "hidden": hidden.half(), "token_prob": torch.rand(per_problem, generator=g).half(),
            "entropy": (torch.rand(per_problem, generator=g) * 5).half(), "label": labels,
            "mismatches": torch.tensor([per_problem], dtype=torch.int32)}, 1.0)


def test_training_recovers_a_planted_label(tmp_path):
    _planted(tmp_path / "a")
    _planted(tmp_path / "b", seed=1, prefix="b")
    data, meta = train.load_shards([tmp_path / "a", tmp_path / "b"])
    assert data["hidden"].shape == (2000, 16)
    clf, report = train.train(data, meta, train.TrainConfig(epochs=30), progress=False)
    assert report["heldout_auroc"] > 0.97
    assert report["problems"]["heldout"] == 12 and report["positions"]["heldout"] == 300
    assert min(report["sigmas"], key=lambda r: abs(r["sigma"] - 0.5))["pivot_recall"] > 0.85
    assert clf.layer == -2 and clf.target_model == "t"


def test_a_problem_in_two_folders_counts_once(tmp_path):
    _planted(tmp_path / "a", problems=5)
    _planted(tmp_path / "b", problems=8, seed=1)  # problems a0..a4 again (other values), then a5..a7
    data, meta = train.load_shards([tmp_path / "a", tmp_path / "b"])
    assert data["hidden"].shape == (8 * 25, 16)
    assert meta["problems_read"] == 8
    first, _ = train.load_shards([tmp_path / "a"])
    assert torch.equal(data["hidden"][: 5 * 25], first["hidden"])  # the first folder's copy is kept
    assert meta["problem_ids"] == sorted(f"a{i}" for i in range(8))
    some, some_meta = train.load_shards([tmp_path / "a", tmp_path / "b"], only=["a1", "a6"])
    assert some_meta["problem_ids"] == ["a1", "a6"] and some_meta["problems_read"] == 2
    assert torch.equal(some["hidden"], torch.cat([data["hidden"][25:50], data["hidden"][150:175]]))


def test_train_cli_writes_classifier_and_report(tmp_path, capsys):
    _planted(tmp_path / "labels")
    assert main(["train", str(tmp_path / "labels"), "--out", str(tmp_path / "clf"), "--epochs", "10", "--folds", "3"]) == 0
    out = capsys.readouterr().out
    assert "Held-out AUROC" in out and "Cross-validated over 3 folds" in out
    clf = pad.PivotClassifier.load(tmp_path / "clf")
    report = json.loads((tmp_path / "clf" / "report.json").read_text())
    assert clf.hidden_size == 16 and len(report["sigmas"]) == 9
    assert report["cross_validation"]["positions"] == 1000 and report["cross_validation"]["auroc"] > 0.95
    text = (tmp_path / "clf" / "report.md").read_text()
    assert text.startswith("Command: `pad-decoding train") and "40 problems read, 40 with labeled positions" in text


def test_report_json_is_strict_json(tmp_path):
    _planted(tmp_path / "labels", problems=7)
    data, meta = train.load_shards([tmp_path / "labels"])
    clf, report = train.train(data, meta, train.TrainConfig(epochs=2), progress=False)
    report["heldout_auroc"] = float("nan")  # as when the held-out problems have one class only
    train.save(clf, report, tmp_path / "clf")

    def refuse(constant):
        raise ValueError(f"not strict JSON: {constant}")

    saved = json.loads((tmp_path / "clf" / "report.json").read_text(), parse_constant=refuse)
    assert saved["heldout_auroc"] is None and "n/a" in (tmp_path / "clf" / "report.md").read_text()


def test_bad_inputs(tmp_path):
    with pytest.raises(FileNotFoundError, match="not a pad label folder"):
        train.load_shards([tmp_path])
    label.LabelWriter(tmp_path / "empty", (0, 1), {"target": "t"})
    with pytest.raises(ValueError, match="no labeled positions"):
        train.load_shards([tmp_path / "empty"])


def test_report_counts_one_held_out_problem(tmp_path):
    _planted(tmp_path / "labels", problems=7)
    data, meta = train.load_shards([tmp_path / "labels"])
    _, report = train.train(data, meta, train.TrainConfig(epochs=2), progress=False)
    text = train.report_markdown({**report, "label_meta": meta})
    assert "from 6 problems (" in text and "from 1 problem (" in text and "7 problems read" in text
    assert f"at epoch {report['best_epoch']} of {report['epochs_run']} run" in text and "Cross-validated" not in text


def test_folders_of_two_drafters_are_both_read_and_folds_keep_a_problem_whole(tmp_path, monkeypatch):
    _planted(tmp_path / "model", problems=12)
    _planted(tmp_path / "lookup", problems=12, seed=1, drafter="lookup")  # the same problem ids, other decisions
    data, meta = train.load_shards([tmp_path / "model", tmp_path / "lookup"])
    assert data["hidden"].shape == (2 * 12 * 25, 16) and meta["problems_read"] == 12
    # Each drafter's walk of a problem is one contiguous run (the replay walks it); both share the problem's group.
    runs = torch.unique_consecutive(data["problem"])
    assert len(runs) == len(data["problem"].unique()) == 24
    assert len(data["group"].unique()) == 12
    assert torch.equal(data["group"][: 12 * 25], data["group"][12 * 25 :])
    assert (data["source"] == 0).all()  # hand-made records without a source: the model's defaults
    fits, real_train = [], train.train
    monkeypatch.setattr(train, "train", lambda part, *a, **k: fits.append(part) or real_train(part, *a, **k))
    train.cross_validate(data, meta, train.TrainConfig(epochs=5), folds=3, progress=False)
    left_out = []
    for part in fits[:3]:  # each fold trains on whole problems: both drafters' walks of a problem, or neither
        groups = part["group"].unique()
        assert torch.equal(part["problem"].unique(), data["problem"][torch.isin(data["group"], groups)].unique())
        left_out += sorted(set(data["group"].tolist()) - set(groups.tolist()))
    assert sorted(left_out) == sorted(set(data["group"].tolist()))  # each problem left out once


def test_cross_validation_scores_every_position_once_without_seeing_it(tmp_path, monkeypatch):
    _planted(tmp_path / "signal", problems=20)
    data, meta = train.load_shards([tmp_path / "signal"])
    fits, real_train = [], train.train

    def spy(part, *args, **kwargs):
        fits.append(set(part["problem"].tolist()))
        clf, report = real_train(part, *args, **kwargs)
        scored_before = clf.pivot_prob

        def pivot_prob(hidden, features):  # every position it scores is one it was not trained on
            assert not any(torch.equal(h, t) for h in hidden for t in part["hidden"].float())
            return scored_before(hidden, features)
        clf.pivot_prob = pivot_prob
        return clf, report

    monkeypatch.setattr(train, "train", spy)
    cv = train.cross_validate(data, meta, train.TrainConfig(epochs=20), folds=4, progress=False)
    problems = set(data["problem"].tolist())
    assert len(fits) == 4 and all(len(f) == 15 for f in fits)
    assert sorted(p for f in fits for p in problems - f) == sorted(problems)  # each left out exactly once
    assert cv["positions"] == 500 and cv["pivots"] == int(data["label"].sum())
    assert cv["auroc"] > 0.97 and len(cv["sigmas"]) == 9
    assert 0.4 < cv["baselines"]["1 - p_target(token)"] < 0.6 and 0.4 < cv["baselines"]["entropy"] < 0.6  # random


def test_cross_validation_reports_single_feature_baselines(tmp_path):
    _planted(tmp_path / "labels", problems=8)
    data, meta = train.load_shards([tmp_path / "labels"])
    pivot = data["label"].bool()
    data["token_prob"] = torch.where(pivot, 0.2, 0.7).half()  # pivots have a low p_target: a perfect score
    data["entropy"] = torch.where(pivot, 0.5, 3.0).half()  # and a low entropy: perfectly backwards
    cv = train.cross_validate(data, meta, train.TrainConfig(epochs=2), folds=2, progress=False)
    assert cv["baselines"] == {"1 - p_target(token)": 1.0, "entropy": 0.0}
    text = train.report_markdown({**train.train(data, meta, train.TrainConfig(epochs=2), progress=False)[1],
                                  "label_meta": meta, "cross_validation": cv})
    assert "1 - p_target(token) AUROC 1.000, entropy AUROC 0.000." in text


def test_cross_validation_bad_folds(tmp_path, capsys):
    _planted(tmp_path / "labels", problems=3)
    data, meta = train.load_shards([tmp_path / "labels"])
    for folds in (1, 4):
        with pytest.raises(ValueError, match="2 <= folds <= problems with labels \\(3\\)"):
            train.cross_validate(data, meta, folds=folds, progress=False)
    # The command line checks before it trains anything.
    assert main(["train", str(tmp_path / "labels"), "--out", str(tmp_path / "clf"), "--folds", "4"]) == 2
    assert "2 <= folds <= problems with labels (3), got 4" in capsys.readouterr().err
    assert not (tmp_path / "clf").exists()
    # The default asks for 5 folds, one per problem here; the CLI test above covers an explicit --folds.
    assert main(["train", str(tmp_path / "labels"), "--out", str(tmp_path / "clf"), "--epochs", "2"]) == 0
    assert "Cross-validated over 3 folds" in (tmp_path / "clf" / "report.md").read_text()


@pytest.mark.parametrize("seed", range(4))
def test_auroc_equals_the_pairwise_count_with_ties_and_weights(seed):
    g = torch.Generator().manual_seed(seed)
    n = 60
    scores = torch.randint(0, 8, (n,), generator=g).float()  # many ties
    labels = torch.randint(0, 2, (n,), generator=g)
    pos, neg = scores[labels == 1], scores[labels == 0]
    pairwise = ((pos[:, None] > neg[None]).double() + 0.5 * (pos[:, None] == neg[None]).double()).mean()
    assert train.auroc(scores, labels) == pytest.approx(float(pairwise), abs=1e-12)
    # Integer weights count a position that many times: the same as repeating it.
    w = torch.randint(0, 4, (2, n), generator=g)
    for r in range(2):
        repeated = train.auroc(scores.repeat_interleave(w[r]), labels.repeat_interleave(w[r]))
        assert float(train.auroc(scores, labels, w.float())[r]) == pytest.approx(repeated, abs=1e-12)
    assert train.auroc(scores, torch.zeros(n, dtype=torch.long)) != train.auroc(scores, labels)  # NaN


def test_bootstrap_intervals_resample_problems():
    g = torch.Generator().manual_seed(0)
    problems = torch.arange(80).repeat_interleave(10)
    labels = (torch.rand(800, generator=g) < 0.3).long()
    good = labels + torch.randn(800, generator=g) * 0.5  # AUROC about 0.92
    noise = torch.randn(800, generator=g)  # about 0.5
    boot = train.bootstrap({"good": good, "noise": noise}, labels, problems, "good", resamples=500)
    lo, hi = boot["auroc_ci"]["good"]
    assert lo < train.auroc(good, labels) < hi and hi - lo < 0.1
    lo, hi = boot["difference_ci"]["noise"]  # noise minus good: clearly below 0
    assert hi < 0 and lo > -0.6
    # One problem holding every position: every resample is the same data, the interval has no width.
    same = train.bootstrap({"good": good, "noise": noise}, labels, torch.zeros(800), "good", resamples=50)
    assert same["auroc_ci"]["good"][0] == same["auroc_ci"]["good"][1]


def test_linear_classifier_recovers_a_planted_label_and_folds_exactly(tmp_path):
    from pad_kernels.verify_ref import pivot_prob_ref

    _planted(tmp_path / "labels")
    data, meta = train.load_shards([tmp_path / "labels"])
    cfg = train.TrainConfig(model="linear", l2_grid=(1e-3, 1e-1, 10.0))
    clf, report = train.train(data, meta, cfg, progress=False)
    assert clf.kind == "linear" and report["model"] == "linear" and report["heldout_auroc"] > 0.97
    assert report["l2"] in cfg.l2_grid and set(report["l2_auroc"]) == {"0.001", "0.1", "10.0"}
    hidden, features = data["hidden"].float(), torch.stack([data["token_prob"], data["entropy"]], -1).float()
    torch.testing.assert_close(pivot_prob_ref(hidden, features, clf.fold()), clf.pivot_prob(hidden, features),
                               atol=1e-5, rtol=0)
    # A heavy penalty shrinks the weights: the L2 strength reaches the fit.
    strong = train._logistic(torch.randn(200, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(1)),
                             torch.arange(200) % 2, 100.0)[0]
    assert strong.abs().max() < 0.05


def test_auto_keeps_the_kind_with_the_higher_cross_validated_auroc(tmp_path):
    _planted(tmp_path / "labels", problems=20)
    data, meta = train.load_shards([tmp_path / "labels"])
    clf, report = train.select_and_train(data, meta, train.TrainConfig(model="auto", epochs=10, bootstrap=200),
                                         folds=3, progress=False)
    sel = report["model_selection"]
    assert set(sel["cross_validated_auroc"]) == {"mlp", "linear"}
    assert sel["chosen"] == max(sel["cross_validated_auroc"], key=sel["cross_validated_auroc"].get) == clf.kind
    cv = report["cross_validation"]
    assert cv["model"] == clf.kind and cv["auroc"] == sel["cross_validated_auroc"][clf.kind]
    lo, hi = cv["auroc_ci"]
    assert lo <= cv["auroc"] <= hi
    best = cv["best_single_feature"]  # the features are noise here; the planted label is in the hidden state
    assert best["difference_ci"][0] > 0 and best["difference"] == pytest.approx(cv["auroc"] - best["auroc"])
    text = train.report_markdown({**report, "label_meta": meta})
    assert "Kind chosen by cross-validated AUROC" in text and "95% bootstrap interval over problems" in text
    with pytest.raises(ValueError, match="unknown model"):
        train.select_and_train(data, meta, train.TrainConfig(model="forest"), folds=3, progress=False)


@pytest.mark.parametrize("seed", range(3))
def test_within_problem_auroc_counts_only_pairs_of_one_problem(seed):
    g = torch.Generator().manual_seed(seed)
    n = 90
    problems = torch.randint(0, 7, (n,), generator=g)
    scores = torch.randint(0, 6, (n,), generator=g).float()  # ties
    labels = torch.randint(0, 2, (n,), generator=g)
    same = problems[:, None] == problems[None]
    pair = same & (labels[:, None] == 1) & (labels[None] == 0)
    win = (scores[:, None] > scores[None]).double() + 0.5 * (scores[:, None] == scores[None]).double()
    area, pairs = train.within_problem_auroc(scores, labels, problems)
    assert pairs == int(pair.sum())
    assert area == pytest.approx(float(win[pair].mean()), abs=1e-12)


def test_a_score_that_only_knows_the_problem_is_chance_within_problems():
    problems = torch.arange(6).repeat_interleave(10)
    labels = (torch.arange(60) % 10 < problems + 1).long()  # problem k has k + 1 pivots of 10
    fragility = problems.float()  # ranks fragile problems first, says nothing inside one
    assert train.auroc(fragility, labels) > 0.7
    assert train.within_problem_auroc(fragility, labels, problems) == (0.5, sum((k + 1) * (9 - k) for k in range(6)))
    area, pairs = train.within_problem_auroc(fragility, torch.zeros(60, dtype=torch.long), problems)
    assert pairs == 0 and area != area  # no pairs: NaN


def test_cross_validation_reports_within_problem_auroc(tmp_path):
    _planted(tmp_path / "labels", problems=8)
    data, meta = train.load_shards([tmp_path / "labels"])
    data["token_prob"] = torch.where(data["label"].bool(), 0.2, 0.7).half()  # perfect inside every problem too
    cv = train.cross_validate(data, meta, train.TrainConfig(epochs=2), folds=2, progress=False)
    inside = cv["within_problems"]
    assert inside["pairs"] == train.within_problem_auroc(data["entropy"].float(), data["label"], data["problem"])[1]
    assert inside["auroc"]["1 - p_target(token)"] == 1.0 and set(inside["auroc"]) == {"classifier", *cv["baselines"]}
    text = train.report_markdown({**train.train(data, meta, train.TrainConfig(epochs=2), progress=False)[1],
                                  "label_meta": meta, "cross_validation": cv})
    assert f"Within problems (only the {inside['pairs']} pivot / non-pivot pairs" in text
    assert "1 - p_target(token) AUROC 1.000" in text.split("Within problems")[1]


def _with_divergence(folder, seed: int, signal: float, unknown: int = 0):
    """Add a ``divergence`` to every problem file of a planted folder: ``signal`` apart between pivots and the
    rest plus unit noise, NaN at the first ``unknown`` positions of each problem (not retraced)."""
    from safetensors.torch import load_file, save_file

    g = torch.Generator().manual_seed(seed)
    for f in sorted((folder / "problems").glob("*.safetensors")):
        t = load_file(str(f))
        t["divergence"] = (t["label"].float() * signal + torch.randn(len(t["label"]), generator=g)).half()
        t["divergence"][:unknown] = float("nan")
        save_file(t, str(f))


def test_compare_feature_measures_what_a_candidate_adds(tmp_path):
    _planted(tmp_path / "labels", problems=30)
    _with_divergence(tmp_path / "labels", seed=5, signal=2.0, unknown=2)
    data, meta = train.load_shards([tmp_path / "labels"])
    data["hidden"] = torch.randn(data["hidden"].shape, generator=torch.Generator().manual_seed(6)).half()  # no signal
    cfg = train.TrainConfig(model="linear", l2_grid=(1e-2, 1.0), bootstrap=500)
    cmp = train.compare_feature(data, meta, cfg, "divergence", folds=3, progress=False)
    assert cmp["positions"] == 30 * 23 and cmp["positions_without_it"] == 30 * 2 and cmp["problems"] == 30
    assert cmp["auroc"]["without"] < 0.6 < 0.8 < cmp["auroc"]["with"] and cmp["difference_ci"][0] > 0.1
    assert cmp["auroc"]["divergence"] > 0.8  # the candidate alone, as the score
    # A candidate of noise: no gain whose interval excludes zero.
    _with_divergence(tmp_path / "labels", seed=7, signal=0.0)
    data, meta = train.load_shards([tmp_path / "labels"])
    cmp = train.compare_feature(data, meta, cfg, "divergence", folds=3, progress=False)
    assert cmp["difference_ci"][0] <= 0 and abs(cmp["difference"]) < 0.01 and cmp["positions_without_it"] == 0
    text = train.report_markdown({**train.train(data, meta, train.TrainConfig(epochs=2), progress=False)[1],
                                  "label_meta": meta, "feature_comparison": cmp})
    assert "Candidate feature divergence (linear, the same 3 folds of problems, on the 750 positions" in text


def _planted_lookup(out, problems=20, n=25):
    """A lookup folder whose labels only the match length carries: matches of 1 token are the pivots."""
    g = torch.Generator().manual_seed(9)
    writer = label.LabelWriter(out, (0, 1), {"task": "synthetic", "target": "t", "draft": "d", "layer": -2,
                                             "drafter": "lookup"})
    for i in range(problems):
        match = torch.randint(1, 5, (n,), generator=g, dtype=torch.int32)
        writer.write(i, f"a{i}", {
            "hidden": torch.randn(n, 16, generator=g).half(), "token_prob": torch.rand(n, generator=g).half(),
            "entropy": (torch.rand(n, generator=g) * 5).half(), "label": (match == 1).to(torch.int8),
            "source": torch.full((n,), 1, dtype=torch.int8), "match": match,
            "offset": torch.randint(0, 8, (n,), generator=g, dtype=torch.int32),
            "mismatches": torch.tensor([n], dtype=torch.int32)}, 1.0)


def test_train_cli_saves_a_classifier_of_source_features(tmp_path, capsys):
    """--features: the saved classifier reads where a draft came from and decodes (folds) with it: on the
    planted lookup decisions, short matches score as pivots through the op's classifier bias."""
    from pad_kernels.verify_ref import pivot_prob_ref

    _planted(tmp_path / "model", problems=20)
    _planted_lookup(tmp_path / "lookup")
    assert main(["train", str(tmp_path / "model"), str(tmp_path / "lookup"), "--out", str(tmp_path / "clf"),
                 "--folds", "2", "--model", "linear", "--features", "match,from_lookup"]) == 0
    clf = pad.PivotClassifier.load(tmp_path / "clf")
    assert clf.feature_names == ("token_prob", "entropy", "from_lookup", "match")  # the classifier's order
    hidden, features = torch.randn(2, 16), torch.tensor([[0.5, 1.0], [0.5, 1.0]])
    sources = torch.tensor([[1.0, 1.0], [1.0, 4.0]])  # a lookup's 1-token match, and a 4-token one
    pivot = pivot_prob_ref(hidden, features, clf.fold(), clf.source_bias(sources))
    assert pivot[0] > 0.9 and pivot[1] < 0.1
    for bad, message in (("divergence", "--features takes source features"), ("match,match", "twice")):
        assert main(["train", str(tmp_path / "model"), "--out", str(tmp_path / "c2"), "--features", bad]) == 2
        assert message in capsys.readouterr().err


def test_source_features_measured_per_source(tmp_path):
    """Lookup decisions whose label only the match length carries (short matches are the pivots) beside the
    model's planted ones: the source features add what the match says, and each source gets its own AUROC."""
    _planted(tmp_path / "model", problems=20)
    _planted_lookup(tmp_path / "lookup")
    data, meta = train.load_shards([tmp_path / "model", tmp_path / "lookup"])
    assert data["from_lookup"].sum() == 500 and not data["from_suffix"].any()
    assert set(data["offset"][data["source"] == 0].tolist()) == {-1}  # the model's records: no place in a proposal
    cfg = train.TrainConfig(model="linear", l2_grid=(1e-2, 1.0), bootstrap=300)
    cmp = train.compare_feature(data, meta, cfg, "from_lookup,from_suffix,match,offset", folds=3, progress=False)
    assert cmp["positions"] == 1000 and cmp["difference_ci"][0] > 0
    lookup = cmp["per_source"]["lookup"]
    assert lookup["positions"] == 500 and lookup["pivots"] == int((data["match"][500:] == 1).sum())
    assert lookup["auroc"]["with"] > 0.9 > 0.65 > lookup["auroc"]["without"]  # only the match knows
    assert 0.4 < lookup["auroc"]["1 - p_target(token)"] < 0.6
    assert set(cmp["per_source"]) == {"model", "lookup"} and cmp["per_source"]["model"]["positions"] == 500
    text = train.report_markdown({**train.train(data, meta, train.TrainConfig(epochs=2), progress=False)[1],
                                  "label_meta": meta, "feature_comparison": cmp})
    assert "Candidate feature from_lookup,from_suffix,match,offset (linear" in text
    assert "| lookup | 500 |" in text
    with pytest.raises(ValueError, match="unknown candidate feature 'source'"):
        train.compare_feature(data, meta, cfg, "match,source", progress=False)


def test_compare_feature_bad_inputs(tmp_path):
    _planted(tmp_path / "labels", problems=6)
    data, meta = train.load_shards([tmp_path / "labels"])
    with pytest.raises(ValueError, match="hold no divergence"):
        train.compare_feature(data, meta, train.TrainConfig(), "divergence", progress=False)
    with pytest.raises(ValueError, match="unknown candidate feature"):
        train.compare_feature(data, meta, train.TrainConfig(), "hidden", progress=False)
    data["divergence"] = torch.full(data["label"].shape, float("nan"))
    with pytest.raises(ValueError, match="no labeled position has a divergence"):
        train.compare_feature(data, meta, train.TrainConfig(), "divergence", progress=False)


def test_train_cli_compares_a_candidate_feature(tmp_path, capsys):
    _planted(tmp_path / "labels", problems=12)
    _with_divergence(tmp_path / "labels", seed=8, signal=1.0)
    assert main(["train", str(tmp_path / "labels"), "--out", str(tmp_path / "clf"), "--epochs", "3", "--folds", "2",
                 "--model", "mlp", "--compare-feature", "divergence"]) == 0
    assert "Candidate feature divergence (mlp, the same 2 folds" in capsys.readouterr().out
    report = json.loads((tmp_path / "clf" / "report.json").read_text())
    assert report["feature_comparison"]["positions"] == 300
    # The saved classifier reads the op's features only, so it decodes.
    assert pad.PivotClassifier.load(tmp_path / "clf").feature_names == ("token_prob", "entropy")
    assert main(["train", str(tmp_path / "labels"), "--out", str(tmp_path / "c2"), "--folds", "0",
                 "--compare-feature", "divergence", "--model", "mlp"]) == 2
    assert "needs --folds of at least 2" in capsys.readouterr().err


def test_a_classifier_of_a_candidate_feature_trains_but_does_not_fold():
    from pad_kernels import FEATURE_NAMES

    clf = pad.PivotClassifier(8, feature_names=FEATURE_NAMES + ("divergence",))
    assert clf.pivot_prob(torch.randn(4, 8), torch.randn(4, 3)).shape == (4,)
    with pytest.raises(ValueError, match="not decoded with"):
        clf.fold()
    with pytest.raises(ValueError, match="candidate features"):
        pad.PivotClassifier(8, feature_names=FEATURE_NAMES + ("draft_prob",))
