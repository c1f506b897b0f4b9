"""The floors of the house, read from the imports (every ``import`` and ``from ... import`` in the source, at any
depth: a lazy import inside a function counts): ``blockdiag_ref`` imports nothing of the project,
``blockdiag_dist`` only ``blockdiag_ref``, ``verify`` never ``bench``; and no two modules import each other."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("blockdiag_ref", "blockdiag_dist", "verify", "bench", "examples")
MAY_IMPORT = {  # package -> the project's packages it may import
    "blockdiag_ref": set(),
    "blockdiag_dist": {"blockdiag_ref"},
    "verify": {"blockdiag_ref", "blockdiag_dist", "examples"},
}


def _modules() -> dict[str, Path]:
    mods = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            mods[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return mods


def _imports(name: str, path: Path, mods: dict[str, Path]) -> set[str]:
    """The project's modules ``name`` imports (``from pkg import sub`` names the submodule when it is one)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            subs = {f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in mods}
            found.update(subs or {base})
    return {m for m in found if m in mods and m != name}


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    mods = _modules()
    return {name: _imports(name, path, mods) for name, path in mods.items()}


def test_the_graph_is_read(graph):
    assert "blockdiag_ref" in graph["blockdiag_dist.plan"]  # from blockdiag_ref import DocLayout
    assert "verify.runner" in graph["verify.cli"]
    assert "blockdiag_dist.plan" in graph["blockdiag_dist.batch"]


def test_each_floor_imports_only_the_floors_below(graph):
    bad = sorted(
        f"{a} imports {b}" for a, deps in graph.items() for b in deps
        if (top := a.split(".")[0]) in MAY_IMPORT and b.split(".")[0] not in MAY_IMPORT[top] | {top}
    )
    assert not bad, bad


def test_no_two_modules_import_each_other(graph):
    mutual = sorted(f"{a} <-> {b}" for a, deps in graph.items() for b in deps if a < b and a in graph.get(b, ()))
    assert not mutual, mutual
