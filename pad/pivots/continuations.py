"""Greedy continuations of many jobs as rows of one batch: rows leave when they finish, new jobs join.

A job continues a text whose keys and values are already cached (``prefix``, a slice of some earlier
cache: nothing is prefilled twice) by feeding its ``first`` tokens, then decodes greedily until an EOS or
its budget. Joining jobs are first fed alone, as one small batch of their own (a long first input in
the running batch would be computed for every row), and their caches are then merged into the running
batch (``Decoder.add_rows``); every later step feeds one token per row. A finished row hands back its
cache (``Decoder.row_cache``), so the caller can continue that text later without a prefill.

Jobs that join together are fed in groups of similar first inputs (``join_groups``): every row of a
forward is fed as many columns as its longest one, so a new problem's prompt (about 100 tokens) fed beside
decisions (2 tokens each) would compute 100 columns for each of them, and texts of 200 to 700 tokens fed
as one batch would compute a third of their columns as padding.

A job with a ``draft_token`` feeds ``[token before the decision, draft token]`` last (after whatever part
of its text its prefix lacks): the first of those two positions is where the target would verify the draft
token, and the op ``verify_block`` computes the classifier's features there (hidden state at ``layer``,
``p_target(token)``, entropy, and with the job's ``draft_logits`` the divergence KL(p_target || p_draft))
exactly as in decoding.

Guessed tokens (prompt lookup): a continuation mostly repeats the text it branched from, shifted. Each
step feeds a row its last token plus up to ``lookahead`` tokens copied from the job's ``lookup`` tokens
(after the latest place where the row's last tokens occur there) and keeps the longest guessed prefix the
target's argmax agrees with, plus the target's own next token: the tokens are exactly greedy decoding's,
only fewer forwards. Rejected guesses become holes of the cache. Guesses pay only where a forward over
a few more tokens a row costs little more (on a 2-core CPU with many rows it does not: docs/kernels.md).

The running batch keeps its cache in layers that grow in place (``Decoder(..., grow_in_place=True)``): a
step writes its new columns after the old ones instead of copying the whole cache.
"""
from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass, field

import torch

from pad_kernels import verify_block

from ..decoding.decoder import Decoder, left_pad, right_aligned
from ..decoding.hf import LayerCapture
from ..decoding.rows import cut


@dataclass
class Job:
    key: object  # the caller's handle
    prefix: tuple | None  # (keys, values): per layer [H, n, D] of the cached text before ``first``, or None
    first: list[int]  # tokens fed first
    budget: int  # new tokens to decode at most after ``first`` (0: only feed it)
    draft_token: int | None = None  # first ends with [x, draft_token]: features of the draft token at x
    draft_logits: torch.Tensor | None = None  # [V], the draft's logits where it chose draft_token: adds divergence
    lookup: list[int] = field(default_factory=list)  # tokens the continuation likely repeats (guesses)
    generated: list[int] = field(default_factory=list)
    features: dict | None = None  # set when ``first`` has been fed
    cursor: int = 0  # where in ``lookup`` the row is expected to be
    _ngrams: dict | None = field(default=None, repr=False)

    def guess(self, n: int) -> tuple[list[int], int]:
        """Up to ``n`` tokens guessed from ``lookup`` to follow what the row holds, and the lookup index of
        the first. The longest tail (3, 2, then 1 tokens) of ``first + generated`` found in ``lookup`` picks
        the place, its occurrence at or after ``cursor`` first; without one the row is assumed in step."""
        if n <= 0 or not self.lookup:
            return [], self.cursor
        if self._ngrams is None:
            self._ngrams = {}
            for size in (1, 2, 3):
                for i in range(len(self.lookup) - size + 1):
                    self._ngrams.setdefault(tuple(self.lookup[i : i + size]), []).append(i + size)
        tail = (self.first + self.generated)[-3:]
        start = self.cursor
        for size in (3, 2, 1):
            ends = self._ngrams.get(tuple(tail[-size:])) if len(tail) >= size else None
            if ends:
                k = bisect_left(ends, self.cursor)
                start = ends[k] if k < len(ends) else ends[-1]
                break
        return self.lookup[start : start + n], start


# What one join forward costs beyond its columns, in columns (rows x tokens fed): reading the weights and
# copying the running batch's cache to add the new rows (measured in docs/kernels.md).
JOIN_FIXED = 32


