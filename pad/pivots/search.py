"""Path-following pivot labels, batched across problems (the search AutoJudge uses, arXiv 2504.20039).

For each problem the target decodes greedily: that is the current text. Walking it from the start, at the
first position after the last decision where the draft's greedy token (teacher-forced on the current
text) differs from the text, the draft token is put there and the target continues greedily to the end.
If the continuation keeps the outcome (GSM8K: the same final number; HumanEval: the same pass/fail), the
draft token is harmless (label 0) and the continuation becomes the current text, so later mismatches are
found on it, the way pivot decoding would see them; otherwise it is a pivot (label 1) and the text stays.
Each decision records the classifier's features at that position, computed on the shared prefix exactly
as ``verify_block`` computes them in decoding (the target's hidden state at ``layer``, ``p_target`` of the
draft token, the target entropy, the divergence KL(p_target || p_draft); the draft's own probability and
entropy), and both outcomes (same answer; correct before and after), so that either criterion can be trained
from one run. Problems the target answers wrong are labeled too. (Folders labeled before the divergence was
stored get it from ``pad.pivots.retrace``.)

With a draft-free drafter (``SearchConfig.drafter`` lookup or suffix) the proposals are that drafter's blocks as
decoding makes them (``_next_free_decision``), and each record says where its token came from (``source``,
``match``, ``offset``): the classifier can then be trained and measured on every kind of proposal.

The continuations of many problems run as rows of one batch (``pad.pivots.continuations``): a problem's next
decision joins as soon as its last one finished, from the cache of its current text (never prefilled again; a
job feeds only what its cache lacks, see below). The draft's teacher-forced pass over a text is cached per
problem too and runs only as far as the next mismatch (``DRAFT_CHUNK`` positions at a time): after a harmless
decision at position t it is fed the new text from t on. Finished problems are written as the rollout labeler
writes them (``pad.pivots.label.LabelWriter``). A problem in flight is saved after each of its decisions
(``partial/``: its current text, next position and records so far), so an interruption loses at most the
continuations running at that moment. A resumed problem has no cache: its next decision's job feeds its text
up to the decision, and a later one what lies between the two, so that the target never computes the part of a
text after a harmless decision, which the continuation replaces (a resumed problem's next decision lay at
token 48 of a 314-token text, medians of the 64 in flight on 2026-11-27). Greedy texts still being decoded are
saved too, every ``GREEDY_SAVE_SECONDS``, and a resumed one goes on from where it was saved (on a CPU without
native bf16 the first greedy texts of a batch take tens of minutes).

Memory: a problem in flight holds up to ``problem_bytes`` (its text's caches in both models and its row of
the batch). The batch is cut at start to what the memory left after loading the models holds (a warning
says so); new problems join only while ``ADMIT_MEMORY`` is left, and with less than ``LOW_MEMORY`` left
the job saves its problems in flight and stops with ``LowMemory`` (the same command, with a smaller
``--batch``, goes on from there) rather than meet the kernel's OOM killer hours in. Freed memory goes back
to the system every ``GREEDY_SAVE_SECONDS`` and whenever less than ``ADMIT_MEMORY`` is left.
"""
from __future__ import annotations

import math
import os
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Callable

import torch

from ..decoding.drafters import SOURCES, LookupDrafter, Sampling, SuffixDrafter
from ..decoding.hf import (crop_cache, decoder_layer, eos_ids, forward_tail, kv_bytes_per_token, returned_cache,
                           shared_vocab_size)
from ..errors import PadError
from ..machine import available_memory, release_free_memory
from .continuations import Continuations, Job
from .label import LabelWriter, problems_to_do, shard_indices, softmax_stats

CRITERIA = ("same-answer", "correct")


# Whose proposals a search labels: the draft model's greedy token at every position, or a draft-free drafter's
# blocks (``pad.decoding.drafters``, each problem's drafter reading its own context only).
DRAFTERS = SOURCES
SOURCE_IDS = {name: i for i, name in enumerate(SOURCES)}  # the records' ``source``, as decoding's Proposal.sources


