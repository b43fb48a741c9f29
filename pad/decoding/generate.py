"""The drop-in decode function: speculative decoding with exact or pivot-aware acceptance."""
from __future__ import annotations

import math
import os
import warnings
from dataclasses import dataclass

import torch

from pad_kernels import Workspace, verify_block
from pad_kernels.types import SAMPLING_RULES
from pad_kernels.verify import check_rule

from ..machine import available_memory
from ..models.classifier import PivotClassifier
from . import speculative
from .decoder import Decoder, left_pad
from .draft_length import DEFAULT_MAX_DRAFT_TOKENS, AutoDraftLength, FixedDraftLength
from .drafters import NEEDS_MODEL, Drafter, Sampling, make_drafter
from .hf import eos_ids, kv_bytes_per_token, shared_vocab_size
from .policy import NAMES as POLICIES
from .policy import DEFAULT_SIGMA, Policy, parse_policy
from .rows import RowBatch
from .sampling import warp_logits
from .speculative import Acceptance, nonfinite_error, random_draws
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


def runs_draft_model(policy: str | None, drafter: str | None = "model") -> bool:
    """Whether ``generate`` under the policy named ``policy`` (None: the default, speculative) and the drafter
    named ``drafter`` runs the draft model: the draft alone, or a speculative policy drafting with the model
    or hybrid. Commands load the draft only where this holds."""
    return policy == "draft" or (policy != "target" and drafter in NEEDS_MODEL)


def option_conflicts(policy, *, drafter=None, draft_stop=None, num_draft_tokens=DEFAULT_K, max_draft_tokens=None,
                     temperature: float = 0.0, judge_free: bool = False) -> list[tuple[str, str, str]]:
    """The pairs of ``generate``'s options that cannot go together, as (option, option, why), found from the
    options alone (no model): ``generate`` raises the first, and the command line refuses them before loading
    anything. ``policy``: a name or ``Policy``; ``drafter``: a name or a ``Drafter``."""
    p = parse_policy(policy)
    name = drafter if isinstance(drafter, str) or drafter is None else getattr(drafter, "name", "custom")
    one_model = p.name in ("target", "draft")
    out = []
    if one_model and drafter is not None:
        out.append(("policy", "drafter", f"policy {p.name!r} decodes with one model: a drafter applies to "
                                         "speculative policies only"))
    if one_model and draft_stop is not None:
        out.append(("policy", "draft_stop", "draft_stop stops a draft model's drafting: it applies to speculative "
                                            "policies only"))
    elif draft_stop is not None and name not in (None, *NEEDS_MODEL):
        out.append(("drafter", "draft_stop", f"draft_stop stops a draft model's drafting; drafter {name!r} runs none"))
    if p.rule.needs_draft_logits and isinstance(drafter, str) and drafter != "model":
        out.append(("policy", "drafter", f"policy {p.name!r} reads the draft's distribution, which drafter "
                                         f"{drafter!r} does not give: use the model drafter, or a rule that reads "
                                         "the target alone"))
    if temperature > 0 and p.rule.name not in SAMPLING_RULES:
        out.append(("policy", "temperature", f"the {p.rule.name} rule is defined for greedy decoding only "
                                             f"(temperature 0); with sampling use one of {', '.join(SAMPLING_RULES)}"))
    if judge_free and p.name != "pivot":
        out.append(("policy", "judge_free", f"judge_free lets the pivot classifier judge draft-free proposals; "
                                            f"policy {p.name!r} has no classifier"))
    if max_draft_tokens is not None and num_draft_tokens != "auto" and not isinstance(num_draft_tokens,
                                                                                     AutoDraftLength):
        out.append(("num_draft_tokens", "max_draft_tokens", "max_draft_tokens caps num_draft_tokens='auto'; with a "
                                                            "fixed K, give only num_draft_tokens"))
    return out


def _check_options(policy: Policy, exact_prefix, judge_free, **options) -> None:
    """generate's option types, then the first of ``option_conflicts`` (``options``: its keywords)."""
    if not isinstance(exact_prefix, int) or isinstance(exact_prefix, bool) or exact_prefix < 0:
        raise ValueError(f"exact_prefix must be an integer >= 0, got {exact_prefix!r}")
    if not isinstance(judge_free, bool):
        raise ValueError(f"judge_free must be True or False, got {judge_free!r}")
    for _, _, why in option_conflicts(policy, judge_free=judge_free, **options):
        raise ValueError(why)


def _drafter(policy: Policy, drafter, draft, target, draft_stop) -> Drafter | None:
    """generate's drafter arguments -> the ``Drafter`` of a speculative policy (None for one model alone)."""
    if policy.name in ("target", "draft"):
        return None
    drafter = make_drafter("model" if drafter is None else drafter, draft, target=target, draft_stop=draft_stop)
    if policy.rule.needs_draft_logits and not drafter.has_logits:
        raise ValueError(f"policy {policy.name!r} reads the draft's distribution, which drafter {drafter.name!r} does "
                         "not give: use drafter='model' (a draft model), or a rule that reads the target alone")
    return drafter


