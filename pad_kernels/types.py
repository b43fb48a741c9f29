"""Argument and result types of the fused verification op."""
from __future__ import annotations

from typing import NamedTuple

import torch

# Classifier features, in the order the folded weights expect them after the hidden state.
FEATURE_NAMES = ("token_prob", "entropy")


class FoldedClassifier(NamedTuple):
    """The pivot classifier folded to one hidden layer.

    ``score = w2 . relu(W1^T [h; f] + b1 + c) + b2`` and ``pivot_prob = sigmoid(score)``, where ``h`` is the
    target hidden state [H], ``f`` the features [F] (``FEATURE_NAMES``) and ``c`` [D] the position's
    ``classifier_bias`` (``verify_block``; 0 without it): a caller folds inputs the op does not see (where a
    draft came from) through the first layer into it.
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


class AcceptRule(NamedTuple):
    """A training-free relaxation of the exact rule: a draft token the exact rule rejects may still be
    accepted. ``a`` and ``b`` are the rule's two settings (unused ones are 0).

    - ``exact``: nothing more is accepted.
    - ``typical`` (a = epsilon, b = delta; Medusa's typical acceptance): accepted when
      ``p_target(d) > min(epsilon, delta * exp(-H))``, H the full-vocabulary entropy.
    - ``threshold`` (a = tau): accepted when ``p_target(d) >= tau``.
    - ``fly`` (a = gate, b = window; FLy, arXiv 2511.22972), greedy only: a mismatch at draft position i
      (1-based, of K) is accepted when the entropy of the target's top 3 probabilities
      (``top3_entropy``) is at least ``gate``, ``i + window - 1 <= K`` and the next ``window - 1`` draft
      tokens all equal the target's argmax.
    - ``kl`` (a = epsilon, b = top1; a divergence judge after arXiv 2601.04766 and 2502.20704): accepted
      when ``KL(p || q) <= epsilon`` and ``max p < top1``, where p and q are the target's and the draft's
      (temperature-scaled) distributions at the position (``divergence``; needs the draft's logits); a
      position where the target is sure (top-1 probability at least ``top1``) keeps the exact rule.
    - ``topk`` (a = k, b = delta; TensorRT-LLM's relaxed acceptance): accepted when the draft token is
      among the target's k most likely tokens (ties broken by lower index, as the argmax) and
      ``p(d) >= max p - delta``.
    Settings that equal ``exact``: ``typical`` with epsilon 1 and delta ``inf`` (``typical@1,inf``: the bound
    is then 1 and p > 1 never holds; with a finite delta, ``delta * exp(-H)`` can fall below 1), ``threshold``
    at 1 only for a token of probability 1, which is the argmax; ``fly`` with gate ``inf``; ``kl`` with top1 0;
    ``topk`` with k 0 (and, greedy only, k 1: the top-1 is the argmax).
    """

    name: str = "exact"
    a: float = 0.0
    b: float = 0.0

    @classmethod
    def typical(cls, epsilon: float = 0.09, delta: float = 0.3) -> "AcceptRule":
        return cls("typical", float(epsilon), float(delta))

    @classmethod
    def threshold(cls, tau: float) -> "AcceptRule":
        return cls("threshold", float(tau), 0.0)

    @classmethod
    def fly(cls, gate: float = 0.3, window: int = 6) -> "AcceptRule":
        return cls("fly", float(gate), float(window))

    @classmethod
    def kl(cls, epsilon: float, top1: float = 1.0) -> "AcceptRule":
        return cls("kl", float(epsilon), float(top1))

    @classmethod
    def topk(cls, k: int, delta: float) -> "AcceptRule":
        return cls("topk", float(k), float(delta))

    @property
    def needs_draft_logits(self) -> bool:
        """Whether the rule reads the draft's distribution (``verify_block``'s ``draft_logits``)."""
        return self.name == "kl"

    @property
    def code(self) -> int:
        """The rule's number in the compiled kernels (``pad::RuleKind``)."""
        return RULES.index(self.name)


RULES = ("exact", "typical", "threshold", "fly", "kl", "topk")  # order = the kernels' rule codes

# Columns of ``row_rules`` [B, 6] fp32: each row's own acceptance (see ``pack_row_rules``).
ROW_RULE_COLUMNS = ("rule", "a", "b", "sigma", "exact_until", "sampled")


def pack_row_rules(rules, sigmas, exact_until, sampled, device=None) -> torch.Tensor:
    """Per-row acceptance for ``verify_block(..., row_rules=...)``: row b is decided as a block of its own
    with ``rule=rules[b]`` (an ``AcceptRule``), ``sigma=sigmas[b]`` (0: the classifier overrides nothing),
    its first ``exact_until[b]`` draft positions by the exact rule alone (``exact_prefix``), and the exact
    test of rejection sampling (``sampled[b]``, the call's temperature > 0) or of greedy decoding. Lists of
    B entries -> [B, 6] fp32 in ``ROW_RULE_COLUMNS`` order (positions past K count as K + 1, so fp32 holds
    them exactly)."""
    if not (len(rules) == len(sigmas) == len(exact_until) == len(sampled)):
        raise ValueError("row_rules needs one rule, sigma, exact_until and sampled per row")
    rows = [[RULES.index(r.name), r.a, r.b, s, min(int(u), 1 << 20), float(bool(t))]
            for r, s, u, t in zip(rules, sigmas, exact_until, sampled)]
    return torch.tensor(rows, dtype=torch.float32, device=device).reshape(len(rows), len(ROW_RULE_COLUMNS))


def rule_of_row(row_rules: torch.Tensor, b: int) -> tuple[AcceptRule, float, int, bool]:
    """Row b of ``row_rules`` [B, 6] as (rule, sigma, exact_until, sampled) (the reference's reading)."""
    code, a, rb, sigma, until, sampled = row_rules[b].tolist()
    return AcceptRule(RULES[int(code)], a, rb), sigma, int(until), bool(sampled)
SAMPLING_RULES = ("exact", "typical", "threshold", "kl", "topk")  # fly's "matches the target" is a greedy notion


class VerifyResult(NamedTuple):
    """Everything one verification block produces (B rows, K draft tokens, V vocabulary)."""

    entropy: torch.Tensor  # [B, K+1] fp32, natural log, of the (temperature-scaled) target distribution
    token_prob: torch.Tensor  # [B, K] fp32, p_target(d_i)
    argmax: torch.Tensor  # [B, K+1] int64, lowest index on ties
    pivot_prob: torch.Tensor  # [B, K] fp32, 1.0 where no classifier
    accepted: torch.Tensor  # [B, K] bool, the accepted prefix only (False after the first rejection)
    pivot_accepted: torch.Tensor  # [B, K] bool, accepted though the exact rule rejected it (classifier or rule)
    num_accepted: torch.Tensor  # [B] int64
    next_token: torch.Tensor  # [B] int64, correction token, or bonus token when all K are accepted
    top3_entropy: torch.Tensor  # [B, K+1] fp32, -sum p log p over the 3 most likely tokens (full softmax)
    divergence: torch.Tensor  # [B, K] fp32, KL(p || q) of target and draft per draft position; -1 without draft_logits


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
        top3_entropy=torch.empty(B, K + 1, **f32),
        divergence=torch.empty(B, K, **f32),
    )


class Workspace:
    """Outputs of ``verify_block`` allocated once for blocks of up to ``rows`` rows and ``k`` drafts and
    reused: ``result(b, k)`` views the first elements of each buffer as a contiguous ``VerifyResult`` of
    shape (b, k), so a decode loop whose rows leave or whose blocks shrink allocates nothing per block, and
    a fixed (b, k) always gets the same memory (what a captured CUDA graph needs)."""

    def __init__(self, rows: int, k: int, device):
        self.rows, self.k = rows, k
        self.buffers = empty_result(rows, k, device)
        self._views: dict[tuple[int, int], VerifyResult] = {}

    def result(self, b: int, k: int) -> VerifyResult:
        if not (0 <= b <= self.rows and 0 <= k <= self.k):
            raise ValueError(f"a workspace for {self.rows} rows and K = {self.k} cannot hold {b} rows and K = {k}")
        if (b, k) not in self._views:
            shapes = empty_result(b, k, "meta")
            self._views[(b, k)] = VerifyResult(*(buf.flatten()[: s.numel()].view(s.shape)
                                                 for buf, s in zip(self.buffers, shapes)))
        return self._views[(b, k)]


def extension_inputs(hidden, classifier, classifier_bias, temperature, draft_probs, uniforms, exponentials,
                     device) -> list:
    """The optional inputs of the compiled backends' ``verify_block_out``, in order: hidden, w1, b1, w2, b2,
    classifier_bias, draft_probs, uniforms, exponentials; contiguous, fp32 where the kernels read fp32, None
    where unused."""

    def f32(t):
        return None if t is None else t.to(device=device, dtype=torch.float32).contiguous()

    clf = [*(f32(t) for t in classifier), f32(classifier_bias)] if classifier is not None else [None] * 5
    draws = [f32(t) for t in (draft_probs, uniforms, exponentials)] if temperature > 0 else [None] * 3
    return [hidden.contiguous() if classifier is not None else None, *clf, *draws]
