"""``pad-decoding doctor``: what this installation runs on, and (``--check``) whether its kernels compute
what the reference does on every device here."""
from __future__ import annotations

import importlib.metadata
import os
import platform

import torch

from .machine import native_bf16
from .models.registry import REGISTRY, cache_dir, weights_source


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def facts() -> list[tuple[str, str]]:
    """(name, value) lines: versions, devices, backends, instruction set, bf16, Triton/CUDA, model cache."""
    from pad_kernels import available_backends, cpu, cuda
    from pad_kernels.selfcheck import devices

    from . import __version__

    lines = [("pad", __version__), ("python", platform.python_version())]
    lines += [(dist, _version(dist)) for dist in ("torch", "transformers", "triton", "numpy")]
    lines.append(("cpu", f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
                         f"{torch.get_num_threads()} torch threads; torch's own kernels: "
                         f"{torch.backends.cpu.get_cpu_capability()}"))
    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    lines.append(("gpus", ", ".join(gpus) if gpus else "none"))
    for device in devices():
        names = available_backends(torch.device(device))
        lines.append((f"verify_block on {device}", f"{', '.join(names)} (auto picks {names[0]})"))
    if cpu.available():
        lines.append(("cpu backend instruction set", f"{cpu.isa()} (the widest this CPU runs: {cpu.best_isa()}; "
                                                     "PAD_CPU_ISA forces one)"))
    else:
        lines.append(("cpu backend instruction set", "not built (reinstall with pip install --no-build-isolation -e .)"))
    lines.append(("native bf16", "yes: models run in bf16" if native_bf16() else
                  "no: models run in fp32 (bf16 is emulated on this CPU)"))
    from pad_kernels import attention

    from .decoding import int4, int8
    from .decoding.fast_draft import FAST_WEIGHTS

    lines.append(("int8 draft weights", "available (--draft-weights int8: torch.ops.aten._weight_int8pack_mm)"
                  if int8.available() else "not in this torch (--draft-weights int8 is refused)"))
    lines.append(("int4 draft weights", "available (--draft-weights int4: torch.ops.aten._weight_int4pack_mm_for_cpu)"
                  if int4.available() else "not in this torch (--draft-weights int4 is refused)"))
    lines.append(("fused draft attention", "available (--draft-attention fused: pad's C++ CPU kernel)"
                  if attention.available() else "not built (--draft-attention fused is refused)"))
    lines.append(("lean draft forward", "available for Llama / Qwen2-family drafts (--draft-forward lean)"))
    weights = FAST_WEIGHTS if native_bf16() else None  # fp32 drafts keep their weights (fast_draft.fast_weights)
    fast = (weights is None or {"int8": int8, "int4": int4}[weights].available()) and attention.available()
    what = f"{weights} weights" if weights else "weights unquantized in fp32"
    lines.append(("--fast-draft", f"available ({what}, fused attention, lean forward)"
                  if fast else "refused here (a piece above is missing)"))
    triton = _version("triton")
    lines.append(("triton", f"{triton}; " + ("runs on the GPU" if gpus and triton != "not installed" else
                                               "no GPU: its kernels run here only in the interpreter (tests)")))
    lines.append(("cuda", f"torch built with CUDA {torch.version.cuda}" if torch.version.cuda else
                  "torch is a CPU build"))
    lines.append(("cuda backend", "built" if cuda.available() else "not built (PAD_BUILD_CUDA=1 with a CUDA torch)"))
    folder = cache_dir()
    cached = sorted(p.name for p in folder.iterdir() if p.name in REGISTRY) if folder.is_dir() else []
    lines.append(("model cache", f"{folder} ({', '.join(cached) if cached else 'no converted model'}); "
                                 f"HuggingFace cache {os.environ.get('HF_HOME', '~/.cache/huggingface')}"))
    try:
        source = weights_source()
    except ValueError as e:
        source = f"invalid: {e}"
    source = source or "not named: a registry name loads the copy cached here"
    lines.append(("weights source", f"{source} ($PAD_WEIGHTS or --weights: hub or index-gguf)"))
    return lines


def check(out) -> bool:
    """Run every backend against the reference (``pad_kernels.selfcheck``), one line each to ``out``;
    True when none fails."""
    from pad_kernels import selfcheck

    def line(r):
        print(f"{'PASS' if r.ok else 'FAIL'}  {r.device:7} {r.backend:7} {r.case}"
              + (f"  ({r.detail})" if r.detail else ""), file=out, flush=True)

    results = selfcheck.run(progress=line)
    failed = sum(not r.ok for r in results)
    none = "" if results else " (no fused backend here: only the pure-PyTorch reference runs)"
    print(f"{len(results) - failed} passed, {failed} failed{none}", file=out)
    return not failed
