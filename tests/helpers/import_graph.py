"""Static import graph of a package, built with `ast` (nothing is imported), and the checks
`test_import_layering.py` runs on it: cycles, layer order, forbidden third-party imports.

Every import statement counts, at module level or deferred inside a function: a deferred
import hides a cycle from Python, not from the design. Left out: the parent packages a
submodule import runs first (a re-exporting `__init__` would otherwise put every module on
a cycle), and names a package's `__getattr__` imports lazily."""

from __future__ import annotations

import ast
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class ImportGraph:
    """`edges[m]`: the package's modules `m` imports; `external[m]`: top-level names of
    everything else it imports (`torch`, `ray`, ...)."""

    edges: dict[str, set[str]] = field(default_factory=dict)
    external: dict[str, set[str]] = field(default_factory=dict)


def module_names(root: Path, package: str) -> dict[str, Path]:
    """Dotted name -> file for every module under `root` (the package's directory)."""
    names: dict[str, Path] = {}
    for path in sorted(root.rglob("*.py")):
        parts = [package, *path.relative_to(root).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        names[".".join(parts)] = path
    return names


def _base(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    """The absolute module an ImportFrom names before its imported names."""
    if not node.level:
        return node.module or ""
    # `from . import x` in a package's __init__ is relative to the package itself.
    parts = module.split(".")
    anchor = parts if is_package else parts[:-1]
    anchor = anchor[: len(anchor) - (node.level - 1)]
    return ".".join([*anchor, node.module] if node.module else anchor)


def _targets(
    module: str, is_package: bool, node: ast.AST, known: Mapping[str, Path]
) -> Iterator[str]:
    """The absolute module names one import statement imports."""
    if isinstance(node, ast.Import):
        yield from (alias.name for alias in node.names)
    elif isinstance(node, ast.ImportFrom):
        base = _base(module, is_package, node)
        for alias in node.names:
            # `from pkg import sub` imports the submodule; any other name is read from `base`.
            sub = f"{base}.{alias.name}"
            yield sub if sub in known else base


def _resolve(name: str, known: Mapping[str, Path]) -> str | None:
    """The package module `name` is (or is inside); None if it is not the package's."""
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name or None


def build_graph(root: Path, package: str) -> ImportGraph:
    """The import graph of the package at `root` (its directory), named `package`."""
    known = module_names(root, package)
    graph = ImportGraph()
    for module, path in known.items():
        is_package = path.name == "__init__.py"
        edges = graph.edges.setdefault(module, set())
        external = graph.external.setdefault(module, set())
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            for target in _targets(module, is_package, node, known):
                if target.split(".")[0] != package:
                    external.add(target.split(".")[0])
                elif (resolved := _resolve(target, known)) and resolved != module:
                    edges.add(resolved)
    return graph


def find_cycle(edges: Mapping[str, set[str]]) -> list[str] | None:
    """One import cycle as a path `[a, b, ..., a]`, or None if the graph is acyclic."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                return [*stack[stack.index(nxt) :], nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(edges):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def lazy_packages(root: Path, package: str) -> set[str]:
    """Packages whose `__init__` defines `__getattr__`: the graph cannot see what a name
    imported from them loads."""
    found = set()
    for module, path in module_names(root, package).items():
        if path.name == "__init__.py":
            tree = ast.parse(path.read_text(), str(path))
            if any(isinstance(n, ast.FunctionDef) and n.name == "__getattr__" for n in tree.body):
                found.add(module)
    return found


def layer_of(module: str, layers: Mapping[str, int]) -> int | None:
    """The layer of the longest entry naming `module` or a package above it. A top-level
    package's entry covers its `__init__` only, so each new top-level module needs an entry."""
    name = module
    while True:
        if name in layers and (name == module or "." in name):
            return layers[name]
        if "." not in name:
            return None
        name = name.rpartition(".")[0]


def layer_violations(edges: Mapping[str, set[str]], layers: Mapping[str, int]) -> list[str]:
    """`importer (layer) -> imported (layer)` for each import of a higher layer, and
    `module: no layer` for each module the table does not cover."""
    problems: list[str] = []
    for module in sorted(edges):
        own = layer_of(module, layers)
        if own is None:
            problems.append(f"{module}: no layer")
            continue
        for target in sorted(edges[module]):
            theirs = layer_of(target, layers)
            if theirs is not None and theirs > own:
                problems.append(f"{module} ({own}) -> {target} ({theirs})")
    return problems
