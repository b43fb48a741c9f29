import importlib.util
import os

# The Triton interpreter must be chosen before any kernel module is imported.
os.environ.setdefault("TRITON_INTERPRET", "1")

if os.environ["TRITON_INTERPRET"] == "1":
    import triton_interpreter

    triton_interpreter.install()

# The vLLM plugin's tests need vLLM's CPU build, kept in its own environment (.ci/run makes it): where vLLM
# is not installed they are not collected (run them there with `pytest tests/vllm_plugin`).
collect_ignore = [] if importlib.util.find_spec("vllm") is not None else ["vllm_plugin"]
