"""The module import graph of gpuledger's packages, and its cycles: ``python -m gpuledger.dev.imports``.

Input: the source of ``gpuledger``, ``producers``, ``streams``, ``schemas`` and ``sinks``
under the repository root (read, never imported). Output: one edge per import between
two of their modules — module-level *and* function-local imports, since a local import
only hides a cycle until the function runs; imports under ``if TYPE_CHECKING:`` are left
out (they never run). The command prints every cycle as a path (``a -> b -> a``) and
exits 1 when there is one, 0 otherwise.
Rules: ``import a.b.c`` and ``from a.b import c`` point at the deepest module they name
(``a.b.c`` when it is a module, else ``a.b``); a package is its ``__init__``; importing a
submodule is not counted as importing its parent packages (Python runs their
``__init__`` first, but a package that imports its own submodules would otherwise be a
cycle with each of them).
Limits: ``importlib.import_module`` with a computed name is invisible.
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path

PACKAGES = ("gpuledger", "producers", "streams", "schemas", "sinks")
REPO_ROOT = Path(__file__).resolve().parents[2]

Graph = dict[str, set[str]]


def modules(root: Path = REPO_ROOT, packages: Iterable[str] = PACKAGES) -> dict[str, Path]:
    """Module name -> source file, for every ``.py`` file of ``packages`` under ``root``."""
    out: dict[str, Path] = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            out[name] = path
    return out


def _type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement, at any depth, except those under ``if TYPE_CHECKING:``."""
    stack: list[ast.AST] = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
            continue
        if isinstance(node, ast.If) and _type_checking(node.test):
            stack.extend(node.orelse)
            continue
        stack.extend(ast.iter_child_nodes(node))


def _deepest(name: str, known: dict[str, Path]) -> str | None:
    parts = name.split(".")
    for n in range(len(parts), 0, -1):
        candidate = ".".join(parts[:n])
        if candidate in known:
            return candidate
    return None


def _targets(node: ast.Import | ast.ImportFrom, module: str, is_package: bool, known: dict[str, Path]) -> Iterator[str]:
    if isinstance(node, ast.Import):
        for alias in node.names:
            target = _deepest(alias.name, known)
            if target:
                yield target
        return
    if node.level:
        base = module.split(".") if is_package else module.split(".")[:-1]
        base = base[: len(base) - (node.level - 1)]
        source = ".".join(base + ([node.module] if node.module else []))
    else:
        source = node.module or ""
    for alias in node.names:
        # ``from a.b import c``: the module a.b.c when there is one, else a.b (c is a name in it).
        target = _deepest(source if alias.name == "*" else f"{source}.{alias.name}", known)
        if target:
            yield target


def import_graph(root: Path = REPO_ROOT, packages: Iterable[str] = PACKAGES) -> Graph:
    """Module -> the modules of ``packages`` it imports (module-level and function-local)."""
    known = modules(root, packages)
    graph: Graph = {name: set() for name in known}
    for name, path in known.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        for node in _imports(tree):
            for target in _targets(node, name, path.name == "__init__.py", known):
                if target != name:
                    graph[name].add(target)
    return graph


def cycles(graph: Graph) -> list[list[str]]:
    """One cycle (a path that returns to its start) per strongly connected component of more than one module."""
    return [_cycle_path(graph, members) for members in tangles(graph)]


def tangles(graph: Graph) -> list[list[str]]:
    """The strongly connected components of more than one module: each module reaches every other one."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    components: list[list[str]] = []
    counter = 0

    for start in sorted(graph):
        if start in index:
            continue
        # Tarjan's algorithm, iteratively (the graph is deep enough to worry about recursion).
        work: list[tuple[str, Iterator[str]]] = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    components.append(sorted(component))
    return sorted(components)


def _cycle_path(graph: Graph, members: list[str]) -> list[str]:
    """The shortest path from the component's first module back to itself, inside the component."""
    inside = set(members)
    start = members[0]
    previous: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for child in sorted(graph[node] & inside):
                if child == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(previous[path[-1]])
                    return [start, *reversed(path[:-1]), start]
                if child not in previous:
                    previous[child] = node
                    following.append(child)
        frontier = following
    return [*members, members[0]]


def importers(graph: Graph, target: str) -> dict[str, set[str]]:
    """Module -> the modules of ``target`` (a module or package name) it imports."""
    hit = {name for name in graph if name == target or name.startswith(target + ".")}
    return {name: deps & hit for name, deps in graph.items() if deps & hit}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gpuledger.dev.imports", description=__doc__.split("\n", 1)[0])
    parser.add_argument("--root", type=Path, default=REPO_ROOT, help="Repository root (default: this checkout).")
    parser.add_argument("--edges", action="store_true", help="Print every import edge too.")
    args = parser.parse_args(argv)
    graph = import_graph(args.root)
    if args.edges:
        for name in sorted(graph):
            for dep in sorted(graph[name]):
                print(f"{name} -> {dep}")
    found = tangles(graph)
    edges = sum(len(v) for v in graph.values())
    if not found:
        print(f"{len(graph)} modules, {edges} imports (function-local ones included): no cycle")
        return 0
    print(f"{len(graph)} modules, {edges} imports (function-local ones included): {len(found)} import cycle(s)", file=sys.stderr)
    for members in found:
        print(f"  {len(members)} modules import each other: {', '.join(members)}", file=sys.stderr)
        print("    e.g. " + " -> ".join(_cycle_path(graph, members)), file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
