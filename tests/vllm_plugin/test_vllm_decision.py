"""The plugin's acceptance function on random inputs in vLLM's layout, greedy, sampled and mixed batches:
with the exact rule it is vLLM's rejection sampling draw for draw, and with every relaxed rule it is pad's
reference (``verify_block_varlen_ref``) composed into vLLM's output rows by hand."""
from types import SimpleNamespace

import pytest
import torch

from pad.decoding.policy import parse_policy
from pad.serving.vllm import PLACEHOLDER, Acceptance, ServingConfig, pad_rejection_sample, vllm_draws
from pad_kernels import FoldedClassifier, verify_block_varlen_ref

COUNTS = [3, 0, 4, 1, 4]
V, H = 97, 16


@pytest.fixture(scope="module", autouse=True)
def cpu_kernels():
    """vLLM's CPU build routes its Triton kernels to C++ ops; a worker does this at start."""
    from vllm.platforms import current_platform

    current_platform.register_triton_kernel_overrides()


def layout(counts, seed, kinds, draft_probs=True):
    """vLLM's inputs for one step: kinds[b] is "greedy" or "random" (temperature 0.7, one seeded request)."""
    g = torch.Generator().manual_seed(seed)
    B, T = len(counts), sum(counts)
    logits = torch.randn(T + B, V, generator=g) * 3  # every sampled row of the step, bonus rows included
    starts = torch.tensor([sum(counts[:b]) + b for b in range(B)])
    target_idx = torch.cat([s + torch.arange(k) for s, k in zip(starts.tolist(), counts)]).int()
    bonus_idx = (starts + torch.tensor(counts)).int()
    temperature = torch.tensor([0.0 if k == "greedy" else 0.7 for k in kinds])
    per_token = torch.repeat_interleave(temperature, torch.tensor(counts))
    target_logits = logits[target_idx.long()] / torch.where(per_token == 0, 1.0, per_token)[:, None]
    q = torch.softmax(target_logits + torch.randn(T, V, generator=g), -1)
    greedy_drafts = target_logits.argmax(-1)
    near = torch.rand(T, generator=g) < 0.4
    greedy_drafts[near] = target_logits.topk(2, -1).indices[near, 1]
    sampled_drafts = torch.multinomial(q, 1, generator=g).flatten()
    drafts = torch.where(per_token == 0, greedy_drafts, sampled_drafts).int()
    metadata = SimpleNamespace(target_logits_indices=target_idx, bonus_logits_indices=bonus_idx,
                               logits_indices=torch.arange(T + B).int() * 2)  # hidden rows: every other token
    sampling = SimpleNamespace(all_greedy=all(k == "greedy" for k in kinds),
                               all_random=all(k == "random" for k in kinds), temperature=temperature,
                               generators={1: torch.Generator().manual_seed(seed + 1)} if "random" in kinds[1:2] else {})
    return dict(metadata=metadata, drafts=drafts, counts=counts, target_logits=target_logits,
                draft_probs=q if draft_probs else None, bonus=torch.randint(0, V, (B, 1), generator=g),
                sampling=sampling, hidden_tokens=torch.randn(2 * (T + B), H, generator=g),
                cu=torch.tensor(counts).cumsum(0).int(), gen_seed=seed + 1)


def reseed(case):
    """The seeded requests' generators as they were before a call used them."""
    case["sampling"].generators = {i: torch.Generator().manual_seed(case["gen_seed"])
                                   for i in case["sampling"].generators}


def call(fn, case, *head):
    return fn(*head, case["drafts"], case["counts"], max(case["counts"]), case["cu"], case["draft_probs"],
              case["target_logits"].clone(), case["bonus"], case["sampling"])


def acceptance(policy, clf=None, hidden=None):
    acc = Acceptance(ServingConfig(parse_policy(policy), classifier="given" if clf is not None else None))
    acc.folded = clf
    acc.capture = SimpleNamespace(value=hidden) if hidden is not None else None
    return acc


KINDS = {"greedy": ["greedy"] * 5, "random": ["random"] * 5,
         "mixed": ["random", "random", "greedy", "random", "greedy"]}


@pytest.mark.parametrize("kinds", KINDS)
@pytest.mark.parametrize("draft_probs", [True, False], ids=["draft-probs", "no-draft-probs"])
def test_exact_rule_is_vllms_rejection_sampling(kinds, draft_probs):
    import vllm.v1.sample.rejection_sampler as rs

    case = layout(COUNTS, 11, KINDS[kinds], draft_probs)
    torch.manual_seed(0)
    want = call(rs.rejection_sample, case)
    torch.manual_seed(0)
    reseed(case)
    got = call(pad_rejection_sample, case, acceptance("exact"), case["metadata"])
    assert got.dtype == want.dtype and torch.equal(got, want), f"{got}\n{want}"


