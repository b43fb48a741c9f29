"""Caller-owned outputs of verify_block (``out=``, ``Workspace``): written in place, checked, reused by the
decode loop, and the out-variant op is consistent under opcheck and torch.compile(fullgraph=True)."""
import importlib

import pytest
import torch

import pad
from pad_kernels import AcceptRule, VerifyResult, Workspace, available_backends, verify_block
from pad_kernels.types import empty_result
from test_verify_backends import POISON, make_case
from tiny import tiny_pair

BACKENDS = available_backends("cpu")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("sampling", [False, True])
def test_out_and_workspace_equal_fresh_outputs(backend, sampling):
    ws = Workspace(4, 6, "cpu")
    for seed, (B, K) in enumerate(((4, 6), (2, 6), (3, 2), (4, 0))):
        args, kwargs = make_case(B, K, 300, 16, torch.float32, sampling, seed=seed + 10 * sampling)
        kwargs["rule"] = AcceptRule.typical(0.3, 0.05)
        want = verify_block(*args, **kwargs, backend=backend)
        for t in ws.buffers:
            t.fill_(POISON[t.dtype])
        got = verify_block(*args, **kwargs, backend=backend, out=ws)
        assert all(torch.equal(g, w) for g, w in zip(got, want)), (B, K)
        # No new memory (an empty output, K = 0, has no address to compare).
        assert all(g.data_ptr() == buf.data_ptr() for g, buf in zip(got, ws.buffers) if g.numel())
        mine = empty_result(B, K, "cpu")
        for t in mine:
            t.fill_(POISON[t.dtype])
        got = verify_block(*args, **kwargs, backend=backend, out=mine)
        assert all(g is m for g, m in zip(got, mine)) and all(torch.equal(g, w) for g, w in zip(got, want))


def test_bad_outputs_are_refused():
    args, kwargs = make_case(2, 3, 50, 16, torch.float32, False, seed=1)
    with pytest.raises(ValueError, match="cannot hold"):
        verify_block(*args, **kwargs, out=Workspace(1, 3, "cpu"))
    wrong = empty_result(2, 3, "cpu")._replace(argmax=torch.empty(2, 4, dtype=torch.int32))
    with pytest.raises(ValueError, match="out.argmax"):
        verify_block(*args, **kwargs, out=wrong)
    strided = empty_result(2, 3, "cpu")._replace(token_prob=torch.empty(3, 2).t())
    with pytest.raises(ValueError, match="out.token_prob"):
        verify_block(*args, **kwargs, out=strided)
    with pytest.raises(TypeError, match="VerifyResult or Workspace"):
        verify_block(*args, **kwargs, out=list(empty_result(2, 3, "cpu")))


@pytest.mark.parametrize("backend", BACKENDS)
def test_out_op_passes_opcheck(backend):
    from pad_kernels.verify import verify_block_out_op

    args, kwargs = make_case(2, 3, 50, 16, torch.float32, True, seed=3, draft_logits=True)
    logits, drafts, hidden, clf = args
    draws = [kwargs[k] for k in ("draft_probs", "uniforms", "exponentials")]
    bias = torch.randn(2, 3, clf.w1.shape[1], generator=torch.Generator().manual_seed(4))
    for rule, c in ((AcceptRule.threshold(0.2), None), (AcceptRule.kl(0.5), bias)):
        torch.library.opcheck(verify_block_out_op, (logits, drafts, hidden, *clf, c, 0.5, 1e-4, 0.8, *draws, rule.code,
                                                    rule.a, rule.b, torch.tensor([3, 1]), kwargs["draft_logits"],
                                                    None, None, backend, *empty_result(2, 3, "cpu")))


@pytest.mark.parametrize("backend", BACKENDS)
def test_compiled_with_fullgraph_equals_eager(backend):
    """The op traces as one node (its fake implementation) under torch.compile(fullgraph=True), with and
    without caller-owned outputs."""
    args, kwargs = make_case(3, 4, 200, 16, torch.float32, False, seed=5)
    logits, drafts, hidden, clf = args
    ws = Workspace(3, 4, "cpu")

    def step(x, d, h, out):
        r = verify_block(x, d, h, clf, sigma=0.5, floor=1e-4, backend=backend, out=out)
        return r.num_accepted + 1, r.entropy.sum()

    compiled = torch.compile(step, fullgraph=True, backend="eager")
    want = step(logits, drafts, hidden, None)
    for out in (None, ws):
        got = compiled(logits, drafts, hidden, out)
        assert torch.equal(got[0], want[0]) and torch.allclose(got[1], want[1])


def test_decode_loop_reuses_one_workspace(monkeypatch):
    """After the first block no new output memory: every block's outputs view the same buffers, while rows
    leave the batch (a stop token) and blocks shrink (never drafting past the budget)."""
    target, draft = tiny_pair("llama")
    module = importlib.import_module("pad.decoding.speculative")  # where the block calls the op
    seen = []
    real = module.verify_block

    def spy(*args, out=None, **kwargs):
        assert isinstance(out, Workspace)
        res = real(*args, out=out, **kwargs)
        seen.append((tuple(res.accepted.shape), [t.data_ptr() for t in res]))
        return res

    ids = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12], [13, 14, 15, 16]])
    mask = torch.ones_like(ids)
    # A stop token row 0 produces early (greedy), so that row leaves while the others go on.
    plain = pad.generate(target, draft, ids, attention_mask=mask, policy="target", max_new_tokens=3)
    eos = int(plain.sequences[0, ids.shape[1] + 2])
    monkeypatch.setattr(module, "verify_block", spy)
    out = pad.generate(target, draft, ids, attention_mask=mask, num_draft_tokens=4, max_new_tokens=11,
                       eos_token_id=eos)
    rows = {shape[0] for shape, _ in seen}
    assert len(seen) > 3 and len(rows) > 1 and len({shape[1] for shape, _ in seen}) > 1
    assert all(ptrs == seen[0][1] for shape, ptrs in seen if shape[1])  # K = 0 outputs have no address
    assert min(out.lengths) < max(out.lengths)
