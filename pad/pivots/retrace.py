"""Retrace the walks of a search label folder to compute, for its stored decisions, features the labeler did not
store: the divergence KL(p_target || p_draft) at the decision (``VerifyResult.divergence``; the search labeler
stores it itself since it exists).

A search walk (``pad.pivots.search``) is fixed by its decisions: the target decodes greedily, and at each
position where the draft's greedy token (teacher-forced on the text) differs, a decision was taken; its stored
``same_answer`` says whether the draft token went into the text (harmless: its continuation became the text)
or the target's token stayed. Retracing decodes each prompt with both models, one token a step and many
problems as rows of one batch, takes the stored choice at each mismatch and stops after the last stored
decision (nothing after it is needed). At each mismatch ``verify_block`` computes the features from both
models' logits, as in decoding; nothing runs to the end of a text, so a retrace costs one greedy text a problem
where labeling cost one per decision.

The retrace checks itself against the folder: a mismatch where none was stored, or none where one was (another
batch's bf16 rounding can flip a near-tied argmax), ends that problem's retrace, and its decisions from there on
get NaN and ``matched`` 0. The recomputed p_target(token) and entropy are kept beside the stored ones.

Writes ``retrace/NNNNNN.safetensors`` into the label folder (``divergence``, ``token_prob``, ``entropy`` fp16
and ``matched`` int8, one entry per stored decision, in walk order) and ``retrace/index.jsonl``, whose line is
a problem's commit point: the same command resumes. ``pad.pivots.train.load_shards`` reads ``divergence``.
"""
from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..decoding.decoder import Decoder, left_pad
from ..decoding.hf import eos_ids, shared_vocab_size
from .. import jsonl
from .label import verify_positions

FOLDER = "retrace"
# Top-two logits this many units of rounding apart count as tied (bf16: 2 ulps is 0.25 at a logit of 20).
TIE_ULPS = 2.0
# A decision recovered at a tie must find the stored p_target(token) this close (matched decisions differ by up
# to 0.03 in bf16: the same logits rounded by other kernels).
PROB_SLACK = 0.05


@dataclass
class Walk:
    """One labeled problem's walk: its prompt, the stored decisions' positions and choices, and what the retrace
    found so far."""

    index: int
    problem: str
    prompt: list[int]
    positions: list[int]
    harmless: list[bool]  # the draft token went into the text
    stored_prob: list[float]  # p_target(token) the labeler stored, to check a decision recovered at a tie
    text: list[int] = field(default_factory=list)
    divergence: list[float] = field(default_factory=list)
    token_prob: list[float] = field(default_factory=list)
    entropy: list[float] = field(default_factory=list)
    lost: str | None = None  # why the retrace left the stored walk, if it did
    ties: int = 0  # positions where a tie within rounding was ordered as the stored walk saw it

    @property
    def done(self) -> int:
        return len(self.divergence)

    @property
    def finished(self) -> bool:
        return self.lost is not None or self.done == len(self.positions)


def stored_walks(folder, prompts: dict[str, list[int]]) -> list[Walk]:
    """The walks of a search label folder whose problems ``prompts`` (problem id -> prompt tokens) holds, in
    the order of the task's file (the folder's index lists them as they finished: the short walks first);
    raises for a folder of another labeling method."""
    from safetensors.torch import load_file

    folder = Path(folder)
    meta = json.loads((folder / "meta.json").read_text())
    if meta.get("method") != "search":
        raise ValueError(f"{folder} was not labeled by --method search: only search walks can be retraced")
    walks = []
    for index in sorted(folder.glob("index-*.jsonl")):
        for rec in jsonl.read(index):
            if not rec["file"] or rec["problem"] not in prompts:
                continue
            t = load_file(str(folder / rec["file"]))
            walks.append(Walk(rec["index"], rec["problem"], prompts[rec["problem"]], t["position"].tolist(),
                              [bool(x) for x in t["same_answer"].tolist()],
                              t["token_prob"].float().tolist()))
    return sorted(walks, key=lambda w: w.index)


