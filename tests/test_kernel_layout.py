"""The kernel layout convention, checked on the source tree: every Triton kernel lives in a
``blockspec/kernels/_x_kernels.py`` file beside its launcher ``blockspec/kernels/x.py``, and
only those files import triton when they are imported. Kernel files are loaded per mode by
``triton_loader.load_kernels`` (compiled or interpreted), so a jitted function anywhere else
would be decorated once, in whichever mode the process happened to start in, and a module-level
``import triton`` anywhere else would make triton a hard dependency of the CPU paths."""
from __future__ import annotations

import ast
import functools
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "blockspec"
KERNELS = PACKAGE / "kernels"


def _is_kernel_file(path: Path) -> bool:
    return path.parent == KERNELS and path.name.startswith("_") and path.name.endswith(
        "_kernels.py")


@functools.cache
def _sources() -> tuple[tuple[Path, ast.Module], ...]:
    """Every package file parsed, once for the module's tests (they only read the trees)."""
    return tuple((p, ast.parse(p.read_text(encoding="utf-8"), str(p)))
                 for p in sorted(PACKAGE.rglob("*.py")))


def _imports_triton(node: ast.AST) -> bool:
    if isinstance(node, ast.Import):
        return any(a.name == "triton" or a.name.startswith("triton.") for a in node.names)
    if isinstance(node, ast.ImportFrom):
        mod = node.module or ""
        return node.level == 0 and (mod == "triton" or mod.startswith("triton."))
    return False


def _module_level(tree: ast.Module):
    """The nodes that run when the module is imported: everything outside function bodies
    (class bodies and top-level if/try blocks included)."""
    todo = list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        yield node
        todo.extend(ast.iter_child_nodes(node))


def _uses_jit(tree: ast.Module) -> list[int]:
    """Lines that reference ``triton.jit`` (as a decorator or a call) or import ``jit`` from
    triton."""
    lines = []
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and node.attr == "jit"
                and isinstance(node.value, ast.Name) and node.value.id == "triton"):
            lines.append(node.lineno)
        if _imports_triton(node) and isinstance(node, ast.ImportFrom) and any(
                a.name == "jit" for a in node.names):
            lines.append(node.lineno)
    return lines


def test_every_kernel_file_has_its_launcher():
    kernel_files = sorted(p for p in KERNELS.glob("_*_kernels.py"))
    assert kernel_files, "no kernel files found"
    missing = [p.name for p in kernel_files
               if not (KERNELS / f"{p.name[1:-len('_kernels.py')]}.py").is_file()]
    assert not missing, f"kernel files without a launcher of the same name: {missing}"


def test_kernel_files_sit_only_in_kernels():
    stray = [str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*_kernels.py")
             if p.parent != KERNELS]
    assert not stray, f"kernel files outside blockspec/kernels/: {stray}"


def test_jit_only_in_kernel_files():
    found = [f"{p.relative_to(PACKAGE)}:{line}" for p, tree in _sources()
             if not _is_kernel_file(p) for line in _uses_jit(tree)]
    assert not found, f"@triton.jit outside blockspec/kernels/_*_kernels.py: {found}"


def test_triton_imported_at_module_level_only_by_kernel_files():
    found = [f"{p.relative_to(PACKAGE)}:{node.lineno}" for p, tree in _sources()
             if not _is_kernel_file(p) for node in _module_level(tree)
             if _imports_triton(node)]
    assert not found, f"module-level triton imports outside the kernel files: {found}"


def test_kernel_files_are_loaded_not_imported():
    """A plain import would give a module decorated in one mode only; launchers go through
    ``load_kernels``."""
    names = {p.stem for p in KERNELS.glob("_*_kernels.py")}
    found = []
    for p, tree in _sources():
        for node in ast.walk(tree):
            mods = []
            if isinstance(node, ast.Import):
                mods = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                mods = [node.module or ""] + [a.name for a in node.names]
            if any(m.rsplit(".", 1)[-1] in names for m in mods):
                found.append(f"{p.relative_to(PACKAGE)}:{node.lineno}")
    assert not found, f"kernel files imported directly: {found}"
