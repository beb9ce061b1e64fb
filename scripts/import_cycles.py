"""Lists the import circles among the shipped modules (grimp's graph, imports inside functions included).

Run from the repository root: ``python scripts/import_cycles.py``; exit code 1 if there is one.
"""

from __future__ import annotations

import sys

import grimp

PACKAGES = ("rdzv_core", "rdzv_backends", "rdzv_agent", "rdzv_admin")


def cycles(graph: grimp.ImportGraph) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0

    def visit(start: str) -> None:
        nonlocal counter
        work = [(start, iter(sorted(graph.find_modules_directly_imported_by(start))))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.find_modules_directly_imported_by(child)))))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
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
                        found.append(sorted(component))

    for module in sorted(graph.modules):
        if module not in index:
            visit(module)
    return found


def main() -> int:
    graph = grimp.build_graph(*PACKAGES, include_external_packages=False)
    found = cycles(graph)
    for component in found:
        print("circle:", " <-> ".join(component))
        for module in component:
            inside = sorted(m for m in graph.find_modules_directly_imported_by(module) if m in component)
            print(f"    {module} -> {', '.join(inside)}")
    print(f"{len(found)} import circle(s) among {len(graph.modules)} modules")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