def retraced(folder) -> set[str]:
    """Problem ids the folder's retrace has written."""
    return {r["problem"] for r in jsonl.read(Path(folder) / FOLDER / "index.jsonl")}


def _top2(logits: torch.Tensor, ulps: float) -> tuple[list[int], list[int], list[bool]]:
    """logits [R, V] -> (argmax (lowest index on ties), runner-up, whether the two lie within ``ulps`` units of
    the logits' dtype's rounding at the top value: a tie that another kernel's rounding may order otherwise)."""
    top = logits.float().topk(2, -1)
    first = logits.argmax(-1)
    second = torch.where(top.indices[:, 0] == first, top.indices[:, 1], top.indices[:, 0])
    gap = top.values[:, 0] - top.values[:, 1]
    tied = gap <= ulps * torch.finfo(logits.dtype).eps * top.values[:, 0].abs()
    return first.tolist(), second.tolist(), tied.tolist()


def _step(walks: list[Walk], t_logits: torch.Tensor, d_logits: torch.Tensor, eos: set[int], max_new_tokens: int,
          ulps: float = TIE_ULPS) -> list[int]:
    """One position of every walk in ``walks`` from both models' next-token logits [R, V]: decide whether the
    stored walk took a decision here, record its features, extend each text; returns each walk's new token.

    Where one model's top two tokens are tied within rounding (``_top2``), the other order is the one the
    stored walk is taken to have seen when only it agrees with the walk (a mismatch where none is stored, or
    none where one is); a decision recovered so must also find the stored p_target(token) within
    ``PROB_SLACK``."""
    g, g2, g_tied = _top2(t_logits, ulps)
    d, d2, d_tied = _top2(d_logits, ulps)
    plan = []  # per walk: (target token, draft token, decision?) or None when the walk is lost
    for r, w in enumerate(walks):
        t, expected = len(w.text), w.positions[w.done]
        gt, dt = g[r], d[r]
        if gt != dt and t != expected:  # the walk saw agreement here
            if g_tied[r] and g2[r] == dt:
                gt, w.ties = dt, w.ties + 1
            elif d_tied[r] and d2[r] == gt:
                dt, w.ties = gt, w.ties + 1
            else:
                w.lost = f"a mismatch at {t} where the next stored decision is at {expected}"
        elif gt == dt and t == expected:  # the walk saw a mismatch here
            probs = torch.softmax(t_logits[r].float(), -1)
            options = ([(g2[r], dt)] if g_tied[r] else []) + ([(gt, d2[r])] if d_tied[r] else [])
            options = [(abs(float(probs[o[1]]) - w.stored_prob[w.done]), o) for o in options]
            slack, best = min(options, default=(math.inf, None))
            if slack <= PROB_SLACK:
                (gt, dt), w.ties = best, w.ties + 1
            else:
                w.lost = f"no mismatch at {t}, where a decision is stored"
        plan.append(None if w.lost else (gt, dt, gt != dt))
    decide = [r for r, x in enumerate(plan) if x is not None and x[2]]
    if decide:
        rows = torch.tensor(decide)
        res = verify_positions(t_logits[rows], torch.tensor([plan[r][1] for r in decide]), d_logits[rows])
        for j, r in enumerate(decide):
            w = walks[r]
            w.divergence.append(float(res.divergence[j, 0]))
            w.token_prob.append(float(res.token_prob[j, 0]))
            w.entropy.append(float(res.entropy[j, 0]))
    tokens = []
    for r, (w, x) in enumerate(zip(walks, plan)):
        if x is None:
            tokens.append(g[r])
            continue
        gt, dt, decision = x
        token = dt if decision and w.harmless[w.done - 1] else gt
        w.text.append(token)
        tokens.append(token)
        if not w.finished and (token in eos or len(w.text) >= max_new_tokens):
            w.lost = f"the text ended at {len(w.text)} before the stored decision at {w.positions[w.done]}"
    return tokens


