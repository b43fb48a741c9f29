"""Every fused backend matches the pure-PyTorch reference on fresh random inputs.

Integer outputs (argmax, accept masks, accepted count, next token) must equal the reference's. Float
outputs follow flash-attention's rule: against an fp64 computation from the same inputs, a backend's
error is at most twice the reference's own error plus a floor of a few fp32 ulps (table below; all
backends accumulate in fp32 whatever the logits' dtype, so the floor is the same for every dtype).
Outputs are poisoned before the backend runs, so an element it forgets to write fails the comparison.
"""
import os
import zlib

import pytest
import torch

from pad_kernels import AcceptRule, FoldedClassifier, available_backends, verify_block_ref
from pad_kernels.types import empty_result, pack_row_rules

FUSED = [b for b in available_backends("cpu") if b != "torch"]
# The CUDA backend's kernels simulated on the CPU, block by block (pad_kernels.cuda.emulate_cuda): no GPU
# here, so this is how its slices, trees and arithmetic meet the reference. Slices as planned for an H100.
KERNELS = FUSED + (["cuda-emulated"] if "cpu" in FUSED else [])
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# Absolute error floor per output and dtype of the logits (entropies reach ln V ~ 12: 1e-5 is ~10 ulps).
# The divergence, a difference of log-sum-exps of ~10, gets the entropy's floor.
FLOOR = {dtype: {"entropy": 1e-5, "token_prob": 1e-7, "pivot_prob": 1e-6, "top3_entropy": 1e-5, "divergence": 1e-5}
         for dtype in DTYPES}
POISON = {torch.float32: float("nan"), torch.int64: -7, torch.bool: True}


def run_backend(backend, *args, **kwargs):
    if backend == "cpu":
        from pad_kernels.cpu import verify_block_cpu as impl
    elif backend == "triton":
        from pad_kernels.triton.verify_block import verify_block_triton as impl
    elif backend == "cuda-emulated":
        from pad_kernels.cuda import emulate_cuda as impl
    else:
        raise AssertionError(backend)
    B, K = args[1].shape  # draft_tokens: target_logits may be [R, V] (logit_rows)
    out = empty_result(B, K, args[0].device)
    for t in out:
        t.fill_(POISON[t.dtype])
    result = impl(*args, **kwargs, out=out)
    assert all(a is b for a, b in zip(result, out)), "the backend must write into the given outputs"
    return result


def make_case(B, K, V, H, dtype, sampling, seed, draft_logits=False):
    """Fresh inputs; ``draft_logits``: also the draft's logits (the target's plus noise), from which the
    sampling draft distribution then comes."""
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(B, K + 1, V, generator=g) * 4).to(dtype)
    if V > 2:
        logits[0, 0, 1] = float("-inf")  # masked tokens appear in real decoding (top-p)
    kwargs = dict(sigma=0.5, floor=1e-4)
    draft = (logits[:, :K].float() + torch.randn(B, K, V, generator=g)).to(dtype)
    if draft_logits:
        kwargs.update(draft_logits=draft)
    if sampling:
        draft_probs = torch.softmax(draft.float() / (0.8 if draft_logits else 1.0), -1)
        draft_tokens = torch.multinomial(draft_probs.reshape(B * K, V), 1, generator=g).reshape(B, K)
        kwargs.update(temperature=0.8, draft_probs=draft_probs, uniforms=torch.rand(B, K, generator=g),
                      exponentials=torch.empty(B, V).exponential_(generator=g))
    else:
        # Mostly the target's own choices, so that blocks accept a few tokens before a rejection.
        # The others: the target's second or third choice (plausible tokens the relaxed rules may accept), or
        # any token.
        draft_tokens = logits[:, :K].float().argmax(-1)
        runner_up = logits[:, :K].float().topk(min(3, V), -1).indices[..., -1]
        near = torch.rand(B, K, generator=g) < 0.25
        draft_tokens[near] = runner_up[near]
        noise = torch.rand(B, K, generator=g) < 0.15
        draft_tokens[noise] = torch.randint(0, V, (int(noise.sum()),), generator=g)
    hidden = (torch.randn(B, K + 1, H, generator=g) * 2).to(dtype)
    D = 128
    clf = FoldedClassifier(torch.randn(H + 2, D, generator=g) / H**0.5, torch.randn(D, generator=g) * 0.1,
                           torch.randn(D, generator=g) / D**0.5, torch.tensor(0.2))
    return (logits, draft_tokens, hidden, clf), kwargs


