"""No module of ours imports another in a circle, not even for type hints: a circle hides
which of two modules is the lower one, and the folders' layers (import-linter in
pyproject.toml) only hold between folders, not inside one."""

from __future__ import annotations

import grimp

PACKAGES = ("dataplane_client", "dataplane_server", "policy_workers", "benchmarks")


def _circles(imports: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for other in imports.get(module, ()):
            if other not in index:
                visit(other)
                low[module] = min(low[module], low[other])
            elif other in on_stack:
                low[module] = min(low[module], index[other])
        if low[module] == index[module]:
            group = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                group.append(top)
                if top == module:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for module in sorted(imports):
        if module not in index:
            visit(module)
    return found


def test_the_circle_finder_finds_a_circle():
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _circles({"a": {"b"}, "b": set()}) == []


def test_no_module_imports_another_in_a_circle():
    graph = grimp.build_graph(*PACKAGES)
    imports = {
        m: {i for i in graph.find_modules_directly_imported_by(m) if i.split(".")[0] in PACKAGES}
        for m in graph.modules
    }
    assert _circles(imports) == []
