"""The drop-in decode function: speculative decoding with exact or pivot-aware acceptance."""
from __future__ import annotations

import math
import os
import time
import warnings
from dataclasses import dataclass

import torch

from pad_kernels import AcceptRule, FoldedClassifier, Workspace, verify_block
from pad_kernels.verify import check_rule

from ..evaluation.machine import available_memory
from ..pivots.classifier import PivotClassifier
from .decoder import Decoder, left_pad
from .draft_length import DEFAULT_MAX_DRAFT_TOKENS, AutoDraftLength, ForwardCost, synchronize
from .hf import LayerCapture, eos_ids, kv_bytes_per_token, shared_vocab_size, vocab_size
from .policy import NAMES as POLICIES
from .policy import DEFAULT_SIGMA, Policy, parse_policy
from .stats import GenerationStats

# Bumped whenever a change to the decode path can change the tokens, counts or timings it produces:
# benchmark run logs record it and never reuse a run of another version.
DECODE_VERSION = 2
# Draft tokens per block when none is asked for: the K of the shipped classifier's tables (bench/ and docs/).
DEFAULT_K = 8


@dataclass
class GenerationResult:
    sequences: torch.Tensor  # [B, P + N] int64: the input as given, then each row's new tokens, right-padded
    stats: GenerationStats  # summed over rows (wall time and tokens/s: of the whole call)
    lengths: torch.Tensor | None = None  # [B] int64: new tokens per row, its EOS included
    row_stats: list[GenerationStats] | None = None  # one per row


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
    if not isinstance(num_draft_tokens, AutoDraftLength) and (
            not isinstance(num_draft_tokens, int) or isinstance(num_draft_tokens, bool) or num_draft_tokens < 1):
        raise ValueError(f"num_draft_tokens must be an integer >= 1 or 'auto', got {num_draft_tokens!r}")
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


def _stack_draft_logits(draft_logits: list, target_logits: torch.Tensor) -> torch.Tensor:
    """The draft's logits of a block's k steps ([b, V] each) as [b, k, V] in the target logits' dtype (the
    fused op reads both in one type); an empty [b, 0, V] for a block without drafts."""
    b, _, V = target_logits.shape
    if not draft_logits:
        return target_logits.new_empty((b, 0, V))
    return torch.stack(draft_logits, 1).to(target_logits.dtype)


def _draft_length(num_draft_tokens, max_draft_tokens):
    """generate's K arguments -> an int K or an ``AutoDraftLength``."""
    if isinstance(num_draft_tokens, str):
        if num_draft_tokens != "auto":
            raise ValueError(f"num_draft_tokens must be an integer >= 1 or 'auto', got {num_draft_tokens!r}")
        return AutoDraftLength(DEFAULT_MAX_DRAFT_TOKENS if max_draft_tokens is None else max_draft_tokens)
    if max_draft_tokens is not None:
        raise ValueError("max_draft_tokens caps num_draft_tokens='auto'; with a fixed K, give only num_draft_tokens")
    return num_draft_tokens


