"""What requests with different policies in one step cost the plugin's decision (pad.serving.vllm).

The plugin runs the op once per policy present, over that policy's requests (their rows gathered first),
and scatters the results back. This times ``pad_rejection_sample`` on one greedy step in vLLM's layout
(B requests, K drafts each, a vocabulary of V) with every request under one policy, then split evenly over
2, 4 and B policies, against the same step's op alone; no vLLM needed (greedy steps draw nothing).

    python bench/vllm_policy_groups.py --batch 16 --k 8 --vocab 151936
"""
from __future__ import annotations

import argparse
import time
from types import SimpleNamespace

import torch

from pad.decoding.policy import parse_policy
from pad.serving.vllm import Acceptance, ServingConfig, pad_rejection_sample
from pad_kernels import verify_block_varlen

POLICIES = ["threshold@0.2", "typical@0.3,0.6", "topk@3,0.3", "threshold@0.1"]


def step(B: int, K: int, V: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    T = B * K
    logits = torch.randn(T, V, generator=g) * 3
    starts = torch.arange(B) * (K + 1)
    target_idx = (starts[:, None] + torch.arange(K)).flatten().int()
    metadata = SimpleNamespace(target_logits_indices=target_idx, bonus_logits_indices=(starts + K).int(),
                               logits_indices=torch.arange(T + B).int())
    sampling = SimpleNamespace(all_greedy=True, all_random=False, temperature=None, generators={})
    drafts = logits.argmax(-1).int()
    drafts[::3] = logits.topk(2, -1).indices[::3, 1].int()  # some mismatches for the rules to judge
    return logits, drafts, metadata, sampling


def acceptance(policies: list[str]) -> Acceptance:
    ids = [f"r{b}" for b in range(len(policies))]
    requests = {r: SimpleNamespace(sampling_params=SimpleNamespace(temperature=0.0, extra_args={"pad": {"policy": p}}),
                                   output_token_ids=[0]) for r, p in zip(ids, policies)}
    acc = Acceptance(ServingConfig(parse_policy(POLICIES[0])))
    acc.runner = SimpleNamespace(input_batch=SimpleNamespace(req_ids=ids), requests=requests)
    return acc


def seconds(fn, repeat: int) -> float:
    fn()  # warm
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--repeat", type=int, default=20)
    args = ap.parse_args()
    B, K, V = args.batch, args.k, args.vocab
    logits, drafts, metadata, sampling = step(B, K, V)
    counts, cu = [K] * B, torch.full((B,), K).cumsum(0).int()
    bonus = torch.zeros(B, 1, dtype=torch.long)
    packed = torch.zeros(B * (K + 1), V)
    packed[metadata.target_logits_indices.long()] = logits
    op = seconds(lambda: verify_block_varlen(packed, drafts.long(), counts, rule=parse_policy(POLICIES[0]).rule),
                 args.repeat)
    print(f"B = {B}, K = {K}, V = {V}, greedy, fp32 logits, torch threads {torch.get_num_threads()}; best of "
          f"{args.repeat}\n")
    print("| policies in the step | ms | x one policy | x the op alone |\n|---|---|---|---|")
    base = None
    for n in sorted({1, 2, 4, B}):
        policies = [POLICIES[b * min(n, len(POLICIES)) // B] if n <= len(POLICIES) else
                    f"threshold@{0.05 + 0.01 * (b % n):.2f}" for b in range(B)]
        acc = acceptance(policies)
        t = seconds(lambda acc=acc: pad_rejection_sample(acc, metadata, drafts, counts, K, cu, None, logits, bonus,
                                                         sampling), args.repeat)
        base = base or t
        print(f"| {len(set(policies))} | {t * 1e3:.2f} | {t / base:.2f} | {t / op:.2f} |")
    print(f"| (the op alone, one call) | {op * 1e3:.2f} | | 1.00 |")


if __name__ == "__main__":
    main()
