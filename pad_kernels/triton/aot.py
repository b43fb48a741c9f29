"""Compile every Triton kernel ahead of time for sm_80 and sm_90: proof that they build for real GPUs
without one. Run with TRITON_INTERPRET unset:

    python -m pad_kernels.triton.aot [--arch 80 90]

Each kernel is compiled for every logits dtype and every constexpr branch it has; prints one line per
compilation with the resources the compiled kernel uses (registers per thread, local memory, i.e. spills,
and shared memory per program, read from the cubin by the ``cuobjdump`` Triton ships) and exits non-zero
on the first failure or spill.
"""
from __future__ import annotations

import argparse
import itertools
import multiprocessing
import os
import re
import subprocess
import sys
import tempfile
from concurrent.futures import ProcessPoolExecutor

DTYPES = {"fp32": "*fp32", "bf16": "*bf16", "fp16": "*fp16"}


def compile_kernel(kernel, signature: dict, constexprs: dict, arch: int):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig = {name: signature.get(name, "constexpr") for name in kernel.arg_names}
    target = GPUTarget("cuda", arch, 32)
    backend = triton.compiler.make_backend(target)
    options = backend.parse_options({"num_warps": 4})
    src = ASTSource(fn=kernel, signature=sig, constexprs=constexprs)
    return triton.compile(src, target=target, options=options.__dict__)


def resources(compiled) -> dict:
    """Registers per thread, local memory per thread (register spills) and shared memory per program
    (static plus what Triton asks for at launch) of a compiled kernel, as ``cuobjdump -res-usage`` reads
    them from its cubin."""
    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        text = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
    usage = dict(re.findall(r"(REG|LOCAL|SHARED):(\d+)", text))
    return {"registers": int(usage["REG"]), "local": int(usage["LOCAL"]),
            "shared": int(usage["SHARED"]) + int(compiled.metadata.shared), "warps": compiled.metadata.num_warps}


