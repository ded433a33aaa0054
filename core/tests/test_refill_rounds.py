"""DAPO's dynamic sampling through ``Rollouts.collect``: groups whose rewards are all equal are
dropped and more rounds are generated until the step has its prompts' worth of trajectories.
Generator and environment are plain fakes (no model): the environment rewards a response 1 when
its text ends in an even digit, so whole groups can be made all-equal on purpose."""

from __future__ import annotations

from types import SimpleNamespace

from rlcore.algorithms import config as C
from rlcore.algorithms.dapo import DAPO
from rlcore.controller.context import RunContext
from rlcore.controller.rollouts import Rollouts
from rlcore.controller.timing import StepTimer
from rlcore.interfaces import EnvStep, GenerationResult, Sample


class Generator:
    """Round r gives prompt p's n samples the texts in ``texts[r][p]`` (one digit each)."""

    weights_version = 7

    def __init__(self, texts: list[list[str]]):
        self.texts, self.calls = texts, 0

    def generate(self, prompts, params):
        texts = self.texts[self.calls]
        self.calls += 1
        return [[GenerationResult(prompt_ids=list(p), response_ids=[1], response_logprobs=[-0.5], finish_reason="stop",
                                  text=texts[i][j]) for j in range(params.n)] for i, p in enumerate(prompts)]

    def metrics(self):
        return {"generation/truncated_prompts": 0}


class Environment:
    def step(self, samples, responses):
        return [EnvStep(reward=float(int(r[0][-1]) % 2 == 0)) for r in responses]


def refill_rollouts(texts: list[list[str]]) -> Rollouts:
    generation = SimpleNamespace(temperature=1.0, top_p=1.0, top_k=-1, max_new_tokens=4, stop_strings=(),
                                 stop_token_ids=(), ignore_eos=False)
    config = SimpleNamespace(train=SimpleNamespace(num_prompts_per_step=2, seed=0, deterministic=False),
                             grpo=SimpleNamespace(num_generations_per_prompt=2),
                             generation=generation)
    dataset = SimpleNamespace(train=[Sample(prompt=f"p{i}", prompt_ids=[i + 1]) for i in range(8)])
    return Rollouts(config, RunContext(max_sequence_length=16, timeout_s=30.0), Generator(texts), Environment(),
                    DAPO(C.DAPOConfig()), dataset)


def test_refill_rounds_replace_all_equal_groups_until_the_step_is_full():
    # round 0: prompt 0 mixed (kept), prompt 1 all correct (dropped); round 1: both mixed, so two
    # groups more than needed: the step keeps the first 4 trajectories (groups 0 and 2)
    rollouts = refill_rollouts([[["1", "2"], ["2", "4"]], [["3", "6"], ["8", "5"]]])
    kept, metrics, version = rollouts.collect(1, StepTimer())
    assert rollouts.generator.calls == 2
    assert [t.group for t in kept] == [0, 0, 2, 2]
    assert [t.reward for t in kept] == [0.0, 1.0, 0.0, 1.0]
    assert metrics["rollout/refill_rounds"] == 1.0 and metrics["rollout/kept_trajectories"] == 4.0
    # rollout metrics describe the first round, as every round was generated the same way
    assert metrics["rollout/num_trajectories"] == 4.0 and metrics["train/reward_mean"] == 0.75
    assert metrics["generation/truncated_prompts"] == 0.0 and version == 7


def test_a_full_first_round_needs_no_refill():
    rollouts = refill_rollouts([[["1", "2"], ["3", "4"]]])
    kept, metrics, _ = rollouts.collect(1, StepTimer())
    assert rollouts.generator.calls == 1
    assert [t.group for t in kept] == [0, 0, 1, 1] and metrics["rollout/refill_rounds"] == 0.0


class PlainDropper:
    """DAPO's group filter in an algorithm that does not subclass AlgorithmBase: it has no
    ``max_refill_rounds`` (rlcore.interfaces.RefillRounds), so the run does no refill rounds."""

    def __init__(self):
        self.dapo = DAPO(C.DAPOConfig())

    def keep_trajectories(self, rewards_N, group_ids_N, truncated_N):
        return self.dapo.keep_trajectories(rewards_N, group_ids_N, truncated_N)


class QuietGenerator(Generator):
    metrics = None  # no metrics() (rlcore.interfaces.GeneratorMetrics): the run logs none of its own


def test_an_algorithm_without_refill_rounds_and_a_generator_without_metrics():
    rollouts = refill_rollouts([[["1", "2"], ["2", "4"]], [["3", "6"], ["8", "5"]]])
    rollouts.algorithm, rollouts.generator = PlainDropper(), QuietGenerator(rollouts.generator.texts)
    assert rollouts.refill_rounds() == 0
    kept, metrics, _ = rollouts.collect(1, StepTimer())
    assert rollouts.generator.calls == 1 and [t.group for t in kept] == [0, 0]  # the all-correct group dropped, not refilled
    assert not any(key.startswith("generation/") for key in metrics)
