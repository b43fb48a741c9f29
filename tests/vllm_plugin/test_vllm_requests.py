"""A policy per request inside vLLM: ``SamplingParams(extra_args={"pad": {"policy": ...}})`` over the engine's
default, requests with different policies in one batch, and bad requests refused alone as they arrive."""
import pytest

from conftest import run_engines
from test_vllm_plugin import DRAFTS, K, MAX_TOKENS, PROMPTS, pad_config, pad_tokens

ENGINE = "threshold@0.05"
# One per prompt of PROMPTS: the batch decodes them together, each by its own policy (None: the engine's).
REQUESTS = ["pivot@0.5", None, "exact", "typical@0.3,0.3", "fly@0.3,2"]
# exact_prefix per prompt (None: the engine's ENGINE_PREFIX), on an engine of PREFIX_POLICY with the unrelated
# draft: there these prefixes change requests 0-2 (checked below), so the run can tell a prefix from none.
PREFIX_POLICY, ENGINE_PREFIX, PREFIXES = "typical@0.3,0.3", 6, [3, 11, MAX_TOKENS, None, 0]
BAD = [  # (extra_args, temperature, what the refusal says)
    ({"pad": {"policy": "banana"}}, 0.0, "unknown policy"),
    ({"pad": {"policy": "kl@0.5"}}, 0.0, "draft's logits"),
    ({"pad": {"classifier": "elsewhere"}}, 0.0, "unknown pad request setting"),
    ({"pad_policy": "fly@0.3,2"}, 0.7, "greedy requests only"),
]


def engine_config(tiny, policy=ENGINE):
    return {**pad_config(policy, tiny), "classifier": tiny["classifier"]}


def extra_args(policy):
    return None if policy is None else {"pad": {"policy": policy}}


@pytest.fixture(scope="module")
def runs(tiny, tmp_path_factory):
    """Per draft: the mixed batch on a threshold engine with a classifier (bad requests first); then a fly
    engine given a sampled request."""
    spec = {"target": tiny["target"], "k": K, "runs": [
        {"draft": tiny[d], "prompts": PROMPTS, "max_tokens": MAX_TOKENS, "pad": engine_config(tiny),
         "extra_args": [extra_args(p) for p in REQUESTS],
         "bad_requests": [{"extra_args": e, "temperature": t} for e, t, _ in BAD]} for d in DRAFTS]}
    spec["runs"].append({"draft": tiny["right"], "prompts": PROMPTS, "max_tokens": MAX_TOKENS,
                         "pad": pad_config("fly@0.3,2", tiny), "bad_requests": [{"temperature": 0.7}]})
    spec["runs"].append({"draft": tiny["wrong"], "prompts": PROMPTS, "max_tokens": MAX_TOKENS,
                         "pad": {**engine_config(tiny, PREFIX_POLICY), "exact_prefix": ENGINE_PREFIX},
                         "extra_args": [None if n is None else {"pad": {"exact_prefix": n}} for n in PREFIXES]})
    out = run_engines(spec, tmp_path_factory.mktemp("requests"))
    return {**dict(zip(DRAFTS, out)), "fly": out[-2], "prefix": out[-1]}


@pytest.mark.parametrize("draft", DRAFTS)
def test_each_request_decodes_by_its_own_policy(runs, tiny, draft):
    want = {p: pad_tokens(tiny, draft, p or ENGINE) for p in set(REQUESTS)}
    got = runs[draft]["tokens"]
    for i, policy in enumerate(REQUESTS):
        assert got[i] == want[policy][i], (i, policy)


def test_policies_tell_the_requests_apart(runs, tiny):
    """Over both drafts, at least two requests' own policies give tokens the engine's policy would not."""
    differ = sum(pad_tokens(tiny, d, p or ENGINE)[i] != pad_tokens(tiny, d, ENGINE)[i]
                 for d in DRAFTS for i, p in enumerate(REQUESTS))
    assert differ >= 2, differ


@pytest.mark.parametrize("draft", DRAFTS)
def test_bad_requests_are_refused_alone(runs, draft):
    refused = runs[draft]["refused"]
    for (extra, temperature, message), got in zip(BAD, refused):
        assert got is not None and "VLLMValidationError" in got and message in got, (extra, temperature, got)


def test_fly_engine_refuses_a_sampled_request_and_goes_on(runs, tiny):
    got = runs["fly"]
    assert got["refused"][0] is not None and "greedy requests only" in got["refused"][0], got["refused"]
    assert got["tokens"] == pad_tokens(tiny, "right", "fly@0.3,2")


def test_exact_prefix_per_request(runs, tiny):
    """Each request's first N tokens decided exactly (its own N, or the engine's), as pad.generate's
    exact_prefix decides them; and the prefixes change what the policy decodes."""
    got = runs["prefix"]["tokens"]
    for i, n in enumerate(PREFIXES):
        n = ENGINE_PREFIX if n is None else n
        assert got[i] == pad_tokens(tiny, "wrong", PREFIX_POLICY, exact_prefix=n)[i], (i, n)
    assert got[2] == pad_tokens(tiny, "wrong", "exact")[2]  # the whole reply exact: the target's greedy
    plain = pad_tokens(tiny, "wrong", PREFIX_POLICY)
    assert [g != p for g, p in zip(got, plain)] == [True, True, True, False, False]