def fp64_truth(logits, draft_tokens, hidden=None, clf=None, *, temperature=0.0, draft_logits=None,
               classifier_bias=None, **_):
    """entropy, token_prob, pivot_prob, top3_entropy and divergence computed in fp64 from the same inputs."""
    K = draft_tokens.shape[1]
    scale = temperature if temperature > 0 else 1.0
    x = logits.double() / scale
    logp = torch.log_softmax(x, -1)
    p = logp.exp()
    entropy = -torch.where(p > 0, p * logp, 0.0).sum(-1)
    top = logp.topk(min(3, logp.shape[-1]), -1).values
    top3 = -torch.where(top > float("-inf"), top.exp() * top, 0.0).sum(-1)
    token_prob = p[:, :K].gather(-1, draft_tokens[..., None]).squeeze(-1)
    if draft_logits is None:
        divergence = torch.full_like(token_prob, -1.0)
    else:
        logq = torch.log_softmax(draft_logits.double() / scale, -1)
        divergence = torch.where(p[:, :K] > 0, p[:, :K] * (logp[:, :K] - logq), 0.0).sum(-1)
    truth = {"entropy": entropy, "token_prob": token_prob, "pivot_prob": torch.ones_like(token_prob),
             "top3_entropy": top3, "divergence": divergence}
    if clf is not None:
        feats = torch.cat([hidden[:, :K].double(), token_prob[..., None], entropy[:, :K, None]], -1)
        w1, b1, w2, b2 = (t.double() for t in clf)
        first = feats @ w1 + b1 + (classifier_bias.double() if classifier_bias is not None else 0.0)
        truth["pivot_prob"] = torch.sigmoid(torch.relu(first) @ w2 + b2)
    return truth


def assert_matches(got, expected, truth, dtype):
    for name, g, e in zip(expected._fields, got, expected):
        assert g.shape == e.shape and g.dtype == e.dtype, name
        if e.is_floating_point():
            t = truth[name]
            assert torch.isfinite(g).all(), f"{name} has non-finite or unwritten elements"
            ref_err = (e.double() - t).abs().max().item()
            assert ref_err <= 1e-4, f"the reference's own {name} is off the fp64 truth by {ref_err:.3g}"
            err = (g.double() - t).abs().max().item()
            assert err <= 2 * ref_err + FLOOR[dtype][name], f"{name}: error {err:.3g}, reference's {ref_err:.3g}"
        else:
            assert torch.equal(g, e), f"{name}: {g.tolist()} != {e.tolist()}"


SHAPES = [(B, H, K, V) for B, H in ((1, 64), (3, 896)) for K in (1, 4, 10) for V in (1271, 32000, 151936)]


def tier(backend, V):
    """The slow tier takes the large vocabularies of the simulated kernels (the Triton interpreter, the
    CUDA kernels emulated block by block): their small shapes keep every backend in the fast tier."""
    return [pytest.mark.slow] if backend in ("triton", "cuda-emulated") and V >= 32000 else []
# The Triton interpreter runs a kernel as numpy code, about a second per program over 151936 logits: it gets a
# covering subset instead of the full product. Its kernels read the vocabulary in chunks of 1024 logits, masked
# at the tail, so V = 1271 (a full chunk and a tail) takes every path that a larger V takes: per dtype one shape
# at V = 1271 (together every K and both (B, H)), and one full-vocabulary case per path (greedy, sampling) in
# the slow tier (TRITON_FULL_VOCABULARY).
TRITON_SHAPES = {
    torch.float32: [(1, 64, 1, 1271)],
    torch.bfloat16: [(3, 896, 10, 1271)],
    torch.float16: [(1, 64, 4, 1271)],
}
TRITON_FULL_VOCABULARY = {False: (torch.float32, (1, 64, 10, 151936)), True: (torch.bfloat16, (3, 896, 4, 151936))}


