"""CUDA backend of ``verify_block`` (``csrc/cuda``), built by setup.py with a CUDA build of torch; and
``emulate_cuda``, its kernels simulated block by block on the CPU (the tests' view of the GPU's math)."""
from __future__ import annotations

import torch

from . import compiled
from .splits import sm_count, split_plan
from .types import AcceptRule, FoldedClassifier, VerifyResult, empty_result, extension_inputs

THREADS = 256  # threads per block of every kernel (pad_cuda::kThreads)
H100_SMS = 132  # the slices emulate_cuda plans for by default


def extension():
    """The compiled module, or None if it was not built."""
    return compiled.extension("_cuda")


def available() -> bool:
    return extension() is not None


def _run(ext_fn, target_logits, draft_tokens, hidden, classifier, sigma, floor, temperature, draft_probs, uniforms,
         exponentials, rule, num_drafts, draft_logits, row_rules, logit_rows, classifier_bias, out, sms, splits,
         *extra):
    (B, K), V = draft_tokens.shape, target_logits.shape[-1]
    K1 = K + 1
    dev = target_logits.device
    out = out if out is not None else empty_result(B, K1 - 1, dev)
    # Slices per position (kernels 1-2: B(K+1) positions) and per row (the sampling draw: B positions).
    plan = (*split_plan(B * K1, V, sms, splits), *split_plan(B, V, sms, splits))
    hidden, w1, b1, w2, b2, bias, *draws = extension_inputs(hidden, classifier, classifier_bias, temperature,
                                                            draft_probs, uniforms, exponentials, dev)
    ext_fn(target_logits.contiguous(), draft_tokens.contiguous(), hidden, w1, b1, w2, b2, bias, sigma, floor,
           temperature, *draws, rule.code, rule.a, rule.b, None if num_drafts is None else num_drafts.contiguous(),
           None if draft_logits is None else draft_logits.contiguous(),
           None if row_rules is None else row_rules.contiguous(),
           None if logit_rows is None else logit_rows.contiguous(),
           *out, *plan, *extra)
    return out


def verify_block_cuda(
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
    splits: int | None = None,
) -> VerifyResult:
    """Same contract as ``verify_block_ref``; writes into ``out`` when given. ``splits``: vocabulary
    slices per position and per sampling draw (default: enough to fill the GPU, ``split_plan``)."""
    return _run(extension().verify_block_out, target_logits, draft_tokens, hidden, classifier, sigma, floor,
                temperature, draft_probs, uniforms, exponentials, rule, num_drafts, draft_logits, row_rules, logit_rows,
                classifier_bias, out, sm_count(target_logits.device), splits)


def emulate_cuda(
    target_logits: torch.Tensor,  # [B, K+1, V] on the CPU
    draft_tokens: torch.Tensor,  # [B, K] int64
    hidden: torch.Tensor | None = None,  # [B, K+1, H]
    classifier: FoldedClassifier | None = None,
    *,
    sigma: float = 0.0,
    floor: float = 0.0,
    temperature: float = 0.0,
    draft_probs: torch.Tensor | None = None,
    uniforms: torch.Tensor | None = None,
    exponentials: torch.Tensor | None = None,
    rule: AcceptRule = AcceptRule(),
    num_drafts: torch.Tensor | None = None,
    draft_logits: torch.Tensor | None = None,
    row_rules: torch.Tensor | None = None,
    logit_rows: torch.Tensor | None = None,
    classifier_bias: torch.Tensor | None = None,
    out: VerifyResult | None = None,
    splits: int | None = None,
    sms: int = H100_SMS,
    threads: int = THREADS,
) -> VerifyResult:
    """The CUDA backend's three kernels run on the CPU by the CPU extension (``csrc/cpu/emulate_cuda.cpp``):
    the same per-thread functions, slices (planned for ``sms`` multiprocessors unless ``splits`` is given)
    and reduction trees as on the GPU, so its results are the GPU's up to the compilers' contractions. A
    test tool: slow, and no argument checks beyond the extension's."""
    from . import cpu

    return _run(cpu.extension().emulate_cuda_verify, target_logits, draft_tokens, hidden, classifier, sigma, floor,
                temperature, draft_probs, uniforms, exponentials, rule, num_drafts, draft_logits, row_rules, logit_rows,
                classifier_bias, out, sms, splits, threads)
