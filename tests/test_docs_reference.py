"""The configuration reference page (docs/reference/configuration.md) against the schemas: it is
what the generator writes today, and it names every key ``rlcore config --defaults`` prints."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "reference" / "configuration.md"


def test_committed_page_matches_the_schemas():
    from rlcore.cli.docs_reference import render
    from rlcore.plugins import get_plugin_manager

    assert PAGE.read_text() == render(get_plugin_manager()), (
        f"{PAGE.relative_to(ROOT)} has drifted from the schemas: run `python -m rlcore.cli.docs_reference` (or `make docs`)")


def _leaves(tree: dict, prefix: str) -> list[str]:
    out = []
    for key, value in tree.items():
        path = f"{prefix}.{key}" if prefix else key
        out.extend(_leaves(value, path) if isinstance(value, dict) and value else [path])
    return out


def test_page_lists_every_key_config_defaults_prints():
    printed = json.loads(subprocess.run([sys.executable, "-m", "rlcore.cli", "config", "--defaults", "--json"],
                                        check=True, capture_output=True, text=True, timeout=120).stdout)
    keys = _leaves(printed["core"], "")
    for section in printed["sections"]:
        keys += _leaves(section["defaults"], section["path"])
    rows = re.findall(r"^\| `([^`]+)` \| ((?:[^|\\]|\\.)*) \|", PAGE.read_text(), flags=re.M)
    listed = {key for key, _ in rows}
    # A dict-valued default with no schema below it is one key: its entries are the user's.
    values = {key for key, kind in rows if kind.strip() != "`section`"}
    missing = [k for k in keys if k not in listed and not any(k.startswith(key + ".") for key in values)]
    assert len(keys) > 200 and not missing, missing
