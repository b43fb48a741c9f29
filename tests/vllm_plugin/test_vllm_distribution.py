"""Sampled speculative decoding in a vLLM engine with pad keeps the target's distribution.

vLLM 0.32's CPU build expands per-request temperature, top-k and top-p to per-token values into memory it
never writes (``pad.serving.vllm.vllm_expand_is_broken``), so sampled requests' target logits are divided by
garbage; the plugin expands them itself while it decides. Checked here through ``LLM.generate``: many seeded
requests of one prompt, and the empirical joint distribution of their first two tokens (the first sampled at
prefill, the second decided by rejection sampling against the draft) against the target's own, computed
exactly from the HuggingFace model, by a chi-square test.
"""
import torch

from conftest import run_engines
from test_vllm_plugin import K

PROMPT = [5, 6, 7]
SAMPLES = 1500
TEMPERATURE, TOP_K, TOP_P = 0.9, 4, 0.95
P_MIN = 1e-3  # the chi-square test's p-value below which the distributions differ


def processed(logits: torch.Tensor) -> torch.Tensor:
    """Probabilities after vLLM's processing: temperature, then top-k, then top-p (logits [..., V])."""
    logits = logits / TEMPERATURE
    kth = logits.topk(TOP_K, -1).values[..., -1:]
    logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, -1)
    sorted_probs, order = probs.sort(-1, descending=True)
    # keep the smallest prefix whose mass reaches top_p (vLLM drops tokens whose preceding mass exceeds it)
    drop = (sorted_probs.cumsum(-1) - sorted_probs) > TOP_P
    probs = probs.scatter(-1, order, sorted_probs.masked_fill(drop, 0.0))
    return probs / probs.sum(-1, keepdim=True)


def target_joint(model) -> dict[tuple[int, int], float]:
    """P(first token, second token) under the target with the processed distribution."""
    with torch.no_grad():
        first = processed(model(torch.tensor([PROMPT])).logits[0, -1])
        support = first.nonzero().flatten().tolist()
        second = processed(model(torch.tensor([PROMPT + [t] for t in support])).logits[:, -1])
    return {(a, int(b)): float(first[a] * second[i, b]) for i, a in enumerate(support)
            for b in second[i].nonzero().flatten()}


def chi_square_p(counts: dict, probs: dict, n: int) -> float:
    """p-value of Pearson's chi-square test of ``counts`` (n samples) against ``probs``; cells outside the
    support of ``probs`` make it 0."""
    if set(counts) - set(probs):
        return 0.0
    stat = sum((counts.get(c, 0) - n * p) ** 2 / (n * p) for c, p in probs.items())
    df = len(probs) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def test_sampled_requests_keep_the_targets_distribution(tiny, tmp_path):
    """Exact requests on a relaxed engine (pad decides, by the exact rule) with an unrelated draft, so
    that many drafts are rejected and the correction token is drawn too."""
    run = {"draft": tiny["wrong"], "prompts": [PROMPT] * SAMPLES, "max_tokens": 2, "temperature": TEMPERATURE,
           "seed": list(range(SAMPLES)), "sampling": {"top_k": TOP_K, "top_p": TOP_P},
           "pad": {"policy": "threshold@0.05"}, "extra_args": [{"pad": {"policy": "exact"}}] * SAMPLES,
           "engine": {"max_num_seqs": 256}}
    got = run_engines({"target": tiny["target"], "k": K, "runs": [run]}, tmp_path)[0]
    assert got["counts"]["draft_tokens"] > 0 and got["counts"]["accepted"] < got["counts"]["draft_tokens"]
    counts: dict = {}
    for tokens in got["tokens"]:
        counts[tuple(tokens)] = counts.get(tuple(tokens), 0) + 1
    probs = target_joint(tiny["models"]["target"])
    assert len(probs) > 4, "the test needs a spread distribution"
    p = chi_square_p(counts, probs, SAMPLES)
    assert p > P_MIN, (p, sorted(counts.items()), probs)