def join_groups(widths: list[int], fixed: float = JOIN_FIXED) -> list[list[int]]:
    """Split jobs that join together into groups fed as one forward each, at the least total cost
    ``sum(fixed + rows * widest)`` over groups. ``widths``: columns each job feeds -> groups of indices into
    ``widths``, narrowest group first. An optimal split never mixes widths across another group's range, so
    the jobs are sorted by width and cut into runs (dynamic programming over the cut points, O(n^2))."""
    order = sorted(range(len(widths)), key=lambda i: widths[i])
    n = len(order)
    if n == 0 or fixed == float("inf"):
        return [order] if n else []
    best, cut = [0.0] + [float("inf")] * n, [0] * (n + 1)  # best cost of the first i jobs; start of the last run
    for i in range(1, n + 1):
        for j in range(i):
            cost = best[j] + fixed + (i - j) * widths[order[i - 1]]
            if cost < best[i]:
                best[i], cut[i] = cost, j
    groups, i = [], n
    while i > 0:
        groups.append(order[cut[i] : i])
        i = cut[i]
    return groups[::-1]


@dataclass
class Finished:
    job: Job
    cache: tuple  # (keys, values): per layer [H, n, D], the text up to the last token it fed
    features: dict | None  # hidden [H], token_prob, entropy (and divergence) of the draft token, when it had one


