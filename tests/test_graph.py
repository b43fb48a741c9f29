"""VerifyGraph: verify_block for one fixed shape on static buffers (captured and replayed on CUDA; run
eagerly on the same buffers here), equal to verify_block call by call, and strict about its inputs."""
import pytest
import torch

from pad_kernels import AcceptRule, VerifyGraph, available_backends, verify_block
from test_verify_backends import make_case


@pytest.mark.parametrize("backend", available_backends("cpu"))
@pytest.mark.parametrize("sampling", [False, True])
def test_graph_equals_the_op_block_after_block(backend, sampling):
    B, K, V, H = 3, 5, 700, 16
    args, kwargs = make_case(B, K, V, H, torch.bfloat16, sampling, seed=int(sampling))
    clf = args[3]
    settings = dict(sigma=0.5, floor=1e-4, temperature=kwargs.get("temperature", 0.0),
                    rule=AcceptRule.typical(0.3, 0.05), backend=backend)
    graph = VerifyGraph(B, K, V, dtype=torch.bfloat16, device="cpu", hidden_size=H, classifier=clf, draft_stop=True,
                        **settings)
    first = None
    for seed in range(4):  # fresh inputs every block, as a decode loop would give it
        (logits, drafts, hidden, _), kw = make_case(B, K, V, H, torch.bfloat16, sampling, seed=100 + seed)
        draws = {k: kw[k] for k in ("draft_probs", "uniforms", "exponentials")} if sampling else {}
        num_drafts = torch.randint(0, K + 1, (B,), generator=torch.Generator().manual_seed(seed))
        want = verify_block(logits, drafts, hidden, clf, **settings, **draws, num_drafts=num_drafts)
        got = graph(logits, drafts, hidden, **draws, num_drafts=num_drafts)
        assert all(torch.equal(g, w) for g, w in zip(got, want)), seed
        first = first or got
        assert all(g is f for g, f in zip(got, first)), "the same output tensors every block"


def test_graph_refuses_other_inputs():
    B, K, V = 2, 3, 50
    graph = VerifyGraph(B, K, V, dtype=torch.float32, device="cpu")
    logits, drafts = torch.randn(B, K + 1, V), torch.zeros(B, K, dtype=torch.long)
    graph(logits, drafts)
    with pytest.raises(ValueError, match=r"target_logits must be torch.float32 \[2, 4, 50\]"):
        graph(torch.randn(B, K + 2, V), drafts)
    with pytest.raises(ValueError, match="target_logits must be torch.float32"):
        graph(logits.bfloat16(), drafts)
    with pytest.raises(ValueError, match="built without hidden"):
        graph(logits, drafts, torch.randn(B, K + 1, 8))
    with pytest.raises(ValueError, match="built without num_drafts"):
        graph(logits, drafts, num_drafts=torch.full((B,), K))
    sampled = VerifyGraph(B, K, V, dtype=torch.float32, device="cpu", temperature=0.7)
    with pytest.raises(ValueError, match="built with draft_probs"):
        sampled(logits, drafts)
    with pytest.raises(ValueError, match="needs hidden_size"):
        VerifyGraph(B, K, V, dtype=torch.float32, device="cpu", classifier=make_case(B, K, V, 8, torch.float32,
                                                                                       False, 0)[0][3])