def expected_rows(case, res_greedy, res_sampled):
    """vLLM's output rows from pad's reference decisions, written out request by request."""
    rows, tok = [], 0
    for b, k in enumerate(case["counts"]):
        res = res_greedy if case["sampling"].temperature[b] == 0 else res_sampled
        n = int(res.num_accepted[b])
        nxt = int(res.next_token[b]) if n < k else int(case["bonus"][b, 0])
        row = case["drafts"][tok:tok + n].tolist() + [nxt]
        rows.append(row + [PLACEHOLDER] * (max(case["counts"]) + 1 - len(row)))
        tok += k
    return torch.tensor(rows, dtype=torch.int32)


@pytest.mark.parametrize("kinds", KINDS)
@pytest.mark.parametrize("policy", ["pivot@0.5", "threshold@0.1", "typical@0.2,0.3"])
@pytest.mark.parametrize("draft_probs", [True, False], ids=["draft-probs", "no-draft-probs"])
def test_relaxed_rules_are_pads_reference(kinds, policy, draft_probs):
    """no-draft-probs: vLLM's draft-free speculators (ngram, suffix), whose drafts count as certain."""
    case = layout(COUNTS, 23, KINDS[kinds], draft_probs)
    g = torch.Generator().manual_seed(5)
    clf = FoldedClassifier(torch.randn(H + 2, 8, generator=g) / 4, torch.randn(8, generator=g) * 0.1,
                           torch.randn(8, generator=g) / 3, torch.tensor(0.1)) if policy.startswith("pivot") else None
    acc = acceptance(policy, clf, case["hidden_tokens"] if clf is not None else None)
    torch.manual_seed(1)
    got = call(pad_rejection_sample, case, acc, case["metadata"])

    # The reference on the packed layout (bonus rows' logits unused), with the same draws re-made.
    T, B = sum(COUNTS), len(COUNTS)
    packed = torch.zeros(T + B, V)
    packed[case["metadata"].target_logits_indices.long()] = case["target_logits"]
    hidden = case["hidden_tokens"][case["metadata"].logits_indices.long()]
    p = parse_policy(policy)
    common = dict(hidden=hidden if clf is not None else None, classifier=clf, sigma=p.sigma or 0.0, floor=1e-4,
                  rule=p.rule)
    drafts = case["drafts"].long()
    greedy = verify_block_varlen_ref(packed, drafts, COUNTS, **common)
    torch.manual_seed(1)
    reseed(case)
    uniforms, exponentials = vllm_draws(COUNTS, V, case["sampling"].generators, "cpu")
    q = case["draft_probs"] if draft_probs else torch.nn.functional.one_hot(drafts, V).float()
    sampled = verify_block_varlen_ref(packed, drafts, COUNTS, temperature=1.0, draft_probs=q,
                                      uniforms=uniforms, exponentials=exponentials, **common)
    want = expected_rows(case, greedy, sampled)
    assert torch.equal(got, want), f"{got}\n{want}"
    relaxed = (greedy.pivot_accepted | sampled.pivot_accepted).any()
    assert relaxed or kinds == "greedy", "the case must relax something to test the relaxation"


def test_placeholders_end_a_requests_drafts_greedy():
    """vLLM's async scheduling pads missing drafts with -1: greedy and exact, vLLM emits the target's argmax
    at the first placeholder; so does pad (the request's own drafts end there)."""
    import vllm.v1.sample.rejection_sampler as rs

    case = layout(COUNTS, 31, KINDS["greedy"])
    case["drafts"][[1, 2, 8]] = -1  # request 0 from its 2nd draft, request 2 from its 2nd, request 4 at its 1st
    want = call(rs.rejection_sample, case)
    got = call(pad_rejection_sample, case, acceptance("exact"), case["metadata"])
    assert torch.equal(got, want), f"{got}\n{want}"


