"""What a drafter is: the ``Drafter`` protocol, its ``Proposal``, and the sampling settings it drafts under.

A drafter proposes up to K tokens for each live row of a ``RowBatch`` (rows may propose fewer: ragged),
optionally with the distribution each token was drawn from; it is told what each row committed; it predicts
what proposing costs, so that ``num_draft_tokens="auto"`` can weigh it. The acceptance rules that read the
target alone (exact, pivot, typical, threshold, fly, topk) apply to any drafter; ``kl`` reads the draft's
distribution and needs a drafter with ``has_logits``. A proposal says where each row's drafts came from and
the match behind them (``Proposal.sources``, ``matches``): pivot's classifier leaves draft-free rows
(``Proposal.free``) to the exact rule unless told otherwise, and a classifier trained on where drafts came
from reads both.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch


@dataclass(frozen=True)
class Sampling:
    """How tokens are drawn: greedy at ``temperature`` 0, else sampled from the top-p nucleus of
    softmax(logits / temperature) with ``generator`` (on the target's device)."""

    temperature: float = 0.0
    top_p: float = 1.0
    generator: torch.Generator | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


# Where a row's drafts came from: ``Proposal.sources`` holds indices into this, as the labels' ``source`` does.
SOURCES = ("model", "lookup", "suffix")


@dataclass
class Proposal:
    """One block's drafts for the B live rows.

    tokens: [B, k] int64 on the target's device; row j's drafts are ``tokens[j, :lengths[j]]`` (the rest is
    padding, verified never). lengths: [B] int64 on the host, each in [0, k]; None means k for every row.
    probs: [B, k, V] fp32, the distribution each draft was sampled from (needed when sampling; None for a
    deterministic proposal, which the decode treats as one-hot). logits: [B, k, V] the drafter's logits,
    warped by the sampling's top-p (for rules that read them; None if the drafter has none).
    forwards: [B] draft-model forwards each row took part in this block (counted in the stats).
    sources: [B] per row, where its drafts came from (an index into ``SOURCES``: 0 the draft model, 1 a lookup,
    2 a suffix match); None: every row's from the model. matches: [B] the match behind a draft-free row's
    drafts (lookup: the n-gram's length; suffix: the depth of its first context), 0 for the model's; None:
    all 0.
    """

    tokens: torch.Tensor
    lengths: torch.Tensor | None = None
    probs: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    forwards: list[int] | None = None
    sources: list[int] | None = None
    matches: list[int] | None = None

    @property
    def k(self) -> int:
        return self.tokens.shape[1]

    @property
    def free(self) -> list[bool] | None:
        """[B] per row, whether its drafts came without a draft model: the pivot classifier, trained on a
        draft model's mismatches, leaves such rows to the exact rule unless told to judge them (``generate``'s
        ``judge_free``); None: no row's did."""
        return None if self.sources is None else [s != 0 for s in self.sources]

    def length(self, j: int) -> int:
        return self.k if self.lengths is None else int(self.lengths[j])


@runtime_checkable
class Drafter(Protocol):
    """Proposes draft tokens for the rows of a ``RowBatch``; see the module docstring.

    Calls in a decode, in order: ``start`` once; per block ``propose`` then ``commit``; ``select`` whenever
    rows leave the batch; ``finish`` once at the end (also after an error).
    """

    name: str
    has_logits: bool  # proposals carry ``logits`` (and ``probs`` when sampling)

    def start(self, batch, sampling: Sampling, device: torch.device) -> None:
        """Before the first block: the batch's prompts are its context."""

    def propose(self, batch, k: int) -> Proposal:
        """Up to k drafts per live row (k >= 1)."""

    def commit(self, batch, proposal: Proposal | None, accepted: list[int], kept: list[list[int]]) -> None:
        """What each live row committed this block: ``accepted[j]`` drafts of the proposal (None after a block
        without drafts) and ``kept[j]`` tokens in all (those drafts and the target's token, cut at EOS or the
        budget). Called before finished rows leave the batch."""

    def select(self, keep: list[int]) -> None:
        """Only batch rows ``keep`` go on."""

    def seconds(self, k: int, rows: int) -> float:
        """Predicted seconds to propose k tokens for each of ``rows`` rows now."""

    def finish(self, batch) -> None:
        """After the last block."""


class FreeDrafter:
    """Shared parts of drafters that run no model: their proposals are deterministic (no logits), their
    cost a measured mean of their own time. A subclass keeps one object per live row in ``rows`` (with
    ``extend(tokens)``) and gives ``matches(k)``: per row (up to k drafts, the length of the match).
    ``source``: the kind of proposal it makes (``SOURCES``, never the model's), as a classifier of sources reads
    it; a drafter of one's own is taken for a lookup unless it says otherwise."""

    rows: list

    has_logits = False
    source = "lookup"

    def __init__(self):
        self._seconds_per_row = 0.0
        self._timed = 0

    def timed(self, seconds: float, rows: int) -> None:
        """Fold one proposal's measured time into the running mean cost per row."""
        self._timed += 1
        self._seconds_per_row += (seconds / max(rows, 1) - self._seconds_per_row) / min(self._timed, 32)

    def seconds(self, k: int, rows: int) -> float:
        return self._seconds_per_row * rows

    def start(self, batch, sampling: Sampling, device: torch.device) -> None:
        self.device = device

    def available(self, k: int) -> list[int]:
        """Per live row the drafts a proposal of k would hold."""
        return [len(tokens) for tokens, _ in self.matches(k)]

    def propose(self, batch, k: int) -> Proposal:
        start = time.perf_counter()
        proposal = pack(self.matches(k), k, self.device, SOURCES.index(self.source))
        self.timed(time.perf_counter() - start, len(batch))
        return proposal

    def commit(self, batch, proposal, accepted, kept) -> None:
        for row, tokens in zip(self.rows, kept):
            row.extend(tokens)

    def select(self, keep: list[int]) -> None:
        self.rows = [self.rows[j] for j in keep]

    def finish(self, batch) -> None:
        pass


def pack(matches: list[tuple[list[int], int]], k: int, device, source: int) -> Proposal:
    """(token list of at most k, match length) per row -> a deterministic ``Proposal`` [B, k], right-padded
    with 0, every row's drafts from ``source`` (an index into ``SOURCES``)."""
    tokens = torch.zeros((len(matches), k), dtype=torch.long)
    for j, (p, _) in enumerate(matches):
        if p:
            tokens[j, : len(p)] = torch.tensor(p, dtype=torch.long)
    lengths = torch.tensor([len(p) for p, _ in matches], dtype=torch.long)
    return Proposal(tokens.to(device), lengths, forwards=[0] * len(matches), sources=[source] * len(matches),
                    matches=[n for _, n in matches])
