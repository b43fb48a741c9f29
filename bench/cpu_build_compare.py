"""Two builds of the C++ CPU backend side by side: the installed one against another ``_cpu`` shared object
(for example a ``-march=native`` build), timed in turns in one process on ``bench/verify_table.py``'s
shapes (greedy, a classifier of 128 hidden units) and on the attention kernel's labeler shape.

    python bench/cpu_build_compare.py OTHER_SO [--repeats 15] [--isa auto|avx512|avx2|baseline]

Prints a markdown table of medians and the ratio other / installed (above 1: the installed build is faster).
Both builds compute on the same inputs; their outputs are checked equal first.
"""
from __future__ import annotations

import argparse
import importlib.util
import itertools
from pathlib import Path

import torch

from pad.machine import machine_line
from pad_kernels import cpu
from pad_kernels.types import empty_result
from verify_table import interleaved_medians, make_inputs


def load_other(path: Path):
    """Load another build of ``pad_kernels._cpu`` under a package name of its own (its init symbol stays)."""
    spec = importlib.util.spec_from_file_location("other_build._cpu", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def verify_fn(ext, logits, drafts, hidden, clf):
    """pad_kernels.cpu.verify_block_cpu run on the build ``ext``: its call into the extension is the one
    the package makes (both builds pay the same swap of ``cpu.extension``)."""
    out = empty_result(logits.shape[0], drafts.shape[1], "cpu")

    def run():
        cpu.extension = lambda: ext
        return cpu.verify_block_cpu(logits, drafts, hidden, clf, sigma=0.5, floor=1e-4, out=out)

    return run


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("other", type=Path, help="the other build's _cpu*.so")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--isa", default="auto", help="instruction set of the installed build (default: the widest)")
    args = ap.parse_args()
    mine = cpu.extension()
    mine.set_isa(args.isa)
    other = load_other(args.other)
    print(f"Machine: {machine_line()}\n\nInstalled build: instruction set {mine.isa()}; other: {args.other}\n")
    print("| op | dtype | shape | installed ms | other ms | other / installed |\n|---|---|---|---|---|---|")
    for dtype, (B, K, V, H) in itertools.product((torch.float32, torch.bfloat16),
                                                  itertools.product((1, 4), (4, 10), (32000, 151936), (896, 1536))):
        inputs = make_inputs(B, K, V, H, dtype)
        fns = {"installed": verify_fn(mine, *inputs), "other": verify_fn(other, *inputs)}
        a, b = fns["installed"](), fns["other"]()
        assert all(torch.allclose(x, y, rtol=1e-5, atol=1e-6) if x.is_floating_point() else torch.equal(x, y)
                   for x, y in zip(a, b)), "the two builds disagree"
        t = interleaved_medians(fns, args.repeats)
        print(f"| verify_block | {str(dtype).removeprefix('torch.')} | B={B} K={K} V={V} H={H} | "
              f"{t['installed']:.2f} | {t['other']:.2f} | {t['other'] / t['installed']:.2f}x |", flush=True)
    g = torch.Generator().manual_seed(0)
    Bq, Hq, Hkv, T, S, D = 64, 12, 2, 3, 700, 128  # the search labeler's step
    q = torch.randn(Bq, T, Hq, D, generator=g).to(torch.bfloat16).transpose(1, 2)
    k, v = (torch.randn(Bq, Hkv, S, D, generator=g).to(torch.bfloat16) for _ in range(2))
    mask = torch.ones(Bq, 1, T, S, dtype=torch.bool).tril(S - T)
    outs = {name: torch.empty(Bq, T, Hq, D, dtype=torch.bfloat16) for name in ("installed", "other")}
    fns = {name: (lambda ext=ext, o=outs[name]: ext.gqa_attention_out(q, k, v, mask, D**-0.5, o))
           for name, ext in (("installed", mine), ("other", other))}
    t = interleaved_medians(fns, args.repeats)
    print(f"| gqa_attention | bfloat16 | B={Bq} Hq={Hq} Hkv={Hkv} T={T} S={S} D={D} | {t['installed']:.2f} | "
          f"{t['other']:.2f} | {t['other'] / t['installed']:.2f}x |")


if __name__ == "__main__":
    main()