def test_placeholders_end_a_requests_drafts_sampled():
    """Sampled: the request's block ends at the placeholder, whose position's token is drawn from the target
    (pad's reference on the shortened block, with the draws vLLM made for every slot)."""
    case = layout([3, 2], 41, ["random", "random"])
    case["drafts"][1] = -1
    torch.manual_seed(2)
    got = call(pad_rejection_sample, case, acceptance("threshold@0.1"), case["metadata"])
    torch.manual_seed(2)
    reseed(case)
    uniforms, exponentials = vllm_draws([3, 2], V, case["sampling"].generators, "cpu")
    keep_rows, keep_toks = [0, 1, 4, 5, 6], [0, 3, 4]  # request 0: one own draft (rows 0, 1); request 1 whole
    packed = torch.zeros(7, V)
    packed[case["metadata"].target_logits_indices.long()] = case["target_logits"]
    res = verify_block_varlen_ref(packed[keep_rows], case["drafts"].long()[keep_toks], [1, 2], temperature=1.0,
                                  draft_probs=case["draft_probs"][keep_toks], uniforms=uniforms[keep_toks],
                                  exponentials=exponentials, rule=parse_policy("threshold@0.1").rule)
    n0, n1 = res.num_accepted.tolist()
    row0 = case["drafts"][:n0].tolist() + [int(res.next_token[0])]  # never the bonus: its drafts were cut
    row1 = case["drafts"][3:3 + n1].tolist() + [int(res.next_token[1]) if n1 < 2 else int(case["bonus"][1, 0])]
    want = torch.tensor([r + [PLACEHOLDER] * (4 - len(r)) for r in (row0, row1)], dtype=torch.int32)
    assert torch.equal(got, want), f"{got}\n{want}"


def test_compiled_backend_decides_in_vllms_environment():
    """Under vLLM's torch the wheel's C++ backend loads and is the one the plugin's op picks (CI requires it)."""
    import os

    from pad_kernels import resolve_backend

    if os.environ.get("PAD_REQUIRE_CPU_EXTENSION") == "1":
        assert resolve_backend(None, "cpu") == "cpu"
    else:
        assert resolve_backend(None, "cpu") in ("cpu", "torch")


def test_fly_refuses_a_sampled_request():
    case = layout([2, 2], 5, ["greedy", "random"])
    with pytest.raises(ValueError, match="greedy requests only"):
        call(pad_rejection_sample, case, acceptance("fly@0.3,2"), case["metadata"])


def runner_of(case, policies, generated=None, judge_free=None):
    """A stand-in for vLLM's model runner: its input batch's request ids and each request's sampling
    parameters (temperature as the case's; extra_args choosing ``policies[b]``, None: the engine's, and
    ``judge_free[b]`` when given)."""
    ids = [f"req-{b}" for b in range(len(case["counts"]))]
    judge_free = judge_free or [None] * len(ids)

    def extra_args(policy, judge):
        settings = {**({"policy": policy} if policy else {}), **({"judge_free": judge} if judge is not None else {})}
        return {"pad": settings} if settings else None

    requests = {
        rid: SimpleNamespace(
            sampling_params=SimpleNamespace(temperature=float(case["sampling"].temperature[b]),
                                            extra_args=extra_args(p, judge_free[b])),
            output_token_ids=[7] * (generated[b] if generated else 1))
        for b, (rid, p) in enumerate(zip(ids, policies))}
    return SimpleNamespace(input_batch=SimpleNamespace(req_ids=ids), requests=requests)


@pytest.mark.parametrize("kinds", KINDS)
def test_requests_with_their_own_policies_decide_as_alone(kinds):
    """A step whose requests choose different policies: each request's output row is the one a step under its
    policy alone makes (same inputs, same draws)."""
    policies = ["pivot@0.5", None, "exact", "typical@0.2,0.3", "threshold@0.1"]  # None: the engine's
    engine = "threshold@0.3"
    case = layout(COUNTS, 29, KINDS[kinds])
    g = torch.Generator().manual_seed(6)
    clf = FoldedClassifier(torch.randn(H + 2, 8, generator=g) / 4, torch.randn(8, generator=g) * 0.1,
                           torch.randn(8, generator=g) / 3, torch.tensor(0.1))
    acc = acceptance(engine, clf, case["hidden_tokens"])
    acc.runner = runner_of(case, policies)
    torch.manual_seed(3)
    reseed(case)
    got = call(pad_rejection_sample, case, acc, case["metadata"])
    alone = {}
    for p in set(policies):
        torch.manual_seed(3)
        reseed(case)
        alone[p] = call(pad_rejection_sample, case, acceptance(p or engine, clf, case["hidden_tokens"]),
                        case["metadata"])
    want = torch.stack([alone[p][b] for b, p in enumerate(policies)])
    assert torch.equal(got, want), f"{got}\n{want}"
    assert len({tuple(alone[p].flatten().tolist()) for p in alone}) > 1, "the policies must decide differently"


