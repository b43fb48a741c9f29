"""The ragged ("varlen") entry point of the op: every backend equals the per-request reference."""
import zlib

import pytest
import torch
from test_verify_backends import FLOOR, fp64_truth

from pad_kernels import (AcceptRule, FoldedClassifier, available_backends, verify_block_ref, verify_block_varlen,
                         verify_block_varlen_ref)

BACKENDS = available_backends("cpu")  # torch, the C++ backend when built, Triton through its interpreter
COUNTS = {"ragged": [3, 0, 5, 1], "uniform": [4, 4, 4], "no-drafts": [0, 0], "one": [6]}
RULES = [AcceptRule(), AcceptRule.threshold(0.2), AcceptRule.typical(), AcceptRule.fly(0.3, 2), AcceptRule.kl(0.5),
         AcceptRule.topk(3, 0.3)]
FLOATS = ("entropy", "token_prob", "pivot_prob", "top3_entropy", "divergence")


def make_packed(counts, V, H, sampling, seed):
    """Packed inputs: logits [N, V], the draft's logits [T, V] (the target's plus noise), drafts mostly the
    target's argmax (some runners-up, some random)."""
    g = torch.Generator().manual_seed(seed)
    N, T = sum(counts) + len(counts), sum(counts)
    logits = torch.randn(N, V, generator=g) * 4
    draft_rows = torch.cat([torch.arange(k) + sum(counts[:b]) + b for b, k in enumerate(counts)]).long() \
        if T else torch.zeros(0, dtype=torch.long)
    draft_logits = logits[draft_rows] + torch.randn(T, V, generator=g)
    kwargs = dict(sigma=0.5, floor=1e-4, draft_logits=draft_logits)
    if sampling:
        q = torch.softmax(draft_logits / 0.8, -1)
        drafts = torch.multinomial(q, 1, generator=g).flatten() if T else torch.zeros(0, dtype=torch.long)
        kwargs.update(temperature=0.8, draft_probs=q, uniforms=torch.rand(T, generator=g),
                      exponentials=torch.empty(len(counts), V).exponential_(generator=g))
    else:
        drafts = logits[draft_rows].argmax(-1)
        runner_up = logits[draft_rows].topk(2, -1).indices[:, 1]
        near = torch.rand(T, generator=g) < 0.3
        drafts[near] = runner_up[near]
    hidden = torch.randn(N, H, generator=g)
    D = 16
    clf = FoldedClassifier(torch.randn(H + 2, D, generator=g) / H**0.5, torch.randn(D, generator=g) * 0.1,
                           torch.randn(D, generator=g) / D**0.5, torch.tensor(0.2))
    return logits, drafts, hidden, clf, kwargs


def packed_truth(logits, drafts, counts, hidden=None, clf=None, temperature=0.0, draft_logits=None, **_):
    """The float outputs in fp64, request by request (test_verify_backends.fp64_truth), packed."""
    parts, row, tok = [], 0, 0
    for k in counts:
        block = (logits[None, row:row + k + 1], drafts[None, tok:tok + k])
        extra = (hidden[None, row:row + k + 1], clf) if clf is not None else ()
        parts.append(fp64_truth(*block, *extra, temperature=temperature, draft_logits=draft_logits[None, tok:tok + k]))
        row, tok = row + k + 1, tok + k
    return {name: torch.cat([p[name].reshape(-1) for p in parts]) for name in FLOATS}


def assert_same(got, want, truth):
    """Integers equal; floats within twice the reference's own error against fp64 (as every backend test)."""
    for name in want._fields:
        g, w = getattr(got, name), getattr(want, name)
        assert g.shape == w.shape and g.dtype == w.dtype, name
        if name in FLOATS:
            ref_err = (w.double() - truth[name]).abs().max().item() if w.numel() else 0.0
            assert ref_err <= 1e-4, f"the reference's own {name} is off the fp64 truth by {ref_err:.3g}"
            err = (g.double() - truth[name]).abs().max().item() if g.numel() else 0.0
            assert err <= 2 * ref_err + FLOOR[torch.float32][name], f"{name}: error {err:.3g}, reference's {ref_err:.3g}"
        else:
            assert torch.equal(g, w), f"{name}: {g.tolist()} != {w.tolist()}"


