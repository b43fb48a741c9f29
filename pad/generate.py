"""The drop-in decode function: speculative decoding with exact or pivot-aware acceptance."""
from __future__ import annotations

import math
import os
import time
import warnings
from dataclasses import dataclass

import torch

from pad_kernels import FoldedClassifier, verify_block

from .classifier import PivotClassifier
from .hf import LayerCapture, crop_cache, eos_ids, forward_tail, shared_vocab_size, vocab_size
from .stats import GenerationStats

POLICIES = ("target", "draft", "exact", "pivot")
# Bumped whenever a change to the decode path can change the tokens, counts or timings it produces:
# benchmark run logs record it and never reuse a run of another version.
DECODE_VERSION = 2


@dataclass
class GenerationResult:
    sequences: torch.Tensor  # [1, P + N] int64: the prompt as given, then the new tokens
    stats: GenerationStats


class _Decoder:
    """One model and its KV cache; ``seen`` is how many tokens of the sequence the cache holds."""

    def __init__(self, model, vocab: int):
        self.model = model
        self.vocab = vocab
        self.device = next(model.parameters()).device
        self.cache = None
        self.seen = 0
        self.tokens_fed = 0

    def forward(self, ids: torch.Tensor, keep: int) -> torch.Tensor:
        """Feed ``ids`` [1, n] (tokens the cache has not seen); returns logits [1, keep, vocab]."""
        ids = ids.to(self.device)
        out = forward_tail(self.model, ids, keep, past_key_values=self.cache, use_cache=True)
        self.cache = out.past_key_values
        self.seen += ids.shape[1]
        self.tokens_fed += ids.shape[1]
        return out.logits[..., : self.vocab]

    def crop(self, length: int) -> None:
        """Forget every cached position from ``length`` on (rejected draft tokens)."""
        if self.seen > length:
            crop_cache(self.cache, length)
            self.seen = length


def warp_logits(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """Mask (to -inf) the tokens outside the top-p nucleus of ``softmax(logits / temperature)``.

    logits [..., V]; returned unscaled, so ``verify_block`` applies the temperature itself. The most likely
    token is always kept; greedy decoding (temperature 0) ignores top_p.
    """
    if temperature == 0 or top_p >= 1.0:
        return logits
    probs = torch.softmax(logits.float() / temperature, -1)
    sorted_probs, order = probs.sort(-1, descending=True)
    # Drop a token when the tokens ranked above it already hold top_p of the mass.
    drop_sorted = (sorted_probs.cumsum(-1) - sorted_probs) >= top_p
    drop = drop_sorted.scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def sampling_probs(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """The distribution sampled at ``temperature`` > 0 with top-p: logits [..., V] -> probs [..., V] fp32."""
    return torch.softmax(warp_logits(logits, temperature, top_p).float() / temperature, -1)


def _check_args(policy, classifier, num_draft_tokens, sigma, floor, max_new_tokens, temperature, top_p):
    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}; choose one of {', '.join(POLICIES)}")
    if not isinstance(num_draft_tokens, int) or num_draft_tokens < 1:
        raise ValueError(f"num_draft_tokens must be an integer >= 1, got {num_draft_tokens!r}")
    for name, value in (("sigma", sigma), ("floor", floor)):
        if not (isinstance(value, (int, float)) and 0.0 <= value <= 1.0):
            raise ValueError(f"{name} must be in [0, 1], got {value!r}")
    if not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be an integer >= 0, got {max_new_tokens!r}")
    if not (isinstance(temperature, (int, float)) and math.isfinite(temperature) and temperature >= 0):
        raise ValueError(f"temperature must be a finite number >= 0, got {temperature!r}")
    if not (isinstance(top_p, (int, float)) and 0.0 < top_p <= 1.0):
        raise ValueError(f"top_p must be in (0, 1], got {top_p!r}")
    if policy == "pivot" and classifier is None and sigma > 0:
        raise ValueError("policy 'pivot' needs a classifier (or sigma=0, which is the exact policy)")


def _prompt(input_ids, attention_mask) -> torch.Tensor:
    """The prompt as [1, P] int64 without left padding; raises for batches, empty prompts, bad masks."""
    ids = torch.as_tensor(input_ids)
    if ids.dim() == 1:
        ids = ids[None]
    if ids.dim() != 2 or ids.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"input_ids must be integer token ids of shape [1, P], got {ids.dtype} {tuple(ids.shape)}")
    if ids.shape[0] != 1:
        raise ValueError(f"batch size {ids.shape[0]} is not supported yet: pad.generate decodes one sequence at a time")
    ids = ids.long()
    if attention_mask is not None:
        mask = torch.as_tensor(attention_mask, device=ids.device).reshape(ids.shape).bool()[0]
        first = int(mask.long().argmax()) if mask.any() else ids.shape[1]
        if not mask[first:].all():
            raise ValueError("attention_mask must be ones after optional left padding (right padding is not supported)")
        ids = ids[:, first:]
    if ids.shape[1] == 0:
        raise ValueError("the prompt is empty: give at least one token")
    return ids


