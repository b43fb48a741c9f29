"""A fuzz test of the plugin's decision: random steps in vLLM's layout through ``decide_step`` (what an installed
sampler's ``rejection_sample`` runs, guard included), mixing in one step every kind of request a server sees.

Each step: 1 to 32 requests, 0 to K drafts each, greedy and sampled (some seeded), n > 1 (children sharing one
``SamplingParams``), async scheduling's placeholders, each request's own policy or the engine's, ``exact_prefix``
and ``judge_free``, on engines with a draft model or a draft-free speculator. Asserted: nothing raises and the
guard never had to step in; every greedy request's row equals a per-request reference written from the rule
(``verify_block_ref`` on that request's block alone, composed into vLLM's row); every request the exact rule
decides whole equals vLLM's own rejection sampling of the same step; every sampled row is well formed."""
import random
import time
from types import SimpleNamespace

import pytest
import torch

from pad.decoding.policy import parse_policy
from pad.serving.vllm import EVERY_DRAFT, PLACEHOLDER, Acceptance, ServingConfig, decide_step
from pad_kernels import FoldedClassifier
from pad_kernels.verify_ref import verify_block_ref

STEPS = 5000
H = 16
REQUEST_POLICIES = [None, None, "exact", "pivot@0.5", "threshold@0.1", "typical@0.2,0.3", "topk@3,0.1", "fly@0.3,2"]
ENGINE_POLICIES = ["pivot@0.3", "threshold@0.2", "fly@0.3,2"]


@pytest.fixture(scope="module", autouse=True)
def cpu_kernels():
    from vllm.platforms import current_platform

    current_platform.register_triton_kernel_overrides()


def random_step(rng: random.Random, g: torch.Generator, clf):
    """One step: (acceptance with its stand-in runner, vLLM's arguments, each request's description)."""
    V = rng.choice([97, 97, 97, 1271])
    K = rng.randint(1, 8)
    free = rng.random() < 0.4  # ngram/suffix: no draft probabilities
    engine = ServingConfig(parse_policy(rng.choice(ENGINE_POLICIES)), classifier="given",
                           exact_prefix=rng.choice([0, 0, 3]))
    if engine.policy.name == "pivot":
        engine = ServingConfig(parse_policy("pivot@0.3"), classifier="given", exact_prefix=engine.exact_prefix)
    requests = []
    while len(requests) < rng.randint(1, 32):
        sampled = rng.random() < 0.5
        policy = rng.choice(REQUEST_POLICIES)
        name = (policy or str(engine.policy)).split("@")[0]
        if sampled and name == "fly":  # refused as it arrives: never in a step
            policy, name = "threshold@0.1", "threshold"
        settings = {}
        if policy:
            settings["policy"] = policy
        if rng.random() < 0.3:
            settings["exact_prefix"] = rng.randint(0, 6)
        if name == "pivot" and rng.random() < 0.5:
            settings["judge_free"] = rng.random() < 0.5
        params = SimpleNamespace(temperature=rng.choice([0.7, 1.0]) if sampled else 0.0,
                                 extra_args={"pad": settings} if settings else None)
        seeded = sampled and rng.random() < 0.5
        for _ in range(rng.choice([1, 1, 1, 2, 3])):  # n > 1: children share the parent's parameters
            requests.append(dict(params=params, seeded=seeded, generated=rng.randint(1, 8), k=rng.randint(0, K)))
    requests = requests[:32]
    if not any(r["k"] for r in requests):
        requests[0]["k"] = K
    counts = [r["k"] for r in requests]
    B, T = len(counts), sum(counts)
    temperature = torch.tensor([r["params"].temperature for r in requests])
    per_token = torch.repeat_interleave(temperature, torch.tensor(counts))
    target_logits = torch.randn(T, V, generator=g) * 3 / torch.where(per_token == 0, 1.0, per_token)[:, None]
    q = torch.softmax(target_logits + torch.randn(T, V, generator=g), -1)
    drafts = target_logits.argmax(-1)
    near = torch.rand(T, generator=g) < 0.4
    drafts[near] = target_logits.topk(2, -1).indices[near, 1]
    sampled_drafts = torch.multinomial(q, 1, generator=g).flatten()
    drafts = torch.where(per_token == 0, drafts, sampled_drafts)
    start = 0
    for r in requests:  # async scheduling: a request's drafts may end in placeholders
        if r["k"] and rng.random() < 0.15:
            drafts[start + rng.randint(0, r["k"] - 1):start + r["k"]] = PLACEHOLDER
        start += r["k"]
    ids = [f"req-{i}" for i in range(B)]
    runner = SimpleNamespace(input_batch=SimpleNamespace(req_ids=ids), requests={
        rid: SimpleNamespace(sampling_params=r["params"], output_token_ids=[7] * r["generated"])
        for rid, r in zip(ids, requests)})
    acceptance = Acceptance(engine, folded=clf, runner=runner, free_drafts=free)
    acceptance.capture = SimpleNamespace(value=torch.randn(2 * (T + B), H, generator=g))
    seeds = {i: rng.randrange(2**31) for i, r in enumerate(requests) if r["seeded"]}
    sampling = SimpleNamespace(all_greedy=bool((temperature == 0).all()), all_random=bool((temperature > 0).all()),
                               temperature=temperature, generators={})
    metadata = SimpleNamespace(logits_indices=torch.arange(T + B).int() * 2)
    step = dict(drafts=drafts.int().contiguous(), counts=counts, max_spec_len=max(counts),
                cu=torch.tensor(counts).cumsum(0).int(), q=None if free or rng.random() < 0.2 else q,
                target_logits=target_logits, bonus=torch.randint(0, V, (B, 1), generator=g), sampling=sampling)
    return acceptance, metadata, step, seeds, requests


