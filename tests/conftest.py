import os

# The Triton interpreter must be chosen before any kernel module is imported.
os.environ.setdefault("TRITON_INTERPRET", "1")

if os.environ["TRITON_INTERPRET"] == "1":
    import triton_interpreter

    triton_interpreter.install()