def _load_classifier(classifier, target) -> PivotClassifier | None:
    if classifier is None:
        return None
    if isinstance(classifier, (str, os.PathLike)):
        classifier = PivotClassifier.load(classifier)
    if not isinstance(classifier, PivotClassifier):
        raise TypeError(f"classifier must be a PivotClassifier or a folder it was saved to, got {type(classifier).__name__}")
    classifier.check_target(target)
    return classifier


def generate(
    target,
    draft,
    input_ids,
    *,
    policy: str | None = None,
    classifier=None,
    num_draft_tokens: int = 8,
    sigma: float = 0.5,
    floor: float = 1e-4,
    max_new_tokens: int = 256,
    temperature: float = 0.0,
    top_p: float = 1.0,
    eos_token_id=None,
    attention_mask=None,
    seed: int | None = None,
    backend: str | None = None,
    callback=None,
) -> GenerationResult:
    """Decode with a draft/target pair of HuggingFace causal LMs that share a tokenizer.

    input_ids: [1, P] or [P] prompt token ids (one sequence; left padding allowed via attention_mask).
    policy: ``"target"`` (target alone), ``"draft"`` (draft alone), ``"exact"`` (standard speculative
    decoding, output distributed exactly as the target's), ``"pivot"`` (also accept a rejected draft token
    when ``pivot_prob <= sigma`` and ``p_target(token) >= floor``); None means ``"pivot"`` when a classifier
    is given, else ``"exact"``. classifier: a ``PivotClassifier`` or the folder it was saved to.
    temperature 0 is greedy; > 0 samples (with top_p), reproducibly when ``seed`` is set.
    backend: verification backend (see ``pad_kernels.verify_block``).
    callback: called as ``callback(tokens, stats)`` after every block with the token ids it committed
    (for streaming); both caches are cropped to the committed tokens by then.
    Returns ``GenerationResult(sequences [1, P + N], stats)``.
    """
    policy = policy if policy is not None else ("pivot" if classifier is not None else "exact")
    _check_args(policy, classifier, num_draft_tokens, sigma, floor, max_new_tokens, temperature, top_p)
    prompt = _prompt(input_ids, attention_mask)
    if draft is None and policy != "target":
        raise ValueError(f"policy {policy!r} needs a draft model")
    if target is None and policy != "draft":
        raise ValueError(f"policy {policy!r} needs a target model")
    vocab = shared_vocab_size(target, draft) if target is not None and draft is not None else vocab_size(target if target is not None else draft)
    if int(prompt.max()) >= vocab or int(prompt.min()) < 0:
        raise ValueError(f"prompt token ids must lie in [0, {vocab})")
    clf = _load_classifier(classifier, target) if policy == "pivot" else None
    for m in (target, draft):
        if m is not None and m.training:
            warnings.warn(f"{type(m).__name__} is in training mode (dropout active); call .eval() first", stacklevel=2)

    stats = GenerationStats(prompt_tokens=prompt.shape[1])
    gen = None
    if temperature > 0:
        device = next((target if target is not None else draft).parameters()).device
        gen = torch.Generator(device=device)
        if seed is not None:
            gen.manual_seed(seed)
        else:
            gen.seed()
    eos = eos_ids(target if target is not None else draft, eos_token_id)
    start = time.perf_counter()
    with torch.inference_mode():
        if policy in ("target", "draft"):
            new = _decode_alone(
                _Decoder(target if policy == "target" else draft, vocab), prompt, policy, stats,
                max_new_tokens, temperature, top_p, eos, gen, backend, callback,
            )
        else:
            new = _decode_speculative(
                _Decoder(target, vocab), _Decoder(draft, vocab), prompt, clf, stats, num_draft_tokens,
                sigma if clf is not None else 0.0, floor, max_new_tokens, temperature, top_p, eos, gen, backend,
                callback,
            )
    stats.wall_time = time.perf_counter() - start
    sequences = torch.cat([torch.as_tensor(input_ids).reshape(1, -1).long().cpu(), torch.tensor([new], dtype=torch.long)], 1)
    return GenerationResult(sequences=sequences.to(prompt.device), stats=stats)


def _commit(tokens: list[int], budget: int, eos: set[int]) -> tuple[list[int], bool]:
    """Cut ``tokens`` at the token budget and after the first EOS; returns (kept, finished)."""
    tokens = tokens[:budget]
    for i, t in enumerate(tokens):
        if t in eos:
            return tokens[: i + 1], True
    return tokens, len(tokens) == budget


def _random_draws(gen, shape_k, vocab, device):
    if gen is None:
        return None, None
    uniforms = torch.rand((1, shape_k), generator=gen, device=device)
    exponentials = torch.empty((1, vocab), device=device).exponential_(generator=gen)
    return uniforms, exponentials


def _nonfinite_error(block: int) -> FloatingPointError:
    return FloatingPointError(
        f"the model produced non-finite logits (NaN or inf) in block {block}; check its weights and dtype"
    )


