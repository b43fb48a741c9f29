"""pad inside vLLM against vLLM alone and against pad's own loop, on the same problems, in one run.

Rows: vLLM with the target alone ("target": the reference of speedups and accuracy differences), vLLM's
exact speculative decoding (its draft_model speculator), vLLM with pad's plugin at pivot@SIGMA (the shipped
classifier) and at threshold@TAU; with ``--ngram`` also vLLM's draft-free ngram speculator exact and with
pivot@SIGMA; then ``pad.generate``'s policies (``--pad-policies``, the benchmark's spelling, drafters
included) at batch B, in a process of their own. Every vLLM engine decodes at most B requests at a time
(``max_num_seqs``), so aggregate tokens/s compare at one batch size. Also counted: how many of the problems
vLLM-exact and each pad exact row answer with the same text (both are the target's greedy decoding, equal
in exact arithmetic; kernels that round differently flip near ties, often in bf16). ``--only-exact`` runs
vLLM exact and pad exact alone (for that count in fp32).

Run with a Python that has vLLM's CPU build (0.32.0) and pad-decoding installed (docs/serving.md), nothing
else running:

    python bench/vllm_side_by_side.py --limit 64 --batch-size 16 --dtype bfloat16
    python bench/vllm_side_by_side.py --task humaneval --limit 16 --batch-size 1 --max-new-tokens 128 --ngram \
        --pad-policies exact/lookup:auto,exact/hybrid:auto,pivot@0.3/hybrid:auto

Resumable: each finished row is appended to the run log in --out, and rows found there are not re-run.
"""
from __future__ import annotations

import argparse
import gc
import json
import multiprocessing
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process: its counters
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")

from pad.decoding.policy import DEFAULT_SIGMA  # noqa: E402
from pad.evaluation import bench, tasks  # noqa: E402
from pad.machine import machine_line, speed_probe  # noqa: E402
from pad.models import registry  # noqa: E402

WARMUP_TOKENS = 16
TASK_NAMES = {"gsm8k": "GSM8K", "humaneval": "HumanEval"}
PAD_LOG = "pad_rows.runs.jsonl"
NGRAM = {"prompt_lookup_max": 3, "prompt_lookup_min": 1}  # as pad's lookup drafter's defaults


def vllm_rows(args, target, draft, problems, prompts, done):
    """Per vLLM row not in ``done``, one bench record per problem (the counts ``bench.PolicyTotals`` adds up)."""
    from pad.serving import engine as vllm_engine

    pivot = {"policy": f"pivot@{args.sigma:g}", "classifier": "shipped"}
    # (draft, speculator, the engine's pad config, its rows: (name, the requests' own pad settings))
    engines = [(None, None, None, [("target", None)]), (draft, None, None, [("vllm exact", None)]),
               (draft, None, pivot, [(f"vllm pivot@{args.sigma:g}", None)]),
               (draft, None, {"policy": f"threshold@{args.tau:g}"}, [(f"vllm threshold@{args.tau:g}", None)])]
    if args.ngram:  # one engine, each row's requests choosing their rule: in vLLM 0.32's CPU build a second
        # engine in a process fails to start after an ngram one (tests/vllm_plugin/test_vllm_speculators.py)
        engines.append((None, "ngram", pivot, [("vllm ngram exact", {"pad": {"policy": "exact"}}),
                                               (f"vllm ngram pivot@{args.sigma:g}", None)]))
    for row_draft, speculator, pad, rows in engines:
        rows = [(name, extra) for name, extra in rows
                if name not in done and not (args.only_exact and name != "vllm exact")]
        if not rows:
            continue
        speculates = row_draft is not None or speculator is not None
        probe = round(speed_probe(args.dtype), 1)  # before the engine starts its threads
        llm = vllm_engine.engine(target, row_draft, num_draft_tokens=args.k, pad=pad, dtype=args.dtype,
                                 speculator=speculator, speculator_args=NGRAM if speculator == "ngram" else None,
                                 max_num_seqs=args.batch_size, max_model_len=2048)
        for name, extra in rows:
            yield name, _vllm_row(args, llm, name, extra, speculates, problems, prompts, probe)
        del llm
        gc.collect()


