"""Draft-length choosers for the decode tests: a fixed K sequence per block, and the real chooser recording."""
import math

from pad.decoding.draft_length import AutoDraftLength


class Schedule(AutoDraftLength):
    """Chooses the K of block i from a list (cycled), within the chooser's limit, and records them: a K
    sequence to replay, with K = 0 blocks where the list says; a drafter with options (hybrid) proposes by
    each in turn. Measures nothing."""

    def __init__(self, ks):
        super().__init__(max(max(ks), 1))
        self.ks, self.chosen = list(ks), []

    def bind(self, target, draft, rows, columns):
        pass

    def option(self, batch, drafter, target_width, limit):
        options = drafter.options()
        return options[len(self.chosen) % len(options)]

    def choose(self, acceptance, draft_seconds, target_columns, *, limit=None, **kw):
        k = self.ks[len(self.chosen) % len(self.ks)]
        k = k if limit is None else min(k, limit)
        self.chosen.append(k)
        return k, math.nan


class Recorder(AutoDraftLength):
    """The real chooser, recording the K of every block."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.chosen = []

    def choose(self, *a, **kw):
        k, seconds = super().choose(*a, **kw)
        self.chosen.append(k)
        return k, seconds