def _shapes(backend, sampling, dtype):
    if backend != "triton":
        return SHAPES
    full_dtype, full_shape = TRITON_FULL_VOCABULARY[sampling]
    return TRITON_SHAPES[dtype] + ([full_shape] if dtype == full_dtype else [])


def _cases():
    for backend in KERNELS:
        for sampling in (False, True):
            for dtype in DTYPES:
                for shape in _shapes(backend, sampling, dtype):
                    yield pytest.param(backend, sampling, dtype, *shape, marks=tier(backend, shape[3]),
                                       id=f"{backend}-{'sampling' if sampling else 'greedy'}-{dtype}-B{shape[0]}"
                                          f"-H{shape[1]}-K{shape[2]}-V{shape[3]}")


@pytest.mark.parametrize("backend,sampling,dtype,B,H,K,V", list(_cases()))
def test_backend_matches_reference(backend, sampling, dtype, B, H, K, V):
    seed = zlib.crc32(repr((sampling, dtype, V, K, B, H)).encode())
    args, kwargs = make_case(B, K, V, H, dtype, sampling, seed)
    expected = verify_block_ref(*args, **kwargs)
    assert_matches(run_backend(backend, *args, **kwargs), expected, fp64_truth(*args, **kwargs), dtype)
    # Without a classifier there is no override and pivot_prob is 1.
    expected = verify_block_ref(args[0], args[1], **kwargs)
    got = run_backend(backend, args[0], args[1], **kwargs)
    assert_matches(got, expected, fp64_truth(args[0], args[1], **kwargs), dtype)


@pytest.mark.parametrize("backend", KERNELS)
def test_non_finite_logits_give_non_finite_entropy(backend):
    logits = torch.randn(1, 4, 300)
    logits[0, 1, 17] = float("nan")
    logits[0, 2, 5] = float("inf")
    logits[0, 3] = float("-inf")
    out = run_backend(backend, logits, torch.zeros(1, 3, dtype=torch.long))
    assert torch.isfinite(out.entropy[0, 0]) and not torch.isfinite(out.entropy[0, 1:]).any()


def test_cpu_extension_is_built():
    """CI sets PAD_REQUIRE_CPU_EXTENSION=1: there the compiled CPU backend must load, no silent fallback."""
    from pad_kernels import cpu

    if os.environ.get("PAD_REQUIRE_CPU_EXTENSION") == "1":
        assert cpu.available(), "pad_kernels._cpu did not load"
        assert available_backends("cpu")[0] == "cpu"
    else:
        assert ("cpu" in available_backends("cpu")) == cpu.available()


@pytest.mark.parametrize("backend", [pytest.param(b, marks=[pytest.mark.slow] if b == "triton" else []) for b in FUSED])
@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_generate_is_token_identical_with_every_backend(backend, temperature):
    import pad
    from test_generate_pivot import _classifier
    from tiny import tiny_pair

    target, draft = tiny_pair("qwen2", scale=0.3)
    clf = _classifier(target, 2)
    for seed in range(6):
        prompt = torch.randint(0, 96, (1, 5), generator=torch.Generator().manual_seed(seed))
        for policy in ("exact", "pivot", "target"):
            kwargs = dict(policy=policy, classifier=clf if policy == "pivot" else None, num_draft_tokens=4,
                          max_new_tokens=20, temperature=temperature, seed=seed)
            expected = pad.generate(target, draft, prompt, backend="torch", **kwargs)
            got = pad.generate(target, draft, prompt, backend=backend, **kwargs)
            assert torch.equal(got.sequences, expected.sequences), (policy, seed)
            assert got.stats.accepted == expected.stats.accepted
            assert got.stats.relaxed_accepted == expected.stats.relaxed_accepted


@pytest.mark.parametrize("backend", [pytest.param(b, marks=[pytest.mark.slow] if b == "triton" else [])
                                     for b in available_backends("cpu")])
