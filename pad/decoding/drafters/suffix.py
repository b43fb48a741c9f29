"""The ``suffix`` drafter: SuffixDecoding's idea (arXiv 2411.04975) in chain form, bounded in memory.

Per row, counts of which token followed each context of 1..``max_depth`` tokens, over the row's own context
(prompt and committed tokens) and over the outputs of earlier requests decoded with the same drafter in this
process (the global part, at most ``max_cached_tokens`` tokens: the oldest outputs are forgotten first). A
proposal walks from the row's last tokens: at each step it takes the longest context (at least
``min_match`` tokens) seen before, appends its most frequent next token (own and global counts summed; ties
go to the token seen most recently in the row, then the smallest id), and goes on from the extended context,
up to K tokens; it stops where no context of ``min_match`` tokens was seen or where that token's share of
the counts falls below ``min_share``.
"""
from __future__ import annotations

from collections import deque

from .base import FreeDrafter


class SuffixCounts:
    """context (tuple of 1..max_depth tokens) -> {next token: count}."""

    def __init__(self, max_depth: int):
        self.max_depth = max_depth
        self.table: dict[tuple, dict[int, int]] = {}

    def add(self, tokens: list[int], start: int, end: int, sign: int = 1) -> None:
        """Count (or with sign -1 uncount) the pairs whose next token is tokens[i] for start <= i < end."""
        for i in range(max(start, 1), end):
            for d in range(1, min(self.max_depth, i) + 1):
                key = tuple(tokens[i - d : i])
                nexts = self.table.setdefault(key, {})
                count = nexts.get(tokens[i], 0) + sign
                if count > 0:
                    nexts[tokens[i]] = count
                else:
                    nexts.pop(tokens[i], None)
                    if not nexts:
                        del self.table[key]


class SuffixDrafter(FreeDrafter):
    """See the module docstring. One instance keeps its global counts across calls: reuse it (``pad.generate``
    keeps one per target model for ``drafter="suffix"``)."""

    name = source = "suffix"

    def __init__(self, max_depth: int = 8, min_match: int = 2, min_share: float = 0.1,
                 max_cached_tokens: int = 1 << 18):
        super().__init__()
        if not (isinstance(max_depth, int) and isinstance(min_match, int) and 1 <= min_match <= max_depth):
            raise ValueError(f"need 1 <= min_match <= max_depth, got {min_match!r}, {max_depth!r}")
        if not 0.0 <= min_share <= 1.0:
            raise ValueError(f"min_share must be in [0, 1], got {min_share!r}")
        if not isinstance(max_cached_tokens, int) or max_cached_tokens < 0:
            raise ValueError(f"max_cached_tokens must be an integer >= 0, got {max_cached_tokens!r}")
        self.max_depth, self.min_match, self.min_share = max_depth, min_match, min_share
        self.max_cached_tokens = max_cached_tokens
        self.global_counts = SuffixCounts(max_depth)
        self.outputs: deque[list[int]] = deque()  # earlier requests' outputs, oldest first
        self.cached_tokens = 0

    def start(self, batch, sampling, device, needs_logits: bool = False) -> None:
        super().start(batch, sampling, device)
        self.rows = [_Row(p, self.max_depth) for p in batch.prompts]

    def matches(self, k: int) -> list[tuple[list[int], int]]:
        """Per live row (up to k drafts, the depth of the first step's matched context)."""
        return [self._walk(row, k) for row in self.rows]

    def _walk(self, row: "_Row", k: int) -> tuple[list[int], int]:
        row.index()
        context, out, first = row.tokens[-self.max_depth:], [], 0
        tables = (row.counts.table, self.global_counts.table)
        while len(out) < k:
            for d in range(min(self.max_depth, len(context)), self.min_match - 1, -1):
                key = tuple(context[len(context) - d:])
                own, seen = tables[0].get(key), tables[1].get(key)
                if own or seen:
                    break
            else:
                break
            counts = dict(seen or {})
            for t, c in (own or {}).items():
                counts[t] = counts.get(t, 0) + c
            token = max(counts, key=lambda t: (counts[t], row.recency.get(t, -1), -t))
            if counts[token] < self.min_share * sum(counts.values()):
                break
            first = first or d
            out.append(token)
            context = (context + [token])[-self.max_depth:]
        return out, first

    def finish(self, batch) -> None:
        """Remember this call's outputs (forgetting the oldest beyond ``max_cached_tokens``)."""
        for tokens in batch.new:
            self.remember(tokens)

    def remember(self, tokens: list[int]) -> None:
        """Add one output to the global counts."""
        if not tokens or len(tokens) > self.max_cached_tokens:
            return
        self.outputs.append(list(tokens))
        self.global_counts.add(tokens, 0, len(tokens))
        self.cached_tokens += len(tokens)
        while self.cached_tokens > self.max_cached_tokens:
            old = self.outputs.popleft()
            self.global_counts.add(old, 0, len(old), sign=-1)
            self.cached_tokens -= len(old)


class _Row:
    """One row's context, its own counts (indexed lazily) and where each token was last seen."""

    def __init__(self, tokens: list[int], max_depth: int):
        self.tokens = list(tokens)
        self.counts = SuffixCounts(max_depth)
        self.recency: dict[int, int] = {}
        self.indexed = 0

    def extend(self, tokens: list[int]) -> None:
        self.tokens += tokens

    def index(self) -> None:
        end = len(self.tokens)
        self.counts.add(self.tokens, self.indexed, end)
        for i in range(self.indexed, end):
            self.recency[self.tokens[i]] = i
        self.indexed = end
