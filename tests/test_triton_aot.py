"""Every Triton kernel compiles ahead of time for sm_80 and sm_90 (no GPU needed, interpreter off)."""
import os
import subprocess
import sys



def test_triton_kernels_compile_for_sm80_and_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-m", "pad_kernels.triton.aot", "--arch", "80", "90"],
                          capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # Per dtype: 2 position-stats kernels and 28 accept kernels (classifier or not, times greedy with 4 rules
    # and sampling with the 3 rules defined for it, times per-row draft lengths or not), for 3 dtypes and 2
    # architectures.
    assert "180 kernels compiled" in proc.stdout
    assert proc.stdout.count("sm_80 ") == proc.stdout.count("sm_90 ") == 90
    for rule in ("exact", "typical", "threshold", "fly"):
        assert proc.stdout.count(f"RULE={rule}]") == 2 * 3 * (8 if rule != "fly" else 4)
    assert proc.stdout.count("HAS_ND=True") == proc.stdout.count("HAS_ND=False") == 2 * 3 * 14
