"""Triton backend of ``verify_block``: two kernels per block, three when sampling.

1. ``split_stats_kernel``, one program per (row, position, vocabulary slice), flash-decoding's split: an
   online softmax over its slice in chunks (running max, sum of exp, sum of exp * (x - max), argmax with
   the lowest index on ties, the three largest logits). The slices per position (S, ``split_plan``) are
   chosen so that the grid fills the GPU: at B = 1 and K = 10 the 11 positions alone would leave an H100's
   132 multiprocessors nearly idle.
2. ``accept_kernel``, one program per row: it needs every position of its row. It merges the S states of
   each position exactly (as a tree; a tie of the maximum keeps the lowest index), which gives the entropy,
   the top-3 entropy, the argmax and ``p_target(d_i)`` (one logit read); the folded classifier runs on the
   row's K positions at once with ``tl.dot`` (hidden [KP, H] x W1 [H, D]), then the accepted prefix (exact
   rule, classifier, or the training-free rule: typical, threshold, fly, kl, topk), and, greedy, the next
   token: the argmax at the first rejection. With the draft's logits, kernel 1 also runs the draft's online
   softmax and the cross term of KL(p || q) over the same slice, and for topk counts the tokens that rank
   above each draft token; kernel 2 merges them with the rest.
3. ``draw_kernel`` (sampling), one program per (row, vocabulary slice): the exponential race over the
   residual ``max(0, p - q)`` at the row's first rejection, split like kernel 1; the last program of a row
   to finish merges the slices' winners.
All arithmetic is fp32 whatever the logits' dtype, but for the sums of exp(x - max), which add in fp64 (as the
CPU backend's: fp32 adds lost ulps of p). Tested on the CPU with ``TRITON_INTERPRET=1``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..splits import sm_count, split_plan
from ..types import AcceptRule, FoldedClassifier, VerifyResult, empty_result

MIN_EXPONENTIAL = tl.constexpr(1e-30)  # as the reference: an exponential draw of 0 must not make 0/0


@triton.jit
def _top3_insert(t0, t1, t2, x):
    """The three largest of (t0 >= t1 >= t2) and x."""
    n2 = tl.where(x > t1, t1, tl.maximum(t2, x))
    n1 = tl.where(x > t0, t0, tl.maximum(t1, x))
    n0 = tl.maximum(t0, x)
    return n0, n1, n2


@triton.jit
def _plogp(t, m, log_sum):
    """p log p of the probability of logit t (0 for -inf)."""
    lp = (t - m) - log_sum
    return tl.where(t == float("-inf"), 0.0, tl.exp(lp) * lp)


@triton.jit
def _rescaled(m, s, sd, cr, new_m):
    """(sum, entropy sum, cross term of the divergence) of a state with max m, expressed against the larger
    max new_m; a state whose max is -inf holds no mass (NaN is kept alive via * 0)."""
    delta = tl.where(m == float("-inf"), 0.0, new_m - m)
    scale = tl.exp(-delta)
    sd = tl.where(m == float("-inf"), sd * 0.0, tl.where(delta == 0, sd, scale * (sd - delta * s.to(tl.float32))))
    s = tl.where(m == float("-inf"), s * 0.0, tl.where(delta == 0, s, s * scale))
    cr = tl.where(m == float("-inf"), cr * 0.0, tl.where(delta == 0, cr, cr * scale))
    return s, sd, cr


@triton.jit
def _draft_rescaled(dm, ds, new_dm):
    """The draft's sum of exp(y - dm) against the larger max new_dm (0 while empty)."""
    return tl.where(dm == float("-inf"), 0.0, ds * tl.exp(dm - new_dm))


