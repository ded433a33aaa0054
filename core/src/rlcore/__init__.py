"""rlcore: reinforcement-learning post-training of LLMs, a small core with plugins.

Importing this package imports no torch; the heavy parts load on use.

    import rlcore
    config = rlcore.load_config("recipes/grpo_arith_tiny_cpu.yaml", overrides=["train.max_num_steps=5"])
    result = rlcore.run(config)
"""

from __future__ import annotations

from rlcore.config import ConfigError, RunConfig
from rlcore.loading.loader import build_config, load_config
from rlcore.plugins import PluginError, get_plugin_manager, hookimpl

__version__ = "0.1.0"
__all__ = ["ConfigError", "PluginError", "RunConfig", "build_config", "get_plugin_manager", "hookimpl", "load_config", "run"]


def run(config=None, **components):
    """Run GRPO (or any registered algorithm) from a :class:`RunConfig`.

    ``components`` may pass ready objects instead of registered names: ``backend``,
    ``generator``, ``environment``, ``algorithm``, ``dataset``, ``tokenizer``, ``loggers``.
    Returns the run's summary (dict).
    """
    from rlcore.controller.run import run as _run

    return _run(config, **components)
