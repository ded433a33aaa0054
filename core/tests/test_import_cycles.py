"""No import cycles inside ``rlcore``: every import of every module, at module level, inside a
function or under ``if TYPE_CHECKING:``, is an edge; a cycle among them fails the test, naming its
modules. Type-checking imports count: they never run, but a circle among them is a circle in the
design all the same (two modules that can only be read together)."""

from __future__ import annotations

import ast
from pathlib import Path

import rlcore

ROOT = Path(rlcore.__file__).parent


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported(tree: ast.AST, package: str, modules: set[str]) -> set[str]:
    """The rlcore modules ``tree`` imports, when run or type-checked (``package``: its own, for relative imports)."""
    out: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            # ``from pkg import mod`` imports the submodule; ``from mod import name`` the module
            names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
        else:
            names = []
        for name in names:
            while name and name not in modules:  # ``import a.b.c`` of a non-module attribute: its module
                name = name.rpartition(".")[0]
            if name:
                out.add(name)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return out


def import_graph() -> dict[str, set[str]]:
    paths = {module_name(p): p for p in ROOT.rglob("*.py")}
    graph = {}
    for name, path in paths.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges = imported(ast.parse(path.read_text(), str(path)), package, set(paths))
        graph[name] = edges - {name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return found


def test_the_walk_sees_module_function_and_type_checking_imports():
    graph = import_graph()
    assert "rlcore.controller.loop" in graph["rlcore.controller.grpo_run"]  # module level
    assert "rlcore.controller.rollouts" in graph["rlcore.controller.loop"]
    # a cycle made of a function-level import is found
    assert cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]
    tree = ast.parse("def f():\n    from rlcore.controller import run\n")
    assert imported(tree, "rlcore.controller", set(graph)) == {"rlcore.controller.run"}
    tree = ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from rlcore.controller import run\n")
    assert imported(tree, "rlcore.controller", set(graph)) == {"rlcore.controller.run"}
    assert "rlcore.multimodal" in graph["rlcore.interfaces"]  # imported for annotations only


def test_rlcore_has_no_import_cycles():
    found = cycles(import_graph())
    assert not found, "import cycles inside rlcore (each line one cycle's modules):\n" + "\n".join(
        " <-> ".join(c) for c in found)
