"""Every Triton kernel compiles ahead of time for sm_80 and sm_90 (no GPU needed, interpreter off)."""
import os
import subprocess
import sys



def test_triton_kernels_compile_for_sm80_and_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-m", "pad_kernels.triton.aot", "--arch", "80", "90"],
                          capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "36 kernels compiled" in proc.stdout
    assert proc.stdout.count("sm_80 ") == proc.stdout.count("sm_90 ") == 18
