"""``verify_block_varlen``: the fused verification op on a ragged ("varlen") batch, and its reference.

Serving engines pack the verification blocks of all requests into one dimension: request b contributes
``num_drafts[b] + 1`` consecutive rows of target logits (one per draft token, then the row after its last
draft) and ``num_drafts[b]`` draft tokens; a request with no drafts has one row and only picks its next
token. The rules are ``verify_block``'s, applied to each request's own block; the results come back packed:

- per row (N = sum(num_drafts + 1)): ``entropy``, ``argmax``, ``top3_entropy``;
- per draft token (T = sum(num_drafts)): ``token_prob``, ``pivot_prob``, ``accepted``, ``pivot_accepted``,
  ``divergence``;
- per request (B): ``num_accepted``, ``next_token``.

The fused backends run on the padded ``[B, max(num_drafts) + 1, V]`` block with ``num_drafts`` (padding
positions are never accepted); when every request has the same draft count, the packed logits already are
that block and nothing is copied.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from .types import AcceptRule, FoldedClassifier, VerifyResult
from .verify import verify_block
from .verify_ref import verify_block_ref


def _counts(num_drafts) -> list[int]:
    counts = num_drafts.tolist() if isinstance(num_drafts, torch.Tensor) else list(num_drafts)
    if any(not isinstance(n, int) or n < 0 for n in counts):
        raise ValueError(f"num_drafts must be whole numbers >= 0, got {counts}")
    return counts


def _check_packed(target_logits, draft_tokens, counts, hidden, draft_probs, uniforms, exponentials,
                  draft_logits=None) -> None:
    B, N, T = len(counts), sum(counts) + len(counts), sum(counts)
    if target_logits.dim() != 2 or target_logits.shape[0] != N:
        raise ValueError(f"target_logits must be [N, V] with N = sum(num_drafts + 1) = {N}, "
                         f"got {tuple(target_logits.shape)}")
    if draft_tokens.shape != (T,):
        raise ValueError(f"draft_tokens must be [T] with T = sum(num_drafts) = {T}, got {tuple(draft_tokens.shape)}")
    V = target_logits.shape[1]
    for name, t, shape in (("hidden", hidden, (N, None)), ("draft_probs", draft_probs, (T, V)),
                           ("uniforms", uniforms, (T,)), ("exponentials", exponentials, (B, V)),
                           ("draft_logits", draft_logits, (T, V))):
        if t is not None and (t.dim() != len(shape) or any(s is not None and s != d for s, d in zip(shape, t.shape))):
            want = ", ".join("H" if s is None else str(s) for s in shape)
            raise ValueError(f"{name} must be [{want}], got {tuple(t.shape)}")


def _empty(device) -> VerifyResult:
    dtypes = (torch.float32, torch.float32, torch.int64, torch.float32, torch.bool, torch.bool, torch.int64,
              torch.int64, torch.float32, torch.float32)
    return VerifyResult(*(torch.empty(0, dtype=d, device=device) for d in dtypes))


def verify_block_varlen_ref(
    target_logits: torch.Tensor,  # [N, V]: request b's num_drafts[b] + 1 rows, requests one after another
    draft_tokens: torch.Tensor,  # [T] int64, T = sum(num_drafts)
    num_drafts: Sequence[int] | torch.Tensor,  # [B] draft tokens per request (0 allowed)
    hidden: torch.Tensor | None = None,  # [N, H]
    classifier: FoldedClassifier | None = None,
    *,
    sigma: float = 0.0,
    floor: float = 0.0,
    temperature: float = 0.0,
    draft_probs: torch.Tensor | None = None,  # [T, V]
    uniforms: torch.Tensor | None = None,  # [T]
    exponentials: torch.Tensor | None = None,  # [B, V]
    rule: AcceptRule = AcceptRule(),
    draft_logits: torch.Tensor | None = None,  # [T, V]
) -> VerifyResult:
    """The specification: ``verify_block_ref`` on each request's block alone, results concatenated."""
    counts = _counts(num_drafts)
    _check_packed(target_logits, draft_tokens, counts, hidden, draft_probs, uniforms, exponentials, draft_logits)
    parts, row, tok = [], 0, 0
    for b, k in enumerate(counts):
        rows, toks = slice(row, row + k + 1), slice(tok, tok + k)
        sampled = dict(draft_probs=draft_probs[toks][None], uniforms=uniforms[toks][None],
                       exponentials=exponentials[b][None]) if temperature > 0 else {}
        parts.append(verify_block_ref(
            target_logits[rows][None], draft_tokens[toks][None], hidden[rows][None] if hidden is not None else None,
            classifier, sigma=sigma, floor=floor, temperature=temperature, rule=rule,
            draft_logits=draft_logits[toks][None] if draft_logits is not None else None, **sampled))
        row, tok = row + k + 1, tok + k
    if not parts:
        return _empty(target_logits.device)
    return VerifyResult(*(torch.cat([getattr(p, name)[0].reshape(-1) for p in parts]) for name in VerifyResult._fields))


