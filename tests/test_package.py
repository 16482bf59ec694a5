"""The package's own structure: no import cycles between its modules (module-level imports,
``TYPE_CHECKING`` blocks excluded), so each module can be read and changed on its own."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "lightning_onebit"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, modules: set[str]) -> set[str]:
    """The package modules ``path`` imports at module level."""
    found: set[str] = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            continue
        for sub in ast.walk(node):
            if isinstance(sub, ast.Import):
                names = [a.name for a in sub.names]
            elif isinstance(sub, ast.ImportFrom) and sub.module:
                names = [sub.module] + [f"{sub.module}.{a.name}" for a in sub.names]
            else:
                continue
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                continue  # imports inside functions run later, not at import time
            found.update(n for n in names if n in modules)
    return found


def test_no_import_cycles() -> None:
    paths = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {m: _imports(p, set(paths)) - {m} for m, p in paths.items()}
    # a package __init__ importing its submodules is not a cycle with them
    for m in graph:
        graph[m] = {d for d in graph[m] if not m.startswith(d + ".") or d not in paths}
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for d in sorted(graph[m]):
            if state.get(d) == 1:
                cycle = [*path[path.index(d) :], d] if d in path else [m, d]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if d not in state:
                visit(d, [*path, d])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert "lightning_onebit.optim._overlap" in graph  # (the walk saw the package)
