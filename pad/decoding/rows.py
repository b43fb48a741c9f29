"""The rows of one decode call: what each has committed, its budget and EOS cut, its stats, and which rows
are still in the batch.

Every decode path (``pad.generate``'s speculative and one-model loops, the labelers' rollouts) commits
tokens through ``cut``, so a row ends the same way everywhere: at its token budget, or right after its
first EOS, that EOS kept.
"""
from __future__ import annotations

import math
import time

from .stats import GenerationStats


def cut(tokens: list[int], budget: int, eos) -> tuple[list[int], bool]:
    """``tokens`` cut at the token ``budget`` and after the first EOS (in ``eos``, kept); returns (kept,
    finished): finished when an EOS was kept or the budget is spent."""
    tokens = tokens[:max(budget, 0)]
    for i, t in enumerate(tokens):
        if t in eos:
            return tokens[: i + 1], True
    return tokens, len(tokens) == budget


class RowBatch:
    """The rows of a call and the batch of those still decoding.

    Row r of the call is batch row j while ``live[j] == r``; finished rows leave the batch (``end_block``)
    and every model cache of the batch (``decoders``) drops them at once, with anything else registered
    in ``followers`` (objects with ``select(keep)``: a drafter, an acceptance model).
    """

    def __init__(self, prompts: list[list[int]], max_new_tokens: int, eos, *, vocab: int = 0, callback=None,
                 single: bool = False):
        """``vocab``: the token ids the models share (drafters' caches are made for it); ``single``: the callback
        takes one row's tokens (a call of one unbatched prompt)."""
        self.prompts = prompts
        self.vocab = vocab
        self.new: list[list[int]] = [[] for _ in prompts]
        self.stats = [GenerationStats(prompt_tokens=len(p)) for p in prompts]
        self.live = list(range(len(prompts)))
        self.max_new_tokens = max_new_tokens
        self.eos = set(eos)
        self.callback = callback
        self.single = single
        self.start = time.perf_counter()
        self.followers: list = []
        self._block: list[tuple[int, list[int]]] = []
        self.draft_lengths: dict[int, int] = {}  # K -> blocks
        self.timed: list[tuple[float, float]] = []  # (predicted, measured) seconds of the blocks whose K was chosen

    def __len__(self) -> int:
        """Rows still decoding."""
        return len(self.live)

    def budget(self, j: int) -> int:
        """New tokens batch row j may still commit."""
        return self.max_new_tokens - len(self.new[self.live[j]])

    def context(self, j: int) -> list[int]:
        """Batch row j's prompt and committed tokens (a new list)."""
        r = self.live[j]
        return self.prompts[r] + self.new[r]

    def row_stats(self, j: int) -> GenerationStats:
        return self.stats[self.live[j]]

    def commit(self, j: int, tokens: list[int]) -> tuple[list[int], bool]:
        """Commit batch row j's ``tokens`` through ``cut``; returns (kept, finished)."""
        r = self.live[j]
        kept, done = cut(tokens, self.budget(j), self.eos)
        self.new[r] += kept
        self.stats[r].new_tokens = len(self.new[r])
        if self.callback is not None:
            self._block.append((r, kept))
        if done:
            self.stats[r].wall_time = time.perf_counter() - self.start
        return kept, done

    def record_block(self, k: int, predicted: float = math.nan, seconds: float = math.nan) -> None:
        self.draft_lengths[k] = self.draft_lengths.get(k, 0) + 1
        if math.isfinite(predicted):
            self.timed.append((predicted, seconds))

    def end_block(self, finished: list[int]) -> list[int]:
        """Call the callback, then drop the ``finished`` batch rows from the batch and every follower;
        returns the kept batch rows (indices into the old ``live``)."""
        if self.callback is not None:
            if self.single:
                self.callback(self._block[0][1] if self._block else [], self.stats[0])
            else:
                by_row = [[] for _ in self.new]
                for r, kept in self._block:
                    by_row[r] = kept
                self.callback(by_row, self.total())
            self._block = []
        gone = set(finished)
        keep = [j for j in range(len(self.live)) if j not in gone]
        if gone:
            self.live = [self.live[j] for j in keep]
            if self.live:
                for follower in self.followers:
                    follower.select(keep)
        return keep

    def total(self) -> GenerationStats:
        """Stats summed over rows; wall time of the whole call so far."""
        total = GenerationStats()
        for s in self.stats:
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
