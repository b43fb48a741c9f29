"""What pad's acceptance costs inside a vLLM step on this CPU, side by side with vLLM's own.

One step of B requests with K drafts each over the default pair's vocabulary, greedy, fp32 logits as vLLM
passes them: vLLM's ``rejection_sample`` (its C++ kernels on the CPU build), the plugin's
``pad_rejection_sample`` under the exact rule and under threshold@0.2, and the op alone on the packed layout
when every request has K drafts (no copy) and when one has fewer (the padded block: a copy of the logits).

Run with a Python that has vLLM's CPU build and pad-decoding, nothing else running:

    python bench/vllm_acceptance_cost.py --out bench/results/vllm
"""
from __future__ import annotations

import argparse
from pathlib import Path
from types import SimpleNamespace

import torch

from pad.decoding.policy import parse_policy
from pad.machine import machine_line, median_seconds
from pad.serving.vllm import Acceptance, ServingConfig, pad_rejection_sample
from pad_kernels import verify_block_varlen


def step(B, K, V, counts, seed=0):
    g = torch.Generator().manual_seed(seed)
    T = sum(counts)
    starts = [sum(counts[:b]) + b for b in range(B)]
    target_idx = torch.cat([torch.arange(k) + s for s, k in zip(starts, counts)]).int()
    logits = torch.randn(T, V, generator=g) * 3
    drafts = logits.argmax(-1)
    drafts[torch.rand(T, generator=g) < 0.3] = 7
    return dict(metadata=SimpleNamespace(target_logits_indices=target_idx,
                                         bonus_logits_indices=torch.tensor([s + k for s, k in zip(starts, counts)]).int(),
                                         logits_indices=torch.arange(T + B).int()),
                drafts=drafts.int(), counts=counts, cu=torch.tensor(counts).cumsum(0).int(), logits=logits,
                bonus=torch.zeros(B, 1, dtype=torch.long),
                sampling=SimpleNamespace(all_greedy=True, all_random=False, temperature=None, generators={}))


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

    def pad(c, policy):
        acceptance = Acceptance(ServingConfig(parse_policy(policy)))
        return lambda: pad_rejection_sample(acceptance, c["metadata"], c["drafts"], c["counts"], max(c["counts"]),
                                            c["cu"], None, c["logits"], c["bonus"], c["sampling"])

    def op(c):
        packed = torch.zeros(sum(c["counts"]) + B, V)
        packed[c["metadata"].target_logits_indices.long()] = c["logits"]
        return lambda: verify_block_varlen(packed, c["drafts"].long(), c["counts"])

    rows = [("vLLM rejection_sample (stock)", vllm(uniform)), ("pad_rejection_sample, exact rule", pad(uniform, "exact")),
            ("pad_rejection_sample, threshold@0.2", pad(uniform, "threshold@0.2")),
            ("verify_block_varlen, every request K drafts (no copy)", op(uniform)),
            (f"verify_block_varlen, one request {K // 2} drafts (padded copy)", op(ragged))]
    times = [(name, median_seconds(fn, args.repeats, warmup=3)) for name, fn in rows]
    command = "python bench/vllm_acceptance_cost.py " + " ".join(argv if argv is not None else __import__("sys").argv[1:])
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