@dataclass
class SearchConfig:
    layer: int = -8
    max_new_tokens: int = 512
    batch: int = 16  # continuation rows decoded together
    lookahead: int = 4  # tokens guessed per row and step from the text a continuation branched from
    method: str = "search"
    drafter: str = "model"
    proposal_tokens: int = 16  # a draft-free proposal's most tokens (its block's K)

    # Neither changes a record (rows decode as they would alone, guesses only save forwards).
    SPEED_ONLY = ("batch", "lookahead")

    def __post_init__(self):
        if self.drafter not in DRAFTERS:
            raise ValueError(f"unknown drafter {self.drafter!r} for search labels; choose one of {', '.join(DRAFTERS)}")
        if self.proposal_tokens < 1:
            raise ValueError(f"proposal_tokens must be at least 1, got {self.proposal_tokens}")

    def settings(self) -> dict:
        """What a folder records (and a resumed run must match): not the speed settings, nor the drafter's
        where it is the model (folders labeled before draft-free drafters existed say nothing of them)."""
        out = {k: v for k, v in self.__dict__.items() if k not in self.SPEED_ONLY}
        if self.drafter == "model":
            del out["drafter"], out["proposal_tokens"]
        return out


def pivot_labels(tensors: dict, criterion: str) -> torch.Tensor:
    """The pivot label of each decision: ``same-answer``: the continuation's outcome differs;
    ``correct``: the text was right and the continuation is not."""
    if criterion not in CRITERIA:
        raise ValueError(f"unknown criterion {criterion!r}; choose one of {', '.join(CRITERIA)}")
    if criterion == "same-answer":
        return (1 - tensors["same_answer"]).to(torch.int8)
    return (tensors["correct_before"] & (1 - tensors["correct_after"])).to(torch.int8)


@dataclass
class _Problem:
    index: int
    prompt: list[int]
    outcome: Callable[[list[int]], tuple]  # tokens -> (answer key, correct)
    started: float
    text: list[int] = field(default_factory=list)
    # Target keys/values [H, n, D] per layer of the first n tokens of prompt + text: all but at most the last
    # one after a greedy text or a continuation, fewer (None: none) for a resumed problem.
    cache: tuple | None = None
    key: object = None
    correct: bool = False
    pos: int = 0  # the next position a decision may be taken at
    draft_cache: object = None  # the draft's DynamicCache of prompt + text
    draft_top: list[int] = field(default_factory=list)  # the draft's greedy token at each text position
    draft_prob: list[float] = field(default_factory=list)
    draft_entropy: list[float] = field(default_factory=list)
    # The draft's logits [V] at the positions scored where it disagrees with the text, until their decision.
    draft_logits: dict[int, torch.Tensor] = field(default_factory=dict)
    records: list[dict] = field(default_factory=list)
    # A draft-free drafter's state: the drafter (its context: prompt + text[:free_upto]), and the block it
    # proposed last (``proposal`` for text positions proposal_start.., its match length), as decoding runs it.
    free: object = None
    free_upto: int = 0
    proposal: list[int] = field(default_factory=list)
    proposal_start: int = 0
    proposal_match: int = 0
    # What the record of the decision in flight takes from its proposal (draft prob and entropy, source ...).
    pending: dict = field(default_factory=dict)


# Text positions the draft scores per pass. Mismatches come about every 16 tokens, and a harmless
# decision changes the text after it: scoring only up to the next mismatch, not to the end, saves most
# of the draft's work.
DRAFT_CHUNK = 32
GREEDY_SAVE_SECONDS = 60.0
# Memory left below which the job stops (its problems saved), and above which new problems join.
LOW_MEMORY = 1 << 30
ADMIT_MEMORY = 2 << 30
GIB = float(1 << 30)


class LowMemory(PadError):
    """Too little memory left to go on: the problems in flight are saved, and the same command with a smaller
    ``--batch`` resumes them."""


def problem_bytes(target, draft, prompt_tokens: int, max_new_tokens: int) -> int:
    """Most memory one problem in flight holds: the target's and the draft's caches of its text (no draft: a
    draft-free drafter's labels) and its row of the running batch (a target cache as long), at
    ``prompt_tokens + max_new_tokens`` tokens."""
    draft_bytes = kv_bytes_per_token(draft) if draft is not None else 0
    return (prompt_tokens + max_new_tokens) * (2 * kv_bytes_per_token(target) + draft_bytes)


def _memory_left() -> int | None:
    """Memory still available (None: unknown); below ``ADMIT_MEMORY`` freed memory goes back first."""
    free = available_memory()
    if free is not None and free < ADMIT_MEMORY:
        release_free_memory()
        free = available_memory()
    return free


def _roomy() -> bool:
    """Whether another problem may join the batch (memory unknown counts as room)."""
    free = _memory_left()
    return free is None or free >= ADMIT_MEMORY


# Job keys (problem, t): t is the decision's position, or one of these for a job that decodes the problem's
# own greedy text (whole, or the rest of one saved unfinished).
_TEXT_JOBS = (None, "greedy")


