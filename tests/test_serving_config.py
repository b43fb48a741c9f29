"""pad's configuration inside vLLM's additional_config (pad.serving.vllm.ServingConfig), parsed without vLLM,
and the plugin's own expansion of sampling parameters (which replaces a broken one of vLLM's CPU build)."""
import pytest
import torch

from types import SimpleNamespace

from pad import PivotClassifier
from pad.decoding.policy import DEFAULT_SIGMA, parse_policy
from bad_settings import BAD_SETTINGS, ENGINE as BAD_ENGINE
from pad.serving.vllm import (RequestSettingError, ServingConfig, expand_batch_to_tokens, request_exact_prefix,
                              request_policy)


def test_absent_means_not_configured():
    assert ServingConfig.parse(None) is None
    assert ServingConfig.parse({}) is None
    assert ServingConfig.parse({"other_plugin": {"x": 1}}) is None


@pytest.mark.parametrize("policy,rule,sigma", [("threshold@0.2", ("threshold", 0.2, 0.0), None),
                                               ("typical", ("typical", 0.09, 0.3), None),
                                               ("fly@0.4,3", ("fly", 0.4, 3.0), None),
                                               ("topk@3,0.1", ("topk", 3.0, 0.1), None),
                                               ("pivot@0.2", ("exact", 0.0, 0.0), 0.2),
                                               ("pivot", ("exact", 0.0, 0.0), DEFAULT_SIGMA),
                                               ("exact", ("exact", 0.0, 0.0), None)])
def test_policies_parse_in_pads_grammar(policy, rule, sigma):
    extra = {"classifier": "shipped"} if policy.startswith("pivot") else {}
    config = ServingConfig.parse({"pad": {"policy": policy, **extra}})
    assert tuple(config.policy.rule) == rule and config.policy.sigma == sigma
    assert config.floor == 1e-4 and config.backend is None


@pytest.mark.parametrize("entry,message", [
    ("pivot@0.3", "must be an object"),
    ({}, "needs a \"policy\""),
    ({"policy": "threshold@0.2", "sigma": 0.3}, "unknown pad setting"),
    ({"policy": "target"}, "one model"),
    ({"policy": "draft"}, "one model"),
    ({"policy": "pivot@0.3"}, "needs \"classifier\""),
    ({"policy": "exact", "classifier": "shipped"}, "leaves vLLM as it is"),
    ({"policy": "threshold@1.5"}, "tau"),
    ({"policy": "banana"}, "unknown policy"),
    ({"policy": "threshold@0.2", "floor": 2}, "floor"),
    ({"policy": "kl@0.5"}, "draft's logits"),
    ({"policy": "threshold@0.2", "exact_prefix": -1}, "exact_prefix"),
    ({"policy": "threshold@0.2", "exact_prefix": 2.5}, "exact_prefix"),
    ({"policy": "pivot@0.3", "classifier": "shipped", "judge_free": 2}, "judge_free must be true or false"),
    ({"policy": "threshold@0.2", "judge_free": True}, "judge_free is read by pivot"),
])
def test_bad_configuration_is_refused(entry, message):
    with pytest.raises(ValueError, match=message):
        ServingConfig.parse({"pad": entry})


def test_shipped_classifier_loads():
    clf = ServingConfig.parse({"pad": {"policy": "pivot", "classifier": "shipped"}}).load_classifier()
    assert clf.hidden_size == 1536 and clf.layer == -8


def test_a_classifier_of_draft_sources_is_refused(tmp_path):
    names = ("token_prob", "entropy", "from_lookup", "match")
    folder = PivotClassifier(8, feature_names=names).save(tmp_path / "clf")
    with pytest.raises(ValueError, match=r"reads where drafts came from \(from_lookup, match\)"):
        ServingConfig.parse({"pad": {"policy": "pivot", "classifier": str(folder)}}).load_classifier()