@triton.jit
def split_stats_kernel(
    logits_ptr,  # [B, K+1, V] fp32/bf16/fp16
    draft_logits_ptr,  # [B, K, V] (HAS_DRAFT)
    drafts_ptr,  # [B, K] int64 (RANKED)
    part_ptr,  # [B, K+1, S, 7] fp32 out: max, sum of exp(x - max) * (x - max), 2nd, 3rd largest, the draft's
    #            max and sum of exp(y - its max), sum of exp(x - max) * (x - y)
    part_sum_ptr,  # [B, K+1, S] fp64 out: sum of exp(x - max) (fp32 adds lost ulps of p, as on the CPU)
    part_arg_ptr,  # [B, K+1, S, 2] int64 out: argmax of the slice (lowest index on ties), tokens ranked above d
    logit_rows_ptr,  # [B, K+1] int64 (HAS_ROWS): the row of logits [R, V] each position reads, -1: none
    row_rules_ptr,  # [B, 6] fp32 (HAS_RR): each row's rule code first
    K, V, split_len, S, temperature,
    SCALED: tl.constexpr,  # temperature > 0
    HAS_DRAFT: tl.constexpr,  # the draft's logits are given: its softmax and the divergence's cross term
    RANKED: tl.constexpr,  # topk (or per-row rules, one of which may be topk): count the tokens ranked above d
    HAS_ROWS: tl.constexpr,  # logits read through logit_rows
    HAS_RR: tl.constexpr,  # per-row rules
    BLOCK_V: tl.constexpr,
):
    """Program (position, split): the online softmax over logits [split * split_len, (split + 1) * split_len)."""
    pos = tl.program_id(0)
    sp = tl.program_id(1)
    b = pos // (K + 1)
    i = pos % (K + 1)
    present = pos >= 0  # a position without a row reads nothing: its state stays empty
    row_index = pos.to(tl.int64)
    if HAS_ROWS:
        row_index = tl.load(logit_rows_ptr + pos)
        present = row_index >= 0
    row = logits_ptr + tl.maximum(row_index, 0) * V
    is_draft = i < K
    d = tl.full((), -1, tl.int64)
    xd = tl.zeros((), tl.float32)
    if RANKED:
        topk_row = is_draft
        if HAS_RR:
            topk_row = is_draft & (tl.load(row_rules_ptr + b * 6) == 5.0)
        d = tl.load(drafts_ptr + b * K + i, mask=topk_row & present, other=-1)
        xd = tl.load(row + d, mask=(d >= 0) & (d < V), other=0.0).to(tl.float32)
        if SCALED:
            xd = xd / temperature
    ranked = (d >= 0) & (d < V)
    yrow = draft_logits_ptr + (b * K + i).to(tl.int64) * V
    dm = tl.full((), float("-inf"), tl.float32)
    dsum = tl.zeros((), tl.float32)
    cross = tl.zeros((), tl.float32)
    above = tl.zeros((), tl.int64)
    lo = sp * split_len
    hi = tl.minimum(lo + split_len, V)
    offs = tl.arange(0, BLOCK_V)
    m = tl.full((), float("-inf"), tl.float32)
    s = tl.zeros((), tl.float64)
    sd = tl.zeros((), tl.float32)  # sum of exp(x - m) * (x - m): entropy = log(s) - sd / s
    arg = tl.zeros((), tl.int64) - 1
    t1 = tl.full((), float("-inf"), tl.float32)  # second and third largest (the largest is m)
    t2 = tl.full((), float("-inf"), tl.float32)
    for c0 in range(lo, hi, BLOCK_V):
        idx = c0 + offs
        x = tl.load(row + idx, mask=(idx < hi) & present, other=float("-inf")).to(tl.float32)
        if SCALED:
            x = x / temperature
        cm = tl.max(x, axis=0)
        ca0 = tl.argmax(x, axis=0, tie_break_left=True)
        ca = ca0.to(tl.int64) + c0
        # The chunk's three largest (ties count separately), merged into the running three.
        x1 = tl.where(offs == ca0, float("-inf"), x)
        c1 = tl.max(x1, axis=0)
        c2 = tl.max(tl.where(offs == tl.argmax(x1, axis=0, tie_break_left=True), float("-inf"), x1), axis=0)
        t0, t1, t2 = _top3_insert(m, t1, t2, cm)
        t0, t1, t2 = _top3_insert(t0, t1, t2, c1)
        t0, t1, t2 = _top3_insert(t0, t1, t2, c2)
        new_m = tl.maximum(m, cm)
        arg = tl.where((cm > m) | (arg < 0), ca, arg)
        s, sd, cross = _rescaled(m, s, sd, cross, new_m)
        m = new_m
        none = x == float("-inf")
        dx = tl.where(none, 0.0, x - m)
        e = tl.where(none, 0.0, tl.exp(x - m))
        s += tl.sum(e.to(tl.float64), axis=0)
        sd += tl.sum(e * dx, axis=0)
        if RANKED:
            up = (x > xd) | ((x == xd) & (idx < d))
            above += tl.sum(tl.where((idx < hi) & ranked & up, 1, 0), axis=0).to(tl.int64)
        if HAS_DRAFT:
            ymask = (idx < hi) & is_draft
            y = tl.load(yrow + idx, mask=ymask, other=float("-inf")).to(tl.float32)
            if SCALED:
                y = y / temperature
            new_dm = tl.maximum(dm, tl.max(y, axis=0))
            dsum = _draft_rescaled(dm, dsum, new_dm)
            dm = new_dm
            dsum += tl.sum(tl.where(y == float("-inf"), 0.0, tl.exp(y - dm)), axis=0)
            # x - y is +inf where the draft gives no mass and the target does: KL(p || q) is +inf there
            term = tl.where(none | ~ymask, 0.0, tl.where(y == float("-inf"), float("inf"), e * (x - y)))
            cross += tl.sum(term, axis=0)
    at = (pos.to(tl.int64) * S + sp)
    tl.store(part_sum_ptr + at, s)
    tl.store(part_ptr + at * 7, m)
    tl.store(part_ptr + at * 7 + 1, sd)
    tl.store(part_ptr + at * 7 + 2, t1)
    tl.store(part_ptr + at * 7 + 3, t2)
    tl.store(part_ptr + at * 7 + 4, dm)
    tl.store(part_ptr + at * 7 + 5, dsum)
    tl.store(part_ptr + at * 7 + 6, cross)
    tl.store(part_arg_ptr + at * 2, arg)
    tl.store(part_arg_ptr + at * 2 + 1, above)


