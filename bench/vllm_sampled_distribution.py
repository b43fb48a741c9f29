"""Does sampled speculative decoding in vLLM keep the target's distribution? Stock vLLM against vLLM with pad.

The tiny models of the vLLM test tier (tests/vllm_plugin/conftest.py): one prompt, SAMPLES seeded requests of
two tokens (the first sampled at prefill, the second decided by rejection sampling against a draft that
mostly agrees with the target), temperature 0.9. Prints, per engine, the draft acceptance and the total
variation distance between the empirical joint distribution of the two tokens and the target's own (computed
exactly from the HuggingFace model), beside the distances of REPEATS samples of the same size drawn from the
target's distribution itself (what sampling noise alone gives). Run with vLLM's CPU build:

    python bench/vllm_sampled_distribution.py
"""
from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent / "tests" / "vllm_plugin"), str(HERE.parent / "tests")]

import conftest  # noqa: E402
import test_vllm_distribution as dist  # noqa: E402

SAMPLES, REPEATS, K = 1500, 20, 4


def total_variation(counts: dict, probs: dict) -> float:
    n = sum(counts.values())
    inside = sum(abs(counts.get(c, 0) / n - p) for c, p in probs.items())
    outside = sum(v for c, v in counts.items() if c not in probs) / n
    return 0.5 * (inside + outside)


def main() -> int:
    dist.TOP_K, dist.TOP_P = 256, 1.0  # temperature alone: no vocabulary cut
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)

        class Folders:
            def mktemp(self, name):
                (root / name).mkdir()
                return root / name

        tiny = conftest.tiny.__wrapped__(Folders())
        probs = dist.target_joint(tiny["models"]["target"])
        keys = list(probs)
        weights = torch.tensor([probs[c] for c in keys], dtype=torch.float64)
        noise = []
        for seed in range(REPEATS):
            draw = torch.multinomial(weights, SAMPLES, replacement=True, generator=torch.Generator().manual_seed(seed))
            counts: dict = {}
            for i in draw.tolist():
                counts[keys[i]] = counts.get(keys[i], 0) + 1
            noise.append(total_variation(counts, probs))
        print(f"target's own samples: total variation {min(noise):.3f}-{max(noise):.3f} over {REPEATS} draws of "
              f"{SAMPLES}")
        base = {"draft": tiny["right"], "prompts": [dist.PROMPT] * SAMPLES, "max_tokens": 2,
                "temperature": dist.TEMPERATURE, "seed": list(range(SAMPLES)), "engine": {"max_num_seqs": 256}}
        for name, extra, plugins in [("stock vLLM", {}, ""), ("vLLM + pad, exact rule", {
                "pad": {"policy": "threshold@0.05"}, "extra_args": [{"pad": {"policy": "exact"}}] * SAMPLES}, "pad")]:
            got = conftest.run_engines({"target": tiny["target"], "k": K, "runs": [{**base, **extra}]}, root,
                                       VLLM_PLUGINS=plugins)[0]
            counts = {}
            for tokens in got["tokens"]:
                counts[tuple(tokens)] = counts.get(tuple(tokens), 0) + 1
            c = got["counts"]
            print(f"{name}: accepted {c['accepted']} of {c['draft_tokens']} drafts, total variation "
                  f"{total_variation(counts, probs):.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
