"""Pure-PyTorch reference of the fused verification op: the specification every backend must match.

Glossary: a *verification block* is the K+1 target positions scored in one forward over
``[last, d_1..d_K]``; row i of ``target_logits`` scores the token after position i, so row i judges draft
token ``d_{i+1}`` and row K gives the *bonus token*. A draft token is *accepted* by the exact rule
(greedy: ``d == argmax p``; sampling: ``u * q(d) <= p(d)``) or *pivot-accepted* when the classifier says
it is not a pivot (``sigma > 0``, ``pivot_prob <= sigma`` and ``p(d) >= floor``) or when a training-free
``AcceptRule`` allows it (typical, threshold, fly, kl, topk; see ``AcceptRule``). At the first rejection the
*correction token* is emitted (greedy: ``argmax p``; sampling: a draw from ``normalize(max(0, p - q))``).
Random draws are inputs: ``uniforms`` for the acceptance test and one exponential per vocabulary entry for
the single categorical draw of a row (an exponential race: ``argmax_v r_v / e_v`` is a sample of ``r``).
"""
from __future__ import annotations

import torch

from .types import AcceptRule, FoldedClassifier, VerifyResult, rule_of_row

# An exponential draw of exactly 0 would turn 0/0 into NaN in the race; clamp it to a tiny positive value.
MIN_EXPONENTIAL = 1e-30


