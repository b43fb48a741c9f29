"""One policy grammar for pad.generate and the benchmark; the training-free rules decode as the op says."""
import pytest
import torch

import pad
from pad.decoding.policy import Policy, parse_policy
from pad.evaluation import bench
from pad_kernels import AcceptRule
from tiny import tiny_pair


def test_grammar_and_defaults():
    assert parse_policy("exact") == Policy("exact")
    assert parse_policy("pivot@0.3") == Policy("pivot", sigma=0.3) and parse_policy("pivot").sigma is None
    assert parse_policy("typical").rule == AcceptRule.typical(0.09, 0.3)
    assert parse_policy("typical@0.2").rule == AcceptRule.typical(0.2, 0.3)
    assert parse_policy("typical@0.2,0.5").rule == AcceptRule.typical(0.2, 0.5)
    assert parse_policy("threshold@0.5").rule == AcceptRule.threshold(0.5)
    assert parse_policy("fly").rule == AcceptRule.fly(0.3, 6) and parse_policy("fly@0.5,4").rule == AcceptRule.fly(0.5, 4)
    assert parse_policy("kl@0.5").rule == AcceptRule.kl(0.5, 1.0)
    assert parse_policy("kl@0.5,0.9").rule == AcceptRule.kl(0.5, 0.9)
    assert parse_policy("topk@3,0.1").rule == AcceptRule.topk(3, 0.1)
    for spec in ("typical@0.2,0.5", "threshold@0.5", "fly@0.5,4", "kl@0.5,0.9", "topk@3,0.1", "pivot@0.3", "target"):
        assert str(parse_policy(spec)) == spec and parse_policy(str(parse_policy(spec))) == parse_policy(spec)
    assert parse_policy(parse_policy("fly")) == parse_policy("fly")  # parsed objects pass through
    for bad, match in (("fast", "unknown policy"), ("threshold", "needs tau"), ("typical@x", "bad number"),
                       ("typical@0.1,0.2,0.3", "takes 2 setting"), ("fly@0.3,2.5", "whole number"),
                       ("threshold@1.5", "0 <= tau <= 1"), ("pivot@2", "must be in"), ("exact@1", "takes 0"),
                       ("kl", "needs epsilon"), ("topk@3", "needs delta"), ("topk@2.5,0.1", "whole number"),
                       ("kl@0.5,2", "0 <= top1 <= 1")):
        with pytest.raises(ValueError, match=match):
            parse_policy(bad)
    with pytest.raises(TypeError):
        parse_policy(3)


def test_bench_reads_the_same_grammar():
    specs = bench.parse_policies("target,typical@0.09,0.3,fly,threshold@0.4,pivot@0.5,hf-target")
    assert [s.name for s in specs] == ["target", "typical@0.09,0.3", "fly", "threshold@0.4", "pivot@0.5", "hf-target"]
    assert specs[1].parsed.rule == AcceptRule.typical(0.09, 0.3) and specs[4].sigma == 0.5
    for bad in ("pivot", "exact,exact", "nucleus"):
        with pytest.raises(ValueError):
            bench.parse_policies(bad)


@pytest.fixture(scope="module")
def pair():
    return tiny_pair("llama", scale=0.6)


def _prompts(n):
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, 96, (1, 4 + i % 3), generator=g) for i in range(n)]


@pytest.mark.parametrize("spec", ["typical@1,inf", "threshold@1", "fly@inf,6", "kl@inf,0", "topk@0,1", "topk@1,1"])
def test_a_rule_at_its_exact_setting_decodes_as_exact(pair, spec):
    target, draft = pair
    for prompt in _prompts(4):
        exact = pad.generate(target, draft, prompt, policy="exact", num_draft_tokens=4, max_new_tokens=24)
        got = pad.generate(target, draft, prompt, policy=spec, num_draft_tokens=4, max_new_tokens=24)
        assert torch.equal(got.sequences, exact.sequences)
        assert got.stats.accepted == exact.stats.accepted and got.stats.relaxed_accepted == 0


