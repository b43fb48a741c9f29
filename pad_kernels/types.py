"""Argument and result types of the fused verification op."""
from __future__ import annotations

from typing import NamedTuple

import torch

# Classifier features, in the order the folded weights expect them after the hidden state.
FEATURE_NAMES = ("token_prob", "entropy")


class FoldedClassifier(NamedTuple):
    """The pivot classifier folded to one hidden layer.

    ``score = w2 . relu(W1^T [h; f] + b1) + b2`` and ``pivot_prob = sigmoid(score)``, where ``h`` is the
    target hidden state [H] and ``f`` the features [F] (``FEATURE_NAMES``).
    """

    w1: torch.Tensor  # [H + F, D] fp32
    b1: torch.Tensor  # [D] fp32
    w2: torch.Tensor  # [D] fp32
    b2: torch.Tensor  # [] fp32

    @property
    def hidden_size(self) -> int:
        return self.w1.shape[0] - len(FEATURE_NAMES)

    def to(self, device) -> "FoldedClassifier":
        return FoldedClassifier(*(t.to(device=device, dtype=torch.float32) for t in self))


class VerifyResult(NamedTuple):
    """Everything one verification block produces (B rows, K draft tokens, V vocabulary)."""

    entropy: torch.Tensor  # [B, K+1] fp32, natural log, of the (temperature-scaled) target distribution
    token_prob: torch.Tensor  # [B, K] fp32, p_target(d_i)
    argmax: torch.Tensor  # [B, K+1] int64, lowest index on ties
    pivot_prob: torch.Tensor  # [B, K] fp32, 1.0 where no classifier
    accepted: torch.Tensor  # [B, K] bool, the accepted prefix only (False after the first rejection)
    pivot_accepted: torch.Tensor  # [B, K] bool, accepted only because the classifier allowed it
    num_accepted: torch.Tensor  # [B] int64
    next_token: torch.Tensor  # [B] int64, correction token, or bonus token when all K are accepted


def empty_result(B: int, K: int, device) -> VerifyResult:
    """Uninitialized outputs for a fused backend to write (shapes as in ``VerifyResult``)."""
    f32 = dict(dtype=torch.float32, device=device)
    i64 = dict(dtype=torch.int64, device=device)
    return VerifyResult(
        entropy=torch.empty(B, K + 1, **f32),
        token_prob=torch.empty(B, K, **f32),
        argmax=torch.empty(B, K + 1, **i64),
        pivot_prob=torch.empty(B, K, **f32),
        accepted=torch.empty(B, K, dtype=torch.bool, device=device),
        pivot_accepted=torch.empty(B, K, dtype=torch.bool, device=device),
        num_accepted=torch.empty(B, **i64),
        next_token=torch.empty(B, **i64),
    )


def extension_inputs(hidden, classifier, temperature, draft_probs, uniforms, exponentials, device) -> list:
    """The optional inputs of the compiled backends' ``verify_block_out``, in order: hidden, w1, b1, w2, b2,
    draft_probs, uniforms, exponentials; contiguous, fp32 where the kernels read fp32, None where unused."""

    def f32(t):
        return None if t is None else t.to(device=device, dtype=torch.float32).contiguous()

    clf = [f32(t) for t in classifier] if classifier is not None else [None] * 4
    draws = [f32(t) for t in (draft_probs, uniforms, exponentials)] if temperature > 0 else [None] * 3
    return [hidden.contiguous() if classifier is not None else None, *clf, *draws]
