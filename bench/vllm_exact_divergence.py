"""Where vLLM-exact and pad-exact texts part: for each problem whose replies differ, the first token where they
do, with the target's top-2 there as HuggingFace (pad's forward) and vLLM each compute it.

Both are the target's greedy decoding, equal in exact arithmetic; where they part, a near tie between the top
two tokens (a gap of the order of the kernels' rounding) is the expected cause. Reads the rows of
``bench/vllm_side_by_side.py --only-exact`` and pad's run log beside them; runs the target alone in both.
Run with vLLM's CPU build, nothing else running:

    python bench/vllm_exact_divergence.py bench/results/vllm/gsm8k_dev_0-63_k8_float32_b16_exact.rows.jsonl
"""
from __future__ import annotations

import argparse
import gc
import json
import os
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")

import torch  # noqa: E402

from pad.evaluation import tasks  # noqa: E402
from pad.machine import machine_line  # noqa: E402
from pad.models import registry  # noqa: E402


def first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("rows", help="the side-by-side rows log (--only-exact)")
    parser.add_argument("--dtype", default="float32", choices=["bfloat16", "float32"])
    parser.add_argument("--batch-size", type=int, default=16, help="pad exact's batch in its run log")
    parser.add_argument("--out", default=None, help="write the table here (markdown)")
    args = parser.parse_args(argv)
    rows = dict(json.loads(line) for line in Path(args.rows).read_text().splitlines())
    vllm = {r["problem"]: r["reply"] for r in rows["vllm exact"]}
    pad_log = Path(args.rows).parent / "pad_rows.runs.jsonl"
    pad = {r["problem"]: r["reply"] for r in map(json.loads, pad_log.read_text().splitlines())
           if r["policy"] == "exact" and r["settings"]["dtype"] == args.dtype
           and r["settings"]["batch_size"] == args.batch_size and r["problem"] in vllm}
    tokenizer = registry.load_tokenizer(registry.DEFAULT_TARGET, source="index-gguf")
    ids = sorted(vllm, key=lambda p: int(p.rsplit("/", 1)[1]))
    problems, prompts, _ = tasks.prompted_problems(tokenizer, "gsm8k", "dev", start=0,
                                                   limit=1 + max(int(p.rsplit("/", 1)[1]) for p in ids))
    prompt_of = {p.id: q for p, q in zip(problems, prompts)}
    cases = []
    for problem in ids:
        if vllm[problem] == pad.get(problem, vllm[problem]):
            continue
        a = tokenizer.encode(vllm[problem], add_special_tokens=False)
        b = tokenizer.encode(pad[problem], add_special_tokens=False)
        i = first_difference(a, b)
        cases.append((problem, i, prompt_of[problem] + a[:i], a[i] if i < len(a) else None,
                      b[i] if i < len(b) else None))
    torch_dtype = getattr(torch, args.dtype)
    target, _ = registry.load(registry.DEFAULT_TARGET, dtype=args.dtype, source="index-gguf")
    hf = []
    with torch.no_grad():
        for _, _, context, _, _ in cases:
            logits = target(torch.tensor([context])).logits[0, -1].float()
            top = logits.topk(2)
            hf.append(list(zip(top.indices.tolist(), top.values.tolist())))
    del target
    gc.collect()
    from vllm import LLM, SamplingParams

    llm = LLM(model=registry.resolve(registry.DEFAULT_TARGET, source="index-gguf"), dtype=torch_dtype,
              enforce_eager=True, max_model_len=2048, seed=0)
    outputs = llm.generate([{"prompt_token_ids": c[2]} for c in cases],
                           SamplingParams(temperature=0, max_tokens=1, logprobs=2), use_tqdm=False)
    lines = [f"vLLM exact against pad exact, GSM8K dev, {args.dtype}: {len(ids) - len(cases)} of {len(ids)} "
             f"replies equal; per difference, the first token where they part (counted in the re-tokenized "
             f"replies) and the target's top 2 there. Machine: {machine_line()}", "",
             "| problem | token | vLLM's / pad's token | HF top 2 (logit) | HF gap | vLLM top 2 (logprob) | vLLM gap |",
             "|---|---|---|---|---|---|---|"]
    for (problem, i, _, va, pa), top, out in zip(cases, hf, outputs):
        lp = sorted(out.outputs[0].logprobs[0].items(), key=lambda kv: -kv[1].logprob)[:2]

        def name(t):
            return repr(tokenizer.decode([t])) if t is not None else "end"

        lines.append(f"| {problem} | {i} | {name(va)} / {name(pa)} | "
                     f"{', '.join(f'{name(t)} {v:.3f}' for t, v in top)} | {top[0][1] - top[1][1]:.4f} | "
                     f"{', '.join(f'{name(t)} {x.logprob:.3f}' for t, x in lp)} | "
                     f"{lp[0][1].logprob - lp[1][1].logprob:.4f} |")
    text = "\n".join(lines)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
