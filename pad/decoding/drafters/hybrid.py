"""The ``hybrid`` drafter: per row and block, a draft-free proposal where its match is long enough, else
the draft model.

A row takes the draft-free drafter's proposal (``lookup`` by default) when the n-gram or context it matched
is at least ``min_match`` tokens long and proposes something; every other row takes the draft model's. The
model runs only in blocks where some row needs it (at B = 1: only when the row does); it then runs over
the whole batch, as its cache is one tensor, and only the rows that need it count its forwards.

With ``num_draft_tokens="auto"`` each source's acceptance is estimated apart (``sources`` names each row's),
and a row whose match is long enough still takes the model when the model's drafts are expected to give it
more tokens: the model's cost is paid for the whole batch once it runs, so where it runs each row takes the
source of more expected tokens at the block's K (a lookup proposes only what followed its match, often
fewer than K, while the model proposes K).
The chooser also weighs, per block, the draft-free drafter alone (every row its proposal, however short its
match; rows without one propose nothing): where the model's drafts are not worth their cost (a long
context, a low acceptance), a short match still is. Matches shorter than ``min_match`` are a source of
their own (``short``: ``"lookup-short"`` for lookup): they are accepted far less often than long ones,
and pooled with them they would make the long matches look worse than the model.
"""
from __future__ import annotations

import torch

from ..draft_length import expected_tokens
from .base import SOURCES, Proposal
from .lookup import LookupDrafter
from .model import ModelDrafter


