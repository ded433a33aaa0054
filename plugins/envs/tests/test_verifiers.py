"""verifiers 0.4 through rlcore: a real vf.Taskset as the dataset, its weighted rewards and metrics as
the reward and metrics, a vf.Env's run() as the multi-turn rollout. The GRPO run through it (multi-turn,
its rewards and metrics logged) is ``recipes/grpo_verifiers_tiny_cpu.yaml``'s dry run (tests/test_recipes.py)."""

from __future__ import annotations

import importlib.util

import pytest

from rlcore.interfaces import Sample

from rlcore_envs.config import VerifiersEnvConfig
from rlcore_envs.verifiers_env import VerifiersEnvironment

# Found, not imported, at collection: importing verifiers.v1 takes seconds, paid by the tests that run here.
pytestmark = pytest.mark.skipif(importlib.util.find_spec("verifiers") is None or importlib.util.find_spec("verifiers.v1") is None,
                                reason="verifiers 0.4 is not installed")

TASKSET = "rlcore_envs.examples.say_taskset:SayTaskset"
RETRY = "rlcore_envs.examples.say_taskset:RetryEnv"


def sample(i: int) -> Sample:
    from rlcore_envs.verifiers_env import load_taskset

    task = list(load_taskset(TASKSET, {}).take(i + 1))[i]
    return Sample(prompt=[{"role": "user", "content": task.data.prompt}], answer=task.data.model_dump(mode="json"),
                  metadata={"task": task.data.name})


def test_weighted_rewards_and_metrics():
    env = VerifiersEnvironment(VerifiersEnvConfig(taskset=TASKSET))
    right, long_wrong = env.step([sample(3), sample(3)], [["3"], ["the answer is four"]])
    assert right.reward == pytest.approx(1.0) and right.metrics["vf/reward/exact"] == 1.0
    assert right.metrics["vf/reward/short"] == 1.0 and right.metrics["vf/metric/turns"] == 1.0
    assert long_wrong.reward == 0.0 and long_wrong.metrics["vf/reward/exact"] == 0.0
    (short_wrong,) = env.step([sample(3)], [["7"]])
    assert short_wrong.reward == pytest.approx(0.25)  # only the 0.25-weighted reward


def test_an_env_run_plays_the_user_turn_by_turn():
    env = VerifiersEnvironment(VerifiersEnvConfig(taskset=TASKSET, env_class=RETRY, max_turns=2))
    session = env.open_session(sample(5))
    try:
        first = session.step("6")
        assert not first.done and first.observation == "Try again."
        last = session.step("5")
        assert last.done and last.reward == pytest.approx(1.0)
        assert last.metrics["vf/metric/retried"] == 1.0 and last.metrics["vf/metric/turns"] == 2.0
    finally:
        session.close()
    (at_once,) = env.step([sample(5)], [["5"]])
    assert at_once.done and at_once.reward == pytest.approx(1.0) and at_once.metrics["vf/metric/retried"] == 0.0
