"""Reading label folders back in tests: the index lines and each problem's records."""
import json

import torch
from safetensors.torch import load_file

# Record fields compared exactly; the features may differ by fp32 summation order (a resumed text is
# prefilled in one forward where an uninterrupted run decoded it token by token).
INTS = ("position", "same_answer", "correct_before", "correct_after", "label", "generated", "mismatches", "source",
        "match", "offset")


def read_labels(out):
    """(index lines, {problem id: its records}) of a folder written by one shard."""
    index = [json.loads(line) for line in (out / "index-0of1.jsonl").read_text().splitlines()]
    return index, {r["problem"]: load_file(str(out / r["file"])) for r in index if r["file"]}


def assert_same_labels(a, b):
    """Two folders hold the same problems, each once, with the same index lines (but the seconds) and records."""
    (ia, ta), (ib, tb) = read_labels(a), read_labels(b)
    strip = lambda index: sorted(({**r, "seconds": 0} for r in index), key=lambda r: r["index"])  # noqa: E731
    assert strip(ia) == strip(ib) and ta.keys() == tb.keys()
    for pid in ta:
        assert_same_records(ta[pid], tb[pid])


def assert_same_records(a, b):
    """One problem's records from two runs: the same fields, integers equal, features equal to fp16 rounding."""
    assert a.keys() == b.keys()
    for k in a:
        # (NaN where both have none: a draft-free proposal's divergence)
        torch.testing.assert_close(b[k], a[k], rtol=0, atol=0 if k in INTS else 1e-3, equal_nan=True)
