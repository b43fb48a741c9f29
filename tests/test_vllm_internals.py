"""bench/vllm_internals.py: the plugin's INTERNALS read out of a wheel's sources (a wheel made here)."""
import importlib.util
import zipfile
from pathlib import Path

import pytest

from pad.serving.vllm import VERSIONS

BENCH = Path(__file__).resolve().parents[1] / "bench"


def _tool():
    spec = importlib.util.spec_from_file_location("vllm_internals", BENCH / "vllm_internals.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _source(attribute: str, expected) -> str:
    """Python source defining ``attribute`` (dotted) with the shape INTERNALS expects."""
    *outer, name = attribute.split(".")
    if expected is None:
        body = f"class {name}:\n    pass\n"
    elif isinstance(expected, frozenset):  # fields among others
        body = f"class {name}:\n    other: int\n" + "".join(f"    {f}: int\n" for f in sorted(expected))
    elif name[0].isupper():  # a dataclass: exactly these fields, annotated, in order
        body = f"class {name}:\n" + "".join(f"    {f}: int\n" for f in expected)
    else:
        body = f"def {name}({', '.join(expected)}):\n    pass\n"
    for cls in reversed(outer):
        body = f"class {cls}:\n" + "".join(f"    {line}\n" for line in body.splitlines())
    return body


def _wheel(path: Path, change=None, version="0.32.0", written_as=None) -> Path:
    """A wheel of ``version`` whose modules define every internal of ``written_as`` (default: the same version)
    as expected; ``change``: (attribute, source) to define one of them otherwise."""
    modules: dict[str, str] = {}
    for module, attribute, expected in VERSIONS[written_as or version]:
        src = change[1] if change and change[0] == attribute else _source(attribute, expected)
        modules[module] = modules.get(module, "") + src + "\n"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"vllm-{version}.dist-info/METADATA", f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n")
        for module, src in modules.items():
            z.writestr(module.replace(".", "/") + ".py", src)
    return path


@pytest.mark.parametrize("version", list(VERSIONS))
def test_a_matching_wheel_has_no_problems(tmp_path, version):
    assert _tool().check(str(_wheel(tmp_path / "same.whl", version=version))) == []


def test_each_version_is_checked_against_its_own_internals(tmp_path):
    """0.33.0's rejection_sample takes native FLy's arguments, 0.32.0's does not: each is wrong for the other,
    and a version not supported is named (and checked against the newest's internals)."""
    tool = _tool()
    for version, other in [("0.32.0", "0.33.0"), ("0.33.0", "0.32.0")]:
        (problem,) = tool.check(str(_wheel(tmp_path / f"{version}.whl", version=version, written_as=other)))
        assert "rejection_sample takes" in problem, problem
    unknown = tool.check(str(_wheel(tmp_path / "new.whl", version="0.34.0", written_as="0.33.0")))
    assert unknown == ["vLLM 0.34.0 is not a supported version (0.32.0, 0.33.0)"]


def test_each_kind_of_difference_is_named(tmp_path):
    tool = _tool()
    changed = _wheel(tmp_path / "a.whl",
                     ("rejection_sample", "def rejection_sample(draft_token_ids, extra=1):\n    pass\n"))
    (problem,) = tool.check(str(changed))
    assert "rejection_sample takes (draft_token_ids, extra)" in problem
    fields = _wheel(tmp_path / "b.whl", ("CachedRequestState", "class CachedRequestState:\n    sampling_params: int\n"))
    assert tool.check(str(fields)) == ["vllm.v1.worker.gpu_input_batch.CachedRequestState lacks output_token_ids"]
    missing = _wheel(tmp_path / "c.whl", ("VLLMValidationError", "OTHER = 1\n"))
    assert tool.check(str(missing)) == ["vllm.exceptions.VLLMValidationError is missing"]
