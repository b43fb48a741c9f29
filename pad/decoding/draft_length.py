"""The draft length of each block, chosen from measured forward costs and live acceptance
(``num_draft_tokens="auto"``).

A block with K draft tokens costs the draft's K forwards plus one target forward over K + 1 tokens per row,
and yields per row its accepted prefix plus one token. Whether that beats a plain target step (K = 0)
depends on the machine: while a forward is bound by reading the weights, K + 1 tokens cost about what one
does; once rows x tokens make it compute-bound (wide batches on a CPU), every extra token costs. So the
costs are measured, not assumed: ``ForwardCost`` fits a small model of one model's forward time to the
forwards it has seen, and ``AutoDraftLength`` picks, before each block, the K in 0..max_draft_tokens that
maximises the batch's expected new tokens per second.
"""
from __future__ import annotations

import hashlib
import json
import math
import time
import weakref
from collections import deque
from pathlib import Path
from typing import Protocol, runtime_checkable

import numpy as np
import torch

# Knees tried by the fit (tokens per forward where the cost per token changes; see ForwardCost).
KNEES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
# Decoding's forwards kept per model besides its probes (the oldest are dropped, so a drifting machine is
# followed).
MAX_OBSERVATIONS = 512
# Per-token acceptance assumed before any block was verified, and its weight in pseudo-trials: rows
# shrink towards the batch's pooled estimate, the pool towards this prior. Optimistic on purpose: a K = 0
# block verifies nothing, so a pessimistic prior could keep speculation off where it would pay and never
# learn otherwise; an optimistic one tries it and learns within a few blocks.
PRIOR_ACCEPTANCE = 0.9
PRIOR_TRIALS = 4.0
# Trials of earlier calls (same models, policy and sampling settings, this process) a new call starts from,
# scaled down to this many so that its own blocks soon outweigh them.
REMEMBERED_TRIALS = 64.0
# The most a block drafts under -k auto: at one row a block of 33 tokens costs a small multiple of a one-token
# step (bench/README.md, --block-sweep), which pays where lookups match long spans; where it does not, the
# chooser stops sooner by itself.
DEFAULT_MAX_DRAFT_TOKENS = 32
# Speculating (K > 0) must beat a plain target step by more than the chooser's own recent error in predicting
# block times (mean |predicted - measured| / measured over the last blocks); before enough blocks were timed,
# by this much.
PRIOR_MIN_GAIN = 0.1
TIMED_BLOCKS_KEPT = 16


def nnls(a: np.ndarray, b: np.ndarray, tol: float = 1e-12) -> np.ndarray:
    """Least squares with non-negative coefficients (Lawson and Hanson's active-set method):
    ``argmin_x ||a x - b||`` subject to ``x >= 0``; a [M, N], b [M] -> x [N]."""
    n = a.shape[1]
    free = np.zeros(n, dtype=bool)  # coefficients allowed to move (the passive set)
    x = np.zeros(n)
    for _ in range(3 * n):
        gradient = a.T @ (b - a @ x)
        if free.all() or gradient[~free].max() <= tol:
            break
        free[np.argmax(np.where(free, -np.inf, gradient))] = True
        while True:
            z = np.zeros(n)
            z[free] = np.linalg.lstsq(a[:, free], b, rcond=None)[0]
            if (z[free] > tol).all():
                x = z
                break
            # Step from x towards z until the first coefficient reaches zero; it leaves the free set.
            blocked = free & (z <= tol)
            step = np.min(x[blocked] / np.maximum(x[blocked] - z[blocked], tol))
            x = x + step * (z - x)
            free &= x > tol
            x[~free] = 0.0
    return x


def _features(rows, tokens, columns, knee: float) -> np.ndarray:
    """[M, 6] features of ForwardCost's model for arrays of rows B, tokens T and columns S."""
    rows, tokens, columns = (np.asarray(v, dtype=np.float64) for v in (rows, tokens, columns))
    n = rows * tokens
    return np.stack([np.ones_like(n), rows, n, np.maximum(n - knee, 0.0), rows * columns, n * columns], -1)


