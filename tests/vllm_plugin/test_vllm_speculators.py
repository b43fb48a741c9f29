"""pad's rules on vLLM's draft-free speculators: ``ngram`` (prompt lookup) and ``suffix`` (SuffixDecoding, from
arctic-inference). Their drafts carry no probabilities, and every rule but kl reads the target alone.

ngram: vLLM's tokens equal ``pad.generate`` with a drafter written here from vLLM's definition of its proposer,
and every draft vLLM proposed equals that definition's. suffix: its proposals come from arctic-inference's
suffix trees, so the drafts vLLM decided on are recorded and replayed through ``pad.generate``, which must make
the same tokens from them. pivot decides these drafts exactly, as pad.generate decides a lookup's, unless a
request sets judge_free. The decisions themselves are checked against pad's reference in test_vllm_decision.py
(drafts without probabilities included).
"""
import pytest

from conftest import run_engines
from pad.decoding.drafters import FreeDrafter
from test_vllm_plugin import K, MAX_TOKENS, pad_config, pad_tokens

# Repetitive prompts, so that n-grams recur; the tiny target's greedy replies repeat too.
PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7], [9, 10, 11, 12, 13, 9, 10, 11], [30, 31, 30, 32, 30, 31, 30],
           [77], [40, 41, 42, 43, 44, 45, 46, 47]]
NGRAM = {"prompt_lookup_max": 3, "prompt_lookup_min": 1}
# "pivot@0.5 judge_free": pivot with the request's judge_free set (the classifier judging the drafts).
POLICIES = ["pivot@0.5", "pivot@0.5 judge_free", "threshold@0.05", "typical@0.3,0.3", "fly@0.3,2"]
SUFFIX_POLICIES = ["pivot@0.5", "pivot@0.5 judge_free", "threshold@0.05"]


def settings(policy: str) -> dict:
    """A request's pad settings for a name of POLICIES."""
    name, _, judge = policy.partition(" ")
    return {"policy": name, **({"judge_free": True} if judge else {})}


def expected(tiny, policy, drafter):
    """pad.generate's tokens for a name of POLICIES."""
    return pad_tokens(tiny, None, settings(policy)["policy"], PROMPTS, drafter=drafter,
                      judge_free=policy.endswith("judge_free"))


def relaxes(policy: str) -> bool:
    """Whether a policy may accept what the exact rule rejects on a draft-free speculator's drafts."""
    return policy.endswith("judge_free") or policy.split("@")[0] not in ("exact", "pivot")


def ngram_proposal(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """vLLM's ngram proposer (vllm/v1/spec_decode/ngram_proposer.py), written plainly: the longest n in
    [min_n, max_n] whose last-n-token suffix also starts earlier in ``tokens`` (overlap allowed), its earliest
    such occurrence, and the up to k tokens that follow it."""
    total = len(tokens)
    for n in range(min(max_n, total - 1), min_n - 1, -1):
        for start in range(total - n):
            if tokens[start:start + n] == tokens[total - n:]:
                return tokens[start + n:start + n + k]
    return []


class _Context:
    def __init__(self, index: int, tokens: list[int]):
        self.index, self.tokens = index, list(tokens)

    def extend(self, tokens: list[int]) -> None:
        self.tokens += tokens


class VllmNgram(FreeDrafter):
    """``ngram_proposal`` as a pad drafter."""

    name = "vllm-ngram"

    def start(self, batch, sampling, device, needs_logits=False):
        super().start(batch, sampling, device)
        self.rows = [_Context(i, p) for i, p in enumerate(batch.prompts)]

    def matches(self, k):
        return [(ngram_proposal(row.tokens, NGRAM["prompt_lookup_min"], NGRAM["prompt_lookup_max"], k), 0)
                for row in self.rows]


class Replay(VllmNgram):
    """Proposes what vLLM proposed: ``recorded`` [[prompt index, context length, drafts], ...]."""

    name = "replay"

    def __init__(self, recorded):
        super().__init__()
        self.recorded = {(i, length): drafts for i, length, drafts in recorded}

    def matches(self, k):
        return [(self.recorded.get((row.index, len(row.tokens)), [])[:k], 0) for row in self.rows]


@pytest.fixture(scope="module")
def runs(tiny, tmp_path_factory):
    """One engine per speculator, its policy relaxed and with a classifier, decoding the prompts once per policy
    (each request choosing it). One process: a second engine after an ngram one fails to start in vLLM 0.32's
    CPU build (its kernel scan meets numba's library wrapper), so ngram's engine comes last."""
    engine = {**pad_config("threshold@0.05", tiny), "classifier": tiny["classifier"]}
    keys = [("suffix", p) for p in ["exact", *SUFFIX_POLICIES]] + [("ngram", p) for p in ["exact", *POLICIES]]
    spec = {"target": tiny["target"], "k": K, "runs": [
        {"speculator": s, "speculator_args": NGRAM if s == "ngram" else {}, "pad": engine, "prompts": PROMPTS,
         "max_tokens": MAX_TOKENS, "extra_args": [{"pad": settings(p)}] * len(PROMPTS), "record_drafts": True,
         "reuse": (s, p) not in (("suffix", "exact"), ("ngram", "exact"))} for s, p in keys]}
    return dict(zip(keys, run_engines(spec, tmp_path_factory.mktemp("speculators"))))


@pytest.mark.parametrize("speculator", ["ngram", "suffix"])
def test_exact_requests_are_the_targets_greedy_output(runs, tiny, speculator):
    got = runs[(speculator, "exact")]
    assert got["tokens"] == pad_tokens(tiny, None, "exact", PROMPTS, drafter=VllmNgram())
    assert got["counts"]["accepted"] > 0, f"{speculator} must propose drafts the target accepts"
    assert not got["stock"]["instance"], "the engine must decide with pad"


@pytest.mark.parametrize("policy", POLICIES)
def test_ngram_decodes_as_pad_generate(runs, tiny, policy):
    got = runs[("ngram", policy)]
    assert got["tokens"] == expected(tiny, policy, VllmNgram())
    # a relaxing policy must relax something for the comparison to tell it from exact
    assert (got["relaxed_accepted"] > 0) == relaxes(policy)


@pytest.mark.parametrize("policy", ["exact", *POLICIES])
def test_ngram_drafts_are_vllms_definition(runs, policy):
    got = runs[("ngram", policy)]
    assert got["drafts"], "the plugin decided no block"
    proposed = [(index, length, drafts) for index, length, drafts in got["drafts"] if length > len(PROMPTS[index])]
    assert len(proposed) >= len(got["drafts"]) - len(PROMPTS)  # only each request's prefill step drafts nothing
    for index, length, drafts in proposed:
        context = (PROMPTS[index] + got["tokens"][index])[:length]
        assert drafts == ngram_proposal(context, NGRAM["prompt_lookup_min"], NGRAM["prompt_lookup_max"], K)


@pytest.mark.parametrize("policy", ["exact", *SUFFIX_POLICIES])
def test_suffix_decodes_as_pad_generate_on_its_drafts(runs, tiny, policy):
    got = runs[("suffix", policy)]
    assert sum(len(d) for _, _, d in got["drafts"]) > 0, "suffix decoding proposed nothing"
    assert got["tokens"] == expected(tiny, policy, Replay(got["drafts"]))
    assert (got["relaxed_accepted"] > 0) == relaxes(policy)