@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_registered_op_passes_opcheck(backend, temperature):
    """torch.ops.pad_kernels.verify_block: schema, fake (meta) implementation and dispatch are consistent.
    The op's registration does not depend on the backend argument: Triton (7 s a case in its interpreter) is
    in the slow tier; Triton's hand-made cases (test_verify_cases.py) call it through this op in the fast one."""
    from pad_kernels.verify import verify_block_op

    args, kwargs = make_case(2, 3, 50, 16, torch.float32, temperature > 0, seed=3, draft_logits=True)
    logits, drafts, hidden, clf = args
    draws = [kwargs.get(k) for k in ("draft_probs", "uniforms", "exponentials")]
    row_rules = pack_row_rules([AcceptRule.topk(2, 0.1), AcceptRule.threshold(0.2)], [0.0, 0.5], [0, 2],
                               [temperature > 0, False])
    bias = torch.randn(2, 3, clf.w1.shape[1], generator=torch.Generator().manual_seed(4))
    for rule, num_drafts, draft_logits, rows, c in ((AcceptRule(), None, None, None, None),
                                                    (AcceptRule.typical(), torch.tensor([3, 1]), None, None, bias),
                                                    (AcceptRule.threshold(0.2), None, None, row_rules, bias),
                                                    (AcceptRule.kl(0.5), None, kwargs["draft_logits"], None, None),
                                                    (AcceptRule.topk(2, 0.1), torch.tensor([3, 1]), None, None, None)):
        torch.library.opcheck(verify_block_op, (logits, drafts, hidden, *clf, c, 0.5, 1e-4, temperature, *draws,
                                                rule.code, rule.a, rule.b, num_drafts, draft_logits, rows, None,
                                                backend))
    # Logits read by row index: [R, V], rows in another order (every position has one: opcheck compares
    # outputs without equal_nan, and a position without a row has NaN statistics).
    flat = logits.reshape(-1, logits.shape[-1])
    logit_rows = torch.tensor([[7, 6, 5, 4], [3, 2, 1, 0]])
    flat_draws = [flat.softmax(-1) if temperature > 0 else None, *draws[1:]]
    torch.library.opcheck(verify_block_op, (flat, drafts, hidden, *clf, bias, 0.5, 1e-4, temperature, *flat_draws, 0,
                                            0.0, 0.0, None, None, row_rules, logit_rows, backend))


@pytest.mark.parametrize("backend", ["torch", *FUSED])
def test_draft_ids_out_of_range_raise_the_same_error(backend):
    from pad_kernels import verify_block

    logits = torch.randn(2, 4, 50)
    for bad in (50, 51, -1):
        drafts = torch.tensor([[1, 2, 3], [4, bad, 6]])
        with pytest.raises(ValueError, match=r"draft_tokens must lie in \[0, 50\)"):
            verify_block(logits, drafts, backend=backend)