class ForwardCost:
    """Seconds of one model's forward over B rows of T new tokens after S cached columns.

    ``t(B, T, S) = c0 + c1 B + c2 N + c3 max(0, N - knee) + c4 B S + c5 N S``, with N = B T tokens:
    c0 a forward's fixed cost (reading the weights while that bounds it), c1 per row, c2 per token, c3 the
    extra cost per token once the forward turns compute-bound past ``knee`` tokens, c4 per cached column of
    a row (reading, and in transformers' cache copying, the keys and values), c5 attention's work per
    token and column. Fitted by least squares on the relative error with every c >= 0 (``nnls``), the
    knee the best of ``KNEES``; refitted lazily after new observations.
    """

    def __init__(self, observations=()):
        """``observations``: (B, T, S, seconds) of a measured grid, kept as anchors (see ``add``)."""
        self.recent: deque = deque(maxlen=MAX_OBSERVATIONS)  # (B, T, S, seconds) of decoding's forwards
        self.anchors: dict = {}  # (B, T, S) -> seconds of the latest probe of that shape
        self.coefficients: np.ndarray | None = None
        self.knee = 1.0
        self._fitted = 0  # observations added when last fitted
        self._added = 0
        for o in observations:
            self.add(*o, anchor=True)

    @property
    def observations(self) -> list[tuple[int, int, int, float]]:
        """(B, T, S, seconds): the anchors, then the recent forwards."""
        return [(*shape, seconds) for shape, seconds in self.anchors.items()] + list(self.recent)

    def __len__(self) -> int:
        return len(self.anchors) + len(self.recent)

    def add(self, rows: int, tokens: int, columns: int, seconds: float, anchor: bool = False) -> None:
        """One forward's seconds. ``anchor``: a probe or a saved profile's shape, kept whatever decoding adds
        after it (the latest per shape): a long run of one shape (K = 0 blocks) would otherwise push every
        other shape out of the recent ones, leaving the fit blind to K > 0 and ``covers`` false, so that the
        next call probes again inside its own time."""
        if rows > 0 and tokens > 0 and seconds > 0 and math.isfinite(seconds):
            o = (int(rows), int(tokens), int(columns))
            if anchor:
                self.anchors[o] = float(seconds)
            else:
                self.recent.append((*o, float(seconds)))
            self._added += 1

    def covers(self, rows: int, tokens: int) -> bool:
        """Whether forwards of ``tokens`` new tokens were observed at ``rows`` rows or at row counts on both
        sides of it (the model then interpolates rather than extrapolates)."""
        seen = [b for b, t, _, _ in self.observations if t == tokens]
        return any(b <= rows for b in seen) and any(b >= rows for b in seen)

    def fit(self) -> None:
        """Fit the coefficients to the observations (a no-op when nothing was added since the last fit)."""
        if self._added == self._fitted or not len(self):
            return
        obs = np.array(self.observations, dtype=np.float64)
        seconds = obs[:, 3]
        best = None
        for knee in KNEES:
            a = _features(obs[:, 0], obs[:, 1], obs[:, 2], knee) / seconds[:, None]  # relative error
            scale = np.abs(a).max(0)
            scale[scale == 0] = 1.0
            c = nnls(a / scale, np.ones(len(obs))) / scale
            error = float(np.sum((a @ c - 1.0) ** 2))
            if best is None or error < best[0] - 1e-12:
                best = (error, knee, c)
        _, self.knee, self.coefficients = best
        self._fitted = self._added

    def predict(self, rows: int, tokens: int, columns: int) -> float:
        """Predicted seconds of one forward; NaN before any observation."""
        self.fit()
        if self.coefficients is None:
            return math.nan
        return float(_features([rows], [tokens], [columns], self.knee)[0] @ self.coefficients)

    def relative_errors(self) -> list[tuple[int, int, int, float, float]]:
        """(B, T, S, measured, predicted) per observation: the fit checked against what it was fitted to."""
        return [(b, t, s, sec, self.predict(b, t, s)) for b, t, s, sec in self.observations]

    def to_dict(self) -> dict:
        return {"observations": [list(o) for o in self.observations]}

    @classmethod
    def from_dict(cls, d: dict) -> "ForwardCost":
        return cls(tuple(o) for o in d["observations"])