@pytest.mark.parametrize("spec", ["typical@0.3,0.5", "threshold@0.005", "fly@0.0,1", "kl@inf", "topk@8,1"])
def test_relaxed_rules_accept_more_and_count_what_they_relax(pair, spec):
    """The rule reaches the op: a loose setting accepts a larger share of the drafts than exact, and the
    tokens accepted against the exact rule are counted."""
    target, draft = pair
    relaxed = exact = pivot_accepted = 0
    for prompt in _prompts(4):
        e = pad.generate(target, draft, prompt, policy="exact", num_draft_tokens=4, max_new_tokens=24)
        r = pad.generate(target, draft, prompt, policy=spec, num_draft_tokens=4, max_new_tokens=24)
        exact += e.stats.accepted / e.stats.drafted
        relaxed += r.stats.accepted / r.stats.drafted
        pivot_accepted += r.stats.relaxed_accepted
    assert relaxed > exact and pivot_accepted > 0


def test_greedy_only_rule_with_sampling_is_refused_before_decoding(pair):
    target, draft = pair
    with pytest.raises(ValueError, match="greedy decoding only"):
        pad.generate(target, draft, _prompts(1)[0], policy="fly", temperature=0.8)


@pytest.mark.parametrize("spec", ["kl@inf,0", "topk@0,1"])
def test_a_rule_at_its_exact_setting_samples_as_exact(pair, spec):
    """With the same seed, the same draws: a setting that never relaxes gives exact's sampled output."""
    target, draft = pair
    ids = torch.randint(0, 96, (3, 5), generator=torch.Generator().manual_seed(2))
    exact = pad.generate(target, draft, ids, policy="exact", temperature=0.9, seed=4, max_new_tokens=16)
    got = pad.generate(target, draft, ids, policy=spec, temperature=0.9, seed=4, max_new_tokens=16)
    assert torch.equal(got.sequences, exact.sequences) and got.stats.relaxed_accepted == 0
    assert exact.stats.accepted < exact.stats.drafted  # rejections happened: the rule had something to decide


def test_sampling_rules_run_batched(pair):
    target, draft = pair
    ids = torch.randint(0, 96, (3, 5), generator=torch.Generator().manual_seed(1))
    for spec in ("typical", "threshold@0.3", "kl@1.0", "topk@4,0.2"):
        out = pad.generate(target, draft, ids, policy=spec, temperature=0.9, seed=0, max_new_tokens=12)
        assert out.sequences.shape[0] == 3 and int(out.lengths.min()) > 0
        again = pad.generate(target, draft, ids, policy=spec, temperature=0.9, seed=0, max_new_tokens=12)
        assert torch.equal(out.sequences, again.sequences)  # reproducible with a seed


@pytest.mark.parametrize("batch", [1, 3])
def test_exact_with_draft_stop_is_the_target_greedy_output(pair, batch, monkeypatch):
    import importlib

    from pad.decoding.decoder import left_padded
    from tiny import greedy_from_scratch

    target, draft = pair
    gen_module = importlib.import_module("pad.decoding.speculative")  # where the block calls the op
    lengths, real = [], gen_module.verify_block

    def spy(*args, **kwargs):
        if kwargs.get("num_drafts") is not None:
            lengths.extend(kwargs["num_drafts"].tolist())
        return real(*args, **kwargs)

    monkeypatch.setattr(gen_module, "verify_block", spy)
    g = torch.Generator().manual_seed(batch)
    rows = [torch.randint(0, 96, (3 + i,), generator=g).tolist() for i in range(batch)]
    ids, mask = left_padded(rows)
    out = pad.generate(target, draft, ids, attention_mask=mask, policy="exact", num_draft_tokens=6,
                       max_new_tokens=30, draft_stop=0.0145)  # the tiny draft's top probabilities: ~0.013-0.016
    for i, row in enumerate(rows):
        want = greedy_from_scratch(target, row, 30)
        assert out.sequences[i, ids.shape[1] : ids.shape[1] + int(out.lengths[i])].tolist() == want
    assert min(lengths) < max(lengths) and max(lengths) <= 6  # the drafts per block vary
    assert out.stats.drafted < 6 * out.stats.target_forwards
    with pytest.raises(ValueError, match="draft_stop"):
        pad.generate(target, draft, ids[:1], draft_stop=1.5)


def test_relaxed_count_keeps_its_old_name_readable():
    from pad import GenerationStats

    s = GenerationStats(drafted=8, accepted=6, relaxed_accepted=2, new_tokens=7, target_forwards=1)
    assert s.pivot_accepted == 2 and "2 by the relaxed rule" in s.summary()
    assert GenerationStats.from_dict(s.to_dict()) == s
    old = {k: v for k, v in s.to_dict().items() if k != "relaxed_accepted"} | {"pivot_accepted": 2}
    assert GenerationStats.from_dict(old) == s  # a stats record written before the rename
