"""Checks of a run's settings that need no model, made before anything heavy starts.

``rlcore.run`` calls :func:`check_before_start` before it claims the run directory, imports
torch's distributed parts, loads a model or starts an engine; ``rlcore config`` calls it too, so a
recipe it prints is one ``rlcore run`` accepts. Each failure names the key and the fix: a logger
whose client is not installed (``logger.wandb.enabled`` without wandb would otherwise fail after
the model loaded and vLLM started), a registered name that no installed plugin provides, an
``env.reward_fn`` that does not import, a packing budget that cannot hold one sequence (in every
loop, GRPO's and the offline ones).
"""

from __future__ import annotations

import importlib.util
from typing import Any

from rlcore.config import ConfigError, RunConfig
from rlcore.plugins import PluginError, get_plugin_manager


def check_requirements(config: RunConfig, manager: Any) -> None:
    """Each enabled logger's ``requires`` (its registration's capability) must be importable."""
    for reg in manager.registry["logger"].values():
        section = config.section(reg.section)
        if section is None or not section.enabled:  # a logger's section has `enabled` (build_loggers reads it too)
            continue
        for module in reg.capabilities.get("requires", ()):
            if importlib.util.find_spec(module) is None:
                raise ConfigError(f"{reg.section}.enabled", f"is true but {module} is not installed: pip install {module} "
                                  f"(or set {reg.section}.enabled=false)")


def check_names(config: RunConfig, manager: Any, given: dict | None = None) -> None:
    """``env.name`` (unless ``env.reward_fn`` or a given environment replaces it) names an installed
    environment; ``env.reward_fn`` imports."""
    given = given or {}
    if given.get("environment") is not None or given.get("reward_fn") is not None:
        return
    if config.env.reward_fn:
        from rlcore.data.reward_fn import load_reward_fn

        load_reward_fn(config.env.reward_fn)
        return
    try:
        manager.get("environment", config.env.name)
    except PluginError as exc:
        raise ConfigError("env.name", str(exc)) from None


def check_packing(config: RunConfig) -> None:
    """Each packed micro-batch's token budget holds the longest sequence (every loop packs: GRPO's,
    SFT's and the preference pairs')."""
    policy = config.policy
    packing = policy.sequence_packing
    if not packing.enabled:
        return
    for key in ("train_mb_tokens", "logprob_mb_tokens"):
        budget = getattr(packing, key)
        if budget < policy.max_total_sequence_length:
            raise ConfigError(f"policy.sequence_packing.{key}", f"{budget} tokens cannot hold one sequence of "
                              f"policy.max_total_sequence_length={policy.max_total_sequence_length}; raise it to at least that")


def check_before_start(config: RunConfig, given: dict | None = None) -> None:
    """Every check above, for ``config`` run with ``given`` objects (``rlcore.run``'s keywords)."""
    manager = get_plugin_manager()
    check_packing(config)
    check_names(config, manager, given)
    if given is None or given.get("loggers") is None:
        check_requirements(config, manager)