def _prompts(input_ids, attention_mask) -> tuple[torch.Tensor, list[list[int]]]:
    """(input_ids as [B, P] int64, each row's tokens without its left padding); raises for bad shapes,
    right padding, rows of only padding and empty prompts."""
    ids = torch.as_tensor(input_ids)
    if ids.dim() == 1:
        ids = ids[None]
    if ids.dim() != 2 or ids.dtype not in (torch.int64, torch.int32) or ids.shape[0] == 0:
        raise ValueError(f"input_ids must be integer token ids of shape [B, P], got {ids.dtype} {tuple(ids.shape)}")
    ids = ids.long()
    if ids.shape[1] == 0:
        raise ValueError("the prompt is empty: give at least one token")
    if attention_mask is None:
        return ids, ids.tolist()
    mask = torch.as_tensor(attention_mask)
    if mask.dim() == 1 and ids.shape[0] == 1:
        mask = mask[None]
    if tuple(mask.shape) != tuple(ids.shape):
        raise ValueError(f"attention_mask must have the shape of input_ids {tuple(ids.shape)}, got {tuple(mask.shape)}")
    if not ((mask == 0) | (mask == 1)).all():
        raise ValueError("attention_mask must hold only 0 (padding) and 1 (tokens)")
    mask = mask.bool().cpu()
    rows = []
    for i, (row, m) in enumerate(zip(ids.tolist(), mask)):
        if not m.any():
            raise ValueError(f"row {i} of the batch is only padding: give every row at least one token")
        first = int(m.long().argmax())
        if not m[first:].all():
            raise ValueError(f"row {i}: attention_mask must be ones after optional left padding "
                             "(right padding is not supported: pad on the left)")
        rows.append(row[first:])
    return ids, rows


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
    policy: str | Policy | None = None,
    classifier=None,
    num_draft_tokens: int | str | AutoDraftLength = DEFAULT_K,
    max_draft_tokens: int | None = None,
    sigma: float = DEFAULT_SIGMA,
    floor: float = 1e-4,
    max_new_tokens: int = 256,
    temperature: float = 0.0,
    top_p: float = 1.0,
    eos_token_id=None,
    pad_token_id: int | None = None,
    attention_mask=None,
    seed: int | None = None,
    backend: str | None = None,
    callback=None,
    draft_stop: float | None = None,
) -> GenerationResult:
    """Decode with a draft/target pair of HuggingFace causal LMs that share a tokenizer.

    input_ids: [B, P] (or [P]) prompt token ids, left-padded as ``attention_mask`` [B, P] says (1 = token).
    Every row decodes exactly as it would alone: each row accepts its own prefix of each block, and rows
    that finish (EOS or budget) leave the batch.
    policy: ``"target"`` (target alone), ``"draft"`` (draft alone), ``"exact"`` (standard speculative
    decoding, output distributed exactly as the target's), ``"pivot"`` or ``"pivot@SIGMA"`` (also accept a
    rejected draft token when ``pivot_prob <= sigma`` and ``p_target(token) >= floor``), or a training-free
    relaxation: ``"typical@EPSILON,DELTA"``, ``"threshold@TAU"``, ``"fly@GATE,WINDOW"`` (``pad.decoding.policy``; a
    parsed ``pad.Policy`` works too); None means ``"pivot"`` when a classifier is given, else ``"exact"``.
    classifier: a ``PivotClassifier`` or the folder it was saved to.
    num_draft_tokens: draft tokens per block (K), or ``"auto"``: before each block, the K in
    0..``max_draft_tokens`` (default 12) that maximises the batch's expected new tokens per second, from
    each model's measured forward cost and each row's acceptance so far (``pad.decoding.draft_length``;
    K = 0 is a plain target step). The first call in a process times a few forwards of each model at the
    batch's size first (seconds); later calls reuse those costs. Decisions are those of a fixed K of the
    same value: exact stays exact. An ``AutoDraftLength`` instance works too (its own cap and cost models).
    temperature 0 is greedy; > 0 samples (with top_p), reproducibly when ``seed`` is set.
    pad_token_id: fills the rows that end before the longest (default: the target's generation config,
    else its first EOS id).
    backend: verification backend (see ``pad_kernels.verify_block``).
    draft_stop: adaptive draft length: a row stops drafting in a block after a draft token at which the
    draft's own top probability is below ``draft_stop`` (that token is still verified);
    ``num_draft_tokens`` is then the most a block drafts. Rows stop at different steps; the block drafts
    on while any row goes on. None: always ``num_draft_tokens``.
    callback: called after every block as ``callback(tokens, stats)`` with the token ids it committed (for
    streaming): at B = 1 a list of ids, at B > 1 a list of B such lists (empty for rows that committed
    nothing); both caches are cropped to the committed tokens by then.
    On the CPU a warning says when the KV caches of every row run to its budget exceed the memory left.
    Returns ``GenerationResult(sequences [B, P + N], stats, lengths [B], row_stats)``.
    """
    parsed = parse_policy(policy) if policy is not None else Policy("pivot" if classifier is not None else "exact")
    policy, rule = parsed.name, parsed.rule
    if parsed.sigma is not None:
        sigma = parsed.sigma
    check_rule(rule, temperature)  # a greedy-only rule with sampling fails before any model runs
    num_draft_tokens = _draft_length(num_draft_tokens, max_draft_tokens)
    if draft_stop is not None and not (isinstance(draft_stop, (int, float)) and 0.0 <= draft_stop <= 1.0):
        raise ValueError(f"draft_stop must be None or a probability in [0, 1], got {draft_stop!r}")
    _check_args(policy, classifier, num_draft_tokens, sigma, floor, max_new_tokens, temperature, top_p)
    ids, prompts = _prompts(input_ids, attention_mask)
    if draft is None and policy != "target":
        raise ValueError(f"policy {policy!r} needs a draft model")
    if target is None and policy != "draft":
        raise ValueError(f"policy {policy!r} needs a target model")
    main = target if target is not None else draft
    vocab = shared_vocab_size(target, draft) if target is not None and draft is not None else vocab_size(main)
    if any(t < 0 or t >= vocab for row in prompts for t in row):
        raise ValueError(f"prompt token ids must lie in [0, {vocab})")
    clf = _load_classifier(classifier, target) if policy == "pivot" else None
    for m in (target, draft):
        if m is not None and m.training:
            warnings.warn(f"{type(m).__name__} is in training mode (dropout active); call .eval() first", stacklevel=2)
    eos = eos_ids(main, eos_token_id)
    pad = _pad_id(main, pad_token_id, eos)
    alone = {"target": (target,), "draft": (draft,)}
    _warn_if_memory_short(alone.get(policy, (target, draft)), prompts, max_new_tokens)

    rows = [GenerationStats(prompt_tokens=len(p)) for p in prompts]
    gen = None
    if temperature > 0:
        gen = torch.Generator(device=next(main.parameters()).device)
        if seed is not None:
            gen.manual_seed(seed)
        else:
            gen.seed()
    run = _Run(prompts, rows, max_new_tokens, eos, callback, ids.shape[0] == 1, time.perf_counter())
    with torch.inference_mode():
        if max_new_tokens == 0:  # nothing to decode: the prompt as given, no forward
            pass
        elif policy in ("target", "draft"):
            _decode_alone(Decoder(main if policy == "target" else draft, vocab, len(prompts)), run, policy,
                          temperature, top_p, gen, backend)
        else:
            _decode_speculative(Decoder(target, vocab, len(prompts)), Decoder(draft, vocab, len(prompts)), run, clf,
                                num_draft_tokens, sigma if clf is not None else 0.0, floor, temperature, top_p, gen,
                                backend, rule, draft_stop)
    stats = run.total()
    lengths = torch.tensor([len(n) for n in run.new], dtype=torch.long)
    tail = torch.full((len(prompts), int(lengths.max()) if len(lengths) else 0), pad, dtype=torch.long)
    for i, n in enumerate(run.new):
        tail[i, : len(n)] = torch.tensor(n, dtype=torch.long)
    sequences = torch.cat([ids.cpu(), tail], 1).to(ids.device)
    return GenerationResult(sequences=sequences, stats=stats, lengths=lengths, row_stats=rows)


