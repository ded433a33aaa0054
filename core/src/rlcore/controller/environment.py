"""The environment of a run, the one that scores its rollouts: the one passed to ``rlcore.run``, else
``env.reward_fn``'s function, else ``env.name``'s plugin; every call bounded by ``cluster.timeout_s``
(:class:`rlcore.deadlines.TimedEnvironment`)."""

from __future__ import annotations

from rlcore.config import RunConfig
from rlcore.deadlines import TimedEnvironment


def build_environment(config: RunConfig, manager, given: dict) -> tuple[TimedEnvironment, bool]:
    """The environment (passed, else ``env.reward_fn``'s function, else ``env.name``'s plugin), every
    call bounded by ``cluster.timeout_s``; and whether the plugin registered it as multi-turn."""
    environment, name, multi_turn = given.get("environment"), None, False
    if environment is None and config.env.reward_fn:  # a plain function scores single-turn rollouts
        from rlcore.data.reward_fn import FunctionEnvironment, load_reward_fn

        environment = FunctionEnvironment(load_reward_fn(config.env.reward_fn), config.env.reward_fn)
        name = config.env.reward_fn
    if environment is None:  # a given environment replaces the lookup: no plugin of that name is needed
        reg = manager.get("environment", config.env.name)
        environment = reg.build(config.section(f"env.{config.env.name}"))
        name, multi_turn = config.env.name, bool(reg.capabilities.get("multi_turn"))
    timed = TimedEnvironment(environment, name or type(environment).__name__, config.cluster.timeout_s, config.env.on_timeout)
    return timed, multi_turn
