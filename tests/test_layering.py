"""Layering: the bottom layers never import the layers above them.

kernels/ (Triton kernels and their plain-torch references) and k3core/ (model, layers, cache) are what
services/ builds on; an import the other way round pulls gRPC, etcd and the engine into a kernel benchmark
or a model unit test and makes a cycle waiting to happen. Today kernels/ does import k3core/ (references
compose k3core.ops, benchmarks plan pool layouts), so that direction is allowed; nothing in either imports
services/, bench/, tests/ or the generated gRPC stubs (k3), and this test keeps it so. Imports inside
functions count too: a lazy import is still a dependency.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
UPPER_LAYERS = frozenset({"services", "bench", "tests", "k3"})
BOTTOM_LAYERS = ("kernels", "k3core")


def imported_packages(source: str) -> set[str]:
    """Top-level package of every absolute import in `source`, at any nesting depth."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module.split(".")[0])
    return found


def upward_imports(package: str) -> list[str]:
    """'path: package' for each module of `package` that imports one of the upper layers."""
    return [f"{path.relative_to(ROOT)}: {sorted(imported_packages(path.read_text()) & UPPER_LAYERS)}"
            for path in sorted((ROOT / package).rglob("*.py"))
            if imported_packages(path.read_text()) & UPPER_LAYERS]


def test_the_checker_sees_top_level_lazy_and_from_imports():
    source = ("import services.engine\nfrom k3.v1 import decode_pb2\n"
              "def f():\n    from bench.sandbox import x\n    import tests.support as t\n"
              "from . import sibling\nimport torch.nn\n")
    assert imported_packages(source) == {"services", "k3", "bench", "tests", "torch"}


@pytest.mark.parametrize("package", BOTTOM_LAYERS)
def test_bottom_layer_does_not_import_upper_layers(package):
    assert list((ROOT / package).rglob("*.py")), f"{package}/ has no modules: the walk checks nothing"
    assert upward_imports(package) == []
