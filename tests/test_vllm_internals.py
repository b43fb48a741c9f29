"""bench/vllm_internals.py: the plugin's INTERNALS read out of a wheel's sources (a wheel made here)."""
import importlib.util
import zipfile
from pathlib import Path

from pad.serving.vllm import INTERNALS

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


def _wheel(path: Path, change=None) -> Path:
    """A wheel whose modules define every INTERNALS entry as expected; ``change``: (attribute, source) to
    define one of them otherwise."""
    modules: dict[str, str] = {}
    for module, attribute, expected in INTERNALS:
        src = change[1] if change and change[0] == attribute else _source(attribute, expected)
        modules[module] = modules.get(module, "") + src + "\n"
    with zipfile.ZipFile(path, "w") as z:
        for module, src in modules.items():
            z.writestr(module.replace(".", "/") + ".py", src)
    return path


def test_a_matching_wheel_has_no_problems(tmp_path):
    assert _tool().check(str(_wheel(tmp_path / "same.whl"))) == []


def test_each_kind_of_difference_is_named(tmp_path):
    tool = _tool()
    changed = _wheel(tmp_path / "a.whl",
                     ("rejection_sample", "def rejection_sample(draft_token_ids, extra=1):\n    pass\n"))
    (problem,) = tool.check(str(changed))
    assert "rejection_sample takes (draft_token_ids, extra)" in problem
    fields = _wheel(tmp_path / "b.whl", ("CachedRequestState", "class CachedRequestState:\n    sampling_params: int\n"))
    assert tool.check(str(fields)) == ["vllm.v1.worker.gpu_input_batch.CachedRequestState lacks output_token_ids"]
    missing = _wheel(tmp_path / "c.whl", ("GPUModelRunner", "OTHER = 1\n"))
    assert tool.check(str(missing)) == ["vllm.v1.worker.gpu_model_runner.GPUModelRunner is missing"]