def _draft_forget(p: _Problem, start: int) -> None:
    """The text changed from position ``start`` on: the draft's tokens there are stale (its cache is cropped
    when next extended)."""
    del p.draft_top[start:], p.draft_prob[start:], p.draft_entropy[start:]
    for t in [t for t in p.draft_logits if t >= start]:
        del p.draft_logits[t]


def _draft_extend(draft, vocab: int, p: _Problem, end: int) -> None:
    """Teacher-force the draft so that its greedy token, probability and entropy are known at text positions
    up to ``end`` (exclusive). Text token t sits at index P + t of prompt + text and is predicted by the logits
    at P + t - 1; the draft's cache keeps what it has seen of the current text."""
    start, end = len(p.draft_top), min(end, len(p.text))
    if start >= end:
        return
    P, seq = len(p.prompt), p.prompt + p.text
    need = P + start - 1  # tokens the cache must hold: all before the one predicting position ``start``
    have = 0 if p.draft_cache is None else p.draft_cache.get_seq_length()
    if have > need:
        crop_cache(p.draft_cache, need)
        have = need
    ids = torch.tensor([seq[have : P + end - 1]], device=next(draft.parameters()).device)
    out = forward_tail(draft, ids, ids.shape[1], cache=p.draft_cache, use_cache=True)
    p.draft_cache = returned_cache(out)
    logits = out.logits[0, need - have :, :vocab]  # [end - start, V]
    top = logits.argmax(-1)
    prob, entropy = softmax_stats(logits, top)
    for i in (top.cpu() != torch.tensor(p.text[start:end])).nonzero().flatten().tolist():
        p.draft_logits[start + i] = logits[i].clone()  # a decision's divergence reads the whole row
    p.draft_top += top.tolist()
    p.draft_prob += prob.tolist()
    p.draft_entropy += entropy.tolist()


def _next_decision(draft, vocab: int, p: _Problem, cfg: SearchConfig) -> Job | None:
    """The job of the problem's next decision, or None when its text holds no more mismatches."""
    if cfg.drafter != "model":
        return _next_free_decision(p, cfg)
    t = p.pos
    while t < len(p.text):
        if t >= len(p.draft_top):
            _draft_extend(draft, vocab, p, t + DRAFT_CHUNK)
        if p.draft_top[t] != p.text[t]:
            break
        t += 1
    else:
        return None
    return _decision_job(p, t, p.draft_top[t], p.draft_logits.pop(t), cfg.max_new_tokens,
                         draft_prob=p.draft_prob[t], draft_entropy=p.draft_entropy[t], source=SOURCE_IDS["model"],
                         match=0, offset=-1)


def _next_free_decision(p: _Problem, cfg: SearchConfig) -> Job | None:
    """As ``_next_decision`` for a draft-free drafter, walking the text block by block as decoding does: a
    block starts with the drafter's proposal from the text before it (none: a plain target step); its first
    token unlike the text is the decision; a block whose tokens all match ends with the target's bonus token.
    After a harmless decision the same block goes on over the continuation; after a pivot (the target's
    token instead) the next block starts after it (``run``)."""
    t = p.pos
    while t < len(p.text):
        if not p.proposal:  # no block running at t: one starts here
            _propose(p, t, cfg)
            t += not p.proposal
            continue
        j = t - p.proposal_start
        if j == len(p.proposal):  # the block's bonus token; the next block starts after it
            p.proposal = []
            t += 1
            continue
        if p.proposal[j] != p.text[t]:
            return _decision_job(p, t, p.proposal[j], None, cfg.max_new_tokens, draft_prob=1.0, draft_entropy=0.0,
                                 source=SOURCE_IDS[cfg.drafter], match=p.proposal_match, offset=j)
        t += 1
    return None


def _propose(p: _Problem, t: int, cfg: SearchConfig) -> None:
    """The problem's drafter proposes a block for text positions t.. from prompt + text[:t] (its own context
    only: a suffix drafter keeps no counts across problems here, so a problem's labels do not depend on which
    problems finished before it)."""
    if p.free is None:
        p.free = LookupDrafter() if cfg.drafter == "lookup" else SuffixDrafter()
        p.free.start(SimpleNamespace(prompts=[p.prompt]), Sampling(), torch.device("cpu"))
        p.free_upto = 0
    # A block starts at or after the last one: the text before it never changes again.
    p.free.commit(None, None, [0], [p.text[p.free_upto : t]])
    p.free_upto = t
    (p.proposal, p.proposal_match), p.proposal_start = p.free.matches(cfg.proposal_tokens)[0], t


