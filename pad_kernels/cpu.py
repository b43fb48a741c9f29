"""C++ CPU backend of ``verify_block`` (``csrc/cpu/verify_block_cpu.cpp``), built by setup.py when possible."""
from __future__ import annotations

import torch

from . import compiled
from .types import AcceptRule, FoldedClassifier, VerifyResult, empty_result, extension_inputs


def extension():
    """The compiled module, or None if it was not built."""
    return compiled.extension("_cpu")


def available() -> bool:
    return extension() is not None


def isa() -> str | None:
    """The instruction set the CPU backend's loops run in (``avx512``, ``avx2`` or ``baseline``; None when
    it is not built). The widest this CPU supports unless ``PAD_CPU_ISA`` or ``set_isa`` chose another."""
    ext = extension()
    return ext.isa() if ext is not None else None


def best_isa() -> str | None:
    """The widest instruction set this CPU and this build of the backend support (None when not built)."""
    ext = extension()
    return ext.best_isa() if ext is not None else None


def set_isa(name: str) -> str:
    """Run the CPU backend's loops in ``name`` (``auto``, ``avx512``, ``avx2``, ``baseline``) from now on, in
    every thread; returns the set now in use. Raises ValueError for a set this CPU cannot run (instead of
    an illegal instruction later) and RuntimeError when the backend is not built."""
    ext = extension()
    if ext is None:
        raise RuntimeError("the CPU backend is not built: reinstall with pip install --no-build-isolation -e .")
    return ext.set_isa(name)


def verify_block_cpu(
    target_logits: torch.Tensor,  # [B, K+1, V] fp32/bf16/fp16
    draft_tokens: torch.Tensor,  # [B, K] int64
    hidden: torch.Tensor | None = None,  # [B, K+1, H]
    classifier: FoldedClassifier | None = None,
    *,
    sigma: float = 0.0,
    floor: float = 0.0,
    temperature: float = 0.0,
    draft_probs: torch.Tensor | None = None,  # [B, K, V]
    uniforms: torch.Tensor | None = None,  # [B, K]
    exponentials: torch.Tensor | None = None,  # [B, V]
    rule: AcceptRule = AcceptRule(),
    num_drafts: torch.Tensor | None = None,  # [B] int64
    draft_logits: torch.Tensor | None = None,  # [B, K, V], the logits' dtype
    row_rules: torch.Tensor | None = None,  # [B, 6] fp32
    logit_rows: torch.Tensor | None = None,  # [B, K+1] int64 (target_logits, draft_probs: [R, V])
    classifier_bias: torch.Tensor | None = None,  # [B, K, D] fp32
    out: VerifyResult | None = None,
) -> VerifyResult:
    """Same contract as ``verify_block_ref``; writes into ``out`` when given (tests poison it first)."""
    B, K = draft_tokens.shape
    out = out if out is not None else empty_result(B, K, target_logits.device)
    hidden, w1, b1, w2, b2, bias, *draws = extension_inputs(hidden, classifier, classifier_bias, temperature,
                                                            draft_probs, uniforms, exponentials, target_logits.device)
    extension().verify_block_out(target_logits.contiguous(), draft_tokens.contiguous(), hidden, w1, b1, w2, b2,
                                 bias, sigma, floor, temperature, *draws, rule.code, rule.a, rule.b,
                                 None if num_drafts is None else num_drafts.contiguous(),
                                 None if draft_logits is None else draft_logits.contiguous(),
                                 None if row_rules is None else row_rules.contiguous(),
                                 None if logit_rows is None else logit_rows.contiguous(), *out)
    return out
