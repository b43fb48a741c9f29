"""pad's vLLM plugin on vLLM's CPU build: every policy decodes as ``pad.generate`` does, unconfigured engines
are vLLM's own, and a changed vLLM is refused.

Block alignment: vLLM samples a request's first token in its prefill step, without drafts, and speculates
from the second on; ``pad.generate``'s first block drafts the first token. So vLLM's tokens are compared
with the target's first greedy token followed by ``pad.generate`` from the prompt plus that token: then
both verify the same blocks. vLLM drafts K tokens up to its last step where pad.generate would draft fewer
within its budget, so pad.generate decodes K tokens more, cut to vLLM's length.
"""
import pytest
import torch

import pad
from conftest import run_engines

K = 4
MAX_TOKENS = 24
# Prompts of different lengths (token ids of the tiny WordLevel vocabulary; 1 is its EOS, never used).
PROMPTS = [[5, 6, 7], [9, 10, 11, 12, 13, 14, 15], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51], [77],
           [int(t) for t in torch.arange(100, 140, 2)]]
POLICIES = ["pivot@0.5", "threshold@0.05", "typical@0.3,0.3", "fly@0.3,2"]
DRAFTS = ["right", "wrong"]


def pad_config(policy, tiny):
    return {"policy": policy, **({"classifier": tiny["classifier"]} if policy.startswith("pivot") else {})}