def test_a_relaxed_engine_may_load_a_classifier_for_its_requests():
    config = ServingConfig.parse({"pad": {"policy": "threshold@0.2", "classifier": "shipped"}})
    assert config.policy == parse_policy("threshold@0.2") and config.classifier == "shipped"


def params(extra_args=None, temperature=0.0):
    """What request_policy reads of vLLM's SamplingParams."""
    return SimpleNamespace(extra_args=extra_args, temperature=temperature)


ENGINE = {"pad": {"policy": "threshold@0.2", "classifier": "shipped"}}


@pytest.mark.parametrize("extra_args,want", [
    (None, "threshold@0.2"),  # the engine's
    ({"other": 1}, "threshold@0.2"),
    ({"pad": {"policy": "pivot@0.4"}}, "pivot@0.4"),
    ({"pad": {"policy": "pivot"}}, f"pivot@{DEFAULT_SIGMA:g}"),
    ({"pad_policy": "typical@0.3,0.6"}, "typical@0.3,0.6"),  # the OpenAI API's vllm_xargs: flat keys
    ({"pad": {"policy": "exact"}}, "exact"),
])
def test_a_request_chooses_its_policy(extra_args, want):
    assert str(request_policy(ServingConfig.parse(ENGINE), params(extra_args))) == want


@pytest.mark.parametrize("engine,extra_args,temperature,message", [
    (ENGINE, {"pad": "pivot"}, 0.0, "must be an object"),
    (ENGINE, {"pad": {"policy": "pivot"}, "pad_policy": "exact"}, 0.0, "not both"),
    (ENGINE, {"pad": {"classifier": "x"}}, 0.0, "unknown pad request setting"),
    (ENGINE, {"pad": {"policy": "banana"}}, 0.0, "unknown policy"),
    (ENGINE, {"pad": {"policy": "threshold@2"}}, 0.0, "tau"),
    (ENGINE, {"pad": {"policy": "target"}}, 0.0, "one model"),
    (ENGINE, {"pad": {"policy": "kl@0.5"}}, 0.0, "draft's logits"),
    ({"pad": {"policy": "threshold@0.2"}}, {"pad": {"policy": "pivot"}}, 0.0, "engine's classifier"),
    (ENGINE, {"pad": {"policy": "fly@0.3,2"}}, 0.7, "greedy requests only"),
    ({"pad": {"policy": "fly@0.3,2"}}, None, 0.7, "greedy requests only"),  # the engine's fly, a sampled request
    ({"pad": {"policy": "exact"}}, {"pad": {"policy": "threshold@0.2"}}, 0.0, "policy is exact"),
    ({}, {"pad_policy": "threshold@0.2"}, 0.0, "no pad configuration"),
    (ENGINE, {"pad_exact_prefix": -3}, 0.0, "exact_prefix"),
    (ENGINE, {"pad": {"exact_prefix": "8"}}, 0.0, "exact_prefix"),
    (ENGINE, {"pad": {"policy": "pivot", "judge_free": "yes"}}, 0.0, "judge_free must be true or false"),
    (ENGINE, {"pad_policy": "pivot", "pad_judge_free": 1.0}, 0.0, "judge_free must be true or false"),
    (ENGINE, {"pad_judge_free": True}, 0.0, "judge_free is read by pivot"),  # the engine's threshold
    (ENGINE, {"pad": {"policy": "exact", "judge_free": True}}, 0.0, "judge_free is read by pivot"),
])
def test_a_bad_request_is_refused(engine, extra_args, temperature, message):
    with pytest.raises(ValueError, match=message):
        request_policy(ServingConfig.parse(engine), params(extra_args, temperature))


def test_requests_without_pad_on_an_engine_without_pad():
    assert request_policy(None, params({"other": 1}, 0.7)) is None
    # the engine's fly serves greedy requests; a sampled request that chooses a sampling rule is served too
    fly = ServingConfig.parse({"pad": {"policy": "fly@0.3,2"}})
    assert str(request_policy(fly, params(None, 0.0))) == "fly@0.3,2"
    assert str(request_policy(fly, params({"pad": {"policy": "threshold@0.2"}}, 0.7))) == "threshold@0.2"