def _draft_length(num_draft_tokens, max_draft_tokens):
    """generate's K arguments -> an int K or an ``AutoDraftLength``."""
    if isinstance(num_draft_tokens, str):
        if num_draft_tokens != "auto":
            raise ValueError(f"num_draft_tokens must be an integer >= 1 or 'auto', got {num_draft_tokens!r}")
        return AutoDraftLength(DEFAULT_MAX_DRAFT_TOKENS if max_draft_tokens is None else max_draft_tokens)
    return num_draft_tokens  # max_draft_tokens with a fixed K: option_conflicts


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
    drafter: str | Drafter | None = None,
    exact_prefix: int = 0,
    judge_free: bool = False,
) -> GenerationResult:
    """Decode with a target HuggingFace causal LM and a drafter: a draft model sharing its tokenizer, or a
    draft-free drafter (prompt lookup, suffix counts), or both.

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
    drafter: what proposes the drafts (``pad.decoding.drafters``): ``"model"`` (the draft model; the default
    when ``draft`` is given), ``"lookup"`` (prompt lookup: the tokens that followed the latest earlier
    occurrence of the row's last n-gram; no draft model needed), ``"suffix"`` (the most frequent continuation
    over the row's context and this process's earlier outputs), ``"hybrid"`` (lookup where its match is long
    enough, else the draft model; with ``"auto"`` each source's acceptance is estimated apart, and lookup alone
    is also weighed in blocks where that is predicted faster), or a ``Drafter`` of your own. Every rule but
    ``kl`` reads the target alone and works with any drafter (pivot's classifier judging a draft model's drafts
    only, unless ``judge_free``); ``kl`` needs the draft's distribution (``model``).
    exact_prefix: each row's first ``exact_prefix`` new tokens are decided by the exact rule, later ones by
    the policy. A model's refusals of harmful requests are decided mostly in the first tokens of its reply
    (Qi et al., "Safety Alignment Should Be Made More Than Just a Few Tokens Deep", arXiv 2406.05946), which
    a relaxed rule could otherwise accept from the draft; deciding them exactly keeps the target's own.
    judge_free: pivot only: the classifier also judges draft-free proposals (lookup, suffix, hybrid's lookup
    rows). False (the default): the exact rule decides those, and the classifier judges only a draft model's
    drafts, the kind of token its labels hold (a lookup copies tokens from the context, which the target may
    give almost no probability).
    On the CPU a warning says when the KV caches of every row run to its budget exceed the memory left.
    Returns ``GenerationResult(sequences [B, P + N], stats, lengths [B], row_stats)``.
    """
    parsed = parse_policy(policy) if policy is not None else Policy("pivot" if classifier is not None else "exact")
    policy, rule = parsed.name, parsed.rule
    if parsed.sigma is not None:
        sigma = parsed.sigma
    _check_options(parsed, exact_prefix, judge_free, drafter=drafter, draft_stop=draft_stop, temperature=temperature,
                   num_draft_tokens=num_draft_tokens, max_draft_tokens=max_draft_tokens)
    check_rule(rule, temperature)  # the rule's settings (a greedy-only rule with sampling: option_conflicts)
    num_draft_tokens = _draft_length(num_draft_tokens, max_draft_tokens)
    _check_args(policy, classifier, num_draft_tokens, sigma, floor, max_new_tokens, temperature, top_p)
    ids, prompts = _prompts(input_ids, attention_mask)
    drafter = _drafter(parsed, drafter, draft, target, draft_stop)
    main, vocab = _check_models(policy, target, draft, prompts)
    clf = _load_classifier(classifier, target) if policy == "pivot" else None
    eos = eos_ids(main, eos_token_id)
    pad = _pad_id(main, pad_token_id, eos)
    uses = {"target": (target,), "draft": (draft,)}.get(policy) or (
        (target, draft) if getattr(drafter, "model", None) is not None else (target,))
    _warn_if_memory_short(uses, prompts, max_new_tokens)

    sampling = _sampling(temperature, top_p, seed, next(main.parameters()).device)
    batch = RowBatch(prompts, max_new_tokens, eos, vocab=vocab, callback=callback, single=ids.shape[0] == 1)
    acceptance = Acceptance(rule, clf, sigma if clf is not None else 0.0, floor, backend, exact_prefix, judge_free)
    if max_new_tokens > 0:  # else nothing to decode: the prompt as given, no forward
        _decode(batch, policy, draft if policy == "draft" else target, drafter, num_draft_tokens, acceptance, sampling)
    lengths = torch.tensor([len(n) for n in batch.new], dtype=torch.long)
    return GenerationResult(sequences=_sequences(ids, batch.new, lengths, pad), stats=batch.total(),
                            lengths=lengths, row_stats=batch.stats)