def pad_tokens(tiny, draft, policy, prompts=PROMPTS, max_tokens=MAX_TOKENS, exact_prefix=0, drafter=None,
               judge_free=False):
    """What vLLM must produce: the target's first greedy token, then pad.generate from prompt + that token
    (``exact_prefix``: vLLM's, which counts that first token; ``draft`` None with a ``drafter``: draft-free)."""
    target = tiny["models"]["target"]
    with torch.no_grad():
        firsts = [int(target(torch.tensor([p])).logits[0, -1].argmax()) for p in prompts]
    rows = [p + [t] for p, t in zip(prompts, firsts)]
    width = max(map(len, rows))
    ids = torch.tensor([[0] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    out = pad.generate(target, tiny["models"][draft] if draft else None, ids, attention_mask=mask, policy=policy,
                       drafter=drafter, classifier=tiny["classifier"] if policy.startswith("pivot") else None,
                       num_draft_tokens=K, max_new_tokens=max_tokens - 1 + K, eos_token_id=[],
                       exact_prefix=max(0, exact_prefix - 1), judge_free=judge_free)
    new = out.sequences[:, width:].tolist()
    return [[t] + row[: max_tokens - 1] for t, row in zip(firsts, new)]


@pytest.fixture(scope="module")
def runs(tiny, tmp_path_factory):
    """One engine process: per draft, vLLM unconfigured, policy exact, then every pad policy."""
    spec = {"target": tiny["target"], "k": K, "runs": []}
    keys = []
    for draft in DRAFTS:
        for policy in [None, "exact", *POLICIES]:
            keys.append((draft, policy))
            spec["runs"].append({"draft": tiny[draft], "prompts": PROMPTS, "max_tokens": MAX_TOKENS,
                                 "pad": pad_config(policy, tiny) if policy else None})
    return dict(zip(keys, run_engines(spec, tmp_path_factory.mktemp("runs"))))


@pytest.fixture(scope="module")
def stock_runs(tiny, tmp_path_factory):
    """vLLM without pad's plugin at all (VLLM_PLUGINS lists no plugin)."""
    spec = {"target": tiny["target"], "k": K,
            "runs": [{"draft": tiny[d], "prompts": PROMPTS, "max_tokens": MAX_TOKENS} for d in DRAFTS]}
    return dict(zip(DRAFTS, run_engines(spec, tmp_path_factory.mktemp("stock"), VLLM_PLUGINS="")))


@pytest.mark.parametrize("draft", DRAFTS)
@pytest.mark.parametrize("policy", POLICIES)
def test_policy_decodes_as_pad_generate(runs, tiny, draft, policy):
    got = runs[(draft, policy)]
    assert got["tokens"] == pad_tokens(tiny, draft, policy)
    assert not got["stock"]["instance"], "a configured engine must decide with pad"


@pytest.mark.parametrize("policy", POLICIES)
def test_each_policy_relaxes_something(runs, policy):
    """Otherwise the comparison above could not tell the policy from exact."""
    relaxed = [runs[(draft, policy)]["relaxed_accepted"] for draft in DRAFTS]
    assert sum(relaxed) > 0, relaxed
    assert any(runs[(d, policy)]["tokens"] != runs[(d, None)]["tokens"] for d in DRAFTS)


@pytest.mark.parametrize("draft", DRAFTS)
def test_drafts_mostly_right_and_mostly_wrong(runs, draft):
    rate = runs[(draft, None)]["counts"]["accepted"] / runs[(draft, None)]["counts"]["draft_tokens"]
    assert (rate > 0.6) if draft == "right" else (rate < 0.3), rate


@pytest.mark.parametrize("draft", DRAFTS)
def test_unconfigured_and_exact_are_stock_vllm(runs, stock_runs, tiny, draft):
    stock = stock_runs[draft]
    assert all(stock["stock"].values())
    for policy in (None, "exact"):
        got = runs[(draft, policy)]
        assert got["stock"] == {"rejection_sample": True, "forward": True, "instance": True}
        assert got["tokens"] == stock["tokens"]
    # Exact speculative decoding is the target's greedy decoding: pad.generate's exact policy agrees.
    assert stock["tokens"] == pad_tokens(tiny, draft, "exact")


def test_hidden_feature_equals_pads(tiny, tmp_path):
    """The classifier's hidden state captured from vLLM's layer (its output plus the residual it returns
    apart) equals the output of the same HuggingFace decoder layer that pad.generate reads."""
    from pad.decoding.hf import LayerCapture
    from pad.models.classifier import PivotClassifier

    prompt = PROMPTS[2]
    dump = tmp_path / "hidden.pt"
    run_engines({"target": tiny["target"], "k": K, "runs": [
        {"draft": tiny["right"], "prompts": [prompt], "max_tokens": 1, "pad": pad_config("pivot@0.5", tiny),
         "dump_hidden": str(dump)}]}, tmp_path)
    got = torch.load(dump)[: len(prompt)]  # the last target forward (the prompt's prefill) comes first
    layer = PivotClassifier.load(tiny["classifier"]).layer
    capture = LayerCapture(tiny["models"]["target"].model, layer)
    capture.keep = len(prompt)
    with torch.no_grad():
        tiny["models"]["target"](torch.tensor([prompt]))
    capture.remove()
    assert got.shape == (len(prompt), 128)
    torch.testing.assert_close(got, capture.value[0], rtol=1e-4, atol=1e-5)
    # The layer's own output alone (without the residual) is not the feature: the test can tell them apart.
    assert (got - capture.value[0]).abs().max() < 0.01 * capture.value[0].abs().max()


def test_multiprocess_workers_load_the_plugin(tiny, tmp_path):
    """vLLM's default mode: the engine core and its worker in spawned processes, the plugin loaded there
    through the entry point alone."""
    policy = "threshold@0.05"
    got = run_engines({"target": tiny["target"], "k": K, "runs": [
        {"draft": tiny["right"], "prompts": PROMPTS, "max_tokens": MAX_TOKENS, "pad": pad_config(policy, tiny)}]},
        tmp_path, VLLM_ENABLE_V1_MULTIPROCESSING="1")
    assert got[0]["tokens"] == pad_tokens(tiny, "right", policy)


def test_tensor_parallel_workers(tiny, tmp_path):
    """tensor_parallel_size=2: two CPU workers, one core each (vLLM's CPU build binds one NUMA node per
    worker unless told which cores), every rank deciding with pad."""
    policy = "pivot@0.5"
    got = run_engines({"target": tiny["target"], "k": K, "runs": [
        {"draft": tiny["right"], "prompts": PROMPTS, "max_tokens": MAX_TOKENS, "pad": pad_config(policy, tiny),
         "engine": {"tensor_parallel_size": 2}}]},
        tmp_path, VLLM_ENABLE_V1_MULTIPROCESSING="1", VLLM_CPU_OMP_THREADS_BIND="0|1")
    assert got[0]["tokens"] == pad_tokens(tiny, "right", policy)


def test_pivot_compiled(tiny, tmp_path):
    """Without eager mode vLLM compiles the target with torch.compile; the classifier's hidden states come
    through vLLM's auxiliary hidden-state outputs, which the compiled graph keeps. The engine's policy is fly
    (greedy only), which vLLM's warm-up of its sampler on dummy sampled rows must not meet; the requests
    choose pivot."""
    got = run_engines({"target": tiny["target"], "k": K, "runs": [
        {"draft": tiny["wrong"], "prompts": PROMPTS, "max_tokens": MAX_TOKENS,
         "pad": {"policy": "fly@0.3,2", "classifier": tiny["classifier"]},
         "extra_args": [{"pad": {"policy": "pivot@0.5"}}] * len(PROMPTS), "engine": {"enforce_eager": False}}]},
        tmp_path)[0]
    assert got["compiled_graphs"] > 0, "the engine must run a compiled target"
    assert got["tokens"] == pad_tokens(tiny, "wrong", "pivot@0.5")
    assert got["relaxed_accepted"] > 0


def test_a_fault_in_pads_decision_leaves_the_engine_serving(tiny, tmp_path):
    """The guard: a fault planted in pad's decision of one step leaves that step to vLLM's own rejection sampling
    (the rows the engine used are vLLM's own on the same arguments), counts it once, and the engine goes on;
    planted in every step, the engine decodes the target's greedy tokens (the exact rule throughout), and after
    it, on the same engine, pad decides again."""
    policy = "threshold@0.05"
    base = {"draft": tiny["right"], "prompts": PROMPTS, "max_tokens": MAX_TOKENS, "pad": pad_config(policy, tiny)}
    runs = [{**base, "fault": 2}, {**base, "fault": "every", "reuse": True}, {**base, "reuse": True}]
    once, every, after = run_engines({"target": tiny["target"], "k": K, "runs": runs}, tmp_path)
    assert once["skipped"] == 1 and len(once["faulted"]) == 1
    used, exact = once["faulted"][0]
    assert used == exact
    assert len(once["tokens"]) == len(PROMPTS) and all(len(t) == MAX_TOKENS for t in once["tokens"])
    assert every["skipped"] == len(every["faulted"]) > 0 and all(u == e for u, e in every["faulted"])
    assert every["tokens"] == pad_tokens(tiny, "right", "exact") and every["relaxed_accepted"] == 0
    assert after["skipped"] == 0 and after["tokens"] == pad_tokens(tiny, "right", policy)
    assert after["relaxed_accepted"] > 0


def test_bad_configuration_stops_the_engine(tiny, tmp_path):
    """Refused when the engine loads its model (the configuration's own checks: tests/test_serving_config.py)."""
    run = {"draft": None, "prompts": [[5, 6]], "max_tokens": 2, "pad": pad_config("threshold@0.2", tiny)}
    with pytest.raises(AssertionError, match="speculative config"):
        run_engines({"target": tiny["target"], "k": K, "runs": [run]}, tmp_path)


def test_changed_vllm_is_refused(monkeypatch):
    """A vLLM whose internals differ from the supported version's is refused at start, naming that version."""
    import vllm
    import vllm.v1.sample.rejection_sampler as rs

    from pad.serving import vllm as plugin

    assert plugin.compatibility_problems() == []

    def rejection_sample(draft_token_ids, num_draft_tokens, target_logits, sampling_metadata):
        raise AssertionError("never called")

    monkeypatch.setattr(rs, "rejection_sample", rejection_sample)
    with pytest.raises(RuntimeError, match=r"supports vLLM 0\.32\.0 and 0\.33\.0 only.*rejection_sample takes"):
        plugin.register()
    monkeypatch.undo()
    monkeypatch.setattr(vllm, "__version__", "0.33.1")
    with pytest.raises(RuntimeError, match=r"supports vLLM 0\.32\.0 and 0\.33\.0 only.*vLLM is 0\.33\.1"):
        plugin.register()
    # 0.33.0 is checked against its own internals: this vLLM's rejection_sample lacks 0.33's native FLy.
    monkeypatch.setattr(vllm, "__version__", "0.33.0")
    with pytest.raises(RuntimeError, match=r"rejection_sample takes .*use_fp64_gumbel\), not .*fly_entropy_top_k"):
        plugin.register()


def test_v2_model_runner_is_refused():
    """A worker whose runner is not V1's (the V2 runner, vLLM's default on GPUs, which the CPU build does not
    run here: a stand-in) stops at load when pad is configured, naming the setting that selects V1."""
    from types import SimpleNamespace

    from vllm.v1.worker.gpu_worker import Worker

    from pad.serving import vllm as plugin

    plugin.register()
    worker = SimpleNamespace(vllm_config=SimpleNamespace(additional_config={"pad": {"policy": "threshold@0.2"}}),
                             model_runner=object())
    with pytest.raises(RuntimeError, match="VLLM_USE_V2_MODEL_RUNNER=0"):
        Worker.load_model(worker)


def test_request_state_without_its_fields_is_refused(monkeypatch):
    """The per-request settings read each request's sampling parameters and output so far from the runner's
    CachedRequestState: a vLLM whose state lacks them is refused at start."""
    from dataclasses import make_dataclass

    import vllm.v1.worker.gpu_input_batch as batch

    from pad.serving import vllm as plugin

    monkeypatch.setattr(batch, "CachedRequestState", make_dataclass("CachedRequestState", ["req_id", "sampling_params"]))
    with pytest.raises(RuntimeError, match="CachedRequestState lacks output_token_ids"):
        plugin.register()
