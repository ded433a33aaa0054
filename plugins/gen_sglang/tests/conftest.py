"""The plugin registered in the process-wide plugin manager, whether or not its distribution is
installed (installed, its entry point has registered it already and this changes nothing)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def sglang_plugin_manager():
    import rlcore_sglang.plugin
    from rlcore.plugins import get_plugin_manager

    manager = get_plugin_manager()
    manager.register_module(rlcore_sglang.plugin)
    return manager

