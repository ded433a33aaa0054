"""A session environment's calls (``open_session``, a session's ``step`` and ``close``) are bounded by
cluster.timeout_s as ``step`` is: a hung one stops the run naming the environment and the call
(``env.on_timeout: stop``) or scores its trajectory 0 (``zero``), and multi-turn rollouts through
:class:`rlcore.controller.rollouts.Rollouts` end within cluster.timeout_s either way."""

from __future__ import annotations

import threading
import time

import pytest

from rlcore.deadlines import EnvironmentTimeout, TimedEnvironment, batch_deadline
from rlcore.interfaces import EnvironmentSession, EnvStep, Sample, SessionEnvironment, TrajectoryTurns
from rlcore.testing.chat_tokenizers import chat_samples

pytestmark = pytest.mark.wall_clock

TIMEOUT_S = 1.0
MARGIN_S = 3.0  # scheduling and a tiny model's generation on a busy 2-core machine; a hang is 60 s
# The rollouts' cluster.timeout_s: an environment call inside ends batch_margin_s (1 s) before it, and the
# trajectories that did not hang need the rest to finish their turns (the generator's bound is authoritative)
BATCH_TIMEOUT_S = 4 * TIMEOUT_S


class Released:
    """The hung calls wait on this; the test releases them so that no thread outlives it."""

    def __init__(self):
        self.event = threading.Event()

    def wait(self) -> None:
        self.event.wait(60)


class GameSession:
    def __init__(self, env: "HangingGame", sample: Sample):
        self.env, self.sample, self.turns = env, sample, 0

    def step(self, turn: str) -> EnvStep:
        self.turns += 1
        if self.sample.index in self.env.hang_step:
            self.env.release.wait()
        return EnvStep(reward=1.0, done=self.turns >= 2, observation=f"seen {self.turns}")

    def close(self) -> None:
        with self.env.lock:
            self.env.closed.append(self.sample.index)


class HangingGame:
    """A session environment; samples whose index is in ``hang_open`` / ``hang_step`` hang there (injected faults)."""

    def __init__(self, hang_open=(), hang_step=()):
        self.hang_open, self.hang_step = set(hang_open), set(hang_step)
        self.release, self.lock, self.closed = Released(), threading.Lock(), []

    def open_session(self, sample: Sample) -> GameSession:
        if sample.index in self.hang_open:
            self.release.wait()
        return GameSession(self, sample)

    def step(self, samples, histories):
        raise AssertionError("a session environment's multi-turn rollouts go through its sessions")


@pytest.fixture
def game():
    made = []

    def make(**hangs) -> HangingGame:
        made.append(HangingGame(**hangs))
        return made[-1]

    yield make
    for env in made:
        env.release.event.set()


def _timed(env, on_timeout: str) -> TimedEnvironment:
    timed = TimedEnvironment(env, "game", timeout_s=TIMEOUT_S, on_timeout=on_timeout)
    timed.current_step = 3
    return timed


def test_the_wrapper_has_exactly_the_environments_protocols(game):
    class Plain:
        def step(self, samples, histories):
            return []

    assert isinstance(_timed(game(), "stop"), SessionEnvironment)
    assert not isinstance(_timed(Plain(), "stop"), SessionEnvironment)
    assert not isinstance(_timed(Plain(), "stop"), TrajectoryTurns)
    assert isinstance(_timed(game(), "stop").open_session(Sample(prompt="p")), EnvironmentSession)


@pytest.mark.parametrize("hang", ["hang_open", "hang_step"])
def test_a_hung_session_call_stops_the_run_naming_the_environment_the_call_and_the_step(game, hang):
    env = _timed(game(**{hang: [0]}), "stop")
    began = time.monotonic()
    with pytest.raises(EnvironmentTimeout) as failure:
        env.open_session(Sample(prompt="p", index=0)).step("turn")
    assert time.monotonic() - began < TIMEOUT_S + MARGIN_S
    call = "open_session" if hang == "hang_open" else "session step"
    assert f"environment 'game' ({call}) did not answer within 1s (cluster.timeout_s) at step 3" in str(failure.value)
    assert "env.on_timeout=zero" in str(failure.value)


def test_with_zero_a_session_that_does_not_open_scores_0_and_opens_late_then_closes(game):
    inner, opened = game(hang_open=[0]), []
    # Off the main thread, as the multi-turn runner's environment threads call it: the stuck call is
    # abandoned there (in the main thread SIGALRM interrupts it).
    worker = threading.Thread(target=lambda: opened.append(_timed(inner, "zero").open_session(Sample(prompt="p", index=0))))
    worker.start()
    worker.join(TIMEOUT_S + MARGIN_S)
    (session,) = opened
    assert session.step("turn") == EnvStep(reward=0.0, done=True, metrics={"timeout": 1.0})
    session.close()
    inner.release.event.set()  # the abandoned open_session returns: its session is closed, nobody else would
    for _ in range(200):
        if inner.closed:
            break
        time.sleep(0.05)
    assert inner.closed == [0]


