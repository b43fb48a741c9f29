"""The CPU backend's loops are built for AVX-512, AVX2 and the x86-64 baseline and chosen at run time:
auto picks the widest this CPU runs, each set can be forced, and every set this CPU runs gives the
reference's results (so a wheel built here also computes right on a CPU with fewer instructions)."""
import os
import platform
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from pad_kernels import cpu
from pad_kernels.attention import gqa_attention, gqa_attention_ref
from test_verify_backends import assert_matches, fp64_truth, make_case, run_backend

ORDER = ["baseline", "avx2", "avx512"]
X86 = platform.machine().lower() in ("x86_64", "amd64")


def _require_extension():
    if not cpu.available():
        assert os.environ.get("PAD_REQUIRE_CPU_EXTENSION") != "1", "the CPU extension did not build or load"
        pytest.skip("the CPU extension is not built")


def _cpu_flags() -> set[str]:
    text = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    return set(next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), []))


def _supported() -> list[str]:
    """The sets this CPU runs, from its own flags (independent of the extension's detection)."""
    flags = _cpu_flags()
    if not X86:
        return ["baseline"]
    sets = ["baseline"]
    if {"avx2", "fma", "bmi2"} <= flags:
        sets.append("avx2")
        if {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= flags:
            sets.append("avx512")
    return sets


@contextmanager
def forced(isa):
    before = cpu.isa()
    assert cpu.set_isa(isa) == isa
    try:
        yield
    finally:
        cpu.set_isa(before)


def test_auto_picks_the_widest_set_this_cpu_runs():
    _require_extension()
    assert cpu.best_isa() == _supported()[-1]
    with forced("baseline"):
        assert cpu.set_isa("auto") == cpu.best_isa() == cpu.isa()


def test_unknown_or_unsupported_sets_raise():
    _require_extension()
    with pytest.raises(ValueError, match="unknown instruction set 'sse9'"):
        cpu.set_isa("sse9")
    for isa in ORDER[len(_supported()):]:  # wider than this CPU: refused, not an illegal instruction later
        with pytest.raises(ValueError, match=f"cannot run {isa}"):
            cpu.set_isa(isa)
    assert cpu.isa() == cpu.best_isa()


@pytest.mark.parametrize("isa", [pytest.param(i, marks=[] if i == "baseline" else [pytest.mark.slow]) for i in ORDER])
def test_the_environment_forces_a_set_at_load(isa, tmp_path):
    _require_extension()
    code = "import torch; from pad_kernels import cpu; print(cpu.isa())"
    # cwd outside the tree: the installed package (with its compiled backend), not the sources, is imported
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path,
                          env={**os.environ, "PAD_CPU_ISA": isa})
    if isa in _supported():
        assert proc.returncode == 0 and proc.stdout.strip() == isa, proc.stderr
    else:
        assert proc.returncode != 0 and f"PAD_CPU_ISA: this CPU (or this build) cannot run {isa}" in proc.stderr


@pytest.mark.parametrize("isa", _supported())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("sampling", [False, True])
def test_verify_block_in_each_set_matches_the_reference(isa, dtype, sampling):
    _require_extension()
    from pad_kernels import verify_block_ref

    for seed, (B, H, K, V) in enumerate([(3, 896, 4, 32000), (1, 64, 10, 1271)]):
        args, kwargs = make_case(B, K, V, H, dtype, sampling, seed=1000 + seed)
        expected = verify_block_ref(*args, **kwargs)
        with forced(isa):
            got = run_backend("cpu", *args, **kwargs)
        assert_matches(got, expected, fp64_truth(*args, **kwargs), dtype)


@pytest.mark.parametrize("isa", _supported())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_in_each_set_matches_the_spec(isa, dtype):
    _require_extension()
    g = torch.Generator().manual_seed(7)
    B, Hq, Hkv, T, S, D = 2, 12, 2, 3, 70, 128
    q = torch.randn(B, T, Hq, D, generator=g).to(dtype).transpose(1, 2)
    k, v = (torch.randn(B, Hkv, S, D, generator=g).to(dtype) for _ in range(2))
    mask = torch.ones(B, 1, T, S, dtype=torch.bool).tril(S - T)
    mask[1, :, :, :20] = False  # left padding
    out = torch.full((B, T, Hq, D), float("nan"), dtype=dtype)
    with forced(isa):
        gqa_attention(q, k, v, mask, D**-0.5, out=out)
    exact = gqa_attention_ref(q.float(), k.float(), v.float(), mask, D**-0.5)
    half_ulp = {torch.float32: 0.0, torch.bfloat16: 2**-8}[dtype]
    assert ((out.float() - exact).abs() <= 1e-5 + half_ulp * exact.abs() * 2).all()