def _warn_if_memory_short(models, prompts: list[list[int]], max_new_tokens: int) -> None:
    """Warn when the KV caches of a whole call on the CPU (every row run to its budget, as long as the
    longest: the batch's caches are padded) exceed the memory left: the system would kill the process
    without a message once the rows grow that far. Rows that stop early need less, hence a warning."""
    if next(models[0].parameters()).device.type != "cpu" or (free := available_memory()) is None:
        return
    tokens = len(prompts) * (max(map(len, prompts)) + max_new_tokens)
    need = tokens * sum(kv_bytes_per_token(m) for m in models)
    if need > free:
        warnings.warn(f"{len(prompts)} rows of up to {tokens // len(prompts)} tokens need up to {need / 2**30:.2f} GiB "
                      f"of KV cache, more than the {free / 2**30:.2f} GiB of memory left: decode fewer rows at a "
                      "time or fewer new tokens", stacklevel=3)


def _pad_id(model, pad_token_id, eos: set[int]) -> int:
    """``pad_token_id``, else the generation config's pad token, else its first EOS id. Without any stop
    token every row runs to the same budget, so nothing is padded and 0 serves."""
    config = getattr(model, "generation_config", None)
    for candidate in (pad_token_id, getattr(config, "pad_token_id", None), getattr(config, "eos_token_id", None)):
        if isinstance(candidate, (list, tuple)):
            candidate = candidate[0] if candidate else None
        if candidate is not None:
            return int(candidate)
    return min(eos) if eos else 0