def residual_probs(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Unnormalized correction distribution ``max(0, p - q)``; falls back to ``p`` where it is all zero.

    p, q: [B, V] fp32. Returns [B, V].
    """
    r = (p - q).clamp_min(0.0)
    return torch.where(r.sum(-1, keepdim=True) > 0, r, p)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Natural-log entropy of softmax(logits) over the last dim; ``-inf`` logits count as zero mass.

    NaN or +inf logits give NaN, a row of only ``-inf`` gives ``-inf``: callers treat non-finite as an error.
    """
    lse = torch.logsumexp(logits, -1, keepdim=True)
    probs = torch.exp(logits - lse)
    plogit = torch.where(logits == float("-inf"), 0.0, probs * logits)
    return lse.squeeze(-1) - plogit.sum(-1)


def top3_entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """-sum p log p over the (up to) 3 largest probabilities of softmax(logits) over the last dim; the
    probabilities are the full softmax's, not renormalized over the three; zero mass counts as zero."""
    lse = torch.logsumexp(logits, -1, keepdim=True)
    top = logits.topk(min(3, logits.shape[-1]), -1).values
    logp = top - lse
    return -torch.where(top == float("-inf"), 0.0, torch.exp(logp) * logp).sum(-1)


def kl_divergence(logits: torch.Tensor, draft_logits: torch.Tensor) -> torch.Tensor:
    """KL(p || q) = sum p (log p - log q) of p = softmax(logits), q = softmax(draft_logits) over the last dim
    (fp32); a token p gives no mass adds 0, one q gives no mass where p does makes it +inf."""
    logp = torch.log_softmax(logits, -1)
    logq = torch.log_softmax(draft_logits, -1)
    return torch.where(logp == float("-inf"), 0.0, logp.exp() * (logp - logq)).sum(-1)


def target_rank(logits: torch.Tensor, draft_tokens: torch.Tensor) -> torch.Tensor:
    """How many tokens rank above each draft token in ``logits`` (larger logit, or equal with a lower index:
    the argmax's tie rule, so the argmax has rank 0). logits [B, K, V] fp32, draft_tokens [B, K] valid ids."""
    x_d = logits.gather(-1, draft_tokens[..., None])
    index = torch.arange(logits.shape[-1], device=logits.device)
    return ((logits > x_d) | ((logits == x_d) & (index < draft_tokens[..., None]))).sum(-1)


def rule_override(rule: AcceptRule, token_prob: torch.Tensor, entropy: torch.Tensor, top_prob: torch.Tensor,
                  divergence: torch.Tensor, rank: torch.Tensor) -> torch.Tensor:
    """Per position, the typical, threshold, kl and topk rules' acceptance of a token the exact rule rejects
    (fly is decided over the row: ``fly_accepts``). All [B, K]: token_prob p(d), entropy, top_prob max p,
    divergence KL(p || q), rank of d in p (``target_rank``; None unless topk) -> bool [B, K]."""
    if rule.name == "typical":
        return token_prob > torch.clamp(rule.b * torch.exp(-entropy), max=rule.a)
    if rule.name == "threshold":
        return token_prob >= rule.a
    if rule.name == "kl":
        return (divergence <= rule.a) & (top_prob < rule.b) & ~token_prob.isnan()
    if rule.name == "topk":
        return (rank < rule.a) & (token_prob >= top_prob - rule.b)
    return torch.zeros_like(token_prob, dtype=torch.bool)


def fly_accepts(rule: AcceptRule, exact: torch.Tensor, top3_entropy: torch.Tensor,
                num_drafts: torch.Tensor) -> torch.Tensor:
    """FLy: a mismatch at draft position i (0-based here) is accepted when its top-3 entropy is at least the
    gate and the window's next ``window - 1`` drafts, all inside the row's drafts, equal the target's
    argmax. exact, top3_entropy [B, K], num_drafts [B] -> bool [B, K]."""
    B, K = exact.shape
    window = int(rule.b)
    ok = top3_entropy >= rule.a
    for i in range(K):
        inside = i + window <= num_drafts  # else the window runs past the row's drafts: rejected this block
        ok[:, i] &= inside & exact[:, i + 1 : i + window].all(-1)
    return ok


def pivot_prob_ref(hidden: torch.Tensor, features: torch.Tensor, classifier: FoldedClassifier,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
    """Folded classifier: hidden [..., H], features [..., F], bias [..., D] (each position's addition to the
    first layer's b1, or None) -> pivot probability [...] (fp32)."""
    x = torch.cat([hidden.float(), features.float()], -1)
    first = x @ classifier.w1 + classifier.b1
    h = torch.relu(first if bias is None else first + bias.float())
    return torch.sigmoid(h @ classifier.w2 + classifier.b2)


def verify_block_ref(
    target_logits: torch.Tensor,  # [B, K+1, V] fp32/bf16/fp16
    draft_tokens: torch.Tensor,  # [B, K] int64
    hidden: torch.Tensor | None = None,  # [B, K+1, H]
    classifier: FoldedClassifier | None = None,
    *,
    sigma: float = 0.0,
    floor: float = 0.0,
    temperature: float = 0.0,
    draft_probs: torch.Tensor | None = None,  # [B, K, V], needed when temperature > 0
    uniforms: torch.Tensor | None = None,  # [B, K] U(0,1), needed when temperature > 0
    exponentials: torch.Tensor | None = None,  # [B, V] Exp(1), needed when temperature > 0
    rule: AcceptRule = AcceptRule(),
    num_drafts: torch.Tensor | None = None,  # [B] int64: row b's own draft length (<= K); None: K
    draft_logits: torch.Tensor | None = None,  # [B, K, V] the draft's logits at its K positions (the kl rule)
    row_rules: torch.Tensor | None = None,  # [B, 6] fp32: each row's own rule, sigma, exact_until, sampled
    logit_rows: torch.Tensor | None = None,  # [B, K+1] int64: rows of a 2-D target_logits [R, V]; -1: none
    classifier_bias: torch.Tensor | None = None,  # [B, K, D] fp32: each draft position's addition to b1
) -> VerifyResult:
    """Reference verification of one block; arguments are already validated by ``verify_block``.

    ``logit_rows``: target_logits (and draft_probs) are [R, V] and position (b, i) reads row
    ``logit_rows[b, i]``; a position without a row (-1, only at or past the row's own drafts) gets entropy,
    top3_entropy, token_prob and pivot_prob NaN, argmax -1, divergence -1, and the next token is -1 when it
    would be read there. ``row_rules`` (``pack_row_rules``): each row decided as a block of its own with its
    settings in place of ``rule`` and ``sigma``: a greedy row of a call with temperature > 0 has the scaled
    distribution's statistics and the greedy exact test, and its first ``exact_until`` draft positions are
    decided by the exact rule alone (a row whose exact decision stops inside them takes that decision whole).

    A row with ``num_drafts[b] < K`` stopped drafting early: its later positions are never accepted, the
    draft distribution there counts as zero (so the token after its last draft is the bonus token), and
    fly's window must end inside its own drafts. ``divergence`` is KL(p || q) of the temperature-scaled
    target and draft distributions at each draft position (whatever the rule), -1 without ``draft_logits``.
    ``classifier_bias``: added to the classifier's first layer at each draft position (``FoldedClassifier``);
    it is per position (b, i) whatever ``logit_rows`` reads."""
    if logit_rows is not None:
        return _rows_read_by_index(target_logits, draft_tokens, hidden, classifier, logit_rows, sigma=sigma,
                                   floor=floor, temperature=temperature, draft_probs=draft_probs, uniforms=uniforms,
                                   exponentials=exponentials, rule=rule, num_drafts=num_drafts,
                                   draft_logits=draft_logits, row_rules=row_rules, classifier_bias=classifier_bias)
    if row_rules is not None:
        return _each_row_alone(target_logits, draft_tokens, hidden, classifier, row_rules, floor=floor,
                               temperature=temperature, draft_probs=draft_probs, uniforms=uniforms,
                               exponentials=exponentials, num_drafts=num_drafts, draft_logits=draft_logits,
                               classifier_bias=classifier_bias)
    B, K1, V = target_logits.shape
    K = K1 - 1
    logits = target_logits.float()
    if temperature > 0:
        logits = logits / temperature
    entropy = entropy_from_logits(logits)  # [B, K+1]
    top3_entropy = top3_entropy_from_logits(logits)  # [B, K+1]
    probs = torch.softmax(logits, -1)  # [B, K+1, V]
    argmax = logits.argmax(-1)  # [B, K+1]; torch returns the first maximal index
    # An id outside [0, V) has p NaN, which no rule accepts (verify_block raises for it on CPU tensors;
    # on GPU tensors the kernels only avoid reading out of bounds, since a check would sync the host).
    valid = (draft_tokens >= 0) & (draft_tokens < V)
    if num_drafts is None:
        num_drafts = torch.full((B,), K, dtype=torch.int64, device=logits.device)
    own = torch.arange(K, device=logits.device)[None] < num_drafts[:, None]  # [B, K] the row's own drafts
    safe = draft_tokens.clamp(0, V - 1)[..., None]
    token_prob = probs[:, :K].gather(-1, safe).squeeze(-1).masked_fill(~valid, float("nan"))  # [B, K]

    if temperature > 0:
        draft_token_prob = draft_probs.float().gather(-1, safe).squeeze(-1)
        exact_ok = uniforms.float() * draft_token_prob <= token_prob  # u <= min(1, p/q) without a division
    else:
        exact_ok = draft_tokens == argmax[:, :K]

    if classifier is not None:
        features = torch.stack([token_prob, entropy[:, :K]], -1)  # [B, K, F]
        pivot_prob = pivot_prob_ref(hidden[:, :K], features, classifier, classifier_bias)
        override = (pivot_prob <= sigma) & (token_prob >= floor) & (sigma > 0)
    else:
        pivot_prob = torch.ones_like(token_prob)
        override = torch.zeros_like(exact_ok)

    if draft_logits is not None:
        scaled = draft_logits.float() / (temperature if temperature > 0 else 1.0)
        divergence = kl_divergence(logits[:, :K], scaled)
    else:
        divergence = torch.full_like(token_prob, -1.0)
    top_prob = probs[:, :K].gather(-1, argmax[:, :K, None]).squeeze(-1)  # [B, K]
    # Only topk reads the rank: the comparison over [B, K, V] is skipped for the other rules.
    rank = target_rank(logits[:, :K], draft_tokens.clamp(0, V - 1)) if rule.name == "topk" else None
    override = override | rule_override(rule, token_prob, entropy[:, :K], top_prob, divergence, rank)
    if rule.name == "fly":
        override = override | (fly_accepts(rule, exact_ok, top3_entropy[:, :K], num_drafts) & valid)
    accepted = torch.cumprod(((exact_ok | override) & own).to(torch.int64), -1).bool()  # [B, K]
    num_accepted = accepted.sum(-1)  # [B]
    pivot_accepted = accepted & ~exact_ok

    if temperature > 0:
        rows = torch.arange(B, device=logits.device)
        p_next = probs[rows, num_accepted]  # [B, V]
        # Past the last draft position q is zero, so the residual is p itself: the bonus token.
        q_all = torch.cat([draft_probs.float(), draft_probs.new_zeros(B, 1, V).float()], 1)
        q_next = torch.where((num_accepted < num_drafts)[:, None], q_all[rows, num_accepted], 0.0)
        r = residual_probs(p_next, q_next)
        next_token = (r / exponentials.float().clamp_min(MIN_EXPONENTIAL)).argmax(-1)
    else:
        next_token = argmax.gather(1, num_accepted[:, None]).squeeze(1)

    return VerifyResult(
        entropy=entropy,
        token_prob=token_prob,
        argmax=argmax,
        pivot_prob=pivot_prob,
        accepted=accepted,
        pivot_accepted=pivot_accepted,
        num_accepted=num_accepted,
        next_token=next_token,
        top3_entropy=top3_entropy,
        divergence=divergence,
    )


def _rows_read_by_index(target_logits, draft_tokens, hidden, classifier, logit_rows, **kwargs) -> VerifyResult:
    """``logit_rows``: the block gathered row by row, decided, and its positions without a row blanked."""
    K = draft_tokens.shape[1]
    present = logit_rows >= 0  # [B, K+1]
    at = logit_rows.clamp_min(0)
    if kwargs.get("draft_probs") is not None:
        kwargs["draft_probs"] = kwargs["draft_probs"][at[:, :K]]
    res = verify_block_ref(target_logits[at], draft_tokens, hidden, classifier, **kwargs)
    nan = torch.tensor(float("nan"), device=present.device)
    missing = ~present[:, :K]
    next_present = present.gather(1, res.num_accepted[:, None]).squeeze(1)
    return res._replace(
        entropy=torch.where(present, res.entropy, nan), top3_entropy=torch.where(present, res.top3_entropy, nan),
        argmax=res.argmax.masked_fill(~present, -1), token_prob=res.token_prob.masked_fill(missing, float("nan")),
        pivot_prob=res.pivot_prob.masked_fill(missing, float("nan")),
        divergence=res.divergence.masked_fill(missing, -1.0), next_token=res.next_token.masked_fill(~next_present, -1))


def _each_row_alone(target_logits, draft_tokens, hidden, classifier, row_rules, *, floor, temperature, draft_probs,
                    uniforms, exponentials, num_drafts, draft_logits, classifier_bias) -> VerifyResult:
    """``row_rules``: each row as a block of its own under its own settings, results stacked."""
    parts = []
    for b in range(target_logits.shape[0]):
        rule, sigma, until, sampled = rule_of_row(row_rules, b)
        row = target_logits[b:b + 1]
        one = dict(hidden=hidden[b:b + 1] if hidden is not None else None, floor=floor,
                   num_drafts=num_drafts[b:b + 1] if num_drafts is not None else None,
                   draft_logits=draft_logits[b:b + 1] if draft_logits is not None else None)
        if temperature > 0 and sampled:
            one.update(temperature=temperature, draft_probs=draft_probs[b:b + 1], uniforms=uniforms[b:b + 1],
                       exponentials=exponentials[b:b + 1])
        elif temperature > 0:  # greedy, with the call's scaled statistics
            row = row.float() / temperature
            if one["draft_logits"] is not None:
                one["draft_logits"] = one["draft_logits"].float() / temperature
        bias = classifier_bias[b:b + 1] if classifier_bias is not None else None
        relaxed = verify_block_ref(row, draft_tokens[b:b + 1], classifier=classifier, sigma=sigma, rule=rule,
                                   classifier_bias=bias, **one)
        if until > 0:
            exact = verify_block_ref(row, draft_tokens[b:b + 1], **{**one, "hidden": None})
            if int(exact.num_accepted[0]) < until:
                relaxed = relaxed._replace(accepted=exact.accepted, pivot_accepted=exact.pivot_accepted,
                                           num_accepted=exact.num_accepted, next_token=exact.next_token)
        parts.append(relaxed)
    return VerifyResult(*(torch.cat([getattr(p, name) for p in parts]) for name in VerifyResult._fields))
