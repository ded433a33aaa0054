"""The shape the loop keeps: the sync driver reads like the algorithm (short), and only the async
driver, which owns threads, asks which thread it runs on."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import rlcore
from rlcore.controller import loop

ROOT = Path(rlcore.__file__).parent
SYNC_DRIVER_MAX_LINES = 40


def test_the_sync_driver_is_at_most_forty_lines():
    lines = inspect.getsource(loop.run_sync).splitlines()
    assert 10 < len(lines) <= SYNC_DRIVER_MAX_LINES, f"run_sync has {len(lines)} lines"


def thread_identity_calls(path: Path) -> list[int]:
    tree = ast.parse(path.read_text())
    return [node.lineno for node in ast.walk(tree)
            if isinstance(node, ast.Attribute) and node.attr in ("current_thread", "get_ident", "main_thread")]


def test_only_the_async_driver_asks_which_thread_it_runs_on():
    found = {str(p.relative_to(ROOT)): lines for p in sorted(ROOT.rglob("*.py"))
             if (lines := thread_identity_calls(p)) and p.name != "async_driver.py"}
    assert not found, f"thread-identity checks outside controller/async_driver.py: {found}"


def test_the_check_sees_a_thread_identity_call(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("import threading\nif threading.current_thread() is threading.main_thread():\n    pass\n")
    assert thread_identity_calls(probe) == [2, 2]
