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
    out: VerifyResult | None = None,
) -> VerifyResult:
    """Same contract as ``verify_block_ref``; writes into ``out`` when given (tests poison it first)."""
    B, K1, _ = target_logits.shape
    out = out if out is not None else empty_result(B, K1 - 1, target_logits.device)
    hidden, w1, b1, w2, b2, *draws = extension_inputs(hidden, classifier, temperature, draft_probs, uniforms,
                                                      exponentials, target_logits.device)
    extension().verify_block_out(target_logits.contiguous(), draft_tokens.contiguous(), hidden, w1, b1, w2, b2,
                                 sigma, floor, temperature, *draws, rule.code, rule.a, rule.b,
                                 None if num_drafts is None else num_drafts.contiguous(), *out)
    return out
