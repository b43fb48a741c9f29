"""A faster Triton interpreter for the tests, computing exactly what the plain one computes.

The interpreter patches ``triton.language`` for the interpreter on every call of a device function
(``tl.max``, ``tl.sum`` and ``tl.argmax`` are such functions, called in every chunk of a kernel's loop over
the vocabulary), scanning each language module with ``inspect.getmembers``. Inside a kernel launch those
calls find the modules patched already and change nothing, yet they were most of the interpreter's time
(``py-spy``): a backend test over 151936 logits took 51 s with them and 15 s without (2-core AVX2 EPYC;
``pytest tests/test_verify_backends.py -k "triton-greedy-torch.float32-B1-H64-K10-V151936" --durations=1``).
``install`` skips them while a launch holds the patches; the launch itself, and a device function whose
modules the launch has not patched yet, patch as before.
"""
from __future__ import annotations

import inspect


def install() -> bool:
    """Skip the interpreter's redundant patching; False (and nothing changed) if this Triton's interpreter
    is not built the way this expects, so a newer Triton runs the tests at the plain speed."""
    try:
        import triton.language as tl
        from triton.runtime import interpreter as it
    except ImportError:
        return False
    if not all(hasattr(it, name) for name in ("_patch_lang", "_LangPatchScope", "GridExecutor")):
        return False
    real_patch, real_launch = it._patch_lang, it.GridExecutor.__call__
    held: list[set[int]] = []  # per launch in progress: ids of the language modules patched so far

    def patch_lang(fn):
        langs = {id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core)}
        if held and langs <= held[-1]:
            return it._LangPatchScope()  # an empty scope: nothing to patch, nothing to restore
        scope = real_patch(fn)
        if held:
            held[-1] |= langs
        return scope

    def launch(self, *args, **kwargs):
        held.append(set())
        try:
            return real_launch(self, *args, **kwargs)
        finally:
            held.pop()

    it._patch_lang, it.GridExecutor.__call__ = patch_lang, launch
    return True