# fly is greedy only (refused with sampling: test_fly_refused_with_sampling).
MODES = [(sampling, rule) for sampling in (False, True) for rule in RULES if not (sampling and rule.name == "fly")]


def _cases():
    """backend x layout x mode x classifier, but Triton's interpreter (a third of a second a case) crosses each
    (mode, classifier) with the ragged layout and one other in turn (each other layout 7 or 8 times): the
    packing is the same Python for every backend, and the C++ and PyTorch backends take the full product."""
    others = [name for name in COUNTS if name != "ragged"]
    for backend in BACKENDS:
        for i, ((sampling, rule), with_classifier) in enumerate((m, c) for m in MODES for c in (False, True)):
            layouts = list(COUNTS) if backend != "triton" else ["ragged", others[i % len(others)]]
            for layout in layouts:
                yield pytest.param(backend, layout, sampling, rule, with_classifier,
                                   id=f"{'classifier' if with_classifier else 'rule'}-"
                                      f"{'sampling' if sampling else 'greedy'}-{rule.name}-{layout}-{backend}")


@pytest.mark.parametrize("backend,layout,sampling,rule,with_classifier", list(_cases()))
def test_varlen_matches_reference(backend, layout, sampling, rule, with_classifier):
    counts = COUNTS[layout]
    seed = zlib.crc32(repr((backend, layout, sampling, rule.name, with_classifier)).encode())
    logits, drafts, hidden, clf, kwargs = make_packed(counts, 203, 24, sampling, seed)
    args = (hidden, clf) if with_classifier else ()
    want = verify_block_varlen_ref(logits, drafts, counts, *args, rule=rule, **kwargs)
    got = verify_block_varlen(logits, drafts, counts, *args, rule=rule, backend=backend, **kwargs)
    assert_same(got, want, packed_truth(logits, drafts, counts, *args, **kwargs))
    assert want.num_accepted.tolist() == [int(a.sum()) for a in want.accepted.split(counts)]


def test_reference_is_each_request_alone():
    """The reference's own contract, checked by hand on two requests: packed outputs are the blocks'."""
    counts = [2, 3]
    logits, drafts, hidden, clf, kwargs = make_packed(counts, 50, 8, False, 11)
    q = kwargs.pop("draft_logits")
    got = verify_block_varlen_ref(logits, drafts, counts, hidden, clf, **kwargs, draft_logits=q)
    first = verify_block_ref(logits[None, :3], drafts[None, :2], hidden[None, :3], clf, **kwargs,
                             draft_logits=q[None, :2])
    second = verify_block_ref(logits[None, 3:], drafts[None, 2:], hidden[None, 3:], clf, **kwargs,
                              draft_logits=q[None, 2:])
    assert torch.equal(got.divergence, torch.cat([first.divergence[0], second.divergence[0]]))
    assert got.num_accepted.tolist() == [int(first.num_accepted), int(second.num_accepted)]
    assert got.next_token.tolist() == [int(first.next_token), int(second.next_token)]
    assert torch.equal(got.accepted, torch.cat([first.accepted[0], second.accepted[0]]))
    assert torch.equal(got.argmax, torch.cat([first.argmax[0], second.argmax[0]]))


def test_fly_refused_with_sampling():
    logits, drafts, _, _, kwargs = make_packed([2, 1], 30, 8, True, 3)
    with pytest.raises(ValueError, match="greedy"):
        verify_block_varlen(logits, drafts, [2, 1], rule=AcceptRule.fly(), **kwargs)


@pytest.mark.parametrize("bad", ["rows", "drafts", "negative", "hidden"])
def test_bad_layout_raises(bad):
    counts = [2, 1]
    logits, drafts, hidden, clf, _ = make_packed(counts, 30, 8, False, 5)
    args = dict(rows=(logits[:-1], drafts, counts), drafts=(logits, drafts[:-1], counts),
                negative=(logits, drafts, [4, -1]), hidden=(logits, drafts, counts, hidden[:-1], clf))[bad]
    with pytest.raises(ValueError):
        verify_block_varlen(*args)


def test_empty_batch():
    res = verify_block_varlen(torch.zeros(0, 7), torch.zeros(0, dtype=torch.long), [])
    assert res.num_accepted.shape == (0,) and res.entropy.shape == (0,)
