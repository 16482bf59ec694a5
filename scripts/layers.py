"""The package's structure: module sizes, which package modules each imports, import cycles,
and underscore names imported across modules::

    python scripts/layers.py [--dot]

Imports are read from the source (``ast``): at module level and inside functions alike (a
function-level import that closes a cycle is a cycle deferred, not removed); ``TYPE_CHECKING``
blocks are left out (they never run). ``tests/project/test_package.py`` asserts on the same functions.
"""

from __future__ import annotations

import argparse
import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "lightning_onebit"
#: the one module other modules may take underscore names from (other libraries' private APIs)
COMPAT = "lightning_onebit._compat"
#: the compiled extension (a module, not a source file)
EXTENSION = "lightning_onebit._C"
#: lowest first: a module may import its own layer and the ones before it, never a later one
#: (``integration`` is every module no other layer names)
LAYERS = (
    ("base", ("lightning_onebit._compat", EXTENSION)),
    ("kernels", ("lightning_onebit.kernels",)),
    ("exchange", ("lightning_onebit.comm",)),
    ("optimizers", ("lightning_onebit.optim",)),
    ("integration", ()),
    ("tools", ("lightning_onebit.probe",)),
    ("package", ("lightning_onebit",)),
)


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def layer_of(module: str) -> int:
    """The index in ``LAYERS`` of ``module``'s layer."""
    for i, (_, prefixes) in enumerate(LAYERS):
        if any(
            module == p or (p != "lightning_onebit" and module.startswith(p + "."))
            for p in prefixes
        ):
            return i
    return next(i for i, (name, _) in enumerate(LAYERS) if name == "integration")


def _package_of(name: str, path: Path) -> str:
    return name if path.name == "__init__.py" else name.rpartition(".")[0]


def _absolute(node: ast.ImportFrom, name: str, path: Path) -> str:
    if not node.level:
        return node.module or ""
    base = _package_of(name, path).split(".")
    base = base[: len(base) - node.level + 1]
    return ".".join([*base, node.module] if node.module else base)


def _runtime_nodes(tree: ast.Module) -> list[ast.AST]:
    """Every node of the module except those under ``if TYPE_CHECKING:``."""
    out: list[ast.AST] = []
    todo: list[ast.AST] = list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            todo.extend(node.orelse)
            continue
        out.append(node)
        todo.extend(ast.iter_child_nodes(node))
    return out


def imports(name: str, path: Path, known: set[str]) -> dict[str, set[str]]:
    """``{imported package module: names taken from it}`` for the module ``name`` at ``path``."""
    found: dict[str, set[str]] = {}
    for node in _runtime_nodes(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name in known:
                    found.setdefault(a.name, set())
        elif isinstance(node, ast.ImportFrom):
            source = _absolute(node, name, path)
            for a in node.names:
                sub = f"{source}.{a.name}"
                if sub in known:  # ``from package import submodule``
                    found.setdefault(sub, set())
                elif source in known:
                    found.setdefault(source, set()).add(a.name)
    found.pop(name, None)
    return found


def graph() -> dict[str, dict[str, set[str]]]:
    mods = modules()
    return {m: imports(m, p, {*mods, EXTENSION}) for m, p in mods.items()}


def layer_violations(g: dict[str, dict[str, set[str]]]) -> list[str]:
    """``importer (layer) -> imported (layer)`` for every import of a later layer."""
    name = [n for n, _ in LAYERS]
    return [
        f"{m} ({name[layer_of(m)]}) -> {d} ({name[layer_of(d)]})"
        for m, deps in sorted(g.items())
        for d in sorted(deps)
        if layer_of(d) > layer_of(m)
    ]


def cycles(g: dict[str, dict[str, set[str]]]) -> list[list[str]]:
    """Import cycles (a package's ``__init__`` importing its own submodules is not one)."""
    edges = {
        m: sorted(d for d in deps if not (d.startswith(m + ".") or m.startswith(d + ".")))
        for m, deps in g.items()
    }
    found: list[list[str]] = []
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for d in edges[m]:
            if d not in edges:
                continue
            if state.get(d) == 1:
                found.append([*path[path.index(d) :], d])
            elif d not in state:
                visit(d, [*path, d])
        state[m] = 2

    for m in sorted(edges):
        if m not in state:
            visit(m, [m])
    return found


def private_imports(g: dict[str, dict[str, set[str]]]) -> list[str]:
    """``importer: module._name`` for every underscore name taken from another module (a
    package's ``__init__`` re-exporting from its own submodules included; ``_compat`` allowed)."""
    return [
        f"{m}: {d}.{n}"
        for m, deps in sorted(g.items())
        for d, names in sorted(deps.items())
        if d != COMPAT
        for n in sorted(names)
        if n.startswith("_") and not n.startswith("__")
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dot", action="store_true", help="print the graph in Graphviz dot")
    args = parser.parse_args()
    g, mods = graph(), modules()
    if args.dot:
        print("digraph lightning_onebit {")
        for m, deps in sorted(g.items()):
            for d in sorted(deps):
                print(
                    f'  "{m.removeprefix("lightning_onebit.")}" -> "{d.removeprefix("lightning_onebit.")}";'
                )
        print("}")
        return
    print("| module | layer | lines | imports (package modules) |\n|---|---|---:|---|")
    for m, p in mods.items():
        deps = ", ".join(d.removeprefix("lightning_onebit.") for d in sorted(g[m])) or "-"
        layer = LAYERS[layer_of(m)][0]
        print(f"| {m} | {layer} | {len(p.read_text().splitlines())} | {deps} |")
    print(f"\ncycles: {cycles(g) or 'none'}")
    print(f"underscore names across modules: {private_imports(g) or 'none'}")
    print(f"imports of a later layer: {layer_violations(g) or 'none'}")


if __name__ == "__main__":
    main()
