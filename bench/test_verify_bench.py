"""pytest-benchmark microbenchmarks of verify_block: every backend available here against the eager
reference and torch.compile of the reference.

    python -m pytest bench/test_verify_bench.py --benchmark-columns=median,iqr --benchmark-group-by=param:shape

(bench/verify_table.py prints the same comparison as one markdown table with ratios.)
"""
import itertools

import pytest
import torch

from pad_kernels import available_backends, verify_block
from pad_kernels.verify_ref import verify_block_ref
from verify_table import make_inputs

SHAPES = [pytest.param(s, id=f"B{s[0]}-K{s[1]}-V{s[2]}-H{s[3]}")
          for s in itertools.product((1, 4), (4, 10), (32000, 151936), (896, 1536))]
BACKENDS = ["eager", "compile"] + [b for b in available_backends("cpu") if b not in ("torch", "triton")]
_compiled = {}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_verify_block(benchmark, backend, shape, dtype):
    logits, drafts, hidden, clf = make_inputs(*shape, dtype)
    kwargs = dict(sigma=0.5, floor=1e-4)
    if backend == "eager":
        fn = verify_block_ref
    elif backend == "compile":
        fn = _compiled.setdefault("ref", torch.compile(verify_block_ref, dynamic=True))
    else:
        kwargs["backend"] = backend
        fn = verify_block
    result = benchmark(fn, logits, drafts, hidden, clf, **kwargs)
    assert result.num_accepted.shape == (shape[0],)
