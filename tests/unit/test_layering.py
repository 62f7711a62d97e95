"""The import graph: no module of cuctxd.protos, cuctxd.daemon or cuctxd.client is part of an import cycle.

import-linter's contracts (pyproject.toml, run by ``lint-imports`` in .ci/run) say which layer may
import which; this test adds what they cannot say: that no cycle exists at all, through any import,
including those inside functions and under ``TYPE_CHECKING``.
"""

from __future__ import annotations

import grimp

PACKAGES = ("cuctxd.protos", "cuctxd.daemon", "cuctxd.client")


def import_cycles(graph: grimp.ImportGraph, modules: set[str]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []
    for root in sorted(modules):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.find_modules_directly_imported_by(root) & modules)))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            for target in edges:
                if target not in index:
                    index[target] = low[target] = len(index)
                    stack.append(target)
                    on_stack.add(target)
                    work.append((target, iter(sorted(graph.find_modules_directly_imported_by(target) & modules))))
                    break
                if target in on_stack:
                    low[node] = min(low[node], index[target])
            else:
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
                        cycles.append(sorted(component))
    return cycles


def test_the_cycle_finder_finds_a_cycle() -> None:
    graph = grimp.ImportGraph()
    for name in ("a", "a.x", "a.y", "a.z"):
        graph.add_module(name)
    graph.add_import(importer="a.x", imported="a.y")
    graph.add_import(importer="a.y", imported="a.x")
    graph.add_import(importer="a.z", imported="a.x")
    assert import_cycles(graph, {"a.x", "a.y", "a.z"}) == [["a.x", "a.y"]]


def test_no_import_cycles() -> None:
    graph = grimp.build_graph("cuctxd", cache_dir=None)
    modules = {module for module in graph.modules if module.startswith(PACKAGES)}
    assert len(modules) > 50
    assert import_cycles(graph, modules) == []