def test_with_zero_a_hung_session_step_scores_0_and_its_close_does_not_wait(game):
    inner = game(hang_step=[0])
    session = _timed(inner, "zero").open_session(Sample(prompt="p", index=0))
    began = time.monotonic()
    assert session.step("turn") == EnvStep(reward=0.0, done=True, metrics={"timeout": 1.0})
    session.close()
    assert time.monotonic() - began < TIMEOUT_S + MARGIN_S


def test_a_hung_session_close_is_bounded_too(game):
    inner = game()
    session = _timed(inner, "stop").open_session(Sample(prompt="p", index=0))
    session.inner.close = inner.release.wait  # injected: a close that hangs
    with pytest.raises(EnvironmentTimeout, match=r"\(session close\)"):
        session.close()


def test_inside_a_batch_the_limit_is_what_is_left_of_it(game):
    env = _timed(game(hang_open=[0]), "stop")
    began = time.monotonic()
    with batch_deadline(0.3), pytest.raises(EnvironmentTimeout, match="what was left of the batch's cluster.timeout_s=1s"):
        env.open_session(Sample(prompt="p", index=0))
    assert time.monotonic() - began < TIMEOUT_S


# ---- through the run loop's rollouts: real hf generator, multi-turn runner -----------------------------


def _rollouts(generator, env, on_timeout: str):
    import types

    from rlcore.loading.loader import build_config
    from rlcore.controller.rollouts import Rollouts
    from rlcore.controller.context import RunContext
    from rlcore.generation.rollout import MultiTurnRunner

    tok = generator.tokenizer
    samples = chat_samples(tok)
    config = build_config({"policy": {"model_name": "unused", "generation": {"backend": "hf", "max_new_tokens": 4}},
                           "cluster": {"timeout_s": BATCH_TIMEOUT_S}, "env": {"on_timeout": on_timeout}})
    timed = TimedEnvironment(env, "game", config.cluster.timeout_s, on_timeout)
    runner = MultiTurnRunner(generator, timed, tok, max_turns=2, max_total_tokens=256)
    rollouts = Rollouts(config, RunContext.of(config), generator, timed, algorithm=None,
                        dataset=types.SimpleNamespace(train=samples), multi_turn=runner)
    return rollouts, samples


@pytest.mark.parametrize("hang", ["hang_open", "hang_step"])
def test_multi_turn_rollouts_stop_with_the_environments_error_within_the_timeout(multi_turn_generator, game, hang):
    rollouts, samples = _rollouts(multi_turn_generator, game(**{hang: [1]}), "stop")
    began = time.monotonic()
    with pytest.raises(EnvironmentTimeout, match=f"environment 'game'.*what was left of the batch's cluster.timeout_s={BATCH_TIMEOUT_S:g}s"):
        rollouts.generate(samples, 2, seed=1, step=3)
    assert time.monotonic() - began < BATCH_TIMEOUT_S + MARGIN_S


@pytest.mark.parametrize("hang", ["hang_open", "hang_step"])
def test_multi_turn_rollouts_with_zero_score_the_hung_trajectories_0_and_the_rest_as_played(multi_turn_generator, game, hang):
    env = game(**{hang: [1]})
    rollouts, samples = _rollouts(multi_turn_generator, env, "zero")
    began = time.monotonic()
    results, _, final_steps, _ = rollouts.generate(samples, 2, seed=1, step=3)
    assert time.monotonic() - began < BATCH_TIMEOUT_S + MARGIN_S
    assert [len(r) for r in results] == [2, 2]
    assert [(s.reward, s.metrics.get("timeout")) for s in final_steps[0]] == [(1.0, None)] * 2
    assert [(s.reward, s.metrics.get("timeout")) for s in final_steps[1]] == [(0.0, 1.0)] * 2
    assert env.closed.count(0) == 2  # the played sessions are closed (a hung one is closed beside its stuck call, or late)


def test_a_timed_session_environment_pickles_as_its_kind(game):
    import pickle

    timed = pickle.loads(pickle.dumps(_timed(SessionOnly(), "zero")))
    assert isinstance(timed, SessionEnvironment) and timed.on_timeout == "zero" and timed.current_step == 3


class SessionOnly:
    def open_session(self, sample):
        return GameSession(HangingGame(), sample)

    def step(self, samples, histories):
        return []
