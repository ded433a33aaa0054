"""The ``agent`` environment: its rollouts are the agent's own (:mod:`rlcore.agents.runner`), so it
scores nothing itself; the run loop takes the rewards the agent returned."""

from __future__ import annotations

from rlcore.config.agents import AgentEnvConfig
from rlcore.interfaces import EnvStep, Sample


class AgentEnvironment:
    def __init__(self, config: AgentEnvConfig):
        self.config = config

    def step(self, samples: list[Sample], histories: list[list[str]]) -> list[EnvStep]:
        raise TypeError("the 'agent' environment is rolled out by its agent through the endpoint (rlcore.agents.runner), "
                        "which returns the rewards; nothing calls its step() in a run. To score texts, use an environment "
                        "such as 'math'")


def build(section_config: AgentEnvConfig | None) -> AgentEnvironment:
    return AgentEnvironment(section_config or AgentEnvConfig())
