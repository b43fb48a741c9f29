"""The CUDA kernels' arithmetic, run on the CPU: thread-strided online softmax merged by a tree
(row_push/row_merge) and the block-wide exponential race (race_push/race_merge) of verify_block.cu,
emulated by the CPU extension with the same header, against the reference."""
import pytest
import torch

from pad_kernels import cpu
from pad_kernels.verify_ref import entropy_from_logits, residual_probs, top3_entropy_from_logits



@pytest.mark.parametrize("threads", [32, 256])  # a warp; the kernels' block size (kThreads)
@pytest.mark.parametrize("V", [1271, 32000, 151936])
def test_thread_reductions_match_reference(threads, V):
    g = torch.Generator().manual_seed(V + threads)
    N = 6
    x = torch.randn(N, V, generator=g) * 3
    x[1, ::7] = float("-inf")
    x[2, [10, V - 3]] = x[2].max() + 1.0  # a tie for the argmax: the lower index wins
    x[3, : V // 2] = float("-inf")  # the first threads see only -inf
    q = torch.softmax(torch.randn(N, V, generator=g) * 3, -1)
    q[4] = torch.softmax(x[4], -1) * 1.5  # q >= p everywhere: the residual is all zero, the race falls back to p
    e = torch.empty(N, V).exponential_(generator=g)
    assert cpu.available(), "the compiled CPU extension is needed to run the CUDA math on the CPU"
    x[5, [7, V // 2, V - 1]] = x[5].max() + 2.0  # the top 3 tied, in three threads' slices
    entropy, argmax, winner, top3 = cpu.extension().emulate_cuda_reductions(x, q, e, threads)
    torch.testing.assert_close(top3, top3_entropy_from_logits(x.double()).float(), rtol=1e-5, atol=1e-5)
    truth = entropy_from_logits(x.double())
    ref_err = (entropy_from_logits(x).double() - truth).abs().max()
    assert (entropy.double() - truth).abs().max() <= 2 * ref_err + 1e-5  # the rule of test_verify_backends
    assert torch.equal(argmax, x.argmax(-1))
    assert argmax[2] == 10
    p = torch.softmax(x, -1)
    expected = (residual_probs(p, q) / e).argmax(-1)
    assert torch.equal(winner, expected)
