"""No import cycles inside ``rlcore`` and no import against its layering: every import of every
module, at module level, inside a function or under ``if TYPE_CHECKING:``, is an edge; a cycle
among them fails the test, naming its modules, and so does an edge from a part to a part on its own
layer or above it (``LAYERS``, written down in ``docs/concepts.md``). Type-checking imports count:
they never run, but a circle among them is a circle in the design all the same (two modules that
can only be read together)."""

from __future__ import annotations

import ast
import re
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
    assert "rlcore.interfaces.training" in graph["rlcore.interfaces.generation"]  # imported for annotations only


def test_rlcore_has_no_import_cycles():
    found = cycles(import_graph())
    assert not found, "import cycles inside rlcore (each line one cycle's modules):\n" + "\n".join(
        " <-> ".join(c) for c in found)


# The parts of rlcore from the bottom up (docs/concepts.md, "Layers"): a module may import its own
# part and the parts of lower layers, never a part of its own layer or of a higher one. A part is a
# package (all its modules) or a top-level module.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("rlcore.errors", "rlcore.utils", "rlcore.hookspecs"),
    ("rlcore.config",),
    ("rlcore.interfaces",),
    ("rlcore.deadlines", "rlcore.plugins"),
    ("rlcore.loading",),
    ("rlcore.loggers", "rlcore.planning", "rlcore.data"),
    ("rlcore.algorithms",),
    ("rlcore.training",),
    ("rlcore.generation", "rlcore.reward_model"),
    ("rlcore.agents",),
    ("rlcore.controller",),
    ("rlcore.testing", "rlcore.builtin", "rlcore"),  # rlcore: the package's face (run, load_config, ...)
    ("rlcore.cli",),
    ("rlcore.runtime",),
)


def part_of(module: str) -> tuple[str, int] | None:
    """The part ``module`` belongs to and its layer (None: in no part)."""
    for layer, parts in enumerate(LAYERS):
        for part in parts:
            if module == part or (part != "rlcore" and module.startswith(part + ".")):
                return part, layer
    return None


def against_layering(graph: dict[str, set[str]]) -> list[str]:
    """Each import of ``graph`` into a part on the importer's layer or above it, as 'a -> b (why)'."""
    found = []
    for module, imports in sorted(graph.items()):
        here = part_of(module)
        for target in sorted(imports):
            there = part_of(target)
            if here is None or there is None or here[0] == there[0]:
                continue
            if there[1] >= here[1]:
                side = "the same layer as" if there[1] == here[1] else "a higher layer than"
                found.append(f"{module} -> {target} ({there[0]} is on {side} {here[0]})")
    return found


def test_the_layering_check_sees_imports_up_and_across():
    assert part_of("rlcore.controller.loop") == ("rlcore.controller", 10)
    assert part_of("rlcore") == ("rlcore", 11) and part_of("rlcore.configx") is None
    assert against_layering({"rlcore.config.schema": {"rlcore.controller.loop", "rlcore.errors"}}) == [
        "rlcore.config.schema -> rlcore.controller.loop (rlcore.controller is on a higher layer than rlcore.config)"]
    assert against_layering({"rlcore.data.rows": {"rlcore.loggers.jsonl", "rlcore.data.prompts"}}) == [
        "rlcore.data.rows -> rlcore.loggers.jsonl (rlcore.loggers is on the same layer as rlcore.data)"]


def test_every_module_is_in_a_part_of_the_layering():
    outside = sorted(m for m in import_graph() if part_of(m) is None)
    assert not outside, f"modules in no part of LAYERS (add their package to a layer): {outside}"


def test_rlcore_imports_follow_its_layering():
    found = against_layering(import_graph())
    assert not found, "imports against the layering of rlcore (LAYERS; docs/concepts.md):\n" + "\n".join(found)


def test_every_package_says_what_it_owns_and_may_import():
    for init in sorted(ROOT.rglob("__init__.py")):
        if init.parent == ROOT or "data" in init.relative_to(ROOT).parts[1:]:
            continue
        doc = ast.get_docstring(ast.parse(init.read_text()))
        assert doc, f"{init.relative_to(ROOT.parent)} has no docstring saying what the package owns"


def test_the_layers_written_in_the_concepts_page_are_these():
    page = (ROOT.parents[2] / "docs" / "concepts.md").read_text()
    section = page.split("## Layers", 1)[1].split("\n## ", 1)[0]
    rows = [line.split("|")[1:3] for line in section.splitlines() if re.match(r"\| \d+ \|", line)]
    written = tuple(tuple(f"rlcore.{p}" if p != "rlcore" else p for p in re.findall(r"`(\w+)`", parts)) for _, parts in rows)
    assert written == LAYERS
