"""Check the vLLM plugin's INTERNALS against a vLLM wheel's Python sources, without installing or importing it.

Each entry of ``pad.serving.vllm.VERSIONS[version]`` (the wheel's version, or the newest supported) names a
module, an attribute (``Class.method``, a function, a class) and what the plugin relies on (parameter names,
a dataclass's fields, or existence only); this reads the module's source out of the wheel and compares with
``ast`` (so a CUDA build's wheel is checked on a machine without a GPU). Prints one line per difference;
exit code 1 when any differs.

    pip download vllm==0.33.0 --no-deps -d /tmp/wheels
    python bench/vllm_internals.py /tmp/wheels/vllm-0.33.0-*.whl
"""
from __future__ import annotations

import ast
import sys
import zipfile

from pad.serving.vllm import SUPPORTED_VLLM, VERSIONS, shape_problem


def find(tree: ast.Module, attribute: str):
    """The def or class node that ``attribute`` (dotted) names in a module, or None."""
    body = tree.body
    node = None
    for part in attribute.split("."):
        node = next((n for n in body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                     and n.name == part), None)
        if node is None:
            # a module-level name bound otherwise (an assignment or import): present, shape unknown
            names = {t.id for n in body if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Name)}
            names |= {(a.asname or a.name).split(".")[0] for n in body if isinstance(n, (ast.Import, ast.ImportFrom))
                      for a in n.names}
            return "bound" if part in names else None
        body = node.body
    return node


def shape(node) -> tuple[str, ...]:
    """A function's parameter names, or a class's annotated fields (a dataclass's)."""
    if isinstance(node, ast.ClassDef):
        return tuple(n.target.id for n in node.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name))
    a = node.args
    return tuple(x.arg for x in [*a.posonlyargs, *a.args, *([a.vararg] if a.vararg else []), *a.kwonlyargs,
                                 *([a.kwarg] if a.kwarg else [])])


def wheel_version(z: zipfile.ZipFile) -> str | None:
    """The Version of the wheel's METADATA."""
    for name in z.namelist():
        if name.endswith(".dist-info/METADATA"):
            for line in z.read(name).decode().splitlines():
                if line.startswith("Version:"):
                    return line.split(":", 1)[1].strip()
    return None


def check(wheel: str) -> list[str]:
    """What differs between the wheel's sources and the internals the plugin expects of its version (or of
    the newest supported version, with a problem naming the unsupported one)."""
    problems = []
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        version = wheel_version(z)
        if version not in VERSIONS:
            problems.append(f"vLLM {version} is not a supported version ({', '.join(SUPPORTED_VLLM)})")
        for module, attribute, expected in VERSIONS.get(version, VERSIONS[SUPPORTED_VLLM[-1]]):
            path = module.replace(".", "/") + ".py"
            if path not in names:
                path = module.replace(".", "/") + "/__init__.py"
            if path not in names:
                problems.append(f"{module} is missing")
                continue
            node = find(ast.parse(z.read(path)), attribute)
            if node is None:
                problems.append(f"{module}.{attribute} is missing")
            elif expected is None or node == "bound":
                if node == "bound" and expected is not None:
                    problems.append(f"{module}.{attribute} is not a def or class here: its shape is unchecked")
            else:
                problem = shape_problem(f"{module}.{attribute}", shape(node), expected)
                if problem:
                    problems.append(problem)
    return problems


def main() -> None:
    if len(sys.argv) != 2:
        raise SystemExit(__doc__)
    problems = check(sys.argv[1])
    print(f"{sys.argv[1]}: {len(VERSIONS[SUPPORTED_VLLM[-1]])} internals, {len(problems)} differ")
    for p in problems:
        print(f"- {p}")
    raise SystemExit(1 if problems else 0)


if __name__ == "__main__":
    main()