class Continuations:
    def __init__(self, model, vocab: int, eos: set[int], layer: int, batch: int, lookahead: int = 4, *,
                 min_join: int | None = None, join_fixed: float = JOIN_FIXED):
        """``min_join``: queued jobs join only when at least this many rows are free (or none runs), so that
        joins, each a forward of its own plus a copy of the running cache, come in groups; default batch // 8.
        ``join_fixed``: a join forward's cost beyond its columns (``join_groups``); infinity feeds all jobs
        that join together as one forward."""
        if batch < 1:
            raise ValueError(f"the continuation batch must be at least 1, got {batch}")
        if lookahead < 0:
            raise ValueError(f"lookahead must be >= 0, got {lookahead}")
        self.min_join = max(1, batch // 8) if min_join is None else min_join
        if not 1 <= self.min_join <= batch:
            raise ValueError(f"min_join must be between 1 and the batch ({batch}), got {min_join}")
        if not join_fixed >= 0:
            raise ValueError(f"join_fixed must be >= 0, got {join_fixed}")
        self.model, self.vocab, self.eos, self.batch, self.lookahead = model, vocab, eos, batch, lookahead
        self.join_fixed = join_fixed
        self.forwards = self.tokens = 0  # target forwards of running rows and the tokens they committed
        self.joins = 0  # forwards that fed joining jobs
        self.device = next(model.parameters()).device
        self.capture = LayerCapture(model, layer)
        self.capture.keep = 2
        self.main = Decoder(model, vocab, 0, grow_in_place=True)
        # The job of each row of the running batch; None for a finished row, which stays in the batch (fed
        # holes) until the next join removes it, so that the cache is copied once per join, not per finish.
        self.rows: list[Job | None] = []
        self.queue: list[Job] = []

    def close(self) -> None:
        self.capture.remove()

    def submit(self, job: Job) -> None:
        self.queue.append(job)

    @property
    def running(self) -> int:
        """Rows still decoding."""
        return len(self.running_jobs())

    def running_jobs(self) -> list[Job]:
        """The jobs of the rows still decoding (their ``generated`` tokens so far are final)."""
        return [j for j in self.rows if j is not None]

    @property
    def busy(self) -> bool:
        return bool(self.running or self.queue)

    @torch.inference_mode()
    def step(self) -> list[Finished]:
        """Let queued jobs join (as far as the batch has room), then one greedy step of the running rows."""
        room = self.batch - self.running
        if self.queue and (room >= self.min_join or not self.running):
            live = [r for r, j in enumerate(self.rows) if j is not None]
            if len(live) < len(self.rows):  # finished rows leave now, in one copy of the cache
                if live:
                    self.main.select(live)
                else:
                    self.main = Decoder(self.model, self.vocab, 0, grow_in_place=True)
                self.rows = [self.rows[r] for r in live]
            joining, self.queue = self.queue[:room], self.queue[room:]
            return self._join(joining)
        return self._step() if self.running else []

    def _commit(self, job: Job, token: int) -> bool:
        """Append the row's next token; True when the job is finished."""
        if job.budget == 0 or (job.draft_token is not None and job.draft_token in self.eos and not job.generated):
            return True  # a draft token that ends the text: nothing follows it
        kept, done = cut([token], job.budget - len(job.generated), self.eos)
        job.generated += kept
        return done

    def _join(self, jobs: list[Job]) -> list[Finished]:
        """Feed joining jobs in groups of similar first inputs; finished ones come back in ``jobs``' order."""
        # A first input of one token is fed as two columns (see ``_join_group``).
        groups = join_groups([max(2, len(j.first)) for j in jobs], self.join_fixed)
        done = [f for group in groups for f in self._join_group([jobs[r] for r in group])]
        where = {id(job): r for r, job in enumerate(jobs)}
        return sorted(done, key=lambda f: where[id(f.job)])

    def _join_group(self, jobs: list[Job]) -> list[Finished]:
        self.joins += 1
        temp = Decoder(self.model, self.vocab, len(jobs))
        if any(j.prefix is not None and j.prefix[0][0].shape[1] for j in jobs):
            temp.add_rows(*right_aligned([j.prefix for j in jobs]))
        # At least two columns, so that the verify position exists for every row (a hole before a
        # one-token first input is masked out like left padding).
        ids, fed = left_pad([j.first if len(j.first) > 1 else [0, *j.first] for j in jobs], self.device)
        if any(len(j.first) == 1 for j in jobs):
            fed = fed.clone()
            for r, j in enumerate(jobs):
                if len(j.first) == 1:
                    fed[r, -2] = False
        logits = temp.forward(ids, fed, keep=2)  # [R, 2, V]
        hidden = self.capture.value  # [R, 2, H]
        drafts = torch.tensor([[j.draft_token if j.draft_token is not None else 0] for j in jobs], device=self.device)
        # The draft's logits where jobs give them (zeros elsewhere: those rows' divergence is not kept).
        given = [j.draft_logits for j in jobs]
        zero = logits.new_zeros(logits.shape[-1])
        draft_logits = None if all(x is None for x in given) else torch.stack(
            [zero if x is None else x.to(logits.device, logits.dtype) for x in given])[:, None]
        # The features of each draft token, and the argmax after ``first``.
        res = verify_block(logits, drafts, draft_logits=draft_logits)
        host = torch.cat([res.argmax[:, 1], (~torch.isfinite(res.entropy[:, 1])).long()]).tolist()
        tokens, bad = host[: len(jobs)], host[len(jobs) :]
        if any(bad):
            raise FloatingPointError("the model produced non-finite logits while continuing a text")
        done, staying = [], []
        for r, (job, token) in enumerate(zip(jobs, tokens)):
            features = None
            if job.draft_token is not None:
                features = {"hidden": hidden[r, 0].clone(), "token_prob": float(res.token_prob[r, 0]),
                            "entropy": float(res.entropy[r, 0])}
                if job.draft_logits is not None:
                    features["divergence"] = float(res.divergence[r, 0])
            job.features = features
            if self._commit(job, token):
                done.append(Finished(job, temp.row_cache(r), features))
            else:
                staying.append(r)
        if staying:
            temp.select(staying)
            self.main.add_rows([layer.keys for layer in temp.cache.layers],
                               [layer.values for layer in temp.cache.layers], temp.valid_host)
            self.rows += [jobs[r] for r in staying]
        return done

    def _step(self) -> list[Finished]:
        # Never guess past a row's budget: its last token comes from the target anyway. Finished rows get a hole.
        guesses = [([], 0) if j is None else j.guess(min(self.lookahead, j.budget - len(j.generated) - 1))
                   for j in self.rows]
        ids, fed = left_pad([[] if j is None else [j.generated[-1], *g] for j, (g, _) in zip(self.rows, guesses)],
                            self.device)
        W = ids.shape[1]
        logits = self.main.forward(ids, fed, keep=W)  # [B, W, V]
        host = torch.cat([logits.argmax(-1), (~torch.isfinite(logits).all(-1)).long()], 1).tolist()
        self.forwards += 1
        finished = []
        holes = torch.zeros((len(self.rows), W), dtype=torch.bool)
        for r, (job, (guess, start)) in enumerate(zip(self.rows, guesses)):
            if job is None:
                continue
            top, bad = host[r][W - len(guess) - 1 : W], host[r][W + W - len(guess) - 1 :]
            if any(bad):
                raise FloatingPointError("the model produced non-finite logits while continuing a text")
            # Tokens to commit: the guesses the target agrees with, then its own next token.
            n = next((i for i, g in enumerate(guess) if g != top[i]), len(guess))
            committed, done = 0, False
            for token in guess[:n] + [top[n]]:
                committed += 1
                if self._commit(job, token):
                    done = True
                    break
            self.tokens += committed
            job.cursor = start + committed
            # Fed guesses past the committed text (the last committed one is fed only if it was a guess).
            keep = min(n, committed)
            if keep < len(guess):
                holes[r, W - len(guess) + keep :] = True
            if done:
                finished.append(r)
        self.main.drop(holes)
        out = [Finished(self.rows[r], self.main.row_cache(r), self.rows[r].features) for r in finished]
        for r in finished:
            self.rows[r] = None
        return out