@pytest.mark.parametrize("kinds", KINDS)
def test_pivot_decides_a_draft_free_speculators_drafts_exactly(kinds):
    """On an engine whose speculator proposes without a draft model (ngram, suffix: no draft probabilities),
    pivot's requests take the exact rule's rows and those setting judge_free pivot's own (the classifier
    judging every draft), as pad.generate decides a lookup's drafts; other policies are untouched."""
    policies = ["pivot@0.5", "threshold@0.1", None, "exact", None]  # None: the engine's pivot
    judge_free = [False, None, True, None, None]
    case = layout(COUNTS, 35, KINDS[kinds], draft_probs=False)
    g = torch.Generator().manual_seed(8)
    clf = FoldedClassifier(torch.randn(H + 2, 8, generator=g) / 4, torch.randn(8, generator=g) * 0.1,
                           torch.randn(8, generator=g) / 3, torch.tensor(-1.0))

    def decide(policy, free, runner=None):
        acc = acceptance(policy, clf, case["hidden_tokens"])
        acc.free_drafts, acc.runner = free, runner
        torch.manual_seed(5)
        reseed(case)
        return call(pad_rejection_sample, case, acc, case["metadata"])

    alone = {p: decide(p, False) for p in ("exact", "pivot@0.5", "threshold@0.1")}
    got = decide("pivot@0.5", True, runner_of(case, policies, judge_free=judge_free))
    want = torch.stack([alone[p][b] for b, p in enumerate(["exact", "threshold@0.1", "pivot@0.5", "exact", "exact"])])
    assert torch.equal(got, want), f"{got}\n{want}"
    assert torch.equal(decide("pivot@0.5", True), alone["exact"])  # no runner: every request the engine's
    relaxed = [not torch.equal(alone["pivot@0.5"][b], alone["exact"][b]) for b in range(len(COUNTS))]
    assert relaxed[2] and (relaxed[0] or relaxed[4]), "pivot must relax the requests told apart here"


@pytest.mark.parametrize("kinds", KINDS)
def test_exact_prefix_takes_the_exact_decision_inside_it(kinds):
    """Requests with N - generated = until draft positions left to decide exactly: a request whose exact
    decision stops inside them gets the exact row, the others the relaxed row."""
    case = layout(COUNTS, 23, KINDS[kinds])
    generated = [1, 3, 2, 9, 4]
    acc = Acceptance(ServingConfig(parse_policy("threshold@0.1"), exact_prefix=5))
    acc.runner = runner_of(case, [None] * 5, generated)
    torch.manual_seed(4)
    reseed(case)
    got = call(pad_rejection_sample, case, acc, case["metadata"])
    rows = {}
    for p in ("exact", "threshold@0.1"):
        torch.manual_seed(4)
        reseed(case)
        rows[p] = call(pad_rejection_sample, case, acceptance(p), case["metadata"])
    want = []
    for b in range(len(COUNTS)):
        until = max(0, 5 - generated[b])
        n_exact = int((rows["exact"][b] != PLACEHOLDER).sum()) - 1
        want.append(rows["exact"][b] if n_exact < until else rows["threshold@0.1"][b])
    assert torch.equal(got, torch.stack(want)), f"{got}\n{torch.stack(want)}"
    assert not torch.equal(got, rows["threshold@0.1"]), "the prefix must decide some request here"


@pytest.mark.parametrize("kinds", ["greedy", "mixed"])
def test_layout_follows_from_the_draft_counts(kinds):
    """The op's rows come from num_draft_tokens alone: metadata whose target/bonus index tensors are garbage
    (they are not read) decides as vLLM's real ones do, and no row of the packed block is left unwritten."""
    case = layout(COUNTS, 43, KINDS[kinds])
    acc = acceptance("threshold@0.1")
    torch.manual_seed(6)
    reseed(case)
    want = call(pad_rejection_sample, case, acc, case["metadata"])
    garbage = SimpleNamespace(target_logits_indices=torch.full_like(case["metadata"].target_logits_indices, -7),
                              bonus_logits_indices=torch.full_like(case["metadata"].bonus_logits_indices, 10**6),
                              logits_indices=case["metadata"].logits_indices)
    torch.manual_seed(6)
    reseed(case)
    assert torch.equal(call(pad_rejection_sample, case, acc, garbage), want)


def test_vllm_033_native_fly_arguments():
    """vLLM 0.33 passes its native FLy's arguments: unset, pad decides as before; set, it refuses."""
    case = layout(COUNTS, 29, KINDS["greedy"])
    want = call(pad_rejection_sample, case, acceptance("threshold@0.1"), case["metadata"])
    got = pad_rejection_sample(acceptance("threshold@0.1"), case["metadata"], case["drafts"], case["counts"],
                               max(case["counts"]), case["cu"], None, case["target_logits"].clone(), case["bonus"],
                               case["sampling"], fly_window_size=None, fly_entropy_threshold=None,
                               fly_entropy_top_k=3)
    assert torch.equal(got, want)
    with pytest.raises(ValueError, match="native FLy"):
        pad_rejection_sample(acceptance("threshold@0.1"), case["metadata"], case["drafts"], case["counts"],
                             max(case["counts"]), case["cu"], None, case["target_logits"].clone(), case["bonus"],
                             case["sampling"], fly_window_size=2, fly_entropy_threshold=0.3, fly_entropy_top_k=3)