# The cost models of the models in this process, per (device, dtype, threads): later calls of generate
# start from what earlier ones measured instead of probing again.
_COSTS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
# Acceptance trials of earlier calls: target -> {(id of the draft, settings): [accepted, rejected]}.
_TRIALS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def forward_cost(model) -> ForwardCost:
    """The process-wide ``ForwardCost`` of ``model`` on its current device and dtype and torch's thread count."""
    p = next(model.parameters())
    key = (str(p.device), str(p.dtype), torch.get_num_threads())
    return _COSTS.setdefault(model, {}).setdefault(key, ForwardCost())


def profile_path(model) -> Path | None:
    """Where ``pad-decoding profile`` saves ``model``'s forward costs on its current device and dtype at torch's
    thread count (one file per weights identity, device, dtype and threads); None for weights without a
    local identity."""
    from ..models.registry import cache_dir, weights_identity

    name = getattr(model.config, "name_or_path", "") or ""
    if not name or not Path(name).is_dir():
        return None
    try:
        identity = weights_identity(name)
    except (OSError, ValueError):
        return None
    p = next(model.parameters())
    key = f"{identity}|{p.device.type}|{p.dtype}|{torch.get_num_threads()}"
    if getattr(model, "pad_weights", None):  # int8 / int4 weights (pad.decoding.int8): another cost, its own profile
        key += f"|{model.pad_weights}"
    if getattr(model, "pad_vocab", None):  # a pruned output layer (pad.decoding.vocab_prune): the same
        key += f"|vocab{model.pad_vocab}"
    if getattr(model, "pad_attention", None):  # pad's fused attention (pad.decoding.fast_draft): the same
        key += f"|attention-{model.pad_attention}"
    if getattr(model, "pad_forward", None):  # the lean forward (pad.decoding.draft_forward): the same
        key += f"|forward-{model.pad_forward}"
    return cache_dir() / "profiles" / f"{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"


def save_profile(model, cost: ForwardCost) -> Path:
    path = profile_path(model)
    if path is None:
        raise ValueError(f"{model.config.name_or_path!r} is not a local folder: its profile would have "
                         "no weights identity to be found by")
    path.parent.mkdir(parents=True, exist_ok=True)
    p = next(model.parameters())
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"model": model.config.name_or_path, "device": p.device.type, "dtype": str(p.dtype),
                               "threads": torch.get_num_threads(), **cost.to_dict()}))
    tmp.replace(path)
    return path


