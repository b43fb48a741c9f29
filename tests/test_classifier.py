"""PivotClassifier: the folded form scores like the module; save/load round-trips; bad files fail clearly."""
import copy
import json
import re
from pathlib import Path

import pytest
import torch

import pad
from pad import PivotClassifier
from pad_kernels import FEATURE_NAMES, verify_block
from pad_kernels.verify_ref import pivot_prob_ref


def _trained_looking(H, seed, kind="mlp", feature_names=FEATURE_NAMES):
    """A classifier with non-trivial weights (init plus noise of the init's own scale) and standardization."""
    torch.manual_seed(seed)
    clf = pad.PivotClassifier(H, layer=-3, target_model="t", draft_model="d", kind=kind, feature_names=feature_names)
    with torch.no_grad():
        for p in clf.parameters():
            p.add_(torch.randn_like(p) * (p.std() if p.numel() > 1 else 0.1))  # a linear kind's bias is one number
        clf.input_mean.normal_()
        clf.input_scale.uniform_(0.5, 2.0)
    return clf.eval()


@pytest.mark.parametrize("kind", ["mlp", "linear"])
@pytest.mark.parametrize("H", [8, 64, 896])
def test_fold_matches_module(H, kind):
    clf = _trained_looking(H, H, kind)
    g = torch.Generator().manual_seed(H)
    hidden = torch.randn(257, H, generator=g) * 3
    features = torch.stack([torch.rand(257, generator=g), torch.rand(257, generator=g) * 10], -1)
    expected = copy.deepcopy(clf).double().pivot_prob(hidden.double(), features.double()).float()
    folded = clf.fold()
    assert folded.w1.shape == (H + 2, 128 if kind == "mlp" else 2) and folded.w1.dtype == torch.float32
    torch.testing.assert_close(pivot_prob_ref(hidden, features, folded), expected, atol=1e-5, rtol=0)
    torch.testing.assert_close(clf.pivot_prob(hidden, features), expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("kind", ["mlp", "linear"])
def test_verify_block_uses_the_folded_classifier(kind):
    """pivot_prob from the op equals the module applied to hidden states and the op's own features."""
    H, K, V = 16, 5, 40
    clf = _trained_looking(H, 0, kind)
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(2, K + 1, V, generator=g)
    hidden = torch.randn(2, K + 1, H, generator=g)
    res = verify_block(logits, torch.randint(0, V, (2, K), generator=g), hidden, clf.fold(), sigma=0.5)
    features = torch.stack([res.token_prob, res.entropy[:, :K]], -1)
    torch.testing.assert_close(res.pivot_prob, clf.pivot_prob(hidden[:, :K], features), atol=1e-5, rtol=0)


SOURCES = ("token_prob", "entropy", "from_lookup", "from_suffix", "match", "offset")


def _source_features(n, g):
    """Per position: (from_lookup, from_suffix, match, offset) as decoding has them: the model's (0, 0, 0, -1),
    a lookup's or a suffix's (its flag, a match of 1-8, a place 0-7 in its proposal)."""
    source = torch.randint(0, 3, (n,), generator=g)
    free = source > 0
    match = torch.where(free, torch.randint(1, 9, (n,), generator=g), 0)
    offset = torch.where(free, torch.randint(0, 8, (n,), generator=g), -1)
    return torch.stack([source == 1, source == 2, match, offset], -1).float()


@pytest.mark.parametrize("kind", ["mlp", "linear"])
def test_source_features_fold_into_a_per_position_bias(kind):
    """A classifier reading where a draft came from: the op's classifier with ``source_bias`` as its
    ``classifier_bias`` scores like the module, in the reference and through verify_block."""
    H, K, V = 16, 5, 40
    clf = _trained_looking(H, 4, kind, feature_names=SOURCES)
    assert clf.source_names == SOURCES[2:]
    g = torch.Generator().manual_seed(2)
    hidden, features = torch.randn(300, H, generator=g) * 3, torch.rand(300, 2, generator=g) * 3
    sources = _source_features(300, g)
    expected = copy.deepcopy(clf).double().pivot_prob(hidden.double(), torch.cat([features, sources], -1).double())
    folded, bias = clf.fold(), clf.source_bias(sources)
    assert folded.w1.shape[0] == H + 2 and bias.shape == (300, folded.w1.shape[1])
    torch.testing.assert_close(pivot_prob_ref(hidden, features, folded, bias), expected.float(), atol=1e-5, rtol=0)
    assert (pivot_prob_ref(hidden, features, folded) - expected).abs().max() > 1e-2  # the sources matter here
    logits, hidden = torch.randn(2, K + 1, V, generator=g), torch.randn(2, K + 1, H, generator=g)
    sources = _source_features(2 * K, g).reshape(2, K, 4)
    res = verify_block(logits, torch.randint(0, V, (2, K), generator=g), hidden, folded, sigma=0.5,
                       classifier_bias=clf.source_bias(sources))
    features = torch.cat([res.token_prob[..., None], res.entropy[:, :K, None], sources], -1)
    torch.testing.assert_close(res.pivot_prob, clf.pivot_prob(hidden[:, :K], features), atol=1e-5, rtol=0)


def test_source_bias_needs_the_sources_it_reads():
    plain, sourced = _trained_looking(8, 5), _trained_looking(8, 5, feature_names=SOURCES)
    for clf, sources in ((plain, torch.zeros(3, 4)), (sourced, torch.zeros(3, 3))):
        with pytest.raises(ValueError, match="source features"):
            clf.source_bias(sources)
    divergence = _trained_looking(8, 5, feature_names=("token_prob", "entropy", "divergence"))
    with pytest.raises(ValueError, match=r"reads \('divergence',\)"):
        divergence.fold()


@pytest.mark.parametrize("kind", ["mlp", "linear"])
def test_save_load_round_trip(tmp_path, kind):
    clf = _trained_looking(32, 3, kind)
    clf.save(tmp_path / "clf")
    loaded = pad.PivotClassifier.load(tmp_path / "clf")
    assert loaded.config == clf.config
    for (name, a), (_, b) in zip(clf.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(a, b), name
    config = json.loads((tmp_path / "clf" / "config.json").read_text())
    assert config["layer"] == -3 and config["hidden_size"] == 32 and config["target_model"] == "t"
    assert config["feature_names"] == ["token_prob", "entropy"] and config["version"] == 1


def test_missing_and_corrupted_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json is missing"):
        pad.PivotClassifier.load(tmp_path)
    d = _trained_looking(8, 0).save(tmp_path / "clf")
    weights = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(weights[: len(weights) // 2])
    with pytest.raises(ValueError, match="corrupted classifier weights"):
        pad.PivotClassifier.load(d)
    (d / "model.safetensors").write_bytes(weights)
    (d / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="corrupted classifier config"):
        pad.PivotClassifier.load(d)
    (d / "config.json").write_text(json.dumps({"format": "pad-pivot-classifier", "version": 1}))
    with pytest.raises(ValueError, match="missing or bad field"):
        pad.PivotClassifier.load(d)
    other = _trained_looking(16, 0).save(tmp_path / "other")
    (d / "config.json").write_text((other / "config.json").read_text())  # config for H=16, weights for H=8
    with pytest.raises(ValueError, match="do not match its config"):
        pad.PivotClassifier.load(d)
    (tmp_path / "missing_weights").mkdir()
    (tmp_path / "missing_weights" / "config.json").write_text((other / "config.json").read_text())
    with pytest.raises(FileNotFoundError, match="model.safetensors is missing"):
        pad.PivotClassifier.load(tmp_path / "missing_weights")


def test_classifier_for_another_model_pair_is_a_clear_error():
    clf = PivotClassifier(8, target_model="qwen2.5-coder-1.5b-instruct", draft_model="qwen2.5-coder-0.5b-instruct")
    clf.check_pair("qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct")
    clf.check_pair("Qwen/Qwen2.5-Coder-1.5B-Instruct", "/models/qwen2.5-coder-0.5b-instruct/")  # same models
    with pytest.raises(ValueError, match="trained for target 'qwen2.5-coder-1.5b-instruct'.*the target is 'gpt2'"):
        clf.check_pair("gpt2", "qwen2.5-coder-0.5b-instruct")
    with pytest.raises(ValueError, match="the draft is 'Qwen/Qwen2.5-0.5B'"):
        clf.check_pair("qwen2.5-coder-1.5b-instruct", "Qwen/Qwen2.5-0.5B")


def test_a_pair_without_a_shipped_classifier_is_told_so():
    from pad.models.registry import DEFAULT_DRAFT, shipped_classifier

    with pytest.raises(ValueError, match="no classifier ships for target 'gpt2'"):
        shipped_classifier("gpt2", DEFAULT_DRAFT)


def test_checksum_names_the_weights():
    a, b = PivotClassifier(8), PivotClassifier(8)
    assert a.checksum() == a.checksum() != b.checksum()


def test_the_classifier_shipped_for_the_default_pair_loads_and_matches_its_labels():
    from types import SimpleNamespace

    from pad.models.registry import DEFAULT_DRAFT, DEFAULT_TARGET, REGISTRY, shipped_classifier
    from pad.pivots.train import load_shards

    folder = shipped_classifier(DEFAULT_TARGET, DEFAULT_DRAFT)
    clf = PivotClassifier.load(folder)
    clf.check_pair(DEFAULT_TARGET, DEFAULT_DRAFT)
    clf.check_pair("Qwen/Qwen2.5-Coder-1.5B-Instruct", "Qwen/Qwen2.5-Coder-0.5B-Instruct")
    # Qwen2.5-Coder-1.5B: hidden size 1536, 28 decoder layers.
    clf.check_target(SimpleNamespace(config=SimpleNamespace(hidden_size=1536, num_hidden_layers=28)))
    # The report names the command that made it, and its counts are those of the committed label folder.
    report = json.loads((folder / "report.json").read_text())
    command = (folder / "report.md").read_text().splitlines()[0]
    # Made before the command was renamed pad-decoding (the report keeps the command as it was run).
    assert re.match(r"Command: `(pad|pad-decoding) train labels/", command) and f"--out pad/classifiers/{folder.name}`" in command
    root = Path(__file__).resolve().parents[1]
    # The folders go on growing; the report names the problems it was trained on.
    data, meta = load_shards([root / f for f in report["label_meta"]["folders"]], only=report["label_meta"]["problem_ids"])
    assert meta["problem_ids"] == report["label_meta"]["problem_ids"]  # every one of them is still in the folders
    assert report["positions"]["train"] + report["positions"]["heldout"] == len(data["label"])
    assert report["pivots"]["train"] + report["pivots"]["heldout"] == int(data["label"].sum())
    assert report["label_meta"]["problems_read"] == meta["problems_read"]
    assert (meta["target"], meta["draft"], meta["weights"]) == (clf.target_model, clf.draft_model, clf.weights)
    # Made here, where the hub is out of reach: the registry's Q4_K_M GGUF weights, dequantized to bf16.
    assert clf.weights == {role: "gguf-q4_k_m-bf16:sha256:" + REGISTRY[name].sha256[:16]
                           for role, name in (("target", DEFAULT_TARGET), ("draft", DEFAULT_DRAFT))}


def test_fold_is_computed_once_until_a_weight_changes(monkeypatch):
    clf = _trained_looking(8, 3)
    calls = []
    real = PivotClassifier._fold
    monkeypatch.setattr(PivotClassifier, "_fold", lambda self: calls.append(1) or real(self))
    first = clf.fold()
    assert clf.fold() is first and len(calls) == 1  # decoding many prompts folds once
    with torch.no_grad():
        clf.mlp[0].weight[0, 0] += 1.0
    second = clf.fold()
    assert len(calls) == 2 and not torch.equal(second.w1, first.w1)
    torch.testing.assert_close(second.w1, real(clf)[0].w1)


def test_classifier_of_other_weights_is_refused(tmp_path):
    weights = {"target": "gguf-q4_k_m-bf16:sha256:cc324af070c2ecbf", "draft": "gguf-q4_k_m-bf16:sha256:1d9614638d18024d"}
    clf = PivotClassifier(8, target_model="qwen2.5-coder-1.5b-instruct", draft_model="qwen2.5-coder-0.5b-instruct",
                          weights=weights)
    clf = PivotClassifier.load(clf.save(tmp_path / "clf"))
    assert clf.weights == weights
    clf.check_pair("qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct", weights)
    hub = {**weights, "target": "hub:Qwen/Qwen2.5-Coder-1.5B-Instruct@2e1fd397ee46e1388853d2af2c993145b0f1098a"}
    with pytest.raises(ValueError, match="other target weights"):
        clf.check_pair("qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct", hub)