def test_exact_prefix_per_engine_and_per_request():
    from pad.serving.vllm import request_exact_prefix

    engine = ServingConfig.parse({"pad": {"policy": "threshold@0.2", "exact_prefix": 6}})
    assert request_exact_prefix(engine, params(None)) == 6
    assert request_exact_prefix(engine, params({"pad": {"exact_prefix": 0}})) == 0
    assert request_exact_prefix(engine, params({"pad_exact_prefix": 12})) == 12
    assert request_exact_prefix(ServingConfig.parse(ENGINE), params(None)) == 0


def test_judge_free_per_engine_and_per_request():
    from pad.serving.vllm import request_judge_free

    judging = ServingConfig.parse({"pad": {"policy": "pivot@0.3", "classifier": "shipped", "judge_free": True}})
    assert request_judge_free(judging, params(None)) is True
    assert request_judge_free(judging, params({"pad": {"judge_free": False}})) is False
    engine = ServingConfig.parse(ENGINE)
    assert request_judge_free(engine, params(None)) is False
    assert request_judge_free(engine, params({"pad_policy": "pivot", "pad_judge_free": True})) is True
    assert request_judge_free(engine, params({"pad_policy": "pivot", "pad_judge_free": 1})) is True  # vllm_xargs
    assert str(request_policy(engine, params({"pad": {"policy": "pivot", "judge_free": True}}))) == \
        f"pivot@{DEFAULT_SIGMA:g}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.int32, torch.int64])
def test_expand_batch_to_tokens_repeats_each_requests_value(dtype):
    """The plugin's replacement for vLLM's broken CPU expansion, against a plain loop (requests with 0 tokens
    included)."""
    g = torch.Generator().manual_seed(7)
    counts = [3, 0, 2, 5, 1]
    x = torch.randint(0, 4, (len(counts),), generator=g).to(dtype)
    cu = torch.tensor(counts).cumsum(0).int()
    want = [1 if int(v) == 0 else v.item() for v, k in zip(x, counts) for _ in range(k)]
    got = expand_batch_to_tokens(x, cu, sum(counts), replace_from=0, replace_to=1)
    assert got.dtype == dtype and got.tolist() == want


@pytest.mark.parametrize("draft, speculator, message", [
    (None, "eagle", "unknown speculator"),
    ("draft-folder", "ngram", "draft_model speculator only"),
    (None, "draft_model", "needs one"),
])
def test_engine_refuses_a_speculator_that_does_not_fit(draft, speculator, message):
    from pad.serving.engine import engine

    with pytest.raises(ValueError, match=message):
        engine("target-folder", draft, speculator=speculator)


@pytest.mark.parametrize("extra_args,temperature,key", [c[1:] for c in BAD_SETTINGS], ids=[c[0] for c in BAD_SETTINGS])
def test_every_bad_setting_is_refused_naming_its_key(extra_args, temperature, key):
    """Any type for any pad key (tests/bad_settings.py) is a RequestSettingError (vLLM's 400) naming the key as
    the request sent it, in a message of bounded length: never a TypeError, OverflowError or a silent default."""
    with pytest.raises(RequestSettingError) as refused:
        request_policy(ServingConfig.parse(BAD_ENGINE), params(extra_args, temperature))
    assert refused.value.key == key and str(refused.value).startswith(f"{key}: ")
    assert len(str(refused.value)) < 1000


def test_good_settings_beside_the_bad_ones_are_served():
    """The values the table leaves out as valid are served (the table is not refusing everything)."""
    engine = ServingConfig.parse(BAD_ENGINE)
    assert str(request_policy(engine, params({"pad_exact_prefix": 7, "pad_judge_free": True}))) == "pivot@0.3"
    assert str(request_policy(engine, params({"pad_policy": "fly@0.3,2"}))) == "fly@0.3,2"
    assert request_exact_prefix(engine, params({"pad_exact_prefix": 2**31 - 1})) == 2**31 - 1