def _decision_job(p: _Problem, t: int, token: int, logits: torch.Tensor | None, max_new_tokens: int,
                  **record) -> Job:
    """The job of a decision at text position t on draft ``token`` (``logits``: the draft's there, for the
    divergence); ``record``: what the decision's record takes from the proposal. The walk stands at t."""
    full = p.prompt + p.text
    n = len(p.prompt) + t - 1  # the token preceding the decision: fed with the draft token after it
    c = min(n, _cached(p))  # cached columns kept; the job feeds the text from there (a resumed problem's)
    prefix = None if c == 0 else _first_columns(p.cache, c)
    p.pos, p.pending = t, record
    return Job(key=(p.index, t), prefix=prefix, first=[*full[c : n + 1], token], budget=max_new_tokens - t - 1,
               draft_token=token, draft_logits=logits, lookup=p.text[t:])


def _first_columns(cache: tuple, n: int, copy: bool = False) -> tuple:
    """The first ``n`` columns of a cache (parts of per-layer [H, columns, D] tensors): views, or with ``copy``
    tensors of their own, so that the rest of the columns is freed."""
    return tuple([x[:, :n].clone() if copy else x[:, :n] for x in part] for part in cache)


def _cached(p: _Problem) -> int:
    """Columns of prompt + text the problem's target cache holds."""
    return 0 if p.cache is None else p.cache[0][0].shape[1]


_RECORD_FLOATS = ("token_prob", "entropy", "divergence", "draft_prob", "draft_entropy")
_RECORD_INTS = ("position", "same_answer", "correct_before", "correct_after", "source", "match", "offset")
# Records saved before draft-free drafters existed: the draft model's, at no place in a proposal.
PROPOSAL_DEFAULTS = {"source": SOURCE_IDS["model"], "match": 0, "offset": -1}


class _Partial:
    """Problems in flight, one file each (``partial/NNNNNN.safetensors``): the current text, the next
    decision position, the seconds spent and the records so far. Written atomically after every decision,
    and while the greedy text is decoded (the text so far, position -1)."""

    def __init__(self, out_dir):
        self.dir = Path(out_dir) / "partial"
        self.dir.mkdir(parents=True, exist_ok=True)

    def path(self, index: int) -> Path:
        return self.dir / f"{index:06d}.safetensors"

    def save(self, p: _Problem, seconds: float, greedy: list[int] | None = None) -> None:
        """Save ``p`` after a decision, or with ``greedy``, its greedy text decoded so far (no decision yet)."""
        from safetensors.torch import save_file

        t = {k: v for k, v in _tensors(p).items() if k not in ("label", "generated", "mismatches")}
        text, pos = (p.text, p.pos) if greedy is None else (greedy, -1)
        t.update(text=torch.tensor(text, dtype=torch.int32), pos=torch.tensor([pos], dtype=torch.int32),
                 seconds=torch.tensor([seconds], dtype=torch.float64),
                 proposal=torch.tensor(p.proposal, dtype=torch.int32),
                 proposal_at=torch.tensor([p.proposal_start, p.proposal_match], dtype=torch.int32))
        tmp = self.path(p.index).with_suffix(".tmp")
        save_file(t, str(tmp))
        os.replace(tmp, self.path(p.index))

    def load(self, p: _Problem) -> float | None:
        """Restore ``p``'s text, position and records if it was in flight (position -1: a greedy text not
        finished yet); returns the seconds spent."""
        from safetensors.torch import load_file

        if not self.path(p.index).is_file():
            return None
        t = load_file(str(self.path(p.index)))
        p.text, p.pos = t["text"].tolist(), int(t["pos"])
        if "proposal" in t:
            p.proposal = t["proposal"].tolist()
            p.proposal_start, p.proposal_match = t["proposal_at"].tolist()
        for r in range(len(t.get("position", []))):
            # (a record saved before the labeler stored the divergence has NaN there)
            p.records.append({"hidden": t["hidden"][r],
                              **{k: float(t[k][r]) if k in t else math.nan for k in _RECORD_FLOATS},
                              **{k: int(t[k][r]) if k in t else PROPOSAL_DEFAULTS[k] for k in _RECORD_INTS}})
        return float(t["seconds"])

    def remove(self, index: int) -> None:
        self.path(index).unlink(missing_ok=True)