def _vllm_row(args, llm, name, extra, speculates, problems, prompts, probe):
    from pad.serving import engine as vllm_engine

    extra_args = [extra] * len(prompts)
    vllm_engine.generate(llm, prompts[:2], max_tokens=WARMUP_TOKENS, extra_args=extra_args[:2])
    before = vllm_engine.speculation_counts(llm) if speculates else None
    start = time.perf_counter()
    outputs = vllm_engine.generate(llm, prompts, max_tokens=args.max_new_tokens, extra_args=extra_args)
    seconds = time.perf_counter() - start
    counts = vllm_engine.speculation_counts(llm) - before if speculates else None
    new_tokens = sum(map(len, outputs))
    # vLLM counts drafts and accepted tokens over the engine, not per request: the per-problem records split
    # them evenly (the table's rates are the totals' either way). Every target forward makes one token plus
    # the drafts it accepts (ngram steps without a match draft nothing and make one), but vLLM also counts
    # accepted drafts that max_tokens then cuts off; a request has at least its prefill forward and one per
    # block with drafts, so the larger of the two counts.
    forwards = max(new_tokens - counts.accepted, counts.drafts + len(prompts)) if counts else new_tokens
    records = []
    for problem, new in zip(problems, outputs):
        reply = args.tokenizer.decode(new, skip_special_tokens=True)
        share = len(new) / new_tokens
        records.append({"problem": problem.id, "policy": name, "correct": bool(tasks.correct(args.task, problem, reply)),
                        "new_tokens": len(new), "seconds": seconds * share, "target_forwards": forwards * share,
                        "drafted": counts.draft_tokens * share if counts else 0,
                        "accepted": counts.accepted * share if counts else 0, "batch_size": args.batch_size,
                        "speed_probe": probe, "reply": reply})
    print(f"{name}: {new_tokens} tokens in {seconds:.1f} s", file=sys.stderr, flush=True)
    return records


def pad_rows(args, problems, specs):
    """pad.generate's policies through pad's own benchmark (its run log keeps the replies), run in a fresh
    process: in the process where vLLM's engines ran, pad's loop ran 2.5x slower at one request (docs/serving.md)."""
    child = multiprocessing.get_context("spawn").Process(target=_log_pad_runs, args=(vars(args) | {"tokenizer": None},))
    child.start()
    child.join()
    if child.exitcode != 0:
        raise RuntimeError(f"pad's rows failed (exit code {child.exitcode}); the runs they finished are logged")
    runs = [json.loads(line) for line in (Path(args.out) / PAD_LOG).read_text().splitlines()]
    ids = {p.id for p in problems}
    for spec in specs:
        records = [r for r in runs if r["policy"] == spec.name and r["problem"] in ids
                   and r["settings"]["dtype"] == args.dtype and r["settings"]["batch_size"] == args.batch_size
                   and r["settings"]["max_new_tokens"] == args.max_new_tokens]
        yield f"pad {spec.name} (B={args.batch_size})", records


