"""``bench_tool``: a multi-turn environment for timing rollouts with random-weight models.

A random-init model never writes a real tool call, so ``math_tool`` would end every trajectory
after one turn. This environment always answers a model turn with a tool result until the
trajectory's turns are done, after a simulated tool latency (a sandbox or API call), and gives a
pseudo-random reward so GRPO's advantages are not all zero.

Two workloads:

- ``uniform`` (the default): ``max_turns`` turns, latencies uniform in ``[0, tool_latency_s]``
  drawn in call order; turn lengths vary through the per-turn stop string: a near-uniform random
  model emits a token ending in ``777|>`` (``<|extra_N|>`` with N ending in 777) about once per
  thousand tokens, so turns are geometric in length, capped by ``max_new_tokens``.
- ``heavy_tailed``: the realistic one, drawn per (sample, trajectory, turn) from ``seed`` alone,
  so every variant of a comparison (turn barrier or not, sync or async engine) meets the same
  work whatever order the calls come in: ``min_turns`` to ``max_turns`` turns; each turn's length
  lognormal (median ``turn_tokens_median``, log-sd ``turn_tokens_sigma``) clipped to
  ``turn_tokens_range`` and enforced as the turn's ``max_tokens`` (with ``ignore_eos`` and no
  stop strings, a turn is exactly that long); each tool latency lognormal with median
  ``latency_median_s`` and 99th percentile ``latency_p99_s``. It implements
  :class:`rlcore.interfaces.TrajectoryTurns`.

Registered in-process by ``bench_grpo_step.py`` (``PluginManager.register_module``) for the
``*-tool-*`` configurations; it is not an installed plugin.
"""

from __future__ import annotations

import hashlib
import math
import random
import time
from typing import Literal

from attrs import field, frozen

from rlcore import hookimpl
from rlcore.config.environment import MultiTurnEnvConfig
from rlcore.config.structure import doc
from rlcore.interfaces import EnvStep, Sample

Z99 = 2.3263478740408408  # the standard normal's 99th percentile


@frozen
class BenchToolConfig(MultiTurnEnvConfig):
    tool_latency_s: float = field(default=0.5, metadata=doc("uniform workload: tool latency, uniform in [0, this]"))
    turn_stop_strings: tuple[str, ...] = field(default=("777|>",), metadata=doc("ends a model turn"))
    seed: int = field(default=0, metadata=doc("seed of latencies, lengths, turn counts and rewards"))
    workload: Literal["uniform", "heavy_tailed"] = field(default="uniform", metadata=doc("see the module docstring"))
    min_turns: int = field(default=3, metadata=doc("heavy_tailed: fewest model turns of a trajectory"))
    turn_tokens_median: float = field(default=192.0, metadata=doc("heavy_tailed: median tokens of a model turn"))
    turn_tokens_sigma: float = field(default=1.0, metadata=doc("heavy_tailed: log-sd of a turn's tokens"))
    turn_tokens_range: tuple[int, int] = field(default=(32, 2048), metadata=doc("heavy_tailed: a turn's tokens, clipped"))
    latency_median_s: float = field(default=0.5, metadata=doc("heavy_tailed: median tool latency"))
    latency_p99_s: float = field(default=8.0, metadata=doc("heavy_tailed: 99th percentile of the tool latency"))


class HeavyTailedWorkload:
    """The seeded draws of the ``heavy_tailed`` workload; each depends on its key alone."""

    def __init__(self, config: BenchToolConfig):
        if not 1 <= config.min_turns <= config.max_turns:
            raise ValueError(f"env.bench_tool.min_turns={config.min_turns}: needs 1 <= min_turns <= max_turns={config.max_turns}")
        low, high = config.turn_tokens_range
        if not 1 <= low <= high:
            raise ValueError(f"env.bench_tool.turn_tokens_range={config.turn_tokens_range}: needs 1 <= low <= high")
        if not 0 < config.latency_median_s <= config.latency_p99_s:
            raise ValueError("env.bench_tool: needs 0 < latency_median_s <= latency_p99_s")
        self.config = config
        self.latency_sigma = math.log(config.latency_p99_s / config.latency_median_s) / Z99

    def _rng(self, what: str, sample: int, trajectory: int, turn: int = 0) -> random.Random:
        return random.Random(f"{self.config.seed}/{what}/{sample}/{trajectory}/{turn}")

    def turns(self, sample: int, trajectory: int) -> int:
        return self._rng("turns", sample, trajectory).randint(self.config.min_turns, self.config.max_turns)

    def turn_tokens(self, sample: int, trajectory: int, turn: int) -> int:
        c = self.config
        drawn = self._rng("tokens", sample, trajectory, turn).lognormvariate(math.log(c.turn_tokens_median), c.turn_tokens_sigma)
        return int(min(max(round(drawn), c.turn_tokens_range[0]), c.turn_tokens_range[1]))

    def latency_s(self, sample: int, trajectory: int, turn: int) -> float:
        return self._rng("latency", sample, trajectory, turn).lognormvariate(math.log(self.config.latency_median_s),
                                                                             self.latency_sigma)


class BenchToolEnv:
    def __init__(self, config: BenchToolConfig):
        self.config = config
        self._rng = random.Random(config.seed)

    def step(self, samples, histories) -> list[EnvStep]:
        steps = []
        for sample, history in zip(samples, histories):
            turns = len(history) if isinstance(history, (list, tuple)) else 1
            if self.config.tool_latency_s > 0:
                time.sleep(self._rng.uniform(0.0, self.config.tool_latency_s))
            steps.append(_answer(history, turns, self.config.max_turns))
        return steps


class HeavyTailedToolEnv:
    """The ``heavy_tailed`` workload: :class:`rlcore.interfaces.TrajectoryTurns`."""

    def __init__(self, config: BenchToolConfig):
        self.config, self.draws = config, HeavyTailedWorkload(config)

    def turn_max_new_tokens(self, sample: Sample, trajectory: int, turn: int) -> int:
        return self.draws.turn_tokens(sample.index, trajectory, turn)

    def step_trajectory(self, sample: Sample, trajectory: int, history: list[str]) -> EnvStep:
        turns = len(history)
        time.sleep(self.draws.latency_s(sample.index, trajectory, turns - 1))
        return _answer(history, turns, self.draws.turns(sample.index, trajectory))

    def step(self, samples, histories) -> list[EnvStep]:  # the Environment protocol; the runner calls step_trajectory
        return [self.step_trajectory(s, 0, list(h)) for s, h in zip(samples, histories)]


def _answer(history, turns: int, last_turn: int) -> EnvStep:
    last = history[-1] if isinstance(history, (list, tuple)) and history else str(history)
    if turns < last_turn:
        return EnvStep(reward=0.0, done=False, observation=f"<result>{len(last)}</result>", metrics={"env/tool_calls": 1.0})
    digest = hashlib.sha256(last.encode()).digest()
    return EnvStep(reward=float(digest[0] % 2), done=True, metrics={"env/turns": float(turns)})


def build(config: BenchToolConfig):
    return HeavyTailedToolEnv(config) if config.workload == "heavy_tailed" else BenchToolEnv(config)


@hookimpl
def rlcore_environments(register):
    register("bench_tool", "bench_multiturn_env:build", BenchToolConfig, multi_turn=True, devices=("cpu",))