def jobs():
    """(name, kernel, signature, constexprs) for every specialization the launcher can ask for."""
    from ..types import RULES, SAMPLING_RULES
    from ..splits import split_plan
    from .verify_block import accept_kernel, draw_kernel, split_stats_kernel, launch_config

    # B = 1, K = 10 on an H100 (132 multiprocessors): the vocabulary split the most, the widest merge tile.
    slices, _ = split_plan(11, 151936, 132)
    cfg = launch_config(K=10, V=151936, H=1536, D=128, S=slices)
    block_v = 1024  # the launcher's chunk for slices of 1024 logits or more
    for dname, dptr in DTYPES.items():
        # A serving engine's call: logits read by row index (HAS_ROWS), with per-row rules (HAS_RR) or without.
        by_rows = ((False, False), (True, False), (True, True))
        for scaled, has_draft, ranked, (has_rows, has_rr) in itertools.product((False, True), (False, True),
                                                                                (False, True), by_rows):
            if (has_rows or has_rr) and (has_draft or (has_rr and not ranked)):  # no draft logits; rr: ranked
                continue
            sig = dict(logits_ptr=dptr, draft_logits_ptr=dptr, drafts_ptr="*i64", part_ptr="*fp32",
                       part_sum_ptr="*fp64", part_arg_ptr="*i64", logit_rows_ptr="*i64", row_rules_ptr="*fp32",
                       K="i32", V="i32", split_len="i32", S="i32", temperature="fp32")
            yield (f"split_stats_kernel[{dname}, SCALED={scaled}, HAS_DRAFT={has_draft}, RANKED={ranked}, "
                   f"HAS_ROWS={has_rows}, HAS_RR={has_rr}]", split_stats_kernel, sig,
                   dict(SCALED=scaled, HAS_DRAFT=has_draft, RANKED=ranked, HAS_ROWS=has_rows, HAS_RR=has_rr,
                        BLOCK_V=block_v))
        for has_nd, (has_rows, has_rr) in itertools.product((False, True), by_rows):
            sig = dict(logits_ptr=dptr, draft_probs_ptr="*fp32", exponentials_ptr="*fp32", num_accepted_ptr="*i64",
                       num_drafts_ptr="*i64", row_ms_ptr="*fp32", race_ptr="*fp32", race_arg_ptr="*i64",
                       done_ptr="*i32", next_token_ptr="*i64", logit_rows_ptr="*i64", row_rules_ptr="*fp32",
                       K="i32", V="i32", split_len="i32", S="i32", temperature="fp32")
            yield (f"draw_kernel[{dname}, HAS_ND={has_nd}, HAS_ROWS={has_rows}, HAS_RR={has_rr}]", draw_kernel, sig,
                   dict(HAS_ND=has_nd, BLOCK_V=block_v, SPC=16, HAS_ROWS=has_rows, HAS_RR=has_rr))
        for has_clf, sampling, rule, has_nd, has_draft, (has_rows, has_rr) in itertools.product(
                (False, True), (False, True), range(len(RULES)), (False, True), (False, True), by_rows):
            if sampling and RULES[rule] not in SAMPLING_RULES:
                continue
            # The draft's logits: always with kl, else only to report the divergence (one rule suffices: the
            # divergence's code is the same whatever the rule).
            if has_draft != (RULES[rule] == "kl") and not (has_draft and RULES[rule] == "exact"):
                continue
            # Read by row index (no draft logits there): the call's rule as threshold, or per-row rules (every
            # rule's test compiled in, RULE unread), each with draft lengths.
            wanted = "exact" if has_rr else "threshold"
            if (has_rows or has_rr) and (has_draft or not has_nd or RULES[rule] != wanted):
                continue
            sig = dict(logits_ptr=dptr, drafts_ptr="*i64", hidden_ptr=dptr, w1_ptr="*fp32", b1_ptr="*fp32",
                       w2_ptr="*fp32", b2_ptr="*fp32", clf_bias_ptr="*fp32", draft_probs_ptr="*fp32",
                       uniforms_ptr="*fp32",
                       exponentials_ptr="*fp32", part_ptr="*fp32", part_sum_ptr="*fp64", part_arg_ptr="*i64",
                       row_ms_ptr="*fp32",
                       done_ptr="*i32", entropy_ptr="*fp32",
                       top3_ptr="*fp32", argmax_ptr="*i64", token_prob_ptr="*fp32", pivot_prob_ptr="*fp32",
                       accepted_ptr="*i1", pivot_accepted_ptr="*i1", num_accepted_ptr="*i64", next_token_ptr="*i64",
                       divergence_ptr="*fp32", K="i32", V="i32", H="i32", D="i32", S="i32", sigma="fp32", floor="fp32",
                       temperature="fp32",
                       rule_a="fp32", rule_b="fp32", window="i32", num_drafts_ptr="*i64", logit_rows_ptr="*i64",
                       row_rules_ptr="*fp32")
            # A classifier bias where rows have their own draft lengths (as in decoding): both paths compiled.
            has_bias = has_clf and has_nd
            yield (f"accept_kernel[{dname}, HAS_CLF={has_clf}, HAS_BIAS={has_bias}, SAMPLING={sampling}, "
                   f"HAS_ND={has_nd}, RULE={RULES[rule]}, HAS_DRAFT={has_draft}, HAS_ROWS={has_rows}, HAS_RR={has_rr}]",
                   accept_kernel, sig, dict(HAS_CLF=has_clf, HAS_BIAS=has_bias, SAMPLING=sampling, RULE=rule,
                                             HAS_ND=has_nd, HAS_DRAFT=has_draft, HAS_ROWS=has_rows, HAS_RR=has_rr,
                                             **cfg))


def _compile_job(arch: int, index: int):
    """(name, cubin bytes, resources) of the index-th job of ``jobs()`` compiled for ``arch``."""
    name, kernel, sig, constexprs = list(jobs())[index]
    compiled = compile_kernel(kernel, sig, constexprs, arch)
    return name, len(compiled.asm.get("cubin", b"")), resources(compiled)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="ahead-of-time compile the Triton kernels")
    parser.add_argument("--arch", type=int, nargs="+", default=[80, 90])
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("unset TRITON_INTERPRET: the interpreter does not compile", file=sys.stderr)
        return 2
    # Compilation is CPU-bound and each kernel independent: one process per core, results in a fixed order.
    tasks = [(arch, i) for arch in args.arch for i in range(len(list(jobs())))]
    with ProcessPoolExecutor(max_workers=os.cpu_count(), mp_context=multiprocessing.get_context("spawn")) as pool:
        results = list(pool.map(_compile_job, *zip(*tasks)))
    count = 0
    for (arch, _), (name, size, r) in zip(tasks, results):
        if size == 0:
            print(f"sm_{arch} {name}: no cubin produced", file=sys.stderr)
            return 1
        print(f"sm_{arch} {name}: cubin {size} bytes, {r['registers']} registers, local {r['local']} bytes, "
              f"shared {r['shared']} bytes, {r['warps']} warps")
        if r["local"]:
            print(f"sm_{arch} {name}: spills registers to local memory ({r['local']} bytes)", file=sys.stderr)
            return 1
        count += 1
    print(f"{count} kernels compiled, none spills")
    return 0


if __name__ == "__main__":
    sys.exit(main())
