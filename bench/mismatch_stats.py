"""What the rules that read both models see where exact speculative decoding rejects a draft token.

Decodes problems with the exact rule (as ``kl@0,0``, whose gate never opens, so that the op reads the draft's
logits) and records, at every rejected draft token: the divergence KL(p || q), p_target(token), the target's
top-1 probability and the token's rank in the target's distribution. Prints their quantiles and, for a grid of
settings of threshold, kl and topk, the share of these mismatches each setting would accept: a first-order
preview (later blocks would differ once a mismatch is accepted) for choosing which settings to decode.

    python bench/mismatch_stats.py --task gsm8k --split train --start 7000 --limit 7016
"""
import argparse

import torch

import pad
import pad.decoding.generate as gen_module
from pad.evaluation import tasks
from pad.models import registry

p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
p.add_argument("--task", default="gsm8k")
p.add_argument("--split", default="train")
p.add_argument("--start", type=int, default=7000)
p.add_argument("--limit", type=int, default=7016, help="problems start..limit-1, decoded as one batch")
p.add_argument("-k", type=int, default=8)
p.add_argument("--max-new-tokens", type=int, default=512)
p.add_argument("--dtype", default="bfloat16")
p.add_argument("--threads", type=int, default=2)
args = p.parse_args()
torch.set_num_threads(args.threads)

target, tok = registry.load(registry.DEFAULT_TARGET, dtype=args.dtype)
draft, _ = registry.load(registry.DEFAULT_DRAFT, dtype=args.dtype)
problems = tasks.load(args.task, args.split)[args.start:args.limit]
rows = [tasks.prompt_ids(tok, args.task, q)[0] for q in problems]
P = max(len(r) for r in rows)
ids = torch.full((len(rows), P), tok.pad_token_id or 0, dtype=torch.long)
mask = torch.zeros((len(rows), P), dtype=torch.long)
for i, r in enumerate(rows):
    ids[i, P - len(r):] = r
    mask[i, P - len(r):] = 1

seen = {"kl": [], "p": [], "top1": [], "rank": []}
verify = gen_module.verify_block


def recording(target_logits, draft_tokens, *a, **kw):
    res = verify(target_logits, draft_tokens, *a, **kw)
    b, k = draft_tokens.shape
    drafts = kw.get("num_drafts")
    for j in range(b):
        n = int(res.num_accepted[j])
        if n >= (k if drafts is None else int(drafts[j])):
            continue  # every draft token accepted: no mismatch in this row's block
        logits = target_logits[j, n].float()
        d = int(draft_tokens[j, n])
        seen["kl"].append(float(res.divergence[j, n]))
        seen["p"].append(float(res.token_prob[j, n]))
        seen["top1"].append(float(torch.softmax(logits, -1).max()))
        seen["rank"].append(int((logits > logits[d]).sum()) + int((logits[:d] == logits[d]).sum()))
    return res


gen_module.verify_block = recording
out = pad.generate(target, draft, ids, attention_mask=mask, policy="kl@0,0", num_draft_tokens=args.k,
                   max_new_tokens=args.max_new_tokens, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
t = {key: torch.tensor(v, dtype=torch.float64) for key, v in seen.items()}
n = len(seen["kl"])
print(f"{args.task} {args.split} {args.start}-{args.limit - 1}, K = {args.k}, {args.dtype}: {int(out.lengths.sum())} "
      f"new tokens, {n} mismatches")
qs = torch.tensor([0.1, 0.25, 0.5, 0.75, 0.9], dtype=torch.float64)
for key in ("kl", "p", "top1"):
    print(f"{key:>5} quantiles 10/25/50/75/90%: " + ", ".join(f"{v:.3f}" for v in torch.quantile(t[key], qs)))
print("rank shares: " + ", ".join(f"{r}: {float((t['rank'] == r).double().mean()):.2f}" for r in range(1, 5)))
gap = t["top1"] - t["p"]
print("share of mismatches accepted:")
for tau in (0.4, 0.3, 0.2, 0.1):
    print(f"  threshold@{tau:g}: {float((t['p'] >= tau).double().mean()):.2f}")
for eps in (0.05, 0.1, 0.2, 0.3, 0.5, 1.0):
    for top1 in (1.0, 0.9):
        print(f"  kl@{eps:g},{top1:g}: {float(((t['kl'] <= eps) & (t['top1'] < top1)).double().mean()):.2f}")
for k in (2, 3, 5):
    for delta in (0.05, 0.1, 0.2, 0.3, 0.5):
        print(f"  topk@{k},{delta:g}: {float(((t['rank'] < k) & (gap <= delta)).double().mean()):.2f}")