@torch.inference_mode()
def retrace_batch(walks: list[Walk], target, draft, max_new_tokens: int) -> None:
    """Retrace ``walks`` as rows of one batch (rows leave as they finish); fills each walk in place."""
    vocab, eos = shared_vocab_size(target, draft), eos_ids(target, None)
    # One token a step over wide batches: caches that grow in place (no copy of the whole cache a step).
    decoders = [Decoder(target, vocab, len(walks), grow_in_place=True),
                Decoder(draft, vocab, len(walks), grow_in_place=True)]
    live = [w for w in walks if w.positions]
    if not live:
        return
    ids, fed = left_pad([w.prompt for w in live], decoders[0].device)
    logits = [dec.forward(ids.to(dec.device), fed, keep=1)[:, -1] for dec in decoders]
    while True:
        tokens = _step(live, *logits, eos, max_new_tokens)
        keep = [r for r, w in enumerate(live) if not w.finished]
        if not keep:
            return
        if len(keep) < len(live):
            for dec in decoders:
                dec.select(keep)
            live, tokens = [live[r] for r in keep], [tokens[r] for r in keep]
        step = torch.tensor(tokens)[:, None]
        fed = torch.ones_like(step, dtype=torch.bool)
        logits = [dec.forward(step.to(dec.device), fed, keep=1)[:, -1] for dec in decoders]


def write(folder, w: Walk, seconds: float) -> None:
    """Save one retraced walk (``retrace/NNNNNN.safetensors``, then its index line: the commit point)."""
    from safetensors.torch import save_file

    out = Path(folder) / FOLDER
    out.mkdir(exist_ok=True)
    n, k = len(w.positions), w.done
    pad = lambda xs: torch.tensor(xs + [float("nan")] * (n - k), dtype=torch.float16)  # noqa: E731
    tensors = {"divergence": pad(w.divergence), "token_prob": pad(w.token_prob), "entropy": pad(w.entropy),
               "matched": torch.tensor([1] * k + [0] * (n - k), dtype=torch.int8)}
    name = f"{w.index:06d}.safetensors"
    save_file(tensors, str(out / (name + ".tmp")), metadata={"problem": w.problem})
    os.replace(out / (name + ".tmp"), out / name)
    jsonl.append(out / "index.jsonl", {"problem": w.problem, "index": w.index, "file": f"{FOLDER}/{name}",
                                       "decisions": n, "matched": k, "ties": w.ties, "lost": w.lost,
                                       "seconds": round(seconds, 1)})


def run(folder, prompts: dict[str, list[int]], target, draft, max_new_tokens: int, batch: int = 16,
        limit: int | None = None, progress: bool = True) -> dict:
    """Retrace the folder's walks not retraced yet (at most ``limit``), ``batch`` at a time, the walks of similar
    length together; returns {"problems", "decisions", "matched"} of this run."""
    from tqdm.auto import tqdm

    done = retraced(folder)
    todo = [w for w in stored_walks(folder, prompts) if w.problem not in done][:limit]
    # Walks of similar length share a batch (a short one would leave it early), sorted within windows of the
    # folder's order only: the problems retraced so far stay a fair sample of the folder when a run stops.
    window = 4 * batch
    todo = [w for lo in range(0, len(todo), window) for w in sorted(
        todo[lo : lo + window], key=lambda w: len(w.prompt) + (w.positions[-1] if w.positions else 0))]
    summary = {"problems": 0, "decisions": 0, "matched": 0}
    bar = tqdm(total=len(todo), desc="retrace", unit="problem", disable=not progress)
    for lo in range(0, len(todo), batch):
        group = todo[lo : lo + batch]
        start = time.perf_counter()
        retrace_batch(group, target, draft, max_new_tokens)
        seconds = (time.perf_counter() - start) / len(group)
        for w in group:
            write(folder, w, seconds)
            summary["problems"] += 1
            summary["decisions"] += len(w.positions)
            summary["matched"] += w.done
        bar.update(len(group))
        bar.set_postfix(matched=f"{summary['matched']}/{summary['decisions']}")
    bar.close()
    return summary
