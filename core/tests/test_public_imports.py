"""Plugins and examples import only rlcore's public modules (``rlcore.runtime.PUBLIC_MODULES``):
every import of every Python file under ``plugins/`` and ``examples/``, at module level or inside a
function, is checked. ``rlcore.controller`` and the other internals may change without notice."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

from rlcore.runtime import PUBLIC_MODULES, is_public

REPO = Path(__file__).resolve().parents[2]


def rlcore_imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) of each ``rlcore`` import in ``path``; ``from rlcore.x import y`` counts as
    ``rlcore.x.y`` when that is a module, else as ``rlcore.x``."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names if alias.name.split(".")[0] == "rlcore"]
        elif isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").split(".")[0] == "rlcore":
            out.append((node.lineno, node.module))
    return out


def files() -> list[Path]:
    return sorted(p for top in ("plugins", "examples") for p in (REPO / top).rglob("*.py")
                  if ".venv" not in p.parts and "build" not in p.parts)


def test_the_check_sees_plugin_files_and_tells_public_from_internal():
    assert len(files()) > 50
    assert is_public("rlcore.runtime") and is_public("rlcore.config.structure") and is_public("rlcore.config")
    assert not is_public("rlcore.controller.workers") and not is_public("rlcore.configx")


@pytest.mark.parametrize("module", [m.rstrip(".") for m in PUBLIC_MODULES])
def test_every_public_module_exists_and_is_documented(module):
    assert importlib.import_module(module).__doc__, f"{module} has no docstring"


def test_plugins_and_examples_import_only_public_rlcore_modules():
    found = [f"{path.relative_to(REPO)}:{line}: {module}" for path in files()
             for line, module in rlcore_imports(path) if not is_public(module)]
    assert not found, ("imports of rlcore's internal modules (use rlcore.runtime or another module of "
                       "rlcore.runtime.PUBLIC_MODULES):\n" + "\n".join(found))
