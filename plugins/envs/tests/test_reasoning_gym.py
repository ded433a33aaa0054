"""reasoning-gym through rlcore: seeded datasets from its generators, its scorers as rewards. The GRPO run
(per-task accuracy logged) is ``recipes/grpo_reasoning_gym_tiny_cpu.yaml``'s dry run (tests/test_recipes.py)."""

from __future__ import annotations

import importlib.util

import pytest

from rlcore.interfaces import Sample
from rlcore.testing.conformance import EnvironmentConformance

from rlcore_envs.config import ReasoningGymDatasetConfig, ReasoningGymEnvConfig
from rlcore_envs.reasoning_gym_env import ReasoningGymEnvironment, build_env, generate

# Found, not imported, at collection: importing reasoning_gym takes a second, paid by the tests that run here.
pytestmark = pytest.mark.skipif(importlib.util.find_spec("reasoning_gym") is None, reason="reasoning-gym is not installed")

MIX = ReasoningGymDatasetConfig(tasks=("basic_arithmetic", "chain_sum"), num_train=40, num_validation=10, seed=5)


def test_the_mix_is_seeded_sized_and_disjoint():
    train, val = generate(MIX)
    again, _ = generate(MIX)
    assert len(train) == 40 and len(val) == 10
    assert [s.answer["question"] for s in train] == [s.answer["question"] for s in again]
    assert {s.metadata["task"] for s in train} == {"basic_arithmetic", "chain_sum"}
    assert not {s.answer["question"] for s in train} & {s.answer["question"] for s in val}
    assert all(s.answer["metadata"]["source_dataset"] == s.metadata["task"] for s in train)
    assert {s.metadata["task"] for s in val[:4]} == {"basic_arithmetic", "chain_sum"}  # mixed: validating a prefix sees both


def test_its_scorer_is_the_reward():
    train, _ = generate(MIX)
    env = build_env(ReasoningGymEnvConfig())
    steps = env.step(train[:2], [[str(train[0].answer["answer"])], ["certainly not a number"]])
    assert steps[0].reward == 1.0 and steps[0].metrics["correct"] == 1.0
    assert steps[1].reward == 0.0 and steps[1].metrics["correct"] == 0.0


def test_answer_tags():
    train, _ = generate(MIX)
    env = ReasoningGymEnvironment(ReasoningGymEnvConfig(answer_from="answer_tag"))
    (step,) = env.step(train[:1], [[f"thinking... <answer>{train[0].answer['answer']}</answer>"]])
    assert step.reward == 1.0


class TestReasoningGymConformance(EnvironmentConformance):
    @pytest.fixture
    def environment(self):
        return build_env(ReasoningGymEnvConfig())

    @pytest.fixture
    def env_samples(self):
        train, _ = generate(MIX)
        return [Sample(prompt=s.prompt, answer=s.answer, metadata=s.metadata, index=i) for i, s in enumerate(train[:3])]
