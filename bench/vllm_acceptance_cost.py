"""What pad's acceptance costs inside a vLLM step on this CPU, side by side with vLLM's own.

One step of B requests with K drafts each over the default pair's vocabulary, greedy, fp32 logits as vLLM
passes them: vLLM's ``rejection_sample`` (its C++ kernels on the CPU build), then the plugin's decision of
the same step as an installed sampler runs it (``decide_step``): every request under one policy (exact,
threshold@0.2, pivot@0.3 with a classifier of the shipped one's shape), the requests split evenly over 2, 4
and B policies, one request with fewer drafts (ragged), and the op alone on the [B, K+1, V] block. All rows
in one run, median of ``--repeats``.

Run with a Python that has vLLM's CPU build and pad-decoding, nothing else running:

    python bench/vllm_acceptance_cost.py --out bench/results/vllm
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

from pad.decoding.policy import parse_policy
from pad.machine import machine_line, median_seconds
from pad.serving.vllm import Acceptance, ServingConfig, decide_step
from pad_kernels import FoldedClassifier, verify_block

MIXED = ["threshold@0.2", "typical@0.3,0.6", "topk@3,0.3", "pivot@0.3"]
HIDDEN, UNITS = 1536, 128  # the shipped classifier's input and hidden width (Qwen2.5-Coder-1.5B's layers)


def step(B, K, V, counts, seed=0):
    """vLLM's arguments for one greedy step, and a stand-in of its hidden-state capture ([T + B, H])."""
    g = torch.Generator().manual_seed(seed)
    T = sum(counts)
    logits = torch.randn(T, V, generator=g) * 3
    drafts = logits.argmax(-1)
    drafts[torch.rand(T, generator=g) < 0.3] = 7
    return dict(metadata=SimpleNamespace(logits_indices=torch.arange(T + B).int()), drafts=drafts.int(),
                counts=counts, cu=torch.tensor(counts).cumsum(0).int(), logits=logits,
                bonus=torch.zeros(B, 1, dtype=torch.long), hidden=torch.randn(T + B, HIDDEN, generator=g),
                sampling=SimpleNamespace(all_greedy=True, all_random=False, temperature=None, generators={}))


def classifier(seed=1) -> FoldedClassifier:
    g = torch.Generator().manual_seed(seed)
    return FoldedClassifier(torch.randn(HIDDEN + 2, UNITS, generator=g) / HIDDEN**0.5,
                            torch.randn(UNITS, generator=g) * 0.1, torch.randn(UNITS, generator=g) / UNITS**0.5,
                            torch.tensor(0.0))


def acceptance(c, policies: list[str]) -> Acceptance:
    """An engine whose requests choose ``policies`` (one per request) through their extra_args."""
    ids = [f"r{b}" for b in range(len(policies))]
    requests = {r: SimpleNamespace(sampling_params=SimpleNamespace(temperature=0.0, extra_args={"pad": {"policy": p}}),
                                   output_token_ids=[0]) for r, p in zip(ids, policies)}
    acc = Acceptance(ServingConfig(parse_policy("threshold@0.2"), classifier="given"), folded=classifier(),
                     capture=SimpleNamespace(value=c["hidden"]))
    acc.runner = SimpleNamespace(input_batch=SimpleNamespace(req_ids=ids), requests=requests)
    return acc


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("-k", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--repeats", type=int, default=21)
    parser.add_argument("--out", help="folder for vllm_acceptance_cost.md")
    args = parser.parse_args(argv)
    from vllm.platforms import current_platform
    from vllm.v1.sample.rejection_sampler import rejection_sample

    current_platform.register_triton_kernel_overrides()
    B, K, V = args.batch, args.k, args.vocab
    uniform = step(B, K, V, [K] * B)
    ragged = step(B, K, V, [K] * (B - 1) + [K // 2])

    def vllm(c):
        return lambda: rejection_sample(c["drafts"], c["counts"], max(c["counts"]), c["cu"], None, c["logits"],
                                        c["bonus"], c["sampling"])

    def pad(c, policies):
        acc = acceptance(c, policies)

        def run():
            decide_step(acc, c["metadata"], c["drafts"], c["counts"], max(c["counts"]), c["cu"], None, c["logits"],
                        c["bonus"], c["sampling"])
            assert acc.relaxed_decisions_skipped == 0, "pad's decision failed: the row would time vLLM's"
        return run

    def op(c):
        block = torch.zeros(B, K + 1, V)
        block[:, :K] = c["logits"].reshape(B, K, V)
        return lambda: verify_block(block, c["drafts"].long().reshape(B, K))

    def split(n):
        return [MIXED[b * n // B] if n <= len(MIXED) else f"threshold@{0.05 + 0.01 * (b % n):.2f}" for b in range(B)]

    rows = [("vLLM rejection_sample (stock)", vllm(uniform)),
            ("pad, every request exact", pad(uniform, ["exact"] * B)),
            ("pad, every request threshold@0.2", pad(uniform, ["threshold@0.2"] * B)),
            (f"pad, every request pivot@0.3 (classifier {HIDDEN} x {UNITS})", pad(uniform, ["pivot@0.3"] * B)),
            ("pad, 2 policies mixed", pad(uniform, split(2))),
            (f"pad, 4 policies mixed ({', '.join(MIXED)})", pad(uniform, split(4))),
            (f"pad, {B} policies mixed", pad(uniform, split(B))),
            (f"pad, threshold@0.2, one request {K // 2} drafts (ragged)", pad(ragged, ["threshold@0.2"] * B)),
            ("verify_block alone on the [B, K+1, V] block, exact", op(uniform))]
    times = [(name, median_seconds(fn, args.repeats, warmup=3)) for name, fn in rows]
    command = "python bench/vllm_acceptance_cost.py " + " ".join(argv if argv is not None else sys.argv[1:])
    lines = [f"One greedy acceptance step: B={B} requests, K={K} drafts, V={V}, fp32 logits; median of "
             f"{args.repeats}.", "", f"Command: `{command}`", "", f"Machine: {machine_line()}", "",
             "| step | ms | vs vLLM |", "|---|---|---|"]
    base = times[0][1]
    lines += [f"| {name} | {t * 1e3:.2f} | {t / base:.2f}x |" for name, t in times]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "vllm_acceptance_cost.md").write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
