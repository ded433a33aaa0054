"""``bench_tool``: a multi-turn environment for timing rollouts with random-weight models.

A random-init model never writes a real tool call, so ``math_tool`` would end every trajectory
after one turn. This environment always answers a model turn with a tool result until
``max_turns`` turns are done, after a simulated tool latency drawn uniformly from
``[0, tool_latency_s]`` (a sandbox or API call), and gives a pseudo-random reward so GRPO's
advantages are not all zero. Turn lengths vary as in real rollouts through the per-turn stop
string: a near-uniform random model emits a token ending in ``777|>`` (``<|extra_N|>`` with N
ending in 777) about once per thousand tokens, so turns are geometric in length, capped by
``max_new_tokens``.

Registered in-process by ``bench_grpo_step.py`` (``PluginManager.register_module``) for the
``*-tool-sync`` / ``*-tool-async`` configurations; it is not an installed plugin.
"""

from __future__ import annotations

import hashlib
import random
import time

from attrs import field, frozen

from rlcore import hookimpl
from rlcore.config.environment import MultiTurnEnvConfig
from rlcore.config.structure import doc
from rlcore.interfaces import EnvStep


@frozen
class BenchToolConfig(MultiTurnEnvConfig):
    tool_latency_s: float = field(default=0.5, metadata=doc("simulated tool latency, uniform in [0, this]"))
    turn_stop_strings: tuple[str, ...] = field(default=("777|>",), metadata=doc("ends a model turn"))
    seed: int = field(default=0, metadata=doc("seed of latencies and rewards"))


class BenchToolEnv:
    def __init__(self, config: BenchToolConfig):
        self.config = config
        self._rng = random.Random(config.seed)

    def step(self, samples, histories) -> list[EnvStep]:
        steps = []
        for sample, history in zip(samples, histories):
            turns = len(history) if isinstance(history, (list, tuple)) else 1
            last = history[-1] if isinstance(history, (list, tuple)) and history else str(history)
            if self.config.tool_latency_s > 0:
                time.sleep(self._rng.uniform(0.0, self.config.tool_latency_s))
            if turns < self.config.max_turns:
                steps.append(EnvStep(reward=0.0, done=False, observation=f"<result>{len(last)}</result>",
                                     metrics={"env/tool_calls": 1.0}))
            else:
                digest = hashlib.sha256(last.encode()).digest()
                steps.append(EnvStep(reward=float(digest[0] % 2), done=True, metrics={"env/turns": float(turns)}))
        return steps


def build(config: BenchToolConfig) -> BenchToolEnv:
    return BenchToolEnv(config)


@hookimpl
def rlcore_environments(register):
    register("bench_tool", "bench_multiturn_env:build", BenchToolConfig, multi_turn=True, devices=("cpu",))