def _tensors(p: _Problem) -> dict[str, torch.Tensor]:
    if not p.records:
        return {}
    col = lambda name, dtype: torch.tensor([r[name] for r in p.records], dtype=dtype)  # noqa: E731
    out = {
        "hidden": torch.stack([r["hidden"] for r in p.records]).to(torch.float16).cpu().contiguous(),
        "token_prob": col("token_prob", torch.float16),
        "entropy": col("entropy", torch.float16),
        "divergence": col("divergence", torch.float16),
        "draft_prob": col("draft_prob", torch.float16),
        "draft_entropy": col("draft_entropy", torch.float16),
        "position": col("position", torch.int32),
        "same_answer": col("same_answer", torch.int8),
        "correct_before": col("correct_before", torch.int8),
        "correct_after": col("correct_after", torch.int8),
        "source": col("source", torch.int8),  # SOURCE_IDS
        "match": col("match", torch.int32),  # a draft-free proposal's match length (lookup: n-gram; suffix: depth)
        "offset": col("offset", torch.int32),  # the token's place in its proposal (-1: the model's, none)
        "generated": torch.tensor([len(p.text)], dtype=torch.int32),
        "mismatches": torch.tensor([len(p.records)], dtype=torch.int32),
    }
    out["label"] = pivot_labels(out, "same-answer")
    return out


def _rows_that_fit(cfg: SearchConfig, target, draft, longest_prompt: int) -> int:
    """``cfg.batch``, or fewer when the memory left holds fewer problems in flight (a warning says so)."""
    release_free_memory()  # loading both models in fp32 leaves 1.5 GiB freed but held by the allocator
    free = _memory_left()
    if free is None or longest_prompt == 0:
        return cfg.batch
    need = problem_bytes(target, draft, longest_prompt, cfg.max_new_tokens)
    fit = (free - ADMIT_MEMORY) // need
    if fit < 1:
        raise LowMemory(f"{free / GIB:.2f} GiB of memory left after loading the models: one problem in flight "
                        f"needs up to {need / GIB:.2f} GiB beyond the {ADMIT_MEMORY / GIB:.0f} GiB kept free")
    if fit < cfg.batch:
        warnings.warn(f"--batch {cfg.batch} does not fit in the {free / GIB:.1f} GiB of memory left (a problem in "
                      f"flight needs up to {need / GIB:.2f} GiB, {ADMIT_MEMORY / GIB:.0f} GiB are kept free): "
                      f"labeling {fit} problems at a time", stacklevel=3)
        return fit
    return cfg.batch


def _drop_finished(partial: _Partial, problems: list, indices, finished: set[str]) -> None:
    """Remove the checkpoints of problems finished here or in another folder: they are never resumed."""
    for i in indices:
        if problems[i].id in finished:
            partial.remove(i)


def _take(p: _Problem, done) -> bool:
    """Apply a finished job to its problem: its greedy text, or a decision (recorded; a harmless token's
    continuation becomes the text). Returns whether it was a decision."""
    t = done.job.key[1]
    if t in _TEXT_JOBS:
        p.text = p.text + done.job.generated
        p.cache = done.cache
        p.key, p.correct = p.outcome(p.text)
        _draft_forget(p, 0)
        p.free, p.proposal = None, []
        return False
    new = p.text[:t] + [done.job.draft_token] + done.job.generated
    key, correct = p.outcome(new)
    f = done.features
    # (no divergence against a draft-free proposal: it has no distribution)
    p.records.append({"hidden": f["hidden"], "token_prob": f["token_prob"], "entropy": f["entropy"],
                      "divergence": f.get("divergence", math.nan), **p.pending, "position": t,
                      "same_answer": int(key == p.key),
                      "correct_before": int(p.correct), "correct_after": int(correct)})
    if key == p.key:  # harmless: the continuation becomes the text
        p.text, p.cache, p.correct = new, done.cache, correct
        _draft_forget(p, t)
    else:  # a pivot: the target's token ends the block; keep what the job fed of the text
        p.proposal = []
        if _cached(p) < len(p.prompt) + t:
            p.cache = _first_columns(done.cache, len(p.prompt) + t, copy=True)
    p.pos = t + 1
    return True