def _decode_alone(dec, prompt, policy, stats, max_new_tokens, temperature, top_p, eos, gen, backend,
                  callback) -> list[int]:
    """Autoregressive decoding with one model (the target or draft policy)."""
    seq, new = prompt.to(dec.device), []
    no_drafts = torch.empty((1, 0), dtype=torch.long, device=dec.device)
    while len(new) < max_new_tokens:
        logits = warp_logits(dec.forward(seq[:, dec.seen :], keep=1), temperature, top_p)
        uniforms, exponentials = _random_draws(gen, 0, dec.vocab, dec.device)
        res = verify_block(
            logits, no_drafts, temperature=temperature, uniforms=uniforms, exponentials=exponentials,
            draft_probs=logits.new_zeros((1, 0, dec.vocab), dtype=torch.float32) if gen is not None else None,
            backend=backend,
        )
        token, bad = torch.stack([res.next_token[0], ~torch.isfinite(res.entropy).all()]).tolist()
        if bad:
            raise _nonfinite_error(len(new))
        if policy == "target":
            stats.target_forwards += 1
        else:
            stats.draft_forwards += 1
        kept, done = _commit([token], max_new_tokens - len(new), eos)
        new += kept
        stats.new_tokens = len(new)
        seq = torch.cat([seq, res.next_token[:, None]], 1)  # stays on the device: no copy back
        if callback is not None:
            callback(kept, stats)
        if done:
            break
    return new


def _decode_speculative(tgt, drf, prompt, clf, stats, num_draft_tokens, sigma, floor, max_new_tokens,
                        temperature, top_p, eos, gen, backend, callback) -> list[int]:
    """Draft K tokens, verify them in one target forward, accept a prefix, commit, crop both caches."""
    folded: FoldedClassifier | None = clf.fold().to(tgt.device) if clf is not None else None
    capture = LayerCapture(tgt.model, clf.layer) if clf is not None else None
    seq, new = prompt.to(tgt.device), []
    try:
        while len(new) < max_new_tokens:
            # Never draft past the budget: k drafts and one correction/bonus token make at most k + 1.
            k = min(num_draft_tokens, max_new_tokens - len(new))

            # 1. Draft: k tokens autoregressively; the first forward also feeds committed tokens it lacks.
            ids, drafts, draft_probs = seq[:, drf.seen :], [], []
            for _ in range(k):
                logits = drf.forward(ids, keep=1)[:, -1]  # [1, V]
                if gen is not None:
                    q = sampling_probs(logits, temperature, top_p).to(tgt.device)  # the generator's device
                    ids = torch.multinomial(q, 1, generator=gen)
                    draft_probs.append(q)
                else:
                    ids = logits.argmax(-1, keepdim=True)
                drafts.append(ids)
            stats.draft_forwards += k
            draft_tokens = torch.cat(drafts, 1).to(tgt.device)  # [1, k]

            # 2. Verify: one target forward over [unseen committed..., d_1..d_k], then the fused op.
            if capture is not None:
                capture.keep = k + 1
            target_logits = tgt.forward(torch.cat([seq[:, tgt.seen :], draft_tokens], 1), keep=k + 1)
            stats.target_forwards += 1
            uniforms, exponentials = _random_draws(gen, k, tgt.vocab, tgt.device)
            res = verify_block(
                warp_logits(target_logits, temperature, top_p), draft_tokens,
                capture.value if capture is not None else None, folded,
                sigma=sigma, floor=floor, temperature=temperature,
                draft_probs=torch.stack(draft_probs, 1).to(tgt.device) if gen is not None else None,
                uniforms=uniforms, exponentials=exponentials, backend=backend,
            )

            # 3. Accept: the block's only device-to-host sync.
            bad = (~torch.isfinite(res.entropy).all()).long()[None]
            host = torch.cat([res.num_accepted, res.next_token, bad, res.pivot_accepted[0].long(), draft_tokens[0]])
            n, token, bad, *rest = host.tolist()
            if bad:
                raise _nonfinite_error(stats.target_forwards - 1)
            pivot_flags, drafted = rest[:k], rest[k:]

            # 4. Commit, then crop both caches to the committed tokens they hold (the last one is unseen).
            kept, done = _commit(drafted[:n] + [token], max_new_tokens - len(new), eos)
            new += kept
            stats.new_tokens = len(new)
            # Built from device tensors (a host list would be another synchronizing copy on GPUs).
            block = torch.cat([draft_tokens[:, :n], res.next_token[:, None]], 1)
            seq = torch.cat([seq, block[:, : len(kept)]], 1)
            tgt.crop(seq.shape[1] - 1)
            drf.crop(seq.shape[1] - 1)

            # 5. Stats: count only draft tokens that were committed.
            committed_drafts = min(n, len(kept))
            stats.drafted += k
            stats.accepted += committed_drafts
            stats.pivot_accepted += sum(pivot_flags[:committed_drafts])
            if callback is not None:
                callback(kept, stats)
            if done:
                break
    finally:
        if capture is not None:
            capture.remove()
    return new
