"""The CUDA backend's kernels simulated on the CPU (``pad_kernels.cuda.emulate_cuda``: the same per-thread
functions of ``pad/verify_math.h``, slices and reduction trees as ``verify_block.cu``) on rows made to
stress the reductions: ties across threads and slices, threads and slices that see only -inf, the top 3
tied in three threads' ranges, a residual that is zero everywhere. ``test_verify_backends`` runs the same
simulation over the random cases of every backend."""
import pytest
import torch

from pad_kernels import cpu, verify_block_ref
from pad_kernels.cuda import emulate_cuda
from pad_kernels.verify_ref import entropy_from_logits, top3_entropy_from_logits


@pytest.mark.parametrize("threads", [32, 256])  # a warp; the kernels' block size (pad_cuda::kThreads)
@pytest.mark.parametrize("splits", [1, 7, 64])
@pytest.mark.parametrize("V", [1271, 151936])
def test_reductions_match_reference(threads, splits, V):
    assert cpu.available(), "the compiled CPU extension runs the CUDA math on the CPU"
    g = torch.Generator().manual_seed(V + threads + splits)
    B = 6  # one hard row per batch row, at the correction position 0 (K = 1, the draft always rejected)
    x = torch.randn(B, 2, V, generator=g) * 3
    x[1, 0, ::7] = float("-inf")
    x[2, 0, [10, V - 3]] = x[2, 0].max() + 1.0  # a tie for the argmax: the lower index wins
    x[3, 0, : V // 2] = float("-inf")  # the first threads and slices see only -inf
    x[5, 0, [7, V // 2, V - 1]] = x[5, 0].max() + 2.0  # the top 3 tied, in three threads' (and slices') ranges
    q = torch.softmax(torch.randn(B, 1, V, generator=g) * 3, -1)
    q[4, 0] = torch.softmax(x[4, 0], -1) * 1.5  # q >= p everywhere: the residual is all zero, the race falls back to p
    drafts = x[:, 0].argmin(-1, keepdim=True)  # p(d) ~ 0 < q(d): rejected
    kwargs = dict(temperature=1.0, draft_probs=q, uniforms=torch.ones(B, 1),
                  exponentials=torch.empty(B, V).exponential_(generator=g))
    want = verify_block_ref(x, drafts, **kwargs)
    got = emulate_cuda(x, drafts, **kwargs, splits=splits, threads=threads)
    assert (want.num_accepted == 0).all()
    for name in ("argmax", "accepted", "num_accepted", "next_token"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    assert got.argmax[2, 0] == 10
    torch.testing.assert_close(got.top3_entropy, top3_entropy_from_logits(x.double()).float(), rtol=1e-5, atol=1e-5)
    truth = entropy_from_logits(x.double())
    ref_err = (entropy_from_logits(x).double() - truth).abs().max()
    assert (got.entropy.double() - truth).abs().max() <= 2 * ref_err + 1e-5  # the rule of test_verify_backends