@torch.inference_mode()
def run(problems: list, prompts: list[torch.Tensor], outcomes: list[Callable[[list[int]], tuple]], target, draft,
        out_dir, cfg: SearchConfig, *, shard: tuple[int, int] = (0, 1), meta: dict | None = None,
        progress: bool = True, start: int = 0, skip: set[str] = frozenset()) -> dict:
    """Label the problems of this shard from index ``start`` on that the folder does not hold yet (nor
    ``skip``: ids finished in another folder).

    prompts: [1, P] token ids per problem; outcomes: tokens -> (answer key, correct) per problem (GSM8K:
    the final number; HumanEval: pass/fail as the key). ``draft`` may be None where ``cfg.drafter`` is
    draft-free (its proposals need no draft model). Returns a summary.
    """
    from tqdm.auto import tqdm

    decoder_layer(target, cfg.layer)  # a bad layer fails before the folder records these settings
    if draft is None and cfg.drafter == "model":
        raise ValueError("search labels of the draft model's tokens need the draft model (draft is None)")
    # Speed settings change no record: a folder may resume with others.
    writer = LabelWriter(out_dir, shard, {**(meta or {}), **cfg.settings()})
    partial = _Partial(out_dir)
    todo, summary = problems_to_do(problems, start, shard, writer.done, skip)
    _drop_finished(partial, problems, shard_indices(len(problems), start, shard), writer.done | skip)
    rows = _rows_that_fit(cfg, target, draft, max((prompts[i].shape[1] for i in todo), default=0))
    vocab = shared_vocab_size(target, draft)
    eos = eos_ids(target, None)
    engine = Continuations(target, vocab, eos, cfg.layer, rows, cfg.lookahead)
    active: dict[int, _Problem] = {}
    waiting = iter(todo)
    bar = tqdm(total=len(todo), desc="label (search)", unit="problem", disable=not progress)

    def admit() -> None:
        # One problem always runs; more join while memory is left (they grow as their texts are decoded).
        while len(active) < rows and (not active or _roomy()) and (i := next(waiting, None)) is not None:
            p = active[i] = _Problem(i, prompts[i][0].tolist(), outcomes[i], time.perf_counter())
            spent = partial.load(p)
            if spent is None:
                engine.submit(Job(key=(i, None), prefix=None, first=p.prompt, budget=cfg.max_new_tokens,
                                  lookup=p.prompt))
                continue
            p.started -= spent
            if p.pos < 0:  # its greedy text was cut short: prefill the part saved and go on decoding
                p.pos = 0
                engine.submit(Job(key=(i, "greedy"), prefix=None, first=p.prompt + p.text,
                                  budget=cfg.max_new_tokens - len(p.text), lookup=p.prompt))
            else:  # in flight when the last run stopped: its next decision feeds its text as far as it needs
                # (a resumed text kept the greedy text's answer: it only switched to same-answer texts)
                p.key, p.correct = p.outcome(p.text)
                advance(p)

    def save_greedy() -> None:
        for job in engine.running_jobs():
            i, t = job.key
            if t is None or t == "greedy":
                p = active[i]
                partial.save(p, time.perf_counter() - p.started, greedy=p.text + job.generated)

    def advance(p: _Problem) -> None:
        job = _next_decision(draft, vocab, p, cfg)
        if job is not None:
            engine.submit(job)
            partial.save(p, time.perf_counter() - p.started)
            return
        tensors = _tensors(p)
        writer.write(p.index, problems[p.index].id, tensors, time.perf_counter() - p.started)
        partial.remove(p.index)
        del active[p.index]
        summary["problems"] += 1
        summary["records"] += len(p.records)
        summary["pivots"] += int(tensors["label"].sum()) if tensors else 0
        bar.update(1)

    decisions, saved = 0, time.perf_counter()
    try:
        admit()
        while engine.busy:
            for done in engine.step():
                p = active[done.job.key[0]]
                decisions += _take(p, done)
                advance(p)
            # After every step, not only when a job finishes: the first continuations take minutes.
            bar.set_postfix(decisions=decisions, records=summary["records"], pivots=summary["pivots"],
                            rows=engine.running, forwards=engine.forwards, joins=engine.joins,
                            tokens_per_forward=f"{engine.tokens / max(1, engine.forwards):.1f}")
            admit()
            if time.perf_counter() - saved >= GREEDY_SAVE_SECONDS:
                save_greedy()
                release_free_memory()
                saved = time.perf_counter()
            free = _memory_left()
            if free is not None and free < LOW_MEMORY:
                save_greedy()
                raise LowMemory(f"memory ran low ({free / GIB:.2f} GiB left with {len(active)} problems in "
                                f"flight); their progress is saved: run the same command with a smaller --batch "
                                f"to go on")
    except KeyboardInterrupt:
        save_greedy()
        raise
    finally:
        engine.close()
        bar.close()
    return summary
