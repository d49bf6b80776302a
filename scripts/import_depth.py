"""The import depth of a package: the longest chain of imports between its own modules.

    python scripts/import_depth.py [ROOT] [PACKAGE]   (default: . migd.daemon)

Reads the import statements (``ast``; nothing is imported or run), counting every
``import``/``from ... import`` of a module inside PACKAGE, lazy imports in functions
included, ``if TYPE_CHECKING:`` blocks excluded (they are not run). Prints the number
of modules, the depth (the modules on the longest chain: a module importing nothing of
the package has depth 1) and that chain; a cycle is reported and ends the chain.
"""

from __future__ import annotations

import ast
import sys
from functools import cache
from pathlib import Path


def _type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST) -> set[str]:
    found: set[str] = set()
    stack: list[ast.AST] = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and _type_checking(node):
            stack.extend(node.orelse)
            continue
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        stack.extend(ast.iter_child_nodes(node))
    return found


def graph(root: Path, package: str) -> dict[str, set[str]]:
    """``{module: modules of the package it imports}``."""
    base = root / package.replace(".", "/")
    modules: dict[str, Path] = {}
    for path in sorted(base.rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    edges: dict[str, set[str]] = {}
    for name, path in modules.items():
        targets = set()
        for imported in _imports(ast.parse(path.read_text(), str(path))):
            # "from a.b import c" names a.b.c: a module when it is one, else a.b.
            target = imported
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target not in (name, package):
                targets.add(target)
        edges[name] = targets
    return edges


def longest_chain(edges: dict[str, set[str]]) -> list[str]:
    on_path: set[str] = set()

    @cache
    def chain(module: str) -> tuple[str, ...]:
        on_path.add(module)
        best: tuple[str, ...] = ()
        for target in sorted(edges[module]):
            if target in on_path:
                found: tuple[str, ...] = (f"{target} (cycle)",)
            else:
                found = chain(target)
            if len(found) > len(best):
                best = found
        on_path.discard(module)
        return (module, *best)

    return list(max((chain(m) for m in sorted(edges)), key=len, default=()))


def main(argv: list[str]) -> int:
    root = Path(argv[1]) if len(argv) > 1 else Path()
    package = argv[2] if len(argv) > 2 else "migd.daemon"
    edges = graph(root, package)
    path = longest_chain(edges)
    print(f"{package}: {len(edges)} modules, import depth {len(path)}")
    for module in path:
        print(f"  {module}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
