"""The package's floors, checked on the source: no import circles, no arrow to a floor above
(but the exceptions docs/architecture.md names), no import hidden in a function without saying
why, files under 500 lines, and no code or doc citing what the repository does not hold."""
from __future__ import annotations

import ast
import re
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PKG = ROOT / "blockspec"

# floor of each top-level module or package of blockspec (docs/architecture.md draws the same)
FLOORS = {
    0: ("configs", "cache", "kernels", "attention", "forward_metadata", "sampling", "simulated_text", "penalties", "grammar",
        "checkpoint", "tokenizer", "staged_dir", "progress", "args", "flags", "gsm8k_data", "demo_family",
        "parallel",
        "__init__"),
    1: ("layers", "quant"),
    2: ("models", "tiny_model"),
    3: ("runtime",),
    4: ("speculative",),
    5: ("engine",),
    6: ("server", "eval", "bench", "train"),
    7: ("cli", "__main__"),
}
FLOOR = {name: floor for floor, names in FLOORS.items() for name in names}
# (importer, imported) arrows that run upward on purpose, each explained in docs/architecture.md
UPWARD_OK = {
    ("blockspec.kernels.w4a16", "blockspec.quant.nvfp4"),   # the reference decodes with the format
    ("blockspec.kernels.nvfp4_dequant", "blockspec.quant.nvfp4"),   # so does this reference
    ("blockspec", "blockspec.engine"),                      # the lazy public API
}
MAX_LINES = 500
DATA_FILES = {"gsm8k_data/templates.py"}


def _modules() -> dict[str, Path]:
    out = {}
    for path in PKG.rglob("*.py"):
        rel = path.relative_to(ROOT).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _target(module: str, node: ast.ImportFrom | ast.Import) -> list[str]:
    """The blockspec modules an import statement loads (a package's name maps to its __init__)."""
    names = []
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        base = node.module or ""
        if node.level:
            pkg = module.split(".") if MODULES[module].name == "__init__.py" else module.split(".")[:-1]
            pkg = pkg[: len(pkg) - node.level + 1]
            base = ".".join(pkg + ([base] if base else []))
        names = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
    out = []
    for name in names:
        while name and name not in MODULES:
            name = name.rpartition(".")[0]
        if name.startswith("blockspec"):
            out.append(name)
    return out


def _imports() -> dict[str, list[tuple[str, int, str]]]:
    """module -> [(imported module, line, where)] with where in {"top", "function", "typing"}."""
    graph: dict[str, list[tuple[str, int, str]]] = defaultdict(list)
    for module, path in MODULES.items():
        def visit(node: ast.AST, where: str) -> None:
            for child in ast.iter_child_nodes(node):
                if isinstance(child, (ast.Import, ast.ImportFrom)):
                    graph[module] += [(t, child.lineno, where) for t in _target(module, child)
                                      if t != module]
                inner = where
                if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    inner = "function"
                elif isinstance(child, ast.If) and "TYPE_CHECKING" in ast.dump(child.test):
                    inner = "typing"
                visit(child, inner)
        visit(ast.parse(path.read_text()), "top")
    return graph


def _floor(module: str) -> int:
    parts = module.split(".")
    return FLOOR["__init__" if len(parts) == 1 else parts[1]]


def test_every_module_has_a_floor():
    missing = sorted({m.split(".")[1] for m in MODULES if "." in m} - set(FLOOR))
    assert not missing, f"add these to FLOORS (and docs/architecture.md): {missing}"


def test_no_import_circle():
    """Function-level imports count: a circle hidden in a function is one. Annotation-only
    imports (``TYPE_CHECKING``) never run, so two modules may name each other's types; they
    still count against the floors."""
    graph = {m: {t for t, _, where in edges if where != "typing"} for m, edges in _imports().items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles = []

    def strong(v: str) -> None:                 # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                circles.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            strong(v)
    assert not circles, f"import circles: {circles}"


def test_no_arrow_to_a_floor_above():
    up = [f"{m} (floor {_floor(m)}) line {line} -> {t} (floor {_floor(t)})"
          for m, edges in _imports().items() for t, line, _ in edges
          if _floor(t) > _floor(m) and (m, t) not in UPWARD_OK]
    assert not up, "imports that run upward:\n" + "\n".join(up)


def test_function_level_imports_say_why():
    """An import inside a function is there for start-up time or an optional dependency, and a
    ``# lazy: ...`` comment between the ``def`` and the import says so."""
    silent = []
    for module, path in MODULES.items():
        lines = path.read_text().splitlines()
        for node in ast.walk(ast.parse("\n".join(lines))):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for child in ast.walk(node):
                if isinstance(child, (ast.Import, ast.ImportFrom)):
                    span = lines[node.lineno - 1: child.end_lineno]
                    if not any("# lazy" in line for line in span):
                        silent.append(f"{path.relative_to(ROOT)}:{child.lineno}")
    assert not silent, "function-level imports without a '# lazy: why' comment: " + ", ".join(silent)


def test_files_stay_small():
    big = [f"{p.relative_to(PKG)} ({n} lines)" for p in PKG.rglob("*.py")
           if str(p.relative_to(PKG)) not in DATA_FILES
           and (n := len(p.read_text().splitlines())) > MAX_LINES]
    assert not big, f"files over {MAX_LINES} lines: {big}"


def test_no_citation_of_what_the_repository_lacks():
    """Code, tests and docs state facts; they do not point at work logs or outside documents
    (dated history lives in docs/logs/)."""
    words = ["sess" + "ion", "issue " + "#", r"dflash\.md " + "§", r"dspark\.md " + "§",
             r"\.\./shared", "anchors" + r"\.md", "gpu_stack" + r"\.md", "nemotron_nvfp4" + r"\.md"]
    pattern = re.compile("|".join(words), re.IGNORECASE)
    logs = ROOT / "docs" / "logs"
    hits = []
    for folder in (PKG, ROOT / "tests", ROOT / "docs", ROOT / "scripts"):
        for path in folder.rglob("*"):
            if path.suffix not in (".py", ".md", ".sh") or logs in path.parents:
                continue
            for i, line in enumerate(path.read_text().splitlines(), 1):
                if pattern.search(line):
                    hits.append(f"{path.relative_to(ROOT)}:{i}: {line.strip()[:80]}")
    for i, line in enumerate((ROOT / "README.md").read_text().splitlines(), 1):
        if pattern.search(line):
            hits.append(f"README.md:{i}: {line.strip()[:80]}")
    assert not hits, "\n".join(hits)
