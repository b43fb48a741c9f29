"""The token frequencies a pruned draft head keeps (``pad.decoding.vocab_prune``): counts of the default pair's
tokens over text that is no benchmark's test set, ranked, written to ``pad/vocab/qwen2.5.json`` (shipped).

Text: GSM8K's train split (question and answer; its dev/test problems are the reported ones) and Python's own
standard library sources (code, and no benchmark's). Each line of the corpus is also wrapped in the tokenizer's
chat template once, so the template's tokens count as a reply's do. Special tokens always rank first.

    python bench/token_frequencies.py [--gsm8k ../shared/data/gsm8k/train.jsonl] [--keep 65536]
"""
from __future__ import annotations

import argparse
import collections
import json
import sys
import sysconfig
from pathlib import Path

from pad.models.registry import DEFAULT_TARGET, load_tokenizer

ROOT = Path(__file__).resolve().parents[1]


def corpus(gsm8k: Path, stdlib_bytes: int):
    """(source name, text) pieces: GSM8K train problems, then standard library files (sorted by path, up to
    ``stdlib_bytes`` of them)."""
    for line in gsm8k.read_text().splitlines():
        record = json.loads(line)
        yield "gsm8k-train", record["question"] + "\n" + record["answer"]
    total = 0
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py")):
        if "test" in path.parts or "site-packages" in path.parts or total >= stdlib_bytes:
            continue
        text = path.read_text(errors="ignore")
        total += len(text)
        yield "python-stdlib", text


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gsm8k", default=str(ROOT.parent / "shared" / "data" / "gsm8k" / "train.jsonl"))
    parser.add_argument("--stdlib-bytes", type=int, default=8_000_000, help="how much standard library source")
    parser.add_argument("--keep", type=int, default=65536, help="how many of the ranked ids to write")
    parser.add_argument("--out", default=str(ROOT / "pad" / "vocab" / "qwen2.5.json"))
    args = parser.parse_args(argv)
    tok = load_tokenizer(DEFAULT_TARGET)
    counts, sizes = collections.Counter(), collections.Counter()
    for source, text in corpus(Path(args.gsm8k), args.stdlib_bytes):
        ids = tok(text, add_special_tokens=False).input_ids
        counts.update(ids)
        sizes[source] += len(ids)
    if tok.chat_template:  # the template's own tokens, once per GSM8K problem's worth
        text = tok.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False, add_generation_prompt=True)
        ids = tok(text, add_special_tokens=False).input_ids
        counts.update({t: sizes["gsm8k-train"] // max(1, len(ids)) for t in ids})
    special = sorted(set(tok.all_special_ids))
    ranked = special + [t for t, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])) if t not in special]
    command = "python bench/token_frequencies.py " + " ".join(argv if argv is not None else sys.argv[1:])
    out = {"tokenizer": DEFAULT_TARGET, "vocab_size": len(tok), "command": command.strip(),
           "tokens_counted": dict(sizes), "distinct": len(counts), "ids": ranked[: args.keep]}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out) + "\n")
    covered = sum(c for t, c in counts.items() if t in set(ranked[:32768])) / max(1, sum(counts.values()))
    print(f"wrote {args.out}: {len(counts)} distinct of {len(tok)} tokens over {sum(sizes.values())} counted "
          f"({dict(sizes)}); the top 32768 cover {covered:.2%} of the counts")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