class HybridDrafter:
    name = "hybrid"
    has_logits = False  # the draft-free rows have no distribution

    def __init__(self, model: ModelDrafter, free=None, min_match: int = 2):
        if not isinstance(min_match, int) or min_match < 1:
            raise ValueError(f"min_match must be an integer >= 1, got {min_match!r}")
        self.model = model.model  # the draft model (for cost models and the acceptance pool)
        self.drafter = model
        self.free = free if free is not None else LookupDrafter()
        self.min_match = min_match
        self.model_blocks = self.free_blocks = 0  # blocks the model ran in / did not
        self.option = "mixed"
        self.prefer_model = None  # per live row, whether mixed takes the model over a long match

    @property
    def cost(self):
        return self.drafter.cost

    @cost.setter
    def cost(self, value) -> None:
        self.drafter.cost = value

    @property
    def clock(self):
        return self.drafter.clock

    @clock.setter
    def clock(self, value) -> None:
        self.drafter.clock = value

    def start(self, batch, sampling, device, needs_logits: bool = False) -> None:
        self.option, self.prefer_model, self.rows = "mixed", None, len(batch)
        self.drafter.start(batch, sampling, device)
        self.free.start(batch, sampling, device)
        self.sampling, self.device = sampling, device

    def options(self) -> tuple[str, ...]:
        """The ways this drafter can propose: ``"mixed"`` (the free drafter's match where it is at least
        ``min_match`` long, else the model) and ``"free"`` (the free drafter alone)."""
        return ("mixed", "free")

    def all_sources(self) -> tuple[str, ...]:
        """The sources every option draws on, each to be tried before options are weighed (as ``sources``
        names them; the free option's short matches, ``short``, are learnt when it runs)."""
        return ("model", self.free.name)

    @property
    def short(self) -> str:
        """The source name of the free drafter's matches shorter than ``min_match``."""
        return f"{self.free.name}-short"

    def use(self, option: str, acceptance=None, k: int | None = None) -> None:
        """Propose the ``option`` way (see ``options``) until told otherwise; each call starts mixed.
        ``acceptance``: sources [B] -> [B] per-token acceptance estimates of the live rows (the chooser's
        ``estimates``); mixed then sends a row with a long match to the model where the model's k drafts
        are expected to give more tokens than the match's proposal, at most k long (``expected_tokens``);
        None: by match length alone. ``k``: the block's expected draft length, needed with ``acceptance``."""
        if option not in self.options():
            raise ValueError(f"unknown option {option!r}; choose one of {', '.join(self.options())}")
        self.option, self.prefer_model = option, None
        if acceptance is not None:
            if not isinstance(k, int) or k < 1:
                raise ValueError(f"use: acceptance estimates need the block's draft length k >= 1, got {k!r}")
            b = self.rows
            model, free = acceptance(["model"] * b), acceptance([self.free.name] * b)
            caps = [len(tokens) for tokens, _ in self.free.matches(k)]
            self.prefer_model = [expected_tokens(float(m), k) > expected_tokens(float(f), min(k, c))
                                 for m, f, c in zip(model, free, caps)]

    def _plan(self, k: int) -> list[tuple[list[int], bool, int]]:
        """Per live row (the free drafter's tokens, whether the row takes the model's instead, the match's
        length)."""
        matches = self.free.matches(k)
        if self.option == "free":
            return [(tokens, False, n) for tokens, n in matches]
        prefer = self.prefer_model or [False] * len(matches)
        return [(tokens, n < self.min_match or not tokens or p, n) for (tokens, n), p in zip(matches, prefer)]

    def available(self, k: int) -> list[int]:
        return [k if use_model else len(tokens) for tokens, use_model, _ in self._plan(k)]

    def sources(self, k: int) -> list[str]:
        """Per live row where a block of k drafts comes from: ``"model"``, the free drafter's name (a match of
        at least ``min_match`` tokens) or ``short`` (a shorter one, or none)."""
        return ["model" if use_model else self.free.name if n >= self.min_match else self.short
                for _, use_model, n in self._plan(k)]

    def seconds(self, k: int, rows: int) -> float:
        needs_model = any(use_model for _, use_model, _ in self._plan(k))
        return self.drafter.seconds(k, rows) if needs_model else self.free.seconds(k, rows)

    def catch_up(self, rows: int) -> float:
        return self.drafter.catch_up(rows) if any(m for _, m, _ in self._plan(1)) else 0.0

    def propose(self, batch, k: int) -> Proposal:
        plan = self._plan(k)
        b = len(plan)
        used = [use_model for _, use_model, _ in plan]
        lengths = torch.tensor([k if m else len(t) for t, m, _ in plan], dtype=torch.long)
        tokens = torch.zeros((b, k), dtype=torch.long)
        for j, (t, m, _) in enumerate(plan):
            if not m and t:
                tokens[j, : len(t)] = torch.tensor(t, dtype=torch.long)
        tokens = tokens.to(self.device)
        free = SOURCES.index(self.free.source)
        sources = [0 if m else free for m in used]
        matches = [0 if m else n for (_, m, n) in plan]
        if not any(used):
            self.free_blocks += 1
            return Proposal(tokens, lengths, forwards=[0] * b, sources=sources, matches=matches)
        self.model_blocks += 1
        drafted = self.drafter.propose(batch, k)
        self.drafter.use_rows(used)
        k = drafted.k  # draft_stop may end the model's drafting early
        mask = torch.tensor(used, device=self.device)
        tokens = torch.where(mask[:, None], drafted.tokens, tokens[:, :k])
        model_lengths = drafted.lengths if drafted.lengths is not None else torch.full((b,), k, dtype=torch.long)
        lengths = torch.where(torch.tensor(used), model_lengths, lengths.clamp_max(k))
        probs = None
        if drafted.probs is not None:  # sampling: the free rows' tokens are drawn with probability one
            one_hot = torch.nn.functional.one_hot(tokens, drafted.probs.shape[-1]).to(drafted.probs)
            probs = torch.where(mask[:, None, None], drafted.probs, one_hot)
        forwards = [f if m else 0 for f, m in zip(drafted.forwards, used)]
        return Proposal(tokens, lengths, probs=probs, forwards=forwards, sources=sources, matches=matches)

    def commit(self, batch, proposal, accepted, kept) -> None:
        self.drafter.commit(batch, proposal, accepted, kept)
        self.free.commit(batch, proposal, accepted, kept)

    def select(self, keep: list[int]) -> None:
        self.drafter.select(keep)
        self.free.select(keep)
        self.rows = len(keep)
        if self.prefer_model is not None:
            self.prefer_model = [self.prefer_model[j] for j in keep]

    def finish(self, batch) -> None:
        self.drafter.finish(batch)
        self.free.finish(batch)