def _log_pad_runs(settings: dict) -> None:
    from pad.models.classifier import PivotClassifier

    args = argparse.Namespace(**settings)
    tokenizer = registry.load_tokenizer(registry.DEFAULT_TARGET, source="index-gguf")
    problems, _, _ = tasks.prompted_problems(tokenizer, args.task, "dev", start=args.start, limit=args.limit)

    def models():
        return tuple(registry.load(name, dtype=args.dtype, source="index-gguf")[0]
                     for name in (registry.DEFAULT_TARGET, registry.DEFAULT_DRAFT))

    classifier = PivotClassifier.load(registry.shipped_classifier(registry.DEFAULT_TARGET, registry.DEFAULT_DRAFT))
    weights = {role: registry.weights_identity(name, source="index-gguf")
               for role, name in (("target", registry.DEFAULT_TARGET), ("draft", registry.DEFAULT_DRAFT))}
    bench.run(args.task, problems, None, None, tokenizer, bench.parse_policies(
              "exact" if args.only_exact else args.pad_policies), num_draft_tokens=args.k, models=models,
              max_new_tokens=args.max_new_tokens, classifier=classifier, batch_size=args.batch_size,
              log=Path(args.out) / PAD_LOG, settings={"dtype": args.dtype, "weights": weights})


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--task", default="gsm8k", choices=tasks.SCORED)
    parser.add_argument("--start", type=int, default=0)
    parser.add_argument("--limit", type=int, default=64, help="problems [start, limit) of the task's dev split")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("-k", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--sigma", type=float, default=DEFAULT_SIGMA)
    parser.add_argument("--tau", type=float, default=0.2)
    parser.add_argument("--out", default="bench/results/vllm")
    parser.add_argument("--ngram", action="store_true", help="also vLLM's ngram speculator, exact and with pivot")
    parser.add_argument("--pad-policies", default=None,
                        help="pad.generate's rows, as pad-decoding bench spells them (default: exact,pivot@SIGMA)")
    parser.add_argument("--only-exact", action="store_true",
                        help="only vLLM exact and pad exact: do the two give the same tokens (fp32: they should)")
    args = parser.parse_args(argv)
    args.pad_policies = args.pad_policies or f"exact,pivot@{args.sigma:g}"
    pad_specs = bench.parse_policies("exact" if args.only_exact else args.pad_policies)  # bad spelling: fail now
    Path(args.out).mkdir(parents=True, exist_ok=True)
    target = registry.resolve(registry.DEFAULT_TARGET, source="index-gguf")
    draft = registry.resolve(registry.DEFAULT_DRAFT, source="index-gguf")
    args.tokenizer = registry.load_tokenizer(registry.DEFAULT_TARGET, source="index-gguf")
    problems, prompts, _ = tasks.prompted_problems(args.tokenizer, args.task, "dev", start=args.start, limit=args.limit)
    stem = f"{args.task}_dev_{args.start}-{args.limit - 1}_k{args.k}_{args.dtype}_b{args.batch_size}" + \
        (f"_t{args.max_new_tokens}" if args.max_new_tokens != 256 else "") + ("_exact" if args.only_exact else "")
    log = Path(args.out) / f"{stem}.rows.jsonl"
    done = {}
    if log.exists():
        for line in log.read_text().splitlines():
            name, records = json.loads(line)
            done[name] = records

    def rows():
        yield from vllm_rows(args, target, draft, problems, prompts, done)
        yield from pad_rows(args, problems, pad_specs)

    produced = rows()
    pad_names = [f"pad {spec.name} (B={args.batch_size})" for spec in pad_specs]
    order = ["target", "vllm exact", f"vllm pivot@{args.sigma:g}", f"vllm threshold@{args.tau:g}"]
    order += ["vllm ngram exact", f"vllm ngram pivot@{args.sigma:g}"] if args.ngram else []
    order = ["vllm exact"] + pad_names if args.only_exact else order + pad_names
    if not all(name in done for name in order):
        for name, records in produced:
            if name not in done:
                done[name] = records
                with open(log, "a") as f:
                    f.write(json.dumps([name, records]) + "\n")

    totals = {name: bench.PolicyTotals() for name in order}
    correct = {}
    for name in order:
        for r in done[name]:
            totals[name].add(r)
        correct[name] = [r["correct"] for r in done[name]]
    table = bench.summary_rows(totals, correct)
    # Every row is timed in this one process, one after another. pad's tables leave out a row whose speed
    # probe is more than 5% off the target's; here the probe itself moves (vLLM binds the process's threads
    # when its first engine starts), so every row keeps its speed and the probe column shows it.
    target_tps = totals[order[0]].new_tokens / totals[order[0]].wall_time
    for row in table:
        t = totals[row["policy"]]
        row["tokens_per_s"] = t.new_tokens / t.wall_time
        row["speedup_vs_target"] = row["tokens_per_s"] / target_tps if "target" in totals else float("nan")
        row["speed_left_out"] = False
    # Every exact row is the target's greedy decoding: count the texts each pad exact row shares with vLLM's.
    same_text = []
    for name in (n for n, spec in zip(pad_names, pad_specs) if spec.policy == "exact"):
        differ = [a["problem"] for a, b in zip(done["vllm exact"], done[name]) if a["reply"] != b["reply"]]
        same_text.append(f"vLLM exact and {name} give the same text on {len(problems) - len(differ)} of "
                         f"{len(problems)} problems" + (f" (differ: {', '.join(differ)})" if differ else ""))
    command = "python bench/vllm_side_by_side.py " + " ".join(sys.argv[1:] if argv is None else argv)
    head = (f"{TASK_NAMES[args.task]} dev {args.start}-{args.limit - 1} ({len(problems)} problems), K={args.k}, max "
            f"{args.max_new_tokens} new tokens, greedy, {args.dtype}; target {registry.DEFAULT_TARGET}, draft "
            f"{registry.DEFAULT_DRAFT} (index-gguf weights); vLLM 0.32.0 CPU build, max_num_seqs {args.batch_size}, "
            f"enforce_eager" + (f", ngram speculator {NGRAM}" if args.ngram else "") + f"; pad.generate at batch "
            f"{args.batch_size}\n\nCommand: `{command}`\n\nMachine: {machine_line()}\n\n" + "; ".join(same_text)
            + ". Tokens/s: every row timed "
            "in this one process, one after another, nothing else running; the probe reads higher before vLLM's "
            "first engine starts (it binds the process's threads), so pad's 5% probe rule is not applied here.")
    for path in bench.write(table, Path(args.out), stem, head):
        print(path)
    print(bench.markdown(table, head))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