def _decode(batch: RowBatch, policy: str, model, drafter: Drafter | None, num_draft_tokens,
            acceptance: Acceptance, sampling: Sampling) -> None:
    """Decode ``batch`` in place: ``model`` alone, step by step (the target or draft policy), else ``model``
    (the target) verifying ``drafter``'s proposals, K tokens a block (``num_draft_tokens``: an int or an
    ``AutoDraftLength``), judged by ``acceptance``."""
    with torch.inference_mode():
        dec = Decoder(model, batch.vocab, len(batch.prompts))
        if policy in ("target", "draft"):
            _decode_alone(dec, batch, policy, sampling, acceptance.backend)
            return
        length = num_draft_tokens if isinstance(num_draft_tokens, AutoDraftLength) else FixedDraftLength(
            num_draft_tokens)
        speculative.decode(dec, drafter, batch, length, acceptance, sampling)


def _check_models(policy: str, target, draft, prompts: list[list[int]]) -> tuple:
    """(the model that decodes alone or verifies, the vocabulary both score); raises where the policy lacks its
    model or a prompt token lies outside that vocabulary, warns (at ``generate``'s caller) of a model in
    training mode."""
    if draft is None and policy == "draft":
        raise ValueError(f"policy {policy!r} needs a draft model")
    if target is None and policy != "draft":
        raise ValueError(f"policy {policy!r} needs a target model")
    main = target if target is not None else draft
    vocab = shared_vocab_size(target, draft)
    if any(t < 0 or t >= vocab for row in prompts for t in row):
        raise ValueError(f"prompt token ids must lie in [0, {vocab})")
    for m in (target, draft):
        if m is not None and m.training:
            warnings.warn(f"{type(m).__name__} is in training mode (dropout active); call .eval() first", stacklevel=3)
    return main, vocab


def _sampling(temperature: float, top_p: float, seed: int | None, device) -> Sampling:
    """Greedy at temperature 0; else sampled with a generator on ``device``, seeded when ``seed`` is set."""
    gen = None
    if temperature > 0:
        gen = torch.Generator(device=device)
        if seed is not None:
            gen.manual_seed(seed)
        else:
            gen.seed()
    return Sampling(temperature, top_p, gen)


def _sequences(ids: torch.Tensor, new: list[list[int]], lengths: torch.Tensor, pad: int) -> torch.Tensor:
    """[B, P + N]: the prompts ``ids`` [B, P] and each row's new tokens, rows shorter than the longest padded."""
    tail = torch.full((len(new), int(lengths.max()) if len(lengths) else 0), pad, dtype=torch.long)
    for i, n in enumerate(new):
        tail[i, : len(n)] = torch.tensor(n, dtype=torch.long)
    return torch.cat([ids.cpu(), tail], 1).to(ids.device)


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


def _decode_alone(dec: Decoder, batch: RowBatch, policy: str, sampling: Sampling, backend) -> None:
    """Autoregressive decoding with one model (the target or draft policy), all live rows at once."""
    pending = [list(p) for p in batch.prompts]  # committed tokens the model has not seen, per batch row
    batch.followers.append(dec)
    steps = 0
    workspace = Workspace(len(batch), 0, dec.device)  # the op's outputs, reused by every step
    while batch.live:
        b = len(batch)
        ids, fed = left_pad(pending, dec.device)
        logits = warp_logits(dec.forward(ids, fed, keep=1), sampling.temperature, sampling.top_p)
        uniforms, exponentials = random_draws(sampling.generator, b, 0, dec.vocab, dec.device)
        res = verify_block(
            logits, torch.empty((b, 0), dtype=torch.long, device=dec.device), temperature=sampling.temperature,
            uniforms=uniforms, exponentials=exponentials,
            draft_probs=logits.new_zeros((b, 0, dec.vocab), dtype=torch.float32) if uniforms is not None else None,
            backend=backend, out=workspace,
        )
        host = torch.cat([res.next_token, (~torch.isfinite(res.entropy).all()).long()[None]]).tolist()
        tokens, bad = host[:b], host[b]
        if bad:
            raise nonfinite_error(steps)
        steps += 1
        finished = []
        for j in range(b):
            s = batch.row_stats(j)
            if policy == "target":
                s.target_forwards += 1
            else:
                s.draft_forwards += 1
            if batch.commit(j, [tokens[j]])[1]:
                finished.append(j)
        pending = [[t] for t in tokens]
        keep = batch.end_block(finished)
        pending = [pending[j] for j in keep]