def run(fn, step, seeds, *head):
    """``fn`` on the step's arguments, the draws fixed: the global seed and fresh seeded generators."""
    torch.manual_seed(1)
    step["sampling"].generators = {i: torch.Generator().manual_seed(s) for i, s in seeds.items()}
    return fn(*head, step["drafts"], step["counts"], step["max_spec_len"], step["cu"], step["q"],
              step["target_logits"].clone(), step["bonus"], step["sampling"])


def greedy_reference(acceptance, step, b, policy, until, clf_hidden):
    """Request b's row by the rule, from its own block alone: its drafts up to its first placeholder, their
    rows and the next one (vLLM's bonus row, unused, when it has no placeholder)."""
    k, start = step["counts"][b], sum(step["counts"][:b])
    drafts = step["drafts"][start:start + k].long()
    own = int((drafts >= 0).cumprod(0).sum())
    rows = step["target_logits"][start:start + min(own + 1, k)]
    if own == k:
        rows = torch.cat([rows, rows.new_zeros(1, rows.shape[1])])
    hidden = clf_hidden[sum(step["counts"][:b]) + b:][:own + 1]

    def decide(p, with_classifier):
        res = verify_block_ref(rows[None], drafts[:own][None], hidden[None] if with_classifier else None,
                               acceptance.folded if with_classifier else None, sigma=p.sigma or 0.0,
                               floor=acceptance.config.floor, rule=p.rule)
        return int(res.num_accepted[0]), int(res.next_token[0])

    exact = decide(parse_policy("exact"), False)
    n, nxt = exact if until >= EVERY_DRAFT else decide(policy, policy.name == "pivot")
    if exact[0] < until:
        n, nxt = exact
    row = drafts[:n].tolist() + [nxt if n < k else int(step["bonus"][b, 0])]
    return row + [PLACEHOLDER] * (step["max_spec_len"] + 1 - len(row))


def test_random_steps_never_raise_and_decide_as_the_references(capsys):
    import vllm.v1.sample.rejection_sampler as rs

    rng, g = random.Random(20261205), torch.Generator().manual_seed(20261205)
    clf = FoldedClassifier(torch.randn(H + 2, 8, generator=g) / 4, torch.randn(8, generator=g) * 0.1,
                           torch.randn(8, generator=g) / 3, torch.tensor(0.1))
    checked = {"greedy": 0, "exact": 0, "sampled": 0, "relaxed": 0, "fly-beside-sampled": 0}
    began = time.monotonic()
    for i in range(STEPS):
        acceptance, metadata, step, seeds, requests = random_step(rng, g, clf)
        got = run(decide_step, step, seeds, acceptance, metadata)
        assert acceptance.relaxed_decisions_skipped == 0, f"step {i}: pad's decision failed and was skipped"
        decided = acceptance.requests(len(requests))
        own_vllm = run(rs.rejection_sample, step, seeds)
        hidden = acceptance.capture.value[metadata.logits_indices.long()]
        sampled_step = not step["sampling"].all_greedy
        for b, (policy, greedy, until) in enumerate(decided):
            k, start = step["counts"][b], sum(step["counts"][:b])
            placeholders = bool((step["drafts"][start:start + k] < 0).any())
            row = got[b].tolist()
            n = row.index(PLACEHOLDER) - 1 if PLACEHOLDER in row else len(row) - 1
            exact_whole = policy.name == "exact" or until >= k
            if greedy:
                want = greedy_reference(acceptance, step, b, policy, until, hidden)
                assert row == want, (i, b, str(policy), until, row, want)
                checked["greedy"] += 1
                checked["relaxed"] += row != own_vllm[b].tolist()
                checked["fly-beside-sampled"] += policy.name == "fly" and sampled_step
            else:
                V = step["target_logits"].shape[-1]
                assert row[:n] == step["drafts"][start:start + n].tolist() and 0 <= row[n] < V, (i, b, row)
                assert all(t == PLACEHOLDER for t in row[n + 1:]) and n <= k, (i, b, row)
                checked["sampled"] += 1
            if exact_whole and (greedy or not placeholders):
                assert row == own_vllm[b].tolist(), (i, b, str(policy), until, row, own_vllm[b].tolist())
                checked["exact"] += 1
    seconds = time.monotonic() - began
    with capsys.disabled():
        print(f"\nfuzz: {STEPS} steps in {seconds:.1f} s; rows checked {checked}")
    assert all(checked.values()), f"the fuzz must reach every kind of row: {checked}"
