import importlib.util
import os

# One thread per pytest-xdist worker: two workers on two cores, each with a thread pool the size of the machine,
# would contend for the cores (OpenMP threads spin while they wait). Set before torch is imported.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["OMP_NUM_THREADS"] = "1"

# The Triton interpreter must be chosen before any kernel module is imported.
os.environ.setdefault("TRITON_INTERPRET", "1")

if os.environ["TRITON_INTERPRET"] == "1":
    import triton_interpreter

    triton_interpreter.install()

# The vLLM plugin's tests need vLLM's CPU build, kept in its own environment (.ci/run makes it): where vLLM
# is not installed they are not collected (run them there with `pytest tests/vllm_plugin`).
collect_ignore = [] if importlib.util.find_spec("vllm") is not None else ["vllm_plugin"]