class _Run:
    """Per-row state of one call: the new tokens, stats and budget of each row, and the live rows."""

    def __init__(self, prompts, rows, max_new_tokens, eos, callback, single, start):
        self.prompts = prompts
        self.new = [[] for _ in prompts]
        self.rows = rows
        self.live = list(range(len(prompts)))  # batch row j is row live[j] of the call
        self.max_new_tokens = max_new_tokens
        self.eos = eos
        self.callback = callback
        self.single = single
        self.start = start
        self._block: list[list[int]] = []
        self.draft_lengths: dict[int, int] = {}  # K -> blocks
        self.timed = []  # (predicted, measured) seconds of the blocks whose K was chosen

    def record_block(self, k: int, predicted: float, seconds: float) -> None:
        self.draft_lengths[k] = self.draft_lengths.get(k, 0) + 1
        if math.isfinite(predicted):
            self.timed.append((predicted, seconds))

    def budget(self, r: int) -> int:
        return self.max_new_tokens - len(self.new[r])

    def commit(self, r: int, tokens: list[int]) -> tuple[list[int], bool]:
        """Commit row r's tokens cut at its budget and after an EOS; returns (kept, finished)."""
        kept, done = _commit(tokens, self.budget(r), self.eos)
        self.new[r] += kept
        self.rows[r].new_tokens = len(self.new[r])
        if self.callback is not None:
            self._block.append((r, kept))
        if done:
            self.rows[r].wall_time = time.perf_counter() - self.start
        return kept, done

    def end_block(self, finished: list[int]) -> list[int]:
        """Call the callback, drop finished batch rows (indices into ``live``); returns the kept indices."""
        if self.callback is not None:
            if self.single:
                self.callback(self._block[0][1] if self._block else [], self.rows[0])
            else:
                by_row = [[] for _ in self.new]
                for r, kept in self._block:
                    by_row[r] = kept
                self.callback(by_row, self.total())
            self._block = []
        keep = [j for j in range(len(self.live)) if j not in set(finished)]
        self.live = [self.live[j] for j in keep]
        return keep

    def total(self) -> GenerationStats:
        total = GenerationStats()
        for s in self.rows:
            for name in ("target_forwards", "draft_forwards", "drafted", "accepted", "relaxed_accepted", "new_tokens",
                         "prompt_tokens"):
                setattr(total, name, getattr(total, name) + getattr(s, name))
        total.wall_time = time.perf_counter() - self.start
        total.draft_lengths = dict(sorted(self.draft_lengths.items()))
        total.predicted_time = sum(p for p, _ in self.timed)
        total.timed_blocks_time = sum(m for _, m in self.timed)
        total.block_time_error = (sum(abs(p - m) / m for p, m in self.timed) / len(self.timed)
                                  if self.timed else math.nan)
        return total