@triton.jit
def _merge(m, s, sd, t1, t2, dm, ds, cr, arg, ab, pm, ps, psd, p1, p2, pdm, pds, pcr, pa, pab):
    """Two slices' states as one; symmetric, so a reduction tree may pair them in any order (a tie of the
    maxima keeps the lower index)."""
    t0, t1, t2 = _top3_insert(m, t1, t2, pm)
    t0, t1, t2 = _top3_insert(t0, t1, t2, p1)
    t0, t1, t2 = _top3_insert(t0, t1, t2, p2)
    new_m = tl.maximum(m, pm)
    # A state with arg -1 is empty (padding of the reduction): it never wins.
    arg = tl.where((pa >= 0) & ((arg < 0) | (pm > m) | ((pm == m) & (pa < arg))), pa, arg)
    sa, sda, cra = _rescaled(m, s, sd, cr, new_m)
    sb, sdb, crb = _rescaled(pm, ps, psd, pcr, new_m)
    new_dm = tl.maximum(dm, pdm)
    dsum = _draft_rescaled(dm, ds, new_dm) + _draft_rescaled(pdm, pds, new_dm)
    return new_m, sa + sb, sda + sdb, t1, t2, new_dm, dsum, cra + crb, arg, ab + pab


@triton.jit
def accept_kernel(
    logits_ptr,  # [B, K+1, V]
    drafts_ptr,  # [B, K] int64
    hidden_ptr,  # [B, K+1, H] (unused without a classifier)
    w1_ptr,  # [H+2, D] fp32
    b1_ptr,  # [D] fp32
    w2_ptr,  # [D] fp32
    b2_ptr,  # [] fp32 (a pointer: reading a device scalar on the host would sync)
    clf_bias_ptr,  # [B, K, D] fp32 (HAS_BIAS): each draft position's addition to b1
    draft_probs_ptr,  # [B, K, V] fp32 (sampling)
    uniforms_ptr,  # [B, K] fp32 (sampling)
    exponentials_ptr,  # [B, V] fp32 (sampling)
    part_ptr, part_sum_ptr, part_arg_ptr,  # [B, K+1, S, 7], [B, K+1, S] fp64, [B, K+1, S, 2] from split_stats_kernel
    row_ms_ptr,  # [B, 2] fp32 out (sampling): softmax max and sum at the row's first rejection, for draw_kernel
    done_ptr,  # [B] int32 out (sampling): zeroed here, counts draw_kernel's finished slices
    entropy_ptr, top3_ptr,  # [B, K+1] fp32 out
    argmax_ptr,  # [B, K+1] int64 out
    token_prob_ptr,  # [B, K] fp32 out
    pivot_prob_ptr,  # [B, K] fp32 out
    accepted_ptr,  # [B, K] bool out
    pivot_accepted_ptr,  # [B, K] bool out
    num_accepted_ptr,  # [B] int64 out
    next_token_ptr,  # [B] int64 out
    divergence_ptr,  # [B, K] fp32 out
    K, V, H, D, S, sigma, floor, temperature, rule_a, rule_b,
    window,  # fly: int(rule_b)
    num_drafts_ptr,  # [B] int64: each row's own draft length (HAS_ND)
    logit_rows_ptr,  # [B, K+1] int64 (HAS_ROWS): logits and draft_probs are [R, V], read by row; -1: none
    row_rules_ptr,  # [B, 6] fp32 (HAS_RR): rule code, a, b, sigma, exact_until, sampled of each row
    HAS_CLF: tl.constexpr, SAMPLING: tl.constexpr,
    HAS_BIAS: tl.constexpr,  # a per-position classifier bias (with HAS_CLF)
    RULE: tl.constexpr,  # AcceptRule code: 0 exact, 1 typical, 2 threshold, 3 fly, 4 kl, 5 topk (no HAS_RR)
    HAS_ND: tl.constexpr,  # rows have their own draft lengths
    HAS_ROWS: tl.constexpr,  # logits read through logit_rows
    HAS_RR: tl.constexpr,  # per-row rules: every rule's test is compiled in and each row picks its own
    HAS_DRAFT: tl.constexpr,  # kernel 1 read the draft's logits: the divergence is defined
    KP: tl.constexpr,  # power of 2 >= max(K + 1, 16): tl.dot needs 16 rows
    SPC: tl.constexpr,  # vocabulary slices merged at once
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    b = tl.program_id(0)
    K1 = K + 1
    ks = tl.arange(0, KP)
    kmask = ks < K
    k1mask = ks < K1
    k_row = K
    if HAS_ND:  # a row that stopped drafting early: clamped to [0, K] like the other backends
        k_row = tl.minimum(tl.maximum(tl.load(num_drafts_ptr + b), 0), K)
    drafts = tl.load(drafts_ptr + b * K + ks, mask=kmask, other=0)
    # The row of logits of each position, and whether it has one.
    rix = (b * K1 + ks).to(tl.int64)
    present = k1mask
    if HAS_ROWS:
        rix = tl.load(logit_rows_ptr + b * K1 + ks, mask=k1mask, other=-1)
        present = rix >= 0
    rix = tl.maximum(rix, 0)
    # This row's rule (the call's, or its own), as vectors over the positions (one value repeated).
    code = tl.full((KP,), RULE, tl.int32)
    ra = rule_a
    rb = rule_b
    sig = sigma + tl.zeros((KP,), tl.float32)  # a vector: the interpreter cannot AND a scalar test with one
    until = 0
    samp = tl.full((KP,), SAMPLING, tl.int1)
    win = window
    if HAS_RR:
        at_row = row_rules_ptr + b * 6 + ks * 0
        code = tl.load(at_row).to(tl.int32)
        ra = tl.load(at_row + 1)
        rb = tl.load(at_row + 2)
        sig = tl.load(at_row + 3)
        until = tl.load(at_row + 4).to(tl.int32)
        samp = samp & (tl.load(at_row + 5) != 0.0)
        win = rb.to(tl.int32)

    # 0. Merge the S slices' softmax states of each of the row's K+1 positions, in slice order: exact, and
    # the lowest index wins a tie of the maximum across slices as within one.
    m = tl.full((KP,), float("-inf"), tl.float32)
    s = tl.zeros((KP,), tl.float64)
    sd = tl.zeros((KP,), tl.float32)
    arg = tl.zeros((KP,), tl.int64) - 1
    t1 = tl.full((KP,), float("-inf"), tl.float32)
    t2 = tl.full((KP,), float("-inf"), tl.float32)
    dm = tl.full((KP,), float("-inf"), tl.float32)
    dsum = tl.zeros((KP,), tl.float32)
    cr = tl.zeros((KP,), tl.float32)
    ab = tl.zeros((KP,), tl.int64)
    # SPC slices at a time as a tree (rounding grows with log S, not S), the groups one after another.
    at = (b * K1 + ks).to(tl.int64) * S
    cs = tl.arange(0, SPC)
    for c0 in range(0, S, SPC):
        cmask = k1mask[:, None] & (c0 + cs[None, :] < S)
        ix = at[:, None] + c0 + cs[None, :]  # [KP, SPC]
        ps = tl.load(part_sum_ptr + ix, mask=cmask, other=0.0)
        pm = tl.load(part_ptr + ix * 7, mask=cmask, other=float("-inf"))
        psd = tl.load(part_ptr + ix * 7 + 1, mask=cmask, other=0.0)
        p1 = tl.load(part_ptr + ix * 7 + 2, mask=cmask, other=float("-inf"))
        p2 = tl.load(part_ptr + ix * 7 + 3, mask=cmask, other=float("-inf"))
        pdm = tl.load(part_ptr + ix * 7 + 4, mask=cmask, other=float("-inf"))
        pds = tl.load(part_ptr + ix * 7 + 5, mask=cmask, other=0.0)
        pcr = tl.load(part_ptr + ix * 7 + 6, mask=cmask, other=0.0)
        pa = tl.load(part_arg_ptr + ix * 2, mask=cmask, other=-1)
        pab = tl.load(part_arg_ptr + ix * 2 + 1, mask=cmask, other=0)
        pm, ps, psd, p1, p2, pdm, pds, pcr, pa, pab = tl.reduce(
            (pm, ps, psd, p1, p2, pdm, pds, pcr, pa, pab), 1, _merge)
        m, s, sd, t1, t2, dm, dsum, cr, arg, ab = _merge(m, s, sd, t1, t2, dm, dsum, cr, arg, ab,
                                                         pm, ps, psd, p1, p2, pdm, pds, pcr, pa, pab)
    s = s.to(tl.float32)
    ent_all = tl.where(s == 0, float("-inf"), tl.log(s) - sd / s)
    # Top-3 entropy with the full softmax's probabilities; absent (-inf) entries and an empty row add 0.
    ls = tl.log(s)
    h3_all = -(_plogp(m, m, ls) + _plogp(t1, m, ls) + _plogp(t2, m, ls))
    h3_all = tl.where(s > 0, h3_all, tl.where(s != s, s, 0.0))
    arg = tl.where(present, arg, -1)
    tl.store(entropy_ptr + b * K1 + ks, tl.where(present, ent_all, float("nan")), mask=k1mask)
    tl.store(top3_ptr + b * K1 + ks, tl.where(present, h3_all, float("nan")), mask=k1mask)
    tl.store(argmax_ptr + b * K1 + ks, arg, mask=k1mask)
    # p_target of each draft token: one logit read per position.
    valid = kmask & (drafts >= 0) & (drafts < V)  # an id out of range reads nothing; its p is NaN, never accepted
    xd = tl.load(logits_ptr + rix * V + drafts, mask=valid & present, other=0.0).to(tl.float32)
    if SAMPLING:
        xd = xd / temperature
    tp = tl.where(xd == float("-inf"), 0.0, tl.exp(xd - m) / s)
    tp = tl.where(valid & present, tp, float("nan"))
    tl.store(token_prob_ptr + b * K + ks, tp, mask=kmask)
    tp = tl.where(kmask, tp, 0.0)
    am = tl.where(kmask, arg, -1)
    # KL(p || q) = cross / sum - lse(x) + lse(y), and max p (the argmax's probability).
    if HAS_DRAFT:
        div = cr / s - (m + tl.log(s)) + (dm + tl.log(dsum))
    else:
        div = tl.full((KP,), -1.0, tl.float32)
    div = tl.where(present, div, -1.0)
    tl.store(divergence_ptr + b * K + ks, div, mask=kmask)
    top_prob = 1.0 / s

    # 1. Pivot probability of every draft position: sigmoid(w2 . relu(W1^T [h; p; entropy] + b1 + c) + b2).
    if HAS_CLF:
        ent = tl.where(kmask, ent_all, 0.0)
        ds = tl.arange(0, BLOCK_D)
        dmask = ds < D
        acc = tl.zeros((KP, BLOCK_D), tl.float32)
        hrow = hidden_ptr + (b * K1 + ks).to(tl.int64) * H
        for h0 in range(0, H, BLOCK_H):
            hs = h0 + tl.arange(0, BLOCK_H)
            h = tl.load(hrow[:, None] + hs[None, :], mask=kmask[:, None] & (hs[None, :] < H), other=0.0)
            w = tl.load(w1_ptr + hs[:, None] * D + ds[None, :], mask=(hs[:, None] < H) & dmask[None, :], other=0.0)
            acc += tl.dot(h.to(tl.float32), w, input_precision="ieee")
        w_p = tl.load(w1_ptr + H * D + ds, mask=dmask, other=0.0)
        w_e = tl.load(w1_ptr + (H + 1) * D + ds, mask=dmask, other=0.0)
        acc += tp[:, None] * w_p[None, :] + ent[:, None] * w_e[None, :]
        acc += tl.load(b1_ptr + ds, mask=dmask, other=0.0)[None, :]
        if HAS_BIAS:
            crow = clf_bias_ptr + (b * K + ks).to(tl.int64) * D
            acc += tl.load(crow[:, None] + ds[None, :], mask=kmask[:, None] & dmask[None, :], other=0.0)
        w2 = tl.load(w2_ptr + ds, mask=dmask, other=0.0)
        score = tl.sum(tl.maximum(acc, 0.0) * w2[None, :], axis=1) + tl.load(b2_ptr)
        pivot = 1.0 / (1.0 + tl.exp(-score))
    else:
        pivot = tl.full((KP,), 1.0, tl.float32)

    # 2. The accepted prefix: exact rule, else the pivot override; everything after a rejection is out.
    exact = drafts == am
    if SAMPLING:
        qrow = (b * K + ks).to(tl.int64)
        if HAS_ROWS:  # the draft's distributions lie where the target's logits do
            qrow = rix
        u = tl.load(uniforms_ptr + b * K + ks, mask=kmask, other=1.0)
        qd = tl.load(draft_probs_ptr + qrow * V + drafts,
                     mask=kmask & (ks < k_row) & present & (drafts >= 0) & (drafts < V), other=1.0)
        exact = tl.where(samp, u * qd <= tp, exact)
    relax = ks < 0  # all False
    if HAS_CLF:
        relax = relax | ((sig > 0) & (pivot <= sig) & (tp >= floor))
    if HAS_RR or RULE == 1:  # typical: p > min(epsilon, delta * exp(-H))
        ent_k = tl.where(kmask, ent_all, 0.0)
        relax = relax | ((code == 1) & (tp > tl.minimum(ra, rb * tl.exp(-ent_k))))
    if HAS_RR or RULE == 2:  # threshold: p >= tau
        relax = relax | ((code == 2) & (tp >= ra))
    if HAS_RR or RULE == 4:  # kl: KL(p || q) <= epsilon where the target's top-1 probability is below top1
        relax = relax | ((code == 4) & (div <= ra) & (top_prob < rb) & valid)
    if HAS_RR or RULE == 5:  # topk: among the target's k most likely, within delta of the top-1 probability
        relax = relax | ((code == 5) & (ab.to(tl.float32) < ra) & (tp >= top_prob - rb))
    if HAS_RR or RULE == 3:  # fly: top-3 entropy >= gate and the next window - 1 drafts, inside the block, match
        h3 = tl.where(kmask, h3_all, 0.0)
        # The first mismatch after each position (K when none): [KP, KP] over (position, later position).
        later = (ks[None, :] > ks[:, None]) & (ks[None, :] < K) & ~exact[None, :]
        next_miss = tl.min(tl.where(later, ks[None, :], K), axis=1)
        fits = (ks + win <= k_row) & (next_miss >= ks + win)
        relax = relax | ((code == 3) & (h3 >= ra) & fits & (drafts >= 0) & (drafts < V))
    ok = exact | (relax & (ks >= until))  # the row's first exact_until positions: the exact rule alone
    n = tl.min(tl.where(ok | (ks >= K), KP, ks), axis=0)
    n = tl.minimum(n, k_row)
    accepted = ks < n
    pivot = tl.where(present, pivot, float("nan"))
    tl.store(pivot_prob_ptr + b * K + ks, pivot, mask=kmask)
    tl.store(accepted_ptr + b * K + ks, accepted.to(tl.int1), mask=kmask)
    tl.store(pivot_accepted_ptr + b * K + ks, (accepted & ~exact).to(tl.int1), mask=kmask)
    tl.store(num_accepted_ptr + b, n.to(tl.int64))

    # 3. The correction token at the first rejection, or the bonus token after K accepted: the argmax there
    # (greedy), or draw_kernel's race, which needs that position's softmax max and sum (sampling).
    # No row there: -1 (the caller has that token: a serving engine's bonus).
    greedy_next = tl.sum(tl.where(ks == n, arg, 0), axis=0)  # arg is -1 where there is no row
    if SAMPLING:
        tl.store(row_ms_ptr + b * 2, tl.sum(tl.where(ks == n, m, 0.0), axis=0))
        tl.store(row_ms_ptr + b * 2 + 1, tl.sum(tl.where(ks == n, s, 0.0), axis=0))
        tl.store(done_ptr + b, 0)
        row_samples = tl.max(samp.to(tl.int32), axis=0) > 0
        tl.store(next_token_ptr + b, greedy_next, mask=(row_samples == 0) | (greedy_next < 0))
    else:
        tl.store(next_token_ptr + b, greedy_next)


@triton.jit
def draw_kernel(
    logits_ptr,  # [B, K+1, V]
    draft_probs_ptr,  # [B, K, V] fp32
    exponentials_ptr,  # [B, V] fp32
    num_accepted_ptr,  # [B] int64 from accept_kernel
    num_drafts_ptr,  # [B] int64 (HAS_ND)
    row_ms_ptr,  # [B, 2] fp32 from accept_kernel
    race_ptr,  # [B, S, 3] fp32 scratch: per slice the residual's sum and the two races' best keys
    race_arg_ptr,  # [B, S, 2] int64 scratch: the two races' winners
    done_ptr,  # [B] int32, 0 on entry (and on exit)
    next_token_ptr,  # [B] int64 out
    logit_rows_ptr,  # [B, K+1] int64 (HAS_ROWS)
    row_rules_ptr,  # [B, 6] fp32 (HAS_RR): a greedy row's token was written by accept_kernel
    K, V, split_len, S, temperature,
    HAS_ND: tl.constexpr, BLOCK_V: tl.constexpr,
    SPC: tl.constexpr,  # slices merged at once
    HAS_ROWS: tl.constexpr, HAS_RR: tl.constexpr,
):
    """Program (row, slice): the exponential race over the residual max(0, p - q) (and over p, the fallback
    when the residual is all zero) on its slice of the vocabulary at the row's first rejection; the row's
    last program to finish merges the S slices (the best key, the lowest index on ties)."""
    b = tl.program_id(0)
    sp = tl.program_id(1)
    n = tl.load(num_accepted_ptr + b)
    k_row = K
    if HAS_ND:
        k_row = tl.minimum(tl.maximum(tl.load(num_drafts_ptr + b), 0), K)
    mx = tl.load(row_ms_ptr + b * 2)
    sm = tl.load(row_ms_ptr + b * 2 + 1)
    rix = (b * (K + 1) + n).to(tl.int64)
    qix = (b * K + n).to(tl.int64)
    if HAS_ROWS:
        rix = tl.load(logit_rows_ptr + b * (K + 1) + n)
        qix = rix
    go = rix >= 0  # else no row there: accept_kernel wrote -1
    if HAS_RR:
        go = go & (tl.load(row_rules_ptr + b * 6 + 5) != 0.0)
    row = logits_ptr + tl.maximum(rix, 0) * V
    qrow = draft_probs_ptr + tl.maximum(qix, 0) * V
    erow = exponentials_ptr + b.to(tl.int64) * V
    lo = sp * split_len
    hi = tl.minimum(lo + split_len, V)
    offs = tl.arange(0, BLOCK_V)
    rsum = tl.zeros((), tl.float32)
    best_r = tl.full((), -1.0, tl.float32)
    best_p = tl.full((), -1.0, tl.float32)
    arg_r = tl.zeros((), tl.int64)
    arg_p = tl.zeros((), tl.int64)
    for c0 in range(lo, hi, BLOCK_V):
        idx = c0 + offs
        vmask = idx < hi
        x = tl.load(row + idx, mask=vmask & go, other=float("-inf")).to(tl.float32) / temperature
        p = tl.where(x == float("-inf"), 0.0, tl.exp(x - mx) / sm)
        q = tl.load(qrow + idx, mask=vmask & go & (n < k_row), other=0.0)  # past the row's drafts q is 0: bonus
        e = tl.maximum(tl.load(erow + idx, mask=vmask & go, other=1.0), MIN_EXPONENTIAL)
        r = tl.maximum(p - q, 0.0)
        rsum += tl.sum(tl.where(vmask, r, 0.0), axis=0)
        kr = tl.where(vmask, r / e, -1.0)
        kp = tl.where(vmask, p / e, -1.0)
        cr = tl.max(kr, axis=0)
        cp = tl.max(kp, axis=0)
        ar = tl.argmax(kr, axis=0, tie_break_left=True).to(tl.int64) + c0
        ap = tl.argmax(kp, axis=0, tie_break_left=True).to(tl.int64) + c0
        arg_r = tl.where(cr > best_r, ar, arg_r)
        best_r = tl.maximum(cr, best_r)
        arg_p = tl.where(cp > best_p, ap, arg_p)
        best_p = tl.maximum(cp, best_p)
    at = b.to(tl.int64) * S + sp
    tl.store(race_ptr + at * 3, rsum)
    tl.store(race_ptr + at * 3 + 1, best_r)
    tl.store(race_ptr + at * 3 + 2, best_p)
    tl.store(race_arg_ptr + at * 2, arg_r)
    tl.store(race_arg_ptr + at * 2 + 1, arg_p)
    tl.debug_barrier()  # every thread's stores precede the count (release by the atomic below)
    if tl.atomic_add(done_ptr + b, 1, sem="acq_rel") == S - 1:
        # The last of the row's S programs: every part is written. Slices in order, so among equal keys
        # the first slice's (whose index is the lowest) wins.
        cs = tl.arange(0, SPC)
        rsum = tl.zeros((), tl.float32)
        best_r = tl.full((), -1.0, tl.float32)
        best_p = tl.full((), -1.0, tl.float32)
        for c0 in range(0, S, SPC):
            cmask = c0 + cs < S
            ix = b.to(tl.int64) * S + c0 + cs
            rsum += tl.sum(tl.load(race_ptr + ix * 3, mask=cmask, other=0.0, volatile=True), axis=0)
            kr = tl.load(race_ptr + ix * 3 + 1, mask=cmask, other=-1.0, volatile=True)
            kp = tl.load(race_ptr + ix * 3 + 2, mask=cmask, other=-1.0, volatile=True)
            ar = tl.load(race_arg_ptr + ix * 2, mask=cmask, other=0, volatile=True)
            ap = tl.load(race_arg_ptr + ix * 2 + 1, mask=cmask, other=0, volatile=True)
            cr = tl.max(kr, axis=0)
            cp = tl.max(kp, axis=0)
            wr = tl.sum(tl.where(cs == tl.argmax(kr, axis=0, tie_break_left=True), ar, 0), axis=0)
            wp = tl.sum(tl.where(cs == tl.argmax(kp, axis=0, tie_break_left=True), ap, 0), axis=0)
            arg_r = tl.where(cr > best_r, wr, arg_r)
            best_r = tl.maximum(cr, best_r)
            arg_p = tl.where(cp > best_p, wp, arg_p)
            best_p = tl.maximum(cp, best_p)
        tl.store(next_token_ptr + b, tl.where(rsum > 0, arg_r, arg_p), mask=go)
        tl.store(done_ptr + b, 0)


def launch_config(K: int, V: int, H: int, D: int, S: int) -> dict:
    """Compile-time block sizes of the accept kernel for one shape and ``S`` vocabulary slices (shared by the
    launcher and the ahead-of-time check). The slices are merged up to 16 at a time, in a tile no wider than
    S needs: with one slice (no GPU, or positions enough to fill one) a 16-wide tile would merge 15 empty
    states per position, and Triton's interpreter runs a tree's merge function once per element in Python."""
    return dict(
        KP=max(16, triton.next_power_of_2(K + 1)),
        BLOCK_H=64 if H >= 64 else 16,
        BLOCK_D=max(16, triton.next_power_of_2(D)),
        SPC=min(16, max(2, triton.next_power_of_2(S))),
    )


def verify_block_triton(
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
    """Same contract as ``verify_block_ref``; writes into ``out`` when given (tests poison it first).
    ``splits``: vocabulary slices per position (default: enough to fill the GPU, see ``split_plan``)."""
    (B, K), V = draft_tokens.shape, target_logits.shape[-1]
    K1 = K + 1
    dev = target_logits.device
    out = out if out is not None else empty_result(B, K, dev)
    logits = target_logits.contiguous()
    drafts = draft_tokens.contiguous()
    S, split_len = split_plan(B * K1, V, sm_count(dev), splits)
    block_v = min(1024, triton.next_power_of_2(split_len))
    part = torch.empty(B * K1 * S * 7, dtype=torch.float32, device=dev)
    part_sum = torch.empty(B * K1 * S, dtype=torch.float64, device=dev)
    part_arg = torch.empty(B * K1 * S * 2, dtype=torch.int64, device=dev)
    sampling = temperature > 0
    has_draft = draft_logits is not None
    has_rows, has_rr = logit_rows is not None, row_rules is not None
    rows = logit_rows.contiguous() if has_rows else drafts  # a valid pointer where unread
    rr = row_rules.contiguous() if has_rr else part
    ranked = rule.name == "topk" or has_rr
    if B * K1:
        split_stats_kernel[(B * K1, S)](
            logits, draft_logits.contiguous() if has_draft else logits, drafts, part, part_sum, part_arg, rows, rr,
            K, V, split_len, S,
            float(temperature) if sampling else 1.0, SCALED=sampling, HAS_DRAFT=has_draft, RANKED=ranked,
            HAS_ROWS=has_rows, HAS_RR=has_rr, BLOCK_V=block_v,
        )
    has_clf = classifier is not None
    dummy = part  # a valid pointer for arguments a specialization never reads
    if has_clf:
        w1, b1, w2, b2 = (t.to(device=dev, dtype=torch.float32).contiguous() for t in classifier)
        hid = hidden.contiguous()
        H, D = hid.shape[-1], w1.shape[1]
    else:
        w1 = b1 = w2 = b2 = hid = dummy
        H, D = 1, 1
    has_bias = has_clf and classifier_bias is not None
    bias = classifier_bias.to(device=dev, dtype=torch.float32).contiguous() if has_bias else dummy
    if sampling:
        dp = draft_probs.to(torch.float32).contiguous()
        un = uniforms.to(torch.float32).contiguous()
        ex = exponentials.to(torch.float32).contiguous()
    else:
        dp = un = ex = dummy
    row_ms = torch.empty(B * 2 if sampling else 1, dtype=torch.float32, device=dev)
    done = torch.empty(B if sampling else 1, dtype=torch.int32, device=dev)
    accept_kernel[(B,)](
        logits, drafts, hid, w1, b1, w2, b2, bias, dp, un, ex, part, part_sum, part_arg, row_ms, done,
        out.entropy, out.top3_entropy, out.argmax, out.token_prob,
        out.pivot_prob, out.accepted, out.pivot_accepted, out.num_accepted, out.next_token, out.divergence,
        K, V, H, D, S, float(sigma), float(floor), float(temperature) if sampling else 1.0, float(rule.a),
        float(rule.b), int(rule.b) if rule.name == "fly" else 0,
        num_drafts.contiguous() if num_drafts is not None else dummy, rows, rr,
        HAS_ND=num_drafts is not None, HAS_CLF=has_clf, HAS_BIAS=has_bias, SAMPLING=sampling, RULE=rule.code,
        HAS_DRAFT=has_draft, HAS_ROWS=has_rows, HAS_RR=has_rr, **launch_config(K, V, H, D, S),
    )
    if sampling and B:
        S_d, len_d = split_plan(B, V, sm_count(dev), splits)  # B positions: one per row
        race = torch.empty(B * S_d * 3, dtype=torch.float32, device=dev)
        race_arg = torch.empty(B * S_d * 2, dtype=torch.int64, device=dev)
        draw_kernel[(B, S_d)](
            logits, dp, ex, out.num_accepted, num_drafts.contiguous() if num_drafts is not None else dummy, row_ms,
            race, race_arg, done, out.next_token, rows, rr, K, V, len_d, S_d, float(temperature),
            HAS_ND=num_drafts is not None, BLOCK_V=min(1024, triton.next_power_of_2(len_d)), SPC=16,
            HAS_ROWS=has_rows, HAS_RR=has_rr,
        )
    return out