@pytest.mark.parametrize("sampling", [False, True])
@pytest.mark.parametrize("backend", KERNELS)
def test_kernels_read_nothing_for_draft_ids_out_of_range(backend, sampling):
    """Called below the host check (as on GPU tensors, where that check would sync), a kernel reads no
    memory for an id outside [0, V): its p is NaN and the row stops there, as in the reference."""
    B, K, V, H = 3, 4, 1271, 16
    (logits, drafts, hidden, clf), kwargs = make_case(B, K, V, H, torch.float32, sampling, seed=11)
    drafts[:, :2] = logits[:, :2].argmax(-1)  # two accepted tokens, then an id out of range
    if sampling:
        kwargs["uniforms"][:, :2] = 0.0
    drafts[0, 2], drafts[1, 2], drafts[2, 2] = V, -1, 1 << 40
    want = verify_block_ref(logits, drafts, hidden, clf, **kwargs)
    got = run_backend(backend, logits, drafts, hidden, clf, **kwargs)
    assert torch.isnan(want.token_prob[:, 2]).all() and torch.isnan(got.token_prob[:, 2]).all()
    assert (got.num_accepted == 2).all() and torch.equal(got.num_accepted, want.num_accepted)
    for name in ("accepted", "pivot_accepted", "next_token", "argmax"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    torch.testing.assert_close(got.token_prob, want.token_prob, equal_nan=True, rtol=1e-5, atol=1e-7)


# Each rule at a setting that accepts some mismatches and rejects others on these inputs, and at one
# that equals the exact rule.
RULE_SETTINGS = [AcceptRule.typical(), AcceptRule.typical(0.3, 0.05), AcceptRule.threshold(0.05),
                 AcceptRule.fly(0.3, 3), AcceptRule.fly(0.05, 1), AcceptRule.kl(0.5), AcceptRule.kl(2.0, 0.6),
                 AcceptRule.topk(3, 0.3), AcceptRule.topk(8, 1.0)]
EXACT_SETTINGS = [AcceptRule.typical(1.0, float("inf")), AcceptRule.threshold(1.0), AcceptRule.fly(float("inf"), 6),
                  AcceptRule.kl(float("inf"), 0.0), AcceptRule.topk(0, 1.0), AcceptRule.topk(1, 1.0)]
# One shape per dtype. The C++ backend reads the vocabulary in chunks of 2048 logits: V = 4480 takes the path of
# V = 151936 (whole chunks, then a last one of 384 logits, whole vectors), which RULE_FULL_VOCABULARY keeps for
# one rule per path (greedy, sampling) and backend.
RULE_SHAPES = [(1, 64, 10, 1271), (3, 896, 4, 32000), (3, 64, 10, 4480)]
RULE_FULL_VOCABULARY = [(AcceptRule.kl(0.5), False, torch.float16, (3, 64, 10, 151936)),
                        (AcceptRule.topk(3, 0.3), True, torch.float16, (3, 64, 10, 151936))]
# Triton (its interpreter): every rule at V = 1271 (a chunk of 1024 and a tail) in fp32, in bf16 in the slow
# tier, and one rule at the full vocabulary (the divergence and the rank are summed over V on every rule here).
TRITON_RULE_SHAPES = [(torch.float32, (1, 64, 10, 1271), []), (torch.bfloat16, (3, 896, 4, 1271), [pytest.mark.slow])]
TRITON_RULE_FULL_VOCABULARY = [(AcceptRule.topk(3, 0.3), False, torch.float32, (1, 64, 4, 151936))]


def _rule_cases():
    def param(backend, rule, sampling, dtype, shape, marks):
        return pytest.param(backend, rule, sampling, dtype, *shape, marks=marks,
                            id=f"{backend}-{rule.name}@{rule.a:g},{rule.b:g}-"
                               f"{'sampling' if sampling else 'greedy'}-{dtype}-B{shape[0]}-K{shape[2]}-V{shape[3]}")

    for backend in KERNELS:
        for rule in RULE_SETTINGS:
            for sampling in (False, True) if rule.name != "fly" else (False,):
                if backend == "triton":
                    for dtype, shape, marks in TRITON_RULE_SHAPES:
                        yield param(backend, rule, sampling, dtype, shape, marks)
                else:
                    for dtype, shape in zip(DTYPES, RULE_SHAPES):
                        yield param(backend, rule, sampling, dtype, shape, tier(backend, shape[3]))
        for rule, sampling, dtype, shape in TRITON_RULE_FULL_VOCABULARY if backend == "triton" else RULE_FULL_VOCABULARY:
            yield param(backend, rule, sampling, dtype, shape, tier(backend, shape[3]))


@pytest.mark.parametrize("backend,rule,sampling,dtype,B,H,K,V", list(_rule_cases()))
def test_rules_match_reference(backend, rule, sampling, dtype, B, H, K, V):
    seed = zlib.crc32(repr((rule, sampling, dtype, V, K, B)).encode())
    args, kwargs = make_case(B, K, V, H, dtype, sampling, seed, draft_logits=True)  # the divergence on every rule
    logits, drafts = args[:2]
    expected = verify_block_ref(logits, drafts, **kwargs, rule=rule)
    assert_matches(run_backend(backend, logits, drafts, **kwargs, rule=rule), expected,
                   fp64_truth(logits, drafts, **kwargs), dtype)
    # With the classifier too: a token is accepted when the exact rule, the classifier or the rule says so.
    expected = verify_block_ref(*args, **kwargs, rule=rule)
    assert_matches(run_backend(backend, *args, **kwargs, rule=rule), expected, fp64_truth(*args, **kwargs), dtype)


def test_rule_cases_accept_beyond_exact():
    """The random cases above exercise the rules: each setting relaxes some positions the exact rule rejects."""
    for rule in RULE_SETTINGS:
        args, kwargs = make_case(3, 10, 1271, 64, torch.float32, False, seed=5, draft_logits=True)
        relaxed = verify_block_ref(args[0], args[1], **kwargs, rule=rule)
        exact = verify_block_ref(args[0], args[1], **kwargs)
        assert relaxed.pivot_accepted.any() and (relaxed.num_accepted > exact.num_accepted).any(), rule


# Settings that equal exact when sampling too: kl with top1 0 and topk with k 0 never relax.
EXACT_SAMPLING_SETTINGS = [AcceptRule.typical(1.0, float("inf")), AcceptRule.kl(float("inf"), 0.0),
                           AcceptRule.topk(0, 1.0)]


@pytest.mark.parametrize("backend", ["torch", *FUSED])
@pytest.mark.parametrize("rule,sampling",
                         [(r, False) for r in EXACT_SETTINGS] + [(r, True) for r in EXACT_SAMPLING_SETTINGS],
                         ids=lambda v: f"{v.name}@{v.a:g},{v.b:g}" if isinstance(v, AcceptRule) else str(v))
def test_each_rule_has_a_setting_that_equals_exact(backend, rule, sampling):
    """Three seeds of three rows; Triton's interpreter (half a second a call) one seed."""
    from pad_kernels import verify_block

    for seed in range(1 if backend == "triton" else 3):
        args, kwargs = make_case(3, 6, 1271, 64, torch.float32, sampling, seed=seed, draft_logits=True)
        logits, drafts = args[:2]
        if not sampling:
            drafts[:, 1] = (drafts[:, 1] + 1) % 1271  # a sure mismatch in every row
        draws = {k: kwargs[k] for k in ("temperature", "draft_probs", "uniforms", "exponentials") if k in kwargs}
        exact = verify_block(logits, drafts, backend=backend, **draws)
        got = verify_block(logits, drafts, rule=rule, backend=backend, draft_logits=kwargs["draft_logits"], **draws)
        assert (exact.num_accepted < 6).any(), "every row must hold a rejection for the test to mean something"
        for name in ("accepted", "pivot_accepted", "num_accepted", "next_token"):
            assert torch.equal(getattr(got, name), getattr(exact, name)), (rule, name)


@pytest.mark.parametrize("backend", KERNELS)
@pytest.mark.parametrize("rule,sampling", [(AcceptRule(), False), (AcceptRule(), True), (AcceptRule.fly(0.05, 2), False),
                                           (AcceptRule.typical(0.3, 0.05), True)], ids=lambda v: str(v))
def test_rows_with_their_own_draft_lengths_match_reference(backend, rule, sampling):
    """num_drafts (draft_stop): every length from 0 to K, the classifier on, outputs poisoned."""
    B, K, V, H = 6, 5, 1271, 64
    args, kwargs = make_case(B, K, V, H, torch.float32, sampling, seed=31 + sampling)
    if sampling:
        kwargs["uniforms"][:, :3] = 0.0  # long accepted prefixes, so that the lengths cut them
    num_drafts = torch.tensor([0, 1, 2, 3, 4, 5])
    expected = verify_block_ref(*args, **kwargs, rule=rule, num_drafts=num_drafts)
    assert (expected.num_accepted <= num_drafts).all() and (expected.num_accepted == num_drafts).any()
    got = run_backend(backend, *args, **kwargs, rule=rule, num_drafts=num_drafts)
    assert_matches(got, expected, fp64_truth(*args, **kwargs), torch.float32)


@pytest.mark.parametrize("backend", KERNELS)
@pytest.mark.parametrize("dtype,sampling,B,K", [(torch.float32, False, 2, 20), (torch.bfloat16, True, 3, 5)],
                         ids=["fp32-greedy-K20", "bf16-sampling-K5"])
def test_classifier_bias_matches_reference(backend, dtype, sampling, B, K):
    """classifier_bias [B, K, D], each draft position's addition to the classifier's first layer, against the
    fp64 truth: K = 20 spans two of the kernels' tiles of 16 positions, rows have their own draft lengths,
    and the bias moves decisions (so a backend that dropped or misplaced it would fail)."""
    V, H = 1271, 64
    args, kwargs = make_case(B, K, V, H, dtype, sampling, seed=zlib.crc32(repr((dtype, K, "bias")).encode()))
    D = args[3].w1.shape[1]
    # Noise, plus a push along w2's signs: down (fewer pivots) in even rows, up in odd ones.
    push = torch.tensor([-3.0, 3.0]).repeat(B)[:B, None, None] * args[3].w2.sign()
    kwargs.update(classifier_bias=torch.randn(B, K, D, generator=torch.Generator().manual_seed(K)) + push,
                  num_drafts=torch.arange(K, K - B, -1), floor=0.0)
    expected = verify_block_ref(*args, **kwargs)
    without = verify_block_ref(*args, **{k: v for k, v in kwargs.items() if k != "classifier_bias"})
    assert (expected.pivot_prob - without.pivot_prob).abs().max() > 0.1
    assert not torch.equal(expected.pivot_accepted, without.pivot_accepted)
    assert_matches(run_backend(backend, *args, **kwargs), expected, fp64_truth(*args, **kwargs), dtype)
    # A bias of zeros is the classifier alone.
    zero = dict(kwargs, classifier_bias=torch.zeros(B, K, D))
    assert_matches(run_backend(backend, *args, **zero), without, fp64_truth(*args, **zero), dtype)


# Backends that cut the vocabulary into slices per position (flash-decoding's split) and merge them.
SPLIT = [b for b in KERNELS if b in ("triton", "cuda-emulated")]


def _split_params(backend_splits):
    """Triton's interpreter at 64 slices (a second per case) goes to the slow tier."""
    return [pytest.param(b, s, marks=[pytest.mark.slow] if b == "triton" and s == 64 else [], id=f"{s}-{b}")
            for b, s in backend_splits]


SPLIT_RULES = [AcceptRule.typical(0.3, 0.05), AcceptRule.kl(0.5), AcceptRule.topk(3, 0.3)]


def _rule_split_cases():
    """Every rule x sampling x S; Triton's interpreter (about a second a case) has one S of 1, 2 and 7 per
    (rule, sampling) in turn in the fast tier (each S twice), the other S in the slow tier."""
    for b in SPLIT:
        for r, rule in enumerate(SPLIT_RULES):
            for sampling in (False, True):
                for splits in (1, 2, 7, 64):
                    slow = b == "triton" and splits != (1, 2, 7)[(r + sampling) % 3]
                    yield pytest.param(b, splits, sampling, rule, marks=[pytest.mark.slow] if slow else [],
                                       id=f"{rule.name}-{sampling}-{splits}-{b}")


@pytest.mark.parametrize("backend,splits,sampling,rule", list(_rule_split_cases()))
def test_vocabulary_splits_match_reference(backend, splits, sampling, rule):
    """Fresh inputs, outputs poisoned, the classifier and a relaxed rule on, for S slices per position; the
    draft's logits too (the divergence's and the rank's parts are merged across slices)."""
    B, K, V, H = 2, 4, 3000, 64
    args, kwargs = make_case(B, K, V, H, torch.bfloat16, sampling, draft_logits=True,
                             seed=zlib.crc32(repr((splits, sampling, rule)).encode()))
    expected = verify_block_ref(*args, **kwargs, rule=rule)
    got = run_backend(backend, *args, **kwargs, rule=rule, splits=splits)
    assert_matches(got, expected, fp64_truth(*args, **kwargs), torch.bfloat16)


@pytest.mark.parametrize("backend,splits", _split_params([(b, s) for b in SPLIT for s in (2, 7, 64)]))
def test_vocabulary_split_boundaries(backend, splits):
    """Slices holding only -inf logits, maxima tied across a slice boundary (the lowest index wins) and
    draft tokens at a slice's first and last index."""
    from pad_kernels.splits import split_plan

    V, K = 700, 4
    S, L = split_plan(K + 1, V, None, splits)
    assert S == splits and L * (S - 1) < V <= L * S
    g = torch.Generator().manual_seed(100 + splits)
    logits = torch.randn(1, K + 1, V, generator=g)
    logits[0, 0, :] = float("-inf")
    logits[0, 0, V - 1] = 2.0  # position 0: every slice but the last holds only -inf
    logits[0, 1, :L] = float("-inf")  # position 1: the first slice is all -inf, ...
    logits[0, 1, [L, 2 * L - 1]] = 9.0  # ... and the second slice's first and last logits tie for the max
    logits[0, 2, [L - 1, L]] = 9.0  # position 2: a tie across the first boundary
    logits[0, 3, [L - 1, V - 1]] = 9.0  # position 3: a tie between the first and the last slice
    logits[0, 4, :] = 0.0  # position 4 (the bonus): every logit ties
    drafts = torch.tensor([[V - 1, L, L - 1, 2 * L - 1]])  # a slice's last, first, last, last index
    expected = verify_block_ref(logits, drafts)
    assert expected.argmax.tolist() == [[V - 1, L, L - 1, L - 1, 0]]
    got = run_backend(backend, logits, drafts)
    assert_matches(got, expected, fp64_truth(logits, drafts), torch.float32)
    got = run_backend(backend, logits, drafts, splits=splits)
    assert_matches(got, expected, fp64_truth(logits, drafts), torch.float32)


def _split_cases():
    """Every shape of the backend tests above, every dtype, greedy and sampling in turn: the CUDA kernels
    (emulated) with S in {1, 2, 7, 64} each at V = 1271 and one S in turn at V >= 32000 (every V with the
    slices planned for an H100 is test_backend_matches_reference); Triton's covering subset with one S each, in
    turn (its interpreter runs about 20 ms per program: every S on every shape would add 7 minutes; every S on
    one shape is ``test_vocabulary_splits_match_reference``, and S = 1 is Triton's default on a CPU, tested
    above), and one sampled case at the full vocabulary (slices of 2374 logits: whole chunks and a tail each)."""
    def param(backend, splits, sampling, dtype, shape):
        return pytest.param(backend, splits, sampling, dtype, *shape, marks=tier(backend, shape[3]),
                            id=f"{backend}-S{splits}-{'sampling' if sampling else 'greedy'}-{dtype}"
                               f"-B{shape[0]}-H{shape[1]}-K{shape[2]}-V{shape[3]}")

    for backend in SPLIT:
        for d, dtype in enumerate(DTYPES):
            for n, shape in enumerate(SHAPES if backend != "triton" else TRITON_SHAPES[dtype]):
                if backend == "triton":
                    every = [[2, 7, 64][(n + d) % 3]]
                elif shape[3] >= 32000:  # the emulated kernels' slow tier: one S per large shape, in turn
                    every = [[1, 2, 7, 64][(n + d) % 4]]
                else:
                    every = [1, 2, 7, 64]
                for m, splits in enumerate(every):
                    yield param(backend, splits, (n + m + d) % 2 == 1, dtype, shape)
        if backend == "triton":
            yield param(backend, 64, True, torch.float16, (1, 64, 1, 151936))


@pytest.mark.parametrize("backend,splits,sampling,dtype,B,H,K,V", list(_split_cases()))
def test_every_shape_matches_reference_with_splits(backend, splits, sampling, dtype, B, H, K, V):
    """The backend tests' shapes with the vocabulary cut into S slices (fresh inputs, outputs poisoned)."""
    seed = zlib.crc32(repr(("splits", splits, sampling, dtype, V, K, B, H)).encode())
    args, kwargs = make_case(B, K, V, H, dtype, sampling, seed)
    expected = verify_block_ref(*args, **kwargs)
    assert_matches(run_backend(backend, *args, **kwargs, splits=splits), expected, fp64_truth(*args, **kwargs), dtype)