def load_profile(model, cost: ForwardCost) -> bool:
    """Add ``model``'s saved profile to ``cost``; False where there is none."""
    path = profile_path(model)
    if path is None or not path.is_file():
        return False
    for o in json.loads(path.read_text())["observations"]:
        cost.add(*o, anchor=True)
    return True


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work, so that a host clock times it (a no-op on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def probe(model, cost: ForwardCost, rows: int, tokens: list[int], columns: int) -> None:
    """Time forwards of ``rows`` rows of each of ``tokens`` new tokens after ``columns`` cached columns
    (random keys and values: the time does not depend on them) and add them to ``cost``. Each shape runs
    twice and the second is kept: a first forward of a new shape also pays for setting kernels up."""
    from transformers import DynamicCache

    from .hf import forward_tail, kv_shape

    p = next(model.parameters())
    layers, heads, head_dim = kv_shape(model)
    g = torch.Generator().manual_seed(0)
    vocab = min(1000, model.config.vocab_size)
    with torch.inference_mode():
        for t in tokens:
            for _ in range(2):
                data = [tuple(torch.randn(rows, heads, columns, head_dim, generator=g).to(p) for _ in "kv")
                        for _ in range(layers)]
                cache = DynamicCache(ddp_cache_data=data)
                ids = torch.randint(0, vocab, (rows, t), generator=g).to(p.device)
                synchronize(p.device)
                start = time.perf_counter()
                forward_tail(model, ids, t, cache=cache, use_cache=True)
                synchronize(p.device)
                seconds = time.perf_counter() - start
            cost.add(rows, t, columns, seconds, anchor=True)


def measure(model, rows: list[int], tokens: list[int], columns: list[int], progress: bool = True) -> ForwardCost:
    """A ``ForwardCost`` of ``model`` from ``probe`` forwards at every (rows, tokens, columns) of the grid."""
    from tqdm.auto import tqdm

    cost = ForwardCost()
    grid = [(b, s) for b in rows for s in columns]
    for b, s in tqdm(grid, desc=f"profile {model.config.name_or_path}", unit="shape", disable=not progress):
        probe(model, cost, b, tokens, s)
    return cost


def expected_tokens(acceptance: float, k: int) -> float:
    """New tokens a row commits from a block of k drafts when each draft is accepted with probability
    ``acceptance`` given the ones before it: ``1 + a + ... + a^k = (1 - a^(k+1)) / (1 - a)``."""
    if acceptance >= 1.0:
        return float(k + 1)
    return (1.0 - acceptance ** (k + 1)) / (1.0 - acceptance)


class RowAcceptance:
    """Per-token acceptance of each live row, estimated from its verified blocks.

    A block of k drafts of which n were accepted is n accepted trials and, when n < k, one rejected trial
    (positions after a rejection were never judged). A row's estimate is shrunk towards the batch's pooled
    estimate by ``PRIOR_TRIALS`` pseudo-trials, the pool towards ``PRIOR_ACCEPTANCE``.
    """

    def __init__(self, rows: int, prior: float = PRIOR_ACCEPTANCE, remembered: tuple[float, float] = (0.0, 0.0)):
        """``remembered``: (accepted, rejected) trials of earlier calls, counted in the pool."""
        self.prior = prior
        self.accepted = np.zeros(rows)
        self.rejected = np.zeros(rows)
        # the trials of rows that left the batch (and remembered ones) stay in the pool
        self.gone_accepted, self.gone_rejected = remembered
        self.remembered = remembered

    def update(self, accepted: list[int], drafts: list[int]) -> None:
        """One block: per batch row the drafts accepted and the drafts it verified."""
        for j, (n, k) in enumerate(zip(accepted, drafts)):
            self.accepted[j] += n
            self.rejected[j] += n < k

    def select(self, keep: list[int]) -> None:
        gone = np.ones(len(self.accepted), dtype=bool)
        gone[keep] = False
        self.gone_accepted += self.accepted[gone].sum()
        self.gone_rejected += self.rejected[gone].sum()
        self.accepted, self.rejected = self.accepted[keep], self.rejected[keep]

    def trials(self) -> float:
        """Trials in the pool: this call's and the remembered ones."""
        return float(self.accepted.sum() + self.rejected.sum() + self.gone_accepted + self.gone_rejected)

    def new_trials(self) -> tuple[float, float]:
        """(accepted, rejected) trials of this call's blocks."""
        return (float(self.accepted.sum() + self.gone_accepted - self.remembered[0]),
                float(self.rejected.sum() + self.gone_rejected - self.remembered[1]))

    def estimates(self) -> np.ndarray:
        """[B] per-token acceptance of each live row."""
        acc = self.accepted.sum() + self.gone_accepted
        trials = acc + self.rejected.sum() + self.gone_rejected
        pooled = (acc + PRIOR_TRIALS * self.prior) / (trials + PRIOR_TRIALS)
        return (self.accepted + PRIOR_TRIALS * pooled) / (self.accepted + self.rejected + PRIOR_TRIALS)


class ForwardClock:
    """Times forwards into cost models: the seconds of each, and their sum since the last ``take``."""

    def __init__(self):
        self.seconds = 0.0

    def forward(self, dec, ids: torch.Tensor, fed: torch.Tensor, keep: int, cost) -> torch.Tensor:
        """``dec.forward(ids, fed, keep)``, timed into ``cost`` where it is a ``ForwardCost``."""
        rows, tokens, columns = ids.shape[0], ids.shape[1], dec.width
        synchronize(dec.device)
        start = time.perf_counter()
        logits = dec.forward(ids, fed, keep)
        synchronize(dec.device)
        seconds = time.perf_counter() - start
        self.seconds += seconds
        if isinstance(cost, ForwardCost):
            cost.add(rows, tokens, columns, seconds)
        return logits

    def take(self) -> float:
        seconds, self.seconds = self.seconds, 0.0
        return seconds


@runtime_checkable
class DraftLength(Protocol):
    """How long each block's drafts are: what the decode core (``pad.decoding.speculative``) calls, in order
    ``start`` once, per block ``next`` then ``forward`` (the target's verification forward, which it may time)
    and ``observe``, ``select`` whenever rows leave the batch, ``finish`` once (also after an error)."""

    max_draft_tokens: int  # the most a block drafts (the op's workspace is sized for it)

    def start(self, batch, target, drafter, settings: tuple) -> None:
        """Before the first block; ``settings``: what makes acceptance rates comparable between calls."""

    def next(self, batch, drafter, target_width: int, target_pending: int, limit: int) -> tuple[int, float]:
        """(K of the next block, 0 for a plain target step and at most ``limit``; its predicted seconds or NaN)."""

    def forward(self, dec, ids: torch.Tensor, fed: torch.Tensor, keep: int) -> torch.Tensor:
        """The target's forward (``Decoder.forward``)."""

    def observe(self, accepted: list[int], verified: list[int], seconds: float) -> None:
        """A block's result: per row drafts accepted and verified (empty after K = 0), and its seconds."""

    def select(self, keep: list[int]) -> None:
        """Only batch rows ``keep`` go on."""

    def finish(self) -> None:
        """After the last block."""


class FixedDraftLength:
    """The same K for every block (cut to the budget left): the ``DraftLength`` of an integer K."""

    def __init__(self, k: int):
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise ValueError(f"num_draft_tokens must be an integer >= 1 or 'auto', got {k!r}")
        self.max_draft_tokens = k

    def start(self, batch, target, drafter, settings) -> None:
        pass

    def forward(self, dec, ids: torch.Tensor, fed: torch.Tensor, keep: int) -> torch.Tensor:
        return dec.forward(ids, fed, keep)

    def next(self, batch, drafter, target_width: int, target_pending: int, limit: int) -> tuple[int, float]:
        return min(self.max_draft_tokens, limit), math.nan

    def observe(self, accepted: list[int], verified: list[int], seconds: float) -> None:
        pass

    def select(self, keep: list[int]) -> None:
        pass

    def finish(self) -> None:
        pass


class AutoDraftLength:
    """Chooses each block's K in 0..``max_draft_tokens``: the K that maximises the expected new tokens per
    second of the whole batch,

        sum_r E_r(min(K, L_r)) / (draft(K) + target(K) + overhead),

    with ``E_r`` the expected tokens of row r (``expected_tokens`` at its ``RowAcceptance`` estimate), ``L_r``
    the most its drafter can propose now (a lookup finds only so much), ``draft(K)`` the drafter's predicted
    seconds (``Drafter.seconds``: a draft model's K forwards from its ``ForwardCost``, a draft-free drafter's
    measured time), ``target(K)`` one target forward over K + 1 tokens per row from the target's
    ``ForwardCost``, and ``overhead`` the rest of a block (verification, bookkeeping) as measured so far. A draft
    model's catch-up (the committed tokens it has not seen) is spread over the blocks left (``choose``). K = 0
    is a plain target step. A drafter whose rows propose from different sources (``hybrid``: a lookup match
    or the draft model) names each row's with ``sources(k)``; each source then has its own acceptance
    estimates, so that a source that is seldom accepted does not hold another back.

    ``target_cost`` / ``draft_cost``: cost models to use (anything with ``predict(rows, tokens, columns)``);
    None: the process-wide ones of the models (``forward_cost``), probed on first use where they lack the
    shapes a choice needs, after reading the models' saved profiles (``pad-decoding profile``) where there are.
    ``min_gain``: a K > 0 is chosen only where its predicted rate beats a plain target step's by more than this
    share; None: by the chooser's recent relative error in predicting block times (``PRIOR_MIN_GAIN`` until
    4 blocks were timed), so that a prediction within its own noise does not speculate at a loss.
    """

    def __init__(self, max_draft_tokens: int = DEFAULT_MAX_DRAFT_TOKENS, *, target_cost=None, draft_cost=None,
                 prior_acceptance: float = PRIOR_ACCEPTANCE, min_gain: float | None = None):
        if not isinstance(max_draft_tokens, int) or isinstance(max_draft_tokens, bool) or max_draft_tokens < 1:
            raise ValueError(f"max_draft_tokens must be an integer >= 1, got {max_draft_tokens!r}")
        if not 0.0 <= prior_acceptance < 1.0:
            raise ValueError(f"prior_acceptance must be in [0, 1), got {prior_acceptance!r}")
        self.max_draft_tokens = max_draft_tokens
        self.target_cost, self.draft_cost = target_cost, draft_cost
        self.prior_acceptance = prior_acceptance
        if min_gain is not None and not min_gain >= 0:
            raise ValueError(f"min_gain must be None or >= 0, got {min_gain!r}")
        self.min_gain = min_gain
        self.overhead = 0.0  # seconds of a block outside the forwards (running mean)
        self._overheads = 0
        self.errors = deque(maxlen=TIMED_BLOCKS_KEPT)  # |predicted - measured| / measured of recent blocks
        self._predicted = math.nan

    # --- the DraftLength protocol: what the decode calls --------------------------------------------------

    def start(self, batch, target, drafter, settings) -> None:
        """Before a call's first block: bind the cost models (a draft model's is handed to its drafter) and
        start the call's acceptance estimates, pooled with earlier calls' under the same ``settings``."""
        draft = getattr(drafter, "model", None)
        self.bind(target, draft, len(batch), max(map(len, batch.prompts)))
        self.clock = ForwardClock()
        if draft is not None:
            drafter.cost, drafter.clock = self.draft_cost, self.clock
        self._models, self._settings, self._rows = (target, draft), (drafter.name, *settings), len(batch)
        self._pools: dict = {}  # source (None: the drafter's only one) -> (RowAcceptance, remembered trials)
        self._sources: list = [None] * len(batch)  # per row, the source of the block being decoded
        self._k = self.max_draft_tokens  # the K of the last block that drafted: a hybrid's rows weigh sources at it
        self._start = time.perf_counter()

    def _pool(self, source) -> RowAcceptance:
        """The acceptance estimates of ``source``'s proposals (made at its first use, for the live rows)."""
        if source not in self._pools:
            key = self._settings if source is None else (*self._settings, source)
            trials = _TRIALS.setdefault(self._models[0], {}).setdefault((id(self._models[1]), key), [0.0, 0.0])
            self._pools[source] = (self.acceptance(trials, self._rows), trials)
        return self._pools[source][0]

    def estimates(self, sources: list) -> np.ndarray:
        """[B] per-token acceptance of each live row's proposals from ``sources[j]``."""
        pools = {s: self._pool(s).estimates() for s in set(sources)}
        return np.array([pools[s][j] for j, s in enumerate(sources)], dtype=np.float64)

    def forward(self, dec, ids: torch.Tensor, fed: torch.Tensor, keep: int) -> torch.Tensor:
        """The target's forward, timed into its cost model."""
        return self.clock.forward(dec, ids, fed, keep, self.target_cost)

    def next(self, batch, drafter, target_width: int, target_pending: int, limit: int) -> tuple[int, float]:
        """(K, predicted seconds) of the next block. A drafter with ``options`` (``hybrid``: mixed or draft-free
        proposals) is first set, with ``use``, to the one whose best K is predicted fastest; ``use`` is also
        handed ``estimates``, each source's per-row acceptance, and the K of the last block that drafted, for
        drafters that choose a source per row."""
        if getattr(drafter, "options", None) is not None:
            drafter.use(self.option(batch, drafter, target_width, limit), self.estimates, self._k)
        acceptance, seconds, width, kw = self._inputs(batch, drafter, target_width, limit)
        k, self._predicted = self.choose(acceptance, seconds, width, target_pending=target_pending, **kw)
        self._k = k or self._k
        return k, self._predicted

    def option(self, batch, drafter, target_width: int, limit: int) -> str:
        """The one of ``drafter.options()`` whose best K is predicted fastest (ties: the first). Until each of
        ``drafter.all_sources()`` has been tried (its pool has trials, this call's or remembered), only the
        first option is weighed: an untried source has no measured acceptance and, for a draft model, no
        measured prefill, so a cheaper option would be taken on the prior alone and the source never learnt."""
        options = drafter.options()
        if not all(self._pool(s).trials() for s in drafter.all_sources()):
            options = options[:1]
        best, chosen = -math.inf, None
        for option in options:
            drafter.use(option, self.estimates, self._k)
            acceptance, seconds, width, kw = self._inputs(batch, drafter, target_width, limit)
            rate = np.nanmax(self.rates(acceptance, seconds, width, **kw), initial=-math.inf)
            if chosen is None or rate > best:
                best, chosen = rate, option
        return chosen

    def _inputs(self, batch, drafter, target_width: int, limit: int) -> tuple:
        """``choose``'s arguments for ``drafter`` as it stands (its rows' sources noted for ``observe``)."""
        available = getattr(drafter, "available", None)
        catch_up = getattr(drafter, "catch_up", None)
        sources = getattr(drafter, "sources", None)
        self._sources = sources(self.max_draft_tokens) if sources else [None] * len(batch)
        return (self.estimates(self._sources), lambda k: drafter.seconds(k, len(batch)), target_width,
                {"catch_up": catch_up(len(batch)) if catch_up else 0.0, "limit": limit,
                 "remaining": sum(batch.budget(j) for j in range(len(batch))) / len(batch),
                 "caps": available(self.max_draft_tokens) if available else None})

    def observe(self, accepted: list[int], verified: list[int], seconds: float) -> None:
        """A block's result: per row the drafts accepted and verified (empty lists after K = 0), its seconds."""
        for source in set(self._sources) if verified else ():
            mine = [s == source for s in self._sources]
            self._pool(source).update([n if m else 0 for n, m in zip(accepted, mine)],
                                      [n if m else 0 for n, m in zip(verified, mine)])
        self.record_overhead(seconds - self.clock.take())
        if math.isfinite(self._predicted) and seconds > 0:
            self.errors.append(abs(self._predicted - seconds) / seconds)

    def gain_needed(self) -> float:
        """The share by which speculating must beat a plain target step (see ``min_gain``)."""
        if self.min_gain is not None:
            return self.min_gain
        return float(np.mean(self.errors)) if len(self.errors) >= 4 else PRIOR_MIN_GAIN

    def select(self, keep: list[int]) -> None:
        for pool, _ in self._pools.values():
            pool.select(keep)
        self._sources = [self._sources[j] for j in keep]
        self._rows = len(keep)

    def finish(self) -> None:
        for pool, trials in getattr(self, "_pools", {}).values():
            accepted, rejected = pool.new_trials()
            trials[0] += accepted
            trials[1] += rejected
        self._pools = {}

    # --- the model behind it ------------------------------------------------------------------------------

    def bind(self, target, draft, rows: int, columns: int) -> None:
        """The process-wide cost models of ``target`` and ``draft`` (None: a drafter without a model) unless
        given, probed at ``rows`` (and one row) where they lack those shapes."""
        if self.target_cost is None:
            self.target_cost = forward_cost(target)
        if self.draft_cost is None and draft is not None:
            self.draft_cost = forward_cost(draft)
        k = self.max_draft_tokens
        plan = [(target, self.target_cost, sorted({1, 2, (k + 2) // 2, k + 1}))]
        if draft is not None:
            plan.append((draft, self.draft_cost, [1, 2, 4]))
        for model, cost, tokens in plan:
            if not isinstance(cost, ForwardCost):
                continue  # a planted cost model (tests) needs no measurement
            if not len(cost):
                load_profile(model, cost)
            for b in sorted({rows, 1}):
                missing = [t for t in tokens if not cost.covers(b, t)]
                if missing:
                    probe(model, cost, b, missing, max(columns, 1))

    def acceptance(self, trials: list[float], rows: int) -> RowAcceptance:
        """A call's ``RowAcceptance`` for ``rows`` rows, its pool seeded with ``trials`` (accepted, rejected) of
        earlier calls in this process (same models, drafter, source, policy and sampling), scaled down to
        ``REMEMBERED_TRIALS`` so that the call's own blocks soon outweigh them."""
        accepted, rejected = trials
        scale = min(1.0, REMEMBERED_TRIALS / max(accepted + rejected, 1.0))
        return RowAcceptance(rows, self.prior_acceptance, (accepted * scale, rejected * scale))

    def block_time(self, k: int, rows: int, target_columns: int, draft_seconds, target_pending: int = 1) -> float:
        """Predicted seconds of a block of k drafts (k = 0: a plain target step): the target's forward over
        its ``target_pending`` committed tokens and the k drafts, ``draft_seconds(k)``, and the overhead."""
        t = self.target_cost.predict(rows, target_pending + k, target_columns) + self.overhead
        return t + (draft_seconds(k) if k else 0.0)

    def choose(self, acceptance, draft_seconds, target_columns: int, *, target_pending: int = 1,
               catch_up: float = 0.0, remaining: float = math.inf, limit: int | None = None,
               caps=None) -> tuple[int, float]:
        """(K, predicted block seconds) for live rows of per-token ``acceptance`` [B]; K <= ``limit`` too.

        ``draft_seconds(k)``: the drafter's predicted seconds for k drafts per row. ``caps`` [B]: the most each
        row's drafter can propose (None: no limit). ``catch_up``: a draft model's seconds of feeding the
        committed tokens it has not seen (the prompt, or the tokens of K = 0 blocks), paid once for all the
        blocks that follow, so a choice weighs it spread over the blocks the rows' ``remaining`` tokens (mean
        budget left) would take at that K: speculation starts only where it will pay for the draft's
        prefill. The target's ``target_pending`` tokens are fed whatever K comes: they weigh on no choice,
        only on the predicted seconds returned.
        """
        rate = self.rates(acceptance, draft_seconds, target_columns, catch_up=catch_up, remaining=remaining,
                          limit=limit, caps=caps)
        top, rows = len(rate) - 1, len(acceptance)
        if not np.isfinite(rate).any():  # no usable prediction: fall back to the largest K
            return top, math.nan
        k = int(np.nanargmax(rate))
        if k and np.isfinite(rate[0]) and rate[k] <= rate[0] * (1 + self.gain_needed()):
            k = 0  # within the prediction's own error of a plain step: not worth the risk
        return k, self.block_time(k, rows, target_columns, draft_seconds, target_pending) + (catch_up if k else 0.0)

    def rates(self, acceptance, draft_seconds, target_columns: int, *, catch_up: float = 0.0,
              remaining: float = math.inf, limit: int | None = None, caps=None) -> np.ndarray:
        """[K + 1] predicted new tokens per second of the batch at each K that ``choose`` weighs (NaN where
        there is no prediction); the arguments as ``choose``'s."""
        acceptance = np.asarray(acceptance, dtype=np.float64)
        rows = len(acceptance)
        caps = np.full(rows, self.max_draft_tokens) if caps is None else np.asarray(caps)
        top = self.max_draft_tokens if limit is None else max(0, min(limit, self.max_draft_tokens))
        top = min(top, int(caps.max()) if rows else 0)
        # Expected tokens of every row at every K at once: 1 + a + ... + a^min(K, cap).
        drafts = np.minimum(np.arange(top + 1)[None, :], caps[:, None])  # [B, K + 1]
        a = acceptance[:, None]
        safe = np.minimum(a, 0.5)  # where a >= 1 the sum is drafts + 1 (the formula's value is discarded)
        per_row = np.where(a >= 1.0, drafts + 1.0,
                           (1.0 - np.where(a < 1.0, a, safe) ** (drafts + 1)) / (1.0 - np.where(a < 1.0, a, safe)))
        per_row = per_row.mean(0)  # [K + 1]
        # The target's pending tokens (the prompt, at the first block) cost the same whatever K: left out.
        weighed = np.array([self.block_time(k, rows, target_columns, draft_seconds) for k in range(top + 1)])
        weighed[1:] += catch_up / np.maximum(1.0, remaining / per_row[1:])
        return np.where(weighed > 0, per_row / np.where(weighed > 0, weighed, 1.0), np.nan)

    def record_overhead(self, seconds: float) -> None:
        """A block's time outside its forwards."""
        if seconds >= 0 and math.isfinite(seconds):
            self._overheads += 1
            self.overhead += (seconds - self.overhead) / min(self._overheads, 32)