def _commit(tokens: list[int], budget: int, eos: set[int]) -> tuple[list[int], bool]:
    """Cut ``tokens`` at the token budget and after the first EOS; returns (kept, finished)."""
    tokens = tokens[:budget]
    for i, t in enumerate(tokens):
        if t in eos:
            return tokens[: i + 1], True
    return tokens, len(tokens) == budget


def _random_draws(gen, rows, shape_k, vocab, device):
    if gen is None:
        return None, None
    uniforms = torch.rand((rows, shape_k), generator=gen, device=device)
    exponentials = torch.empty((rows, vocab), device=device).exponential_(generator=gen)
    return uniforms, exponentials


def _nonfinite_error(block: int) -> FloatingPointError:
    return FloatingPointError(
        f"the model produced non-finite logits (NaN or inf) in block {block}; check its weights and dtype"
    )


def _decode_alone(dec, run, policy, temperature, top_p, gen, backend) -> None:
    """Autoregressive decoding with one model (the target or draft policy), all live rows at once."""
    pending = [list(p) for p in run.prompts]  # committed tokens the model has not seen, per batch row
    steps = 0
    workspace = Workspace(len(run.live), 0, dec.device)  # the op's outputs, reused by every step
    while run.live:
        b = len(run.live)
        ids, fed = left_pad(pending, dec.device)
        logits = warp_logits(dec.forward(ids, fed, keep=1), temperature, top_p)
        uniforms, exponentials = _random_draws(gen, b, 0, dec.vocab, dec.device)
        res = verify_block(
            logits, torch.empty((b, 0), dtype=torch.long, device=dec.device), temperature=temperature,
            uniforms=uniforms, exponentials=exponentials,
            draft_probs=logits.new_zeros((b, 0, dec.vocab), dtype=torch.float32) if gen is not None else None,
            backend=backend, out=workspace,
        )
        host = torch.cat([res.next_token, (~torch.isfinite(res.entropy).all()).long()[None]]).tolist()
        tokens, bad = host[:b], host[b]
        if bad:
            raise _nonfinite_error(steps)
        steps += 1
        finished = []
        for j, r in enumerate(run.live):
            if policy == "target":
                run.rows[r].target_forwards += 1
            else:
                run.rows[r].draft_forwards += 1
            if run.commit(r, [tokens[j]])[1]:
                finished.append(j)
        pending = [[t] for t in tokens]
        keep = run.end_block(finished)
        if finished and run.live:
            dec.select(keep)
            pending = [pending[j] for j in keep]