def verify_block_varlen(
    target_logits: torch.Tensor,  # [N, V] fp32/bf16/fp16
    draft_tokens: torch.Tensor,  # [T] int64
    num_drafts: Sequence[int] | torch.Tensor,  # [B]; a host list avoids a device sync
    hidden: torch.Tensor | None = None,  # [N, H] target hidden states at the classifier's layer
    classifier: FoldedClassifier | None = None,
    *,
    sigma: float = 0.0,
    floor: float = 0.0,
    temperature: float = 0.0,
    draft_probs: torch.Tensor | None = None,  # [T, V], needed when temperature > 0
    uniforms: torch.Tensor | None = None,  # [T] U(0,1)
    exponentials: torch.Tensor | None = None,  # [B, V] Exp(1)
    rule: AcceptRule = AcceptRule(),
    draft_logits: torch.Tensor | None = None,  # [T, V], the logits' dtype (the kl rule, the divergence)
    backend: str | None = None,
) -> VerifyResult:
    """Verify a ragged batch of blocks (layout in the module docstring); arguments as ``verify_block``'s.

    Returns a ``VerifyResult`` whose tensors are packed: entropy, argmax, top3_entropy [N]; token_prob,
    pivot_prob, accepted, pivot_accepted, divergence [T]; num_accepted, next_token [B].
    """
    counts = _counts(num_drafts)
    _check_packed(target_logits, draft_tokens, counts, hidden, draft_probs, uniforms, exponentials, draft_logits)
    if not counts:
        return _empty(target_logits.device)
    B, V, device = len(counts), target_logits.shape[1], target_logits.device
    K = max(counts)
    if temperature > 0:  # drawn here, so that padding never consumes a draw
        if uniforms is None:
            uniforms = torch.rand(sum(counts), device=device)
        if exponentials is None:
            exponentials = torch.empty(B, V, device=device).exponential_()
    uniform = all(k == K for k in counts)
    if uniform:  # the packed layout already is the [B, K+1, ...] block: views only
        def block(t, rows):
            return None if t is None else t.reshape(B, rows, *t.shape[1:])
    else:
        # Scatter positions: request b's j-th row goes to padded[b, j].
        b_of = torch.repeat_interleave(torch.arange(B), torch.tensor(counts) + 1)
        j_of = torch.cat([torch.arange(k + 1) for k in counts])
        rows_at = (b_of.to(device), j_of.to(device))
        draft_mask = j_of < torch.tensor(counts)[b_of]  # packed rows that carry a draft token
        toks_at = (rows_at[0][draft_mask.to(device)], rows_at[1][draft_mask.to(device)])

        def block(t, rows):
            if t is None:
                return None
            out = t.new_zeros(B, rows, *t.shape[1:])
            out[rows_at if rows == K + 1 else toks_at] = t
            return out
    res = verify_block(
        block(target_logits, K + 1), block(draft_tokens, K), block(hidden, K + 1), classifier, sigma=sigma,
        floor=floor, temperature=temperature, draft_probs=block(draft_probs, K), uniforms=block(uniforms, K),
        exponentials=exponentials, rule=rule, backend=backend, draft_logits=block(draft_logits, K),
        num_drafts=None if uniform else torch.tensor(counts, dtype=torch.int64, device=device),
    )
    if uniform:
        def packed(t):
            return t.reshape(-1)
    else:
        def packed(t):
            return t[rows_at if t.shape[1] == K + 1 else toks_at]
    per_row = ("entropy", "token_prob", "argmax", "pivot_prob", "accepted", "pivot_accepted", "top3_entropy",
               "divergence")
    return VerifyResult(*(packed(getattr(res, f)) if f in per_row else getattr(res, f) for f in VerifyResult._fields))
