"""The ``lookup`` drafter: prompt lookup decoding, per row of a batch.

For each row, the longest n-gram (n from ``max_ngram`` down to ``min_ngram``) ending its context (prompt and
committed tokens) that also occurs earlier in that context; the drafts are the tokens that followed its most
recent earlier occurrence, at most K. No model runs: a row without such a match proposes nothing (its block
is a plain target step), so proposals are ragged.
"""
from __future__ import annotations

from .base import FreeDrafter


class NgramIndex:
    """One row's context and, per n-gram of length ``min_n``..``max_n``, the end of its latest occurrence,
    indexed lazily up to the second-to-last token (so every match has a continuation)."""

    def __init__(self, tokens: list[int], max_n: int, min_n: int):
        self.tokens = list(tokens)
        self.max_n, self.min_n = max_n, min_n
        self.last: dict[tuple, int] = {}
        self.indexed = 0  # n-grams ending before this position are in ``last``

    def extend(self, tokens: list[int]) -> None:
        self.tokens += tokens

    def match(self, k: int) -> tuple[list[int], int]:
        """(up to k tokens that followed the latest earlier occurrence of the longest matching suffix, its
        length n); ([], 0) without a match."""
        t, end = self.tokens, len(self.tokens)
        for i in range(self.indexed, end - 1):
            for n in range(self.min_n, min(self.max_n, i + 1) + 1):
                self.last[tuple(t[i - n + 1 : i + 1])] = i
        self.indexed = max(self.indexed, end - 1)
        for n in range(min(self.max_n, end), self.min_n - 1, -1):
            i = self.last.get(tuple(t[end - n :]))
            if i is not None:
                return t[i + 1 : i + 1 + k], n
        return [], 0


class LookupDrafter(FreeDrafter):
    """Prompt lookup decoding (see the module docstring); ``max_ngram`` >= ``min_ngram`` >= 1."""

    name = "lookup"

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        super().__init__()
        if not (isinstance(min_ngram, int) and isinstance(max_ngram, int) and 1 <= min_ngram <= max_ngram):
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got min_ngram={min_ngram!r}, max_ngram={max_ngram!r}")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def start(self, batch, sampling, device, needs_logits: bool = False) -> None:
        super().start(batch, sampling, device)
        self.rows = [NgramIndex(p, self.max_ngram, self.min_ngram) for p in batch.prompts]

    def matches(self, k: int) -> list[tuple[list[int], int]]:
        """Per live row (up to k drafts, the matched n-gram's length)."""
        return [row.match(k) for row in self.rows]
