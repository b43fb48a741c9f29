"""pad's configuration inside vLLM's additional_config (pad.serving.vllm.ServingConfig): parsed without vLLM."""
import pytest

from pad.decoding.policy import DEFAULT_SIGMA
from pad.serving.vllm import ServingConfig


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
    ({"policy": "threshold@0.2", "classifier": "shipped"}, "pivot only"),
    ({"policy": "threshold@1.5"}, "tau"),
    ({"policy": "banana"}, "unknown policy"),
    ({"policy": "threshold@0.2", "floor": 2}, "floor"),
    ({"policy": "kl@0.5"}, "draft's logits"),
])
def test_bad_configuration_is_refused(entry, message):
    with pytest.raises(ValueError, match=message):
        ServingConfig.parse({"pad": entry})


def test_shipped_classifier_loads():
    clf = ServingConfig.parse({"pad": {"policy": "pivot", "classifier": "shipped"}}).load_classifier()
    assert clf.hidden_size == 1536 and clf.layer == -8