def _decode_speculative(tgt, drf, run, clf, lengths, sigma, floor, temperature, top_p, gen,
                        backend, rule: AcceptRule = AcceptRule(), draft_stop: float | None = None) -> None:
    """Draft K tokens for every live row, verify all rows in one target forward, accept a prefix per row,
    commit, mark each row's rejected columns as holes, drop finished rows. ``lengths``: K of every block
    (int) or an ``AutoDraftLength`` that chooses each block's K (0: a plain target step)."""
    folded: FoldedClassifier | None = clf.fold().to(tgt.device) if clf is not None else None
    capture = LayerCapture(tgt.model, clf.layer) if clf is not None else None
    # Committed tokens each model has not seen yet, per batch row (first: the whole prompt).
    pend_t, pend_d = [list(p) for p in run.prompts], [list(p) for p in run.prompts]
    blocks = 0
    auto = lengths if isinstance(lengths, AutoDraftLength) else None
    top = auto.max_draft_tokens if auto is not None else lengths
    workspace = Workspace(len(run.live), top, tgt.device)  # the op's outputs, reused by every block
    if auto is not None:
        auto.bind(tgt.model, drf.model, len(run.live), max(map(len, run.prompts)))
        acceptance = auto.acceptance(tgt.model, drf.model, (rule, sigma, floor, clf is not None and id(clf),
                                                             temperature, top_p, draft_stop), len(run.live))
    clock = _ForwardClock(auto)
    try:
        while run.live:
            b = len(run.live)
            start = time.perf_counter()
            # Never draft past the largest budget: k drafts and one correction/bonus token make at most k + 1.
            limit = max(run.budget(r) for r in run.live)
            if auto is not None:
                k, predicted = auto.choose(
                    acceptance.estimates(), tgt.width, drf.width, target_pending=max(map(len, pend_t)),
                    draft_pending=max(map(len, pend_d)), limit=limit,
                    remaining=sum(run.budget(r) for r in run.live) / b)
            else:
                k, predicted = min(lengths, limit), math.nan

            # 1. Draft: k tokens autoregressively; the first forward also feeds the committed tokens it lacks.
            # With draft_stop, a row's own length ends after a draft step whose top probability is low, and
            # drafting ends when every row has stopped (one host sync per draft step).
            ids, fed = left_pad(pend_d, drf.device) if k else (None, None)
            drafts, draft_probs, draft_logits = [], [], []
            stops = torch.full((b,), k, dtype=torch.long) if draft_stop is not None and k else None
            for step in range(k):
                logits = clock.forward(drf, ids, fed, 1, draft=True)[:, -1]  # [b, V]
                if rule.needs_draft_logits:  # the distribution the draft samples from, as the target's below
                    draft_logits.append(warp_logits(logits, temperature, top_p).to(tgt.device))
                if gen is not None:
                    q = sampling_probs(logits, temperature, top_p).to(tgt.device)  # the generator's device
                    ids = torch.multinomial(q, 1, generator=gen)
                    draft_probs.append(q)
                else:
                    ids = logits.argmax(-1, keepdim=True)
                fed = torch.ones((b, 1), dtype=torch.bool)
                drafts.append(ids)
                if stops is not None:
                    top_prob = (q if gen is not None else torch.softmax(logits.float(), -1)).max(-1).values.cpu()
                    stops = torch.where((stops == k) & (top_prob < draft_stop), step + 1, stops)
                    if bool((stops <= step + 1).all()):
                        break
            k = len(drafts)  # fewer than asked when every row stopped (each length is then <= that)
            draft_tokens = (torch.cat(drafts, 1) if k else torch.empty((b, 0), dtype=torch.long)).to(tgt.device)

            # 2. Verify: one target forward over [unseen committed..., d_1..d_k] of every row, then the fused op.
            # A block without drafts (k = 0) is a plain target step: nothing for the classifier to judge.
            ids, fed = left_pad(pend_t, tgt.device)
            judge = capture is not None and k > 0
            if capture is not None:
                capture.keep = k + 1
            target_logits = clock.forward(tgt, torch.cat([ids, draft_tokens], 1),
                                          torch.cat([fed, torch.ones((b, k), dtype=torch.bool)], 1), k + 1, draft=False)
            uniforms, exponentials = _random_draws(gen, b, k, tgt.vocab, tgt.device)
            if gen is not None:
                draft_probs = (torch.stack(draft_probs, 1) if k else
                               target_logits.new_zeros((b, 0, tgt.vocab), dtype=torch.float32)).to(tgt.device)
            res = verify_block(
                warp_logits(target_logits, temperature, top_p), draft_tokens,
                capture.value if judge else None, folded if judge else None,
                sigma=sigma, floor=floor, temperature=temperature,
                draft_probs=draft_probs if gen is not None else None,
                uniforms=uniforms, exponentials=exponentials, rule=rule, backend=backend,
                num_drafts=stops.to(tgt.device) if stops is not None else None, out=workspace,
                draft_logits=_stack_draft_logits(draft_logits, target_logits) if rule.needs_draft_logits else None,
            )

            # 3. Accept: the block's only device-to-host sync.
            bad = (~torch.isfinite(res.entropy).all()).long()[None]
            host = torch.cat([res.num_accepted, res.next_token, bad, res.pivot_accepted.long().flatten(),
                              draft_tokens.flatten()]).tolist()
            accepted, tokens, bad = host[:b], host[b : 2 * b], host[2 * b]
            if bad:
                raise _nonfinite_error(blocks)
            pivot_flags = [host[2 * b + 1 + j * k : 2 * b + 1 + (j + 1) * k] for j in range(b)]
            drafted = [host[2 * b + 1 + b * k + j * k : 2 * b + 1 + b * k + (j + 1) * k] for j in range(b)]
            blocks += 1

            # 4. Commit each row's accepted prefix and its correction/bonus token; the columns of its rejected
            # drafts become holes (the target fed [last, d_1..d_k], the draft d_1..d_{k-1} last). Without
            # drafts the draft model did not run: the committed token joins what it has not seen yet.
            t_holes = torch.zeros((b, k + 1), dtype=torch.bool)
            d_holes = torch.zeros((b, max(k - 1, 0)), dtype=torch.bool)
            finished, verified = [], []
            for j, r in enumerate(run.live):
                n = accepted[j]
                # Alone, this row would have drafted only up to its own budget (and its own draft_stop
                # length): count those drafts only.
                k_row = min(k if stops is None else int(stops[j]), run.budget(r))
                verified.append(k if stops is None else int(stops[j]))
                kept, done = run.commit(r, drafted[j][:n] + [tokens[j]])
                c = len(kept)  # n + 1 unless an EOS or the budget cut the block short
                t_holes[j, c:] = True
                d_holes[j, min(n, c - 1) :] = True
                pend_t[j] = [tokens[j]]
                if not k:
                    pend_d[j] = pend_d[j] + [tokens[j]]
                else:
                    pend_d[j] = drafted[j][k - 1 :] + [tokens[j]] if n == k else [tokens[j]]
                # 5. Stats: count only draft tokens that were committed.
                s = run.rows[r]
                committed_drafts = min(n, len(kept))
                s.target_forwards += 1
                s.draft_forwards += k_row
                s.drafted += k_row
                s.accepted += committed_drafts
                s.relaxed_accepted += sum(pivot_flags[j][:committed_drafts])
                s.draft_lengths[k] = s.draft_lengths.get(k, 0) + 1
                if done:
                    finished.append(j)
            tgt.drop(t_holes)
            if k:
                drf.drop(d_holes)
            if auto is not None:
                if k:
                    acceptance.update(accepted, verified)
                seconds = time.perf_counter() - start
                auto.record_overhead(seconds - clock.take())
                run.record_block(k, predicted, seconds)
            else:
                run.record_block(k, math.nan, math.nan)
            keep = run.end_block(finished)
            if finished and run.live:  # finished rows leave the batch
                tgt.select(keep)
                drf.select(keep)
                pend_t, pend_d = [pend_t[j] for j in keep], [pend_d[j] for j in keep]
                if auto is not None:
                    acceptance.select(keep)
    finally:
        if capture is not None:
            capture.remove()
        if auto is not None:
            auto.remember(acceptance)


class _ForwardClock:
    """Times the decode's forwards into the cost models of an ``AutoDraftLength`` (nothing without one)."""

    def __init__(self, auto: AutoDraftLength | None):
        self.auto = auto
        self.seconds = 0.0  # forwards' time since the last ``take``

    def forward(self, dec: Decoder, ids: torch.Tensor, fed: torch.Tensor, keep: int, draft: bool) -> torch.Tensor:
        if self.auto is None:
            return dec.forward(ids, fed, keep)
        rows, tokens, columns = ids.shape[0], ids.shape[1], dec.width
        synchronize(dec.device)
        start = time.perf_counter()
        logits = dec.forward(ids, fed, keep)
        synchronize(dec.device)
        seconds = time.perf_counter() - start
        self.seconds += seconds
        cost = self.auto.draft_cost if draft else self.auto.target_cost
        if isinstance(cost, ForwardCost):
            cost.add(rows, tokens, columns, seconds)
        return logits

    def take(self) -> float:
        seconds, self.seconds = self.seconds, 0.0
        return seconds
