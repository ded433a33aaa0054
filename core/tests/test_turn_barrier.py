"""``env.<name>.turn_barrier``: with it, no trajectory's next turn is generated before every trajectory
still going has its current turn answered; without it, one trajectory runs all its turns while
another waits on its tool. Either way each trajectory's tokens are the same (hf generator, seeded),
and an environment's per-turn budgets (:class:`rlcore.interfaces.TrajectoryTurns`) set each turn's length."""

from __future__ import annotations

import asyncio
import threading

import pytest

from rlcore.interfaces import EnvStep, Sample, SamplingParams, TrajectoryTurns
from rlcore.generation.rollout import MultiTurnRunner, TurnBarrier
from rlcore.testing.chat_tokenizers import chat_samples

TURNS = {(0, 0): 2, (0, 1): 3, (1, 0): 3, (1, 1): 3}  # (sample index, trajectory) -> model turns


class ScheduledEnv:
    """Turn budgets and turn counts per trajectory; records when each turn is asked for and answered.
    With ``gate``, trajectory (0, 0)'s first tool call waits until trajectory (1, 1) has finished."""

    def __init__(self, gate: bool = False):
        self.events: list[tuple[str, int, int, int]] = []
        self._lock = threading.Lock()
        self.gate = threading.Event() if gate else None
        self.gate_opened_by_other = False

    def _record(self, what: str, sample: Sample, trajectory: int, turn: int) -> None:
        with self._lock:
            self.events.append((what, sample.index, trajectory, turn))

    def turn_max_new_tokens(self, sample: Sample, trajectory: int, turn: int) -> int:
        self._record("generate", sample, trajectory, turn)
        return 2 + (3 * sample.index + 2 * trajectory + turn) % 4

    def step_trajectory(self, sample: Sample, trajectory: int, history: list[str]) -> EnvStep:
        turn, last = len(history) - 1, len(history) >= TURNS[(sample.index, trajectory)]
        if self.gate is not None and (sample.index, trajectory, turn) == (0, 0, 0):
            self.gate_opened_by_other = self.gate.wait(timeout=60)
        if self.gate is not None and last and (sample.index, trajectory) == (1, 1):
            self.gate.set()
        self._record("answered", sample, trajectory, turn)
        return EnvStep(reward=float(len("".join(history)) % 3), done=last, observation=f"tool {turn}")

    def step(self, samples, histories):
        raise AssertionError("a TrajectoryTurns environment is answered through step_trajectory")


def _rollout(generator, env, barrier: bool):
    tok = generator.tokenizer
    samples = chat_samples(tok)
    runner = MultiTurnRunner(generator, env, tok, max_turns=3, max_total_tokens=256, turn_barrier=barrier)
    runner(samples, SamplingParams(n=2, max_new_tokens=16, temperature=1.0, seed=5, ignore_eos=True))
    return runner, {(t.sample.index, k): t for group in runner.last_trajectories for k, t in enumerate(group)}


def _model_runs(mask: list[int]) -> list[int]:
    runs, n = [], 0
    for m in mask + [0]:
        if m:
            n += 1
        elif n:
            runs, n = runs + [n], 0
    return runs


def test_the_barrier_holds_every_turn_until_all_trajectories_answered_and_changes_no_token(multi_turn_generator):
    assert isinstance(ScheduledEnv(), TrajectoryTurns)
    free_env, barrier_env = ScheduledEnv(gate=True), ScheduledEnv()
    _, free = _rollout(multi_turn_generator, free_env, barrier=False)
    runner, held = _rollout(multi_turn_generator, barrier_env, barrier=True)

    # Without the barrier, (1, 1) ran all three turns while (0, 0) waited in its first tool call.
    assert free_env.gate_opened_by_other
    # With it, every turn k+1 was asked for only after every turn k was answered.
    events = barrier_env.events
    for turn in (1, 2):
        last_answer = max(i for i, e in enumerate(events) if e[0] == "answered" and e[3] == turn - 1)
        first_ask = min(i for i, e in enumerate(events) if e[0] == "generate" and e[3] == turn)
        assert last_answer < first_ask, events
    assert runner.last_barrier_rounds == 2  # before turn 2 and turn 3; (0, 0) left after two turns
    metrics = runner.metrics()
    longest = max(held.values(), key=lambda t: sum(t.result.response_mask))
    assert metrics["rollout/turn_barrier_rounds"] == 2
    assert metrics["rollout/longest_trajectory_model_tokens"] == sum(longest.result.response_mask)
    assert metrics["rollout/longest_trajectory_env_s"] == longest.env_s > 0

    for key, turns in TURNS.items():
        a, b = free[key].result, held[key].result
        assert a.response_ids == b.response_ids and a.response_mask == b.response_mask
        assert a.response_logprobs == pytest.approx(b.response_logprobs, abs=1e-5)
        assert free[key].reward == held[key].reward and a.num_turns == b.num_turns == turns
        # each model turn is exactly its budget long (ignore_eos, no stop strings)
        assert _model_runs(b.response_mask) == [2 + (3 * key[0] + 2 * key[1] + t) % 4 for t in range(turns)]


def test_a_trajectory_that_fails_leaves_the_barrier():
    async def main():
        barrier, order = TurnBarrier(3), []

        async def trajectory(name: str, turns: int, fail: bool = False):
            try:
                for turn in range(turns):
                    if turn:
                        await barrier.wait()
                    order.append((name, turn))
                    await asyncio.sleep(0)
                    if fail:
                        raise RuntimeError("tool crashed")
            finally:
                barrier.leave()

        results = await asyncio.gather(trajectory("a", 3), trajectory("b", 2), trajectory("c", 3, fail=True),
                                       return_exceptions=True)
        return barrier, order, results

    barrier, order, results = asyncio.run(main())
    assert isinstance(results[2], RuntimeError)
    assert [turn for _, turn in order] == sorted(turn for _, turn in order)  # turns in order, none left waiting
    assert order.count(("a", 2)) == 1 and barrier.rounds == 2 and barrier.parties == 0


def test_the_agent_environment_refuses_a_turn_barrier():
    from rlcore.config.agents import AgentEnvConfig
    from rlcore.agents.runner import make_agent_runner

    with pytest.raises(ValueError, match="env.agent.turn_barrier"):
        make_agent_runner(None, None, None, AgentEnvConfig(turn_barrier=True))
