"""pad-decoding doctor prints the facts a bug report needs, and --check proves every backend here."""
from pad.cli import main
from pad_kernels import available_backends, selfcheck
from pad_kernels.verify_ref import verify_block_ref


def test_doctor_prints_versions_devices_backends_and_caches(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("PAD_CACHE", str(tmp_path))
    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    names = [line.split("  ")[0].strip() for line in out.splitlines()]
    for name in ("pad", "torch", "transformers", "triton", "cpu", "gpus", "verify_block on cpu",
                 "cpu backend instruction set", "native bf16", "cuda", "model cache", "weights source"):
        assert name in names, name
    backends = available_backends("cpu")
    assert f"{', '.join(backends)} (auto picks {backends[0]})" in out
    assert str(tmp_path) in out


def test_check_passes_here_and_names_every_backend(capsys):
    assert main(["doctor", "--check"]) == 0
    out = capsys.readouterr().out
    expected = [b for b in available_backends("cpu") if b not in ("torch", "triton")]  # triton: interpreter only
    cases = 2 * 2 * len(selfcheck.SHAPES)  # dtypes x greedy/sampling x shapes
    assert out.count("PASS") == cases * len(expected) and "FAIL" not in out
    assert f"{cases * len(expected)} passed, 0 failed" in out


def test_check_reports_a_wrong_backend(monkeypatch, capsys):
    """A backend that computes something else is reported, not crashed on, and fails the command."""
    def off_by_one(*args, backend=None, out=None, **kwargs):
        res = verify_block_ref(*args, **kwargs)
        res.next_token.add_(1)
        return res

    monkeypatch.setattr(selfcheck, "devices", lambda: ["cpu"])
    monkeypatch.setattr(selfcheck, "available_backends", lambda device: ["torch", "fake"])
    monkeypatch.setattr(selfcheck, "verify_block", off_by_one)
    assert main(["doctor", "--check"]) == 1
    out = capsys.readouterr().out
    assert out.count("FAIL  cpu     fake    ") == 2 * 2 * len(selfcheck.SHAPES) and "next_token" in out
