"""Pivot labels from rollouts, written as resumable per-problem shards.

For each problem: the target decodes greedily; one teacher-forced forward of each model over that text
gives, at every generated position, the target's hidden state at the classifier's layer, ``p_target`` of
the draft's choice, the target entropy, and the draft's own probability and entropy; at the positions kept,
also the divergence KL(p_target || p_draft) (``verify_block``'s, as decoding computes it). Where the draft's
greedy token differs from the target's, the text is continued from ``prefix + draft token`` and from
``prefix + target token`` with the target and scored with the task's utility:

- ``rollouts=0``: one greedy continuation per side (the target side is the original decode itself);
- ``rollouts=R``: R continuations per side sampled at ``temperature``.

With ``only_draft_wrong`` a problem is labeled only when the draft decoding alone (greedy, a third of the
target's cost) answers it wrong: where both models are right a deviation rarely changes the answer, so
this spends the rollouts where pivots can be. The other problems get an index line with no records.

Continuations run as one batch over the decoded text's cache (``pad.pivots.rollout.continue_batch``).

With success rates ``r_draft`` and ``r_target``: the draft token is a pivot when ``r_draft < r_target *
ratio``, a clear non-pivot when ``r_draft >= keep``; positions with ``r_target == 0`` or in between are
skipped. Each finished problem is one ``problems/NNNNNN.safetensors`` file (fp16 features, written to a
temporary name and renamed) plus one line in ``index-<shard>.jsonl``; a restarted job skips the problems
in its index, so an interruption loses at most the problem in flight and never duplicates a record.
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from pad_kernels import verify_block

from ..decoding.decoder import left_padded
from ..decoding.generate import generate
from ..decoding.hf import LayerCapture, decoder_layer, eos_ids, forward_tail, returned_cache, shared_vocab_size
from .. import jsonl
from ..models.registry import check_weights
from .rollout import Start, continue_batch

@dataclass
class LabelConfig:
    layer: int = -8
    max_new_tokens: int = 256
    max_rollout_tokens: int = 256
    rollouts: int = 0  # 0: one greedy rollout per side
    temperature: float = 0.7
    ratio: float = 0.5  # pivot when rate_draft < rate_target * ratio
    keep: float = 0.8  # non-pivot when rate_draft >= keep
    seed: int = 0
    only_draft_wrong: bool = False  # label only problems the draft alone answers wrong


def parse_shard(text: str | None) -> tuple[int, int]:
    """``"i/n"`` -> (i, n) with 0 <= i < n; None -> (0, 1)."""
    if not text:
        return 0, 1
    try:
        i, n = (int(x) for x in text.split("/"))
    except ValueError:
        raise ValueError(f"--shard must look like i/n (for example 0/4), got {text!r}") from None
    if not 0 <= i < n:
        raise ValueError(f"--shard {text}: need 0 <= i < n")
    return i, n


def softmax_stats(logits: torch.Tensor, tokens: torch.Tensor, chunk: int = 64):
    """logits [T, V], tokens [T] -> (p(token) [T], entropy [T]) in fp32.

    In chunks of positions: fp32 temporaries of a 500-token answer over a 152k vocabulary would take
    gigabytes.
    """
    prob, entropy = [], []
    for rows, toks in zip(logits.split(chunk), tokens.split(chunk)):
        logp = torch.log_softmax(rows.float(), -1)
        p = logp.exp()
        entropy.append(-(p * logp).nan_to_num().sum(-1))
        prob.append(p.gather(-1, toks[:, None]).squeeze(-1))
    return torch.cat(prob), torch.cat(entropy)


def verify_positions(target_logits: torch.Tensor, tokens: torch.Tensor, draft_logits: torch.Tensor | None = None):
    """Each of n positions verified as a block of one draft token -> ``VerifyResult`` of [n, 1] fields (the
    classifier's features at each, and with ``draft_logits`` the divergence, as decoding computes them).

    target_logits [n, V]; tokens [n] the draft tokens; draft_logits [n, V] the draft's logits there.
    """
    return verify_block(torch.stack([target_logits, target_logits], 1), tokens.reshape(-1, 1).to(target_logits.device),
                        draft_logits=None if draft_logits is None else draft_logits[:, None].to(target_logits.dtype))


@torch.inference_mode()
def greedy_texts(model_policy: str, target, draft, prompts: list[torch.Tensor], max_new_tokens: int) -> list[list[int]]:
    """The greedy continuations of several prompts ([1, P] each) by the target (or the draft, with
    ``model_policy="draft"``), decoded as one batch: each row is what it would be alone."""
    ids, mask = left_padded([p[0].tolist() for p in prompts])
    out = generate(target, draft, ids, attention_mask=mask, policy=model_policy, max_new_tokens=max_new_tokens)
    width = ids.shape[1]
    return [out.sequences[i, width : width + int(n)].tolist() for i, n in enumerate(out.lengths)]


@torch.inference_mode()
def label_problem(target, draft, prompt_ids: torch.Tensor, utility: Callable[[list[int]], bool],
                  cfg: LabelConfig, rollout_batch: int = 16, decoded: tuple | None = None) -> dict[str, torch.Tensor]:
    """Labeled positions of one problem as tensors (see the module docstring); prompt_ids [1, P].

    Rollouts run ``rollout_batch`` at a time over the decoded text's own cache (``pad.pivots.rollout``).
    ``decoded``: (the target's greedy text, the draft's or None) when already decoded (``greedy_texts``).
    """
    vocab = shared_vocab_size(target, draft)
    eos = eos_ids(target, None)
    P = prompt_ids.shape[1]
    if decoded is None:
        decoded = (greedy_texts("target", target, draft, [prompt_ids], cfg.max_new_tokens)[0],
                   greedy_texts("draft", target, draft, [prompt_ids], cfg.max_new_tokens)[0]
                   if cfg.only_draft_wrong else None)
    new, alone = decoded
    if cfg.only_draft_wrong and utility(alone):
        return {}
    if not new:
        return {}
    seq = torch.cat([prompt_ids, torch.tensor([new])], 1)
    T = len(new)
    # Teacher-forced passes over the decoded text: position P-1+t predicts new token t.
    capture = LayerCapture(target, cfg.layer)
    capture.keep = T + 1
    try:
        out = forward_tail(target, seq, T + 1, use_cache=True)  # logits of positions P-1 .. P+T-1 only
    finally:
        capture.remove()
    full_cache = returned_cache(out)
    hidden = capture.value[0, :T]  # states at positions P-1 .. P+T-2
    t_logits = out.logits[0, :T, :vocab]
    d_logits = forward_tail(draft, seq, T + 1).logits[0, :T, :vocab]
    new_t = torch.tensor(new)
    draft_tokens = d_logits.argmax(-1)
    token_prob, entropy = softmax_stats(t_logits, draft_tokens)
    draft_prob, draft_entropy = softmax_stats(d_logits, draft_tokens)
    mismatch = (draft_tokens != new_t).nonzero().flatten().tolist()

    g = torch.Generator().manual_seed(cfg.seed)
    base_ok = utility(new)
    # Rollout rows: (position, side, token); "target" rows start from the target's own token.
    if cfg.rollouts == 0:
        # Greedy: the target side is the decode itself; with a wrong answer no position can qualify.
        rows_spec = [(t, "draft", int(draft_tokens[t])) for t in mismatch] if base_ok else []
    else:
        rows_spec = [(t, side, tok) for t in mismatch for side, tok in (("target", new[t]), ("draft", int(draft_tokens[t])))
                     for _ in range(cfg.rollouts)]
    wins = {}  # (position, side) -> successes
    for lo in range(0, len(rows_spec), rollout_batch):
        chunk = rows_spec[lo : lo + rollout_batch]
        tails = continue_batch(target, full_cache, [Start(P + t, tok) for t, _, tok in chunk], vocab=vocab,
                               max_new_tokens=cfg.max_rollout_tokens, eos=eos,
                               temperature=cfg.temperature if cfg.rollouts else 0.0, generator=g)
        for (t, side, tok), tail in zip(chunk, tails):
            wins[t, side] = wins.get((t, side), 0) + utility(new[:t] + [tok] + tail)

    rows = {k: [] for k in ("position", "rate_draft", "rate_target", "label")}
    keep_idx = []
    for t in mismatch:
        if cfg.rollouts == 0:  # no rollouts ran when the target's own answer is wrong: r_target 0 skips
            r_target, r_draft = float(base_ok), float(wins.get((t, "draft"), 0))
        else:
            r_target, r_draft = wins[t, "target"] / cfg.rollouts, wins[t, "draft"] / cfg.rollouts
        if r_target == 0:
            continue
        if r_draft < r_target * cfg.ratio:
            label = 1
        elif r_draft >= cfg.keep:
            label = 0
        else:
            continue
        keep_idx.append(t)
        for k, v in (("position", t), ("rate_draft", r_draft), ("rate_target", r_target), ("label", label)):
            rows[k].append(v)
    idx = torch.tensor(keep_idx, dtype=torch.long)
    divergence = verify_positions(t_logits[idx], draft_tokens[idx], d_logits[idx]).divergence[:, 0]
    return {
        "hidden": hidden[idx].to(torch.float16).contiguous(),
        "token_prob": token_prob[idx].to(torch.float16),
        "entropy": entropy[idx].to(torch.float16),
        "divergence": divergence.to(torch.float16),
        "draft_prob": draft_prob[idx].to(torch.float16),
        "draft_entropy": draft_entropy[idx].to(torch.float16),
        "position": torch.tensor(rows["position"], dtype=torch.int32),
        "rate_draft": torch.tensor(rows["rate_draft"], dtype=torch.float16),
        "rate_target": torch.tensor(rows["rate_target"], dtype=torch.float16),
        "label": torch.tensor(rows["label"], dtype=torch.int8),
        "generated": torch.tensor([T], dtype=torch.int32),
        "mismatches": torch.tensor([len(mismatch)], dtype=torch.int32),
    }


class LabelWriter:
    """Per-problem shard files plus an append-only JSONL index; resumable and duplicate-free."""

    def __init__(self, out_dir: str | os.PathLike, shard: tuple[int, int], meta: dict):
        self.dir = Path(out_dir)
        (self.dir / "problems").mkdir(parents=True, exist_ok=True)
        self.index = self.dir / f"index-{shard[0]}of{shard[1]}.jsonl"
        meta_path = self.dir / "meta.json"
        if meta_path.exists():
            old = json.loads(meta_path.read_text())
            check_weights(old.get("weights") or {}, meta.get("weights") or {}, f"label folder {out_dir}")
            if {k: old.get(k) for k in meta} != meta:
                raise ValueError(f"{out_dir} was labeled with other settings {old}; use another --out")
        else:
            meta_path.write_text(json.dumps(meta, indent=2) + "\n")
        self.done = {r["problem"] for r in jsonl.read(self.index)}  # a torn last line: that problem is redone

    def write(self, problem_index: int, problem_id: str, tensors: dict, seconds: float) -> None:
        from safetensors.torch import save_file

        name = f"problems/{problem_index:06d}.safetensors"
        tmp = self.dir / (name + ".tmp")
        if tensors:
            save_file(tensors, str(tmp), metadata={"problem": problem_id})
            os.replace(tmp, self.dir / name)
        n = int(tensors["label"].numel()) if tensors else 0
        record = {"problem": problem_id, "index": problem_index, "file": name if tensors else None, "records": n,
                  "pivots": int(tensors["label"].sum()) if tensors else 0,
                  "mismatches": int(tensors["mismatches"]) if tensors else 0, "seconds": round(seconds, 1)}
        jsonl.append(self.index, record)  # the index line is the commit point of a problem
        self.done.add(problem_id)


def finished_problems(folder: str | os.PathLike, task: str, split: str) -> set[str]:
    """Ids of the problems another ``pad label`` folder of the same task and split has finished (every
    shard's index), so that a job can leave them out (``run(..., skip=...)``)."""
    folder = Path(folder)
    meta_path = folder / "meta.json"
    if not meta_path.exists():
        raise FileNotFoundError(f"{folder} is not a label folder (no meta.json)")
    meta = json.loads(meta_path.read_text())
    if (meta.get("task"), meta.get("split")) != (task, split):
        raise ValueError(f"{folder} labels {meta.get('task')}/{meta.get('split')}, not {task}/{split}")
    return {r["problem"] for index in sorted(folder.glob("index-*.jsonl")) for r in jsonl.read(index)}


def shard_indices(count: int, start: int, shard: tuple[int, int]) -> list[int]:
    """Indices of shard ``(i, n)``'s problems among ``count`` from ``start`` on (every n-th, from index i)."""
    return [i for i in range(start, count) if i % shard[1] == shard[0]]


def problems_to_do(problems: list, start: int, shard: tuple[int, int], done: set[str],
                   skip: set[str] = frozenset()) -> tuple[list[int], dict]:
    """Indices of this shard's problems from ``start`` on that are neither ``done`` (this folder) nor in
    ``skip`` (finished in another folder), and the summary that counts them."""
    mine = shard_indices(len(problems), start, shard)
    todo = [i for i in mine if problems[i].id not in done and problems[i].id not in skip]
    elsewhere = sum(problems[i].id in skip and problems[i].id not in done for i in mine)
    return todo, {"problems": 0, "records": 0, "pivots": 0, "skipped_done": len(mine) - len(todo) - elsewhere,
                  "skipped_elsewhere": elsewhere}


def run(problems: list, prompts: list[torch.Tensor], utilities: list[Callable], target, draft, out_dir,
        cfg: LabelConfig, *, shard: tuple[int, int] = (0, 1), meta: dict | None = None, progress: bool = True,
        rollout_batch: int = 16, start: int = 0, decode_batch: int = 8, skip: set[str] = frozenset()) -> dict:
    """Label the problems of this shard from index ``start`` on that the index does not hold yet (nor
    ``skip``: ids finished elsewhere); returns a summary. The greedy decodes of ``decode_batch`` problems at
    a time run as one batch."""
    from tqdm.auto import tqdm

    decoder_layer(target, cfg.layer)  # a bad layer fails before the folder records these settings
    writer = LabelWriter(out_dir, shard, {**(meta or {}), **cfg.__dict__})
    todo, summary = problems_to_do(problems, start, shard, writer.done, skip)
    bar = tqdm(todo, desc="label", unit="problem", disable=not progress)
    decoded = {}
    for n, i in enumerate(bar):
        start = time.perf_counter()
        if i not in decoded:  # the next decode_batch problems' greedy texts, decoded together
            group = todo[n : n + decode_batch]
            with torch.inference_mode():
                texts = greedy_texts("target", target, draft, [prompts[j] for j in group], cfg.max_new_tokens)
                drafts = (greedy_texts("draft", target, draft, [prompts[j] for j in group], cfg.max_new_tokens)
                          if cfg.only_draft_wrong else [None] * len(group))
            decoded = dict(zip(group, zip(texts, drafts)))
        tensors = label_problem(target, draft, prompts[i], utilities[i], cfg, rollout_batch, decoded.pop(i))
        writer.write(i, problems[i].id, tensors, time.perf_counter() - start)
        summary["problems"] += 1
        if tensors:
            summary["records"] += int(tensors["label"].numel())
            summary["pivots"] += int(tensors["label"].sum())
        bar.set_postfix(records=summary["records"], pivots=summary["pivots"])
    return summary
