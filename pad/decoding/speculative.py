"""The speculative block, as three steps over a ``RowBatch``: draft, verify, commit.

Draft: the ``Drafter`` proposes up to K tokens per live row (K from the ``DraftLength``). Verify: one
target forward over each row's committed tokens it has not seen and its drafts, then the fused op
(``pad_kernels.verify_block``) decides each row's accepted prefix and next token. Commit: each row commits
that prefix and token through the batch's EOS/budget cut; the target's cache stops attending to the
rejected columns; the drafter is told; finished rows leave the batch.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from pad_kernels import AcceptRule, FoldedClassifier, Workspace, verify_block

from ..models.classifier import PivotClassifier
from .decoder import Decoder, left_pad
from .draft_length import DraftLength
from .drafters.base import SOURCES, Drafter, Proposal, Sampling
from .hf import LayerCapture
from .rows import RowBatch
from .sampling import warp_logits


@dataclass(frozen=True)
class Acceptance:
    """How drafts are judged: the op's rule, and for pivot the classifier (its ``sigma`` and ``floor``);
    ``exact_prefix``: each row's first that many new tokens are decided by the exact rule; ``judge_free``:
    the classifier also judges draft-free proposals (``Proposal.free``), else the exact rule decides them."""

    rule: AcceptRule = AcceptRule()
    classifier: PivotClassifier | None = None
    sigma: float = 0.0
    floor: float = 1e-4
    backend: str | None = None
    exact_prefix: int = 0
    judge_free: bool = False

    def key(self) -> tuple:
        """What makes acceptance rates comparable between calls (hashable)."""
        return (self.rule, self.sigma, self.floor, self.classifier is not None and id(self.classifier),
                self.exact_prefix, self.judge_free)

    @property
    def relaxed(self) -> bool:
        """Whether anything the exact rule rejects may be accepted."""
        return self.classifier is not None or self.rule.name != "exact"


def exact_until(acceptance: Acceptance, committed: list[int], proposal: Proposal) -> list[int] | None:
    """[B] the draft positions of each row that the exact rule decides under a relaxed ``acceptance``: its
    new tokens before ``exact_prefix``, and with the pivot classifier every draft of a draft-free row
    (unless ``judge_free``: the classifier's labels are a draft model's mismatches, and a lookup's
    proposals are not like them); None when no row has any. A host list."""
    if not acceptance.relaxed:
        return None
    left = [max(0, acceptance.exact_prefix - c) for c in committed]
    if acceptance.classifier is not None and not acceptance.judge_free and proposal.free is not None:
        left = [proposal.k if free else n for free, n in zip(proposal.free, left)]
    return left if any(left) else None


def source_features(proposal: Proposal, names: tuple[str, ...]) -> torch.Tensor:
    """Where each draft position of ``proposal`` came from, as the labels record it (``pad.pivots.search``):
    the source features ``names`` (``SOURCE_FEATURES``, in a classifier's order) -> [B, k, len(names)] fp32 on
    the host: from_lookup, from_suffix (0 and 0: the draft model), the row's match length (0 for the model's)
    and the position's place in its proposal (-1 for the model's)."""
    b, k = proposal.tokens.shape
    sources = torch.tensor(proposal.sources if proposal.sources is not None else [0] * b)[:, None].expand(b, k)
    matches = torch.tensor(proposal.matches if proposal.matches is not None else [0] * b)[:, None].expand(b, k)
    offset = torch.where(sources != 0, torch.arange(k)[None], -1)
    columns = {"from_lookup": sources == SOURCES.index("lookup"), "from_suffix": sources == SOURCES.index("suffix"),
               "match": matches, "offset": offset}
    return torch.stack([columns[n].float() for n in names], -1)


def keep_exact_prefix(relaxed, exact, until, counts=None):
    """``relaxed`` (a ``VerifyResult``) where the first ``until`` [B] draft positions of each row are decided
    exactly (``exact``: the same block and draws by the exact rule): a row whose exact decision stops inside
    them takes it whole; otherwise its prefix was accepted exactly and the relaxed decision, which accepts
    all the exact one does with the same draws and more, holds. ``counts``: drafts per row when the results
    are packed (``verify_block_varlen``); None: [B, K]."""
    inside = exact.num_accepted < until
    per_draft = inside[:, None] if counts is None else torch.repeat_interleave(
        inside, torch.as_tensor(counts, device=inside.device), output_size=sum(counts))
    return relaxed._replace(num_accepted=torch.where(inside, exact.num_accepted, relaxed.num_accepted),
                            next_token=torch.where(inside, exact.next_token, relaxed.next_token),
                            pivot_accepted=relaxed.pivot_accepted & ~per_draft)


def random_draws(generator, rows: int, k: int, vocab: int, device):
    """The op's randomness of one block: (uniforms [rows, k], exponentials [rows, vocab]); (None, None)
    when greedy."""
    if generator is None:
        return None, None
    uniforms = torch.rand((rows, k), generator=generator, device=device)
    exponentials = torch.empty((rows, vocab), device=device).exponential_(generator=generator)
    return uniforms, exponentials


def nonfinite_error(block: int) -> FloatingPointError:
    return FloatingPointError(
        f"the model produced non-finite logits (NaN or inf) in block {block}; check its weights and dtype"
    )


def decode(target: Decoder, drafter: Drafter, batch: RowBatch, length: DraftLength, acceptance: Acceptance,
           sampling: Sampling) -> None:
    """Decode every row of ``batch`` to its end: blocks of draft / verify / commit until no row is live.
    ``length``: ``FixedDraftLength`` or ``AutoDraftLength`` (or another ``DraftLength``)."""
    clf = acceptance.classifier
    folded: FoldedClassifier | None = clf.fold().to(target.device) if clf is not None else None
    capture = LayerCapture(target.model, clf.layer) if clf is not None else None
    drafter.start(batch, sampling, target.device, needs_logits=acceptance.rule.needs_draft_logits)
    batch.followers += [target, drafter, length]
    pending = [list(p) for p in batch.prompts]  # committed tokens the target has not seen, per batch row
    verifier = _Verifier(target, length, acceptance, sampling, folded, capture,
                         Workspace(len(batch), length.max_draft_tokens, target.device))  # outputs reused by every block
    blocks = 0
    try:
        length.start(batch, target.model, drafter, (*acceptance.key(), sampling.temperature, sampling.top_p))
        while batch.live:
            start = time.perf_counter()
            # Never draft past the largest budget: k drafts and one correction/bonus token make at most k + 1.
            limit = max(batch.budget(j) for j in range(len(batch)))
            k, predicted = length.next(batch, drafter, target.width, max(map(len, pending)), limit)
            proposal = drafter.propose(batch, k) if k else None
            accepted, tokens, relaxed = verifier.verify(proposal, pending, blocks, [batch.new[r] for r in batch.live])
            blocks += 1
            verified, finished = _commit(target, drafter, proposal, batch, pending, accepted, tokens, relaxed)
            length.observe(accepted if proposal is not None else [], verified, time.perf_counter() - start)
            batch.record_block(proposal.k if proposal is not None else 0, predicted, time.perf_counter() - start)
            keep = batch.end_block(finished)
            if finished:
                pending[:] = [pending[j] for j in keep]
    finally:
        if capture is not None:
            capture.remove()
        length.finish()
        drafter.finish(batch)


@dataclass
class _Verifier:
    """What verifies every block of a call: the target, how long blocks are (its forward may be timed), how
    drafts are judged and drawn, the classifier folded for the op and its layer's capture, the op's outputs."""

    target: Decoder
    length: DraftLength
    acceptance: Acceptance
    sampling: Sampling
    folded: FoldedClassifier | None
    capture: LayerCapture | None
    workspace: Workspace

    def verify(self, proposal: Proposal | None, pending: list[list[int]], block: int,
               committed: list[list[int]]) -> tuple[list[int], list[int], list[list[int]]]:
        """One target forward over [unseen committed..., d_1..d_k] of every row (``pending``: the committed
        tokens the target has not seen; ``committed``: each row's new tokens so far), then the fused op.
        Returns per row (accepted drafts, next token, relaxed flags of the drafts): the block's one
        device-to-host sync. A block without drafts is a plain target step: nothing for the classifier to
        judge."""
        target, sampling, acceptance, capture = self.target, self.sampling, self.acceptance, self.capture
        b, device, vocab = len(pending), target.device, target.vocab
        k = proposal.k if proposal is not None else 0
        drafts = proposal.tokens if proposal is not None else torch.empty((b, 0), dtype=torch.long, device=device)
        ids, fed = left_pad(pending, device)
        until = exact_until(acceptance, [len(n) for n in committed], proposal) if k else None
        exact_only = until is not None and min(until) >= k  # the relaxed rule has nothing to decide
        judge = capture is not None and k > 0 and not exact_only
        if capture is not None:
            capture.keep = k + 1
        logits = self.length.forward(target, torch.cat([ids, drafts], 1),
                                     torch.cat([fed, torch.ones((b, k), dtype=torch.bool)], 1), k + 1)
        uniforms, exponentials = random_draws(sampling.generator, b, k, vocab, device)
        draft_probs = None
        if sampling.generator is not None:
            if proposal is None:
                draft_probs = logits.new_zeros((b, 0, vocab), dtype=torch.float32)
            elif proposal.probs is not None:
                draft_probs = proposal.probs.to(device)
            else:  # a deterministic proposal: the draft "samples" its token with probability one
                draft_probs = torch.nn.functional.one_hot(drafts, vocab).float()
        draft_logits = None
        if acceptance.rule.needs_draft_logits:
            draft_logits = (proposal.logits.to(logits.dtype) if proposal is not None
                            else logits.new_empty((b, 0, vocab)))
        warped = warp_logits(logits, sampling.temperature, sampling.top_p)
        inputs = {"temperature": sampling.temperature, "draft_probs": draft_probs, "uniforms": uniforms,
                  "exponentials": exponentials, "backend": acceptance.backend, "draft_logits": draft_logits,
                  "num_drafts": proposal.lengths.to(device) if proposal is not None and proposal.lengths is not None
                  else None}
        bias = None
        if judge and acceptance.classifier.source_names:  # what it reads of the drafts' sources, folded
            names = acceptance.classifier.source_names
            bias = acceptance.classifier.source_bias(source_features(proposal, names)).to(device)
        res = verify_block(warped, drafts, capture.value if judge else None, self.folded if judge else None,
                           sigma=acceptance.sigma, floor=acceptance.floor, classifier_bias=bias,
                           rule=AcceptRule() if exact_only else acceptance.rule, out=self.workspace, **inputs)
        if until is not None and not exact_only:  # the same block, the same draws, by the exact rule
            res = keep_exact_prefix(res, verify_block(warped, drafts, **inputs), torch.tensor(until, device=device))
        bad = (~torch.isfinite(res.entropy).all()).long()[None]
        host = torch.cat([res.num_accepted, res.next_token, bad, res.pivot_accepted.long().flatten()]).tolist()
        if host[2 * b]:
            raise nonfinite_error(block)
        relaxed = [host[2 * b + 1 + j * k : 2 * b + 1 + (j + 1) * k] for j in range(b)]
        return host[:b], host[b : 2 * b], relaxed


def _commit(target, drafter, proposal: Proposal | None, batch: RowBatch, pending, accepted, tokens,
            relaxed) -> tuple[list[int], list[int]]:
    """Commit each row's accepted prefix and its correction/bonus token; the columns of its rejected drafts
    become holes in the target's cache (it fed [unseen..., d_1..d_k]); count only committed drafts.
    Returns (drafts verified per row, finished batch rows)."""
    b = len(batch)
    k = proposal.k if proposal is not None else 0
    host_drafts = proposal.tokens.tolist() if proposal is not None else [[] for _ in range(b)]
    holes = torch.zeros((b, k + 1), dtype=torch.bool)
    verified, finished, kept_rows = [], [], []
    for j in range(b):
        n, own = accepted[j], (proposal.length(j) if proposal is not None else 0)
        budget = batch.budget(j)
        kept, done = batch.commit(j, host_drafts[j][:n] + [tokens[j]])
        c = len(kept)  # n + 1 unless an EOS or the budget cut the block short
        holes[j, c:] = True
        pending[j] = [tokens[j]]
        s = batch.row_stats(j)
        committed = min(n, c)
        s.target_forwards += 1
        # Alone, this row would have drafted only up to its own budget: count those drafts only.
        s.draft_forwards += min(proposal.forwards[j], budget) if proposal is not None else 0
        s.drafted += min(own, budget)
        s.accepted += committed
        s.relaxed_accepted += sum(relaxed[j][:committed])
        s.draft_lengths[k] = s.draft_lengths.get(k, 0) + 1
        verified.append(own)
        kept_rows.append(kept)
        if done:
            finished.append(j)
    target.drop(holes)
    drafter.commit(batch, proposal, accepted, kept_rows)
    return verified, finished
