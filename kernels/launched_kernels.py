"""Which Triton / Gluon kernels the product launches, read from the source (no import, no Triton): every
@triton.jit or @gluon.jit function under kernels/ that some module there launches with a grid, so that the
sm_90 compile check (tests/kernels/test_sm90_compile.py) can require a recorded case for each one."""

from __future__ import annotations

import ast
from pathlib import Path

KERNELS_DIR = Path(__file__).resolve().parent


def module_name(path: Path, root: Path = KERNELS_DIR) -> str:
    """The dotted module name of a source file under `root` (a package named like its directory)."""
    return ".".join(path.relative_to(root.parent).with_suffix("").parts)


def _is_kernel_jit(decorator: ast.expr) -> bool:
    target = decorator.func if isinstance(decorator, ast.Call) else decorator
    return ast.unparse(target) in ("triton.jit", "gluon.jit")


def _names(tree: ast.Module, module: str) -> dict[str, str]:
    """Local name -> dotted target ("module" or "module.attr") of this module's own and imported names."""
    names: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef):
            names[node.name] = f"{module}.{node.name}"
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.update({a.asname or a.name: f"{node.module}.{a.name}" for a in node.names})
        elif isinstance(node, ast.Import):
            names.update({a.asname: a.name for a in node.names if a.asname})
    return names


def launched_kernels(root: Path = KERNELS_DIR) -> set[str]:
    """"module:function" of every @triton.jit or @gluon.jit function under `root` that some module there
    launches as `name[grid](...)` or `module.name[grid](...)` (device functions that are only called are left
    out)."""
    defined: set[str] = set()
    launched: set[str] = set()
    for path in sorted(root.rglob("*.py")):
        module = module_name(path, root)
        tree = ast.parse(path.read_text(), str(path))
        names = _names(tree, module)
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef) and any(_is_kernel_jit(d) for d in node.decorator_list):
                defined.add(f"{module}.{node.name}")
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Subscript):
                callee = node.func.value
                if isinstance(callee, ast.Name):
                    launched.add(names.get(callee.id, ""))
                elif isinstance(callee, ast.Attribute) and isinstance(callee.value, ast.Name):
                    launched.add(f"{names.get(callee.value.id, '')}.{callee.attr}")
    return {":".join(k.rsplit(".", 1)) for k in defined & launched}
