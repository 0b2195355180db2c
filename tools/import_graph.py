"""The module graph of hvps, derived from the code, and the two rules it must keep.

Every ``import`` counts, including those inside functions: an import moved into a function
hides a cycle from Python's loader but not from the reader. The rules:

- no cycles between modules;
- no module imports one from a layer above its own (``LAYERS``, lowest first).

``python tools/import_graph.py`` prints the violations (exit status 1 when there are any);
``--edges`` prints the whole graph. ``tests/test_layers.py`` runs the same check.
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path
from typing import Iterable

ROOT = Path(__file__).resolve().parent.parent

#: lowest first; a module belongs to the longest prefix that names it
LAYERS: tuple[tuple[str, ...], ...] = (
    ("hvps.version", "hvps.core"),        # foundations: errors, settings, dtypes, scaling, views
    ("hvps.metrics",),                    # instruments, exporter, NVML, energy
    ("hvps.control",),                    # agreement: control plane, negotiation, response cache
    ("hvps.dataplane",),                  # bytes: executors, buffers, ring, Adasum, backends
    ("hvps.runtime",),                    # init/shutdown, topology, engine, process sets
    ("hvps.api",),                        # the public collectives on numpy
    ("hvps.compression",),
    ("hvps.checkpoint",),
    ("hvps.store",),
    ("hvps.elastic",),                    # hvd.elastic's states, retry loop and host-update notices
    ("hvps.runner",),                     # hvpsrun
    ("hvps.doctor",),
    ("hvps.cli",),
    ("hvps",),                            # the facade
    ("hvps.adapters", "hvps.adapters.common"),
    ("hvps.adapters.torch", "hvps.adapters.tensorflow"),
    ("hvps.adapters.tensorflow.keras",),
)


def modules(root: Path = ROOT) -> dict[str, Path]:
    """Dotted name -> file, for every module under hvps/ (hvps/adapters/ included)."""
    found = {}
    for path in sorted((root / "hvps").rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def _targets(module: str, path: Path, node: ast.AST, known: dict) -> Iterable[str]:
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    else:
        base = node.module or ""
        if node.level:
            parts = package.split(".")
            parts = parts[:len(parts) - node.level + 1]
            base = ".".join(parts + ([node.module] if node.module else []))
        names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
    for name in names:
        while name and name not in known:
            name = name.rpartition(".")[0]
        if name and name != module:
            yield name


def graph(root: Path = ROOT) -> dict[str, set[str]]:
    """Module -> the hvps modules it imports (anywhere in its code)."""
    known = modules(root)
    edges = {}
    for module, path in known.items():
        tree = ast.parse(path.read_text(), str(path))
        edges[module] = {target for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))
                         for target in _targets(module, path, node, known)}
    return edges


def layer_of(module: str) -> int:
    best, level = -1, None
    for index, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best:
                best, level = len(prefix), index
    if level is None:
        raise ValueError(f"{module} is in no layer of tools/import_graph.py's LAYERS")
    return level


def _is_entry_point(module: str) -> bool:
    """``python -m`` entry points (``__main__``) sit above everything; nothing imports them."""
    return module.endswith(".__main__")


def upward_imports(edges: dict[str, set[str]]) -> list[str]:
    return [f"{src} (layer {layer_of(src)}) imports {dst} (layer {layer_of(dst)})"
            for src in sorted(edges) if not _is_entry_point(src)
            for dst in sorted(edges[src]) if layer_of(dst) > layer_of(src)]


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(edges.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    sys.setrecursionlimit(max(10000, sys.getrecursionlimit()))
    for node in sorted(edges):
        if node not in index:
            visit(node)
    return found


def violations(root: Path = ROOT) -> list[str]:
    edges = graph(root)
    return ([f"cycle: {' <-> '.join(component)}" for component in cycles(edges)]
            + [f"upward: {line}" for line in upward_imports(edges)])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--edges", action="store_true", help="print every module with what it imports")
    args = parser.parse_args(argv)
    if args.edges:
        for src, dsts in sorted(graph().items()):
            print(f"{src} -> {' '.join(sorted(dsts))}")
    found = violations()
    for line in found:
        print(line)
    print(f"{len(found)} violation(s)")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
