"""Build script (metadata lives in pyproject.toml): the optional compiled backends of pad_kernels.

- ``pad_kernels._cpu``: the C++ CPU backend, built whenever torch's C++ extension tools work here.
- ``pad_kernels._cuda``: the CUDA backend, with ``PAD_BUILD_CUDA=1`` (or ``auto``, the default, when
  torch has CUDA and nvcc exists). ``TORCH_CUDA_ARCH_LIST`` picks the GPUs, ``MAX_JOBS`` the parallelism.
- The CPU backend runs on any x86-64 CPU: its vocabulary and attention loops are compiled for AVX-512, AVX2
  and the x86-64 baseline, and the widest one the CPU runs is chosen at run time (``csrc/cpu/isa.h``;
  ``PAD_CPU_ISA`` or ``pad_kernels.cpu.set_isa`` forces one). ``PAD_CPU_ARCH`` (default: none) adds a
  ``-march``: ``native`` builds for this machine only (a wheel built so may crash on another CPU).

A backend that cannot be built is skipped with a warning; the pure-PyTorch and Triton paths still work.
Build with ``pip install --no-build-isolation -e .`` so that the build sees the installed torch.
"""
import os
import platform
import re
import subprocess
import sys
import warnings

from setuptools import setup

ROOT = os.path.dirname(os.path.abspath(__file__))
INCLUDE = [os.path.join(ROOT, "csrc", "include")]


def _nvcc_major(cuda_home: str) -> int | None:
    """The major CUDA version of ``cuda_home``'s nvcc ("release 13.0" -> 13), or None if it cannot be run."""
    try:
        out = subprocess.run([os.path.join(cuda_home, "bin", "nvcc"), "--version"], capture_output=True, text=True,
                             timeout=60).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    found = re.search(r"release (\d+)\.", out)
    return int(found.group(1)) if found else None


def extensions():
    try:
        import torch
        from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension
    except ImportError:
        warnings.warn("torch is not importable at build time: skipping the compiled backends "
                      "(install torch first and build with --no-build-isolation)")
        return [], {}
    # -fno-trapping-math lets GCC if-convert the float selects of the vocabulary loops (the results do not
    # change, unlike -ffast-math, which would break -inf/NaN handling); -fopenmp makes at::parallel_for
    # parallel (it is inline code in torch's headers).
    # -Wno-psabi: the 32-byte vectors of the baseline attention loops pass only between inline functions.
    cxx = ["-O3", "-fopenmp", "-fno-trapping-math", "-fno-math-errno", "-Wno-psabi"]
    arch = os.environ.get("PAD_CPU_ARCH", "none")
    if arch != "none":
        cxx.append(f"-march={arch}")
    if platform.machine().lower() in ("x86_64", "amd64"):
        cxx.append("-DPAD_MULTI_ISA=1")  # the AVX2 and AVX-512 variants beside the baseline
    exts = [CppExtension("pad_kernels._cpu", ["csrc/cpu/verify_block_cpu.cpp", "csrc/cpu/emulate_cuda.cpp",
                                                 "csrc/cpu/gqa_attention_cpu.cpp"], include_dirs=INCLUDE,
                         extra_compile_args={"cxx": cxx}, extra_link_args=["-fopenmp"])]
    want_cuda = os.environ.get("PAD_BUILD_CUDA", "auto").lower()
    has_cuda = torch.version.cuda is not None and CUDA_HOME is not None
    nvcc_major = _nvcc_major(CUDA_HOME) if has_cuda else None
    if has_cuda and nvcc_major != int(torch.version.cuda.split(".")[0]):
        # torch refuses to build any extension when nvcc's major version differs from its own CUDA's
        warnings.warn(f"nvcc in {CUDA_HOME} is CUDA {nvcc_major}, torch was built with CUDA {torch.version.cuda}: "
                      "skipping the CUDA backend (set CUDA_HOME to a matching toolkit to build it)")
        has_cuda = False
    if want_cuda == "1" or (want_cuda == "auto" and has_cuda):
        if not has_cuda:
            warnings.warn("PAD_BUILD_CUDA=1 but torch has no CUDA or nvcc is missing: skipping the CUDA backend")
        else:
            # CUDA 13 wheels of torch keep the toolkit headers under site-packages/nvidia/cu13/include.
            nvidia = [os.path.join(p, "nvidia", "cu13", "include") for p in sys.path]
            isystem = [arg for p in nvidia if os.path.isdir(p) for arg in ("-isystem", p)]
            exts.append(CUDAExtension(
                "pad_kernels._cuda", ["csrc/cuda/verify_block_cuda.cpp", "csrc/cuda/verify_block.cu"],
                include_dirs=INCLUDE,
                extra_compile_args={"cxx": ["-O3", *isystem], "nvcc": ["-O3", *isystem]},
            ))

    class OptionalBuildExtension(BuildExtension):
        """Torch's ninja build ignores ``optional=True``: catch a failing extension here instead."""

        def build_extension(self, ext):
            try:
                super().build_extension(ext)
            except Exception as e:  # noqa: BLE001 - any compiler failure must not break the install
                warnings.warn(f"could not build {ext.name}; that backend will be unavailable: {e}")

    return exts, {"build_ext": OptionalBuildExtension}


ext_modules, cmdclass = extensions()
setup(ext_modules=ext_modules, cmdclass=cmdclass)
