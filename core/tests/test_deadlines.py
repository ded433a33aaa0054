"""Environment calls are bounded by cluster.timeout_s, in the main thread and in others."""

from __future__ import annotations

import threading
import time

import pytest

from rlcore.deadlines import EnvironmentTimeout, TimedEnvironment
from rlcore.interfaces import EnvStep, Sample

pytestmark = pytest.mark.wall_clock


class HungEnvironment:
    def __init__(self, seconds: float):
        self.seconds = seconds

    def step(self, samples, responses):
        time.sleep(self.seconds)
        return [EnvStep(reward=1.0) for _ in samples]

    def close(self):
        self.closed = True


def _timed(seconds: float, on_timeout: str) -> TimedEnvironment:
    env = TimedEnvironment(HungEnvironment(seconds), "sleepy", timeout_s=0.3, on_timeout=on_timeout)
    env.current_step = 7
    return env


def test_a_hung_environment_stops_the_run_naming_it_and_the_step():
    began = time.monotonic()
    with pytest.raises(EnvironmentTimeout) as failure:
        _timed(60, "stop").step([Sample(prompt="p")], [["r"]])
    assert time.monotonic() - began < 5
    assert "'sleepy'" in str(failure.value) and "step 7" in str(failure.value) and "cluster.timeout_s" in str(failure.value)


def test_a_hung_environment_off_the_main_thread_is_bounded_too():
    failures = []

    def rollouts():  # as the async producer thread calls it
        try:
            _timed(60, "stop").step([Sample(prompt="p")], [["r"]])
        except EnvironmentTimeout as exc:
            failures.append(exc)

    worker = threading.Thread(target=rollouts)
    worker.start()
    worker.join(timeout=5)
    assert not worker.is_alive() and len(failures) == 1


def test_on_timeout_zero_scores_the_batch_zero_and_counts_it(capsys):
    steps = _timed(60, "zero").step([Sample(prompt="p"), Sample(prompt="q")], [["r"], ["s"]])
    assert [(s.reward, s.metrics["timeout"]) for s in steps] == [(0.0, 1.0), (0.0, 1.0)]
    warning = capsys.readouterr().out
    assert "the batch of 2 scores 0 (env.on_timeout=zero)" in warning
    assert "set env.on_timeout=zero" not in warning  # what already happens is not advice


def _sleeps(prompts, completions, **kwargs):
    time.sleep(60)
    return [1.0] * len(completions)


_STOP_SPINNING = threading.Event()


def _spins(prompts, completions, **kwargs):
    # Pure Python, never returning while the test runs: interrupted between bytecodes. The abandoned
    # spinner is stopped after the test, or it would hold the GIL against every later test in this process.
    while not _STOP_SPINNING.is_set():
        pass


@pytest.fixture
def stop_spinners():
    _STOP_SPINNING.clear()
    yield
    _STOP_SPINNING.set()


@pytest.mark.parametrize("fn", [_sleeps, _spins], ids=["sleeping", "spinning"])
@pytest.mark.parametrize("thread", [False, True], ids=["main-thread", "other-thread"])
def test_a_reward_function_that_never_returns_stops_the_run_naming_it(fn, thread, stop_spinners):
    """A plain reward function catches every Exception of its own (they score 0): the deadline's
    timeout is not one of them, in the sync loop's main thread or the async scoring thread alike."""
    from rlcore.data.reward_fn import FunctionEnvironment

    env = TimedEnvironment(FunctionEnvironment(fn, "my_rewards:hangs"), "my_rewards:hangs", timeout_s=0.3, on_timeout="stop")
    env.current_step = 3
    outcome = []

    def score():
        try:
            outcome.append(env.step([Sample(prompt="p")], [["r"]]))
        except EnvironmentTimeout as exc:
            outcome.append(exc)

    began = time.monotonic()
    if thread:
        worker = threading.Thread(target=score, daemon=True)
        worker.start()
        worker.join(timeout=5)
    else:
        score()
    assert time.monotonic() - began < 5 and len(outcome) == 1, outcome
    assert isinstance(outcome[0], EnvironmentTimeout), outcome
    assert "'my_rewards:hangs'" in str(outcome[0]) and "step 3" in str(outcome[0])
    zero = TimedEnvironment(FunctionEnvironment(fn, "f"), "f", timeout_s=0.3, on_timeout="zero").step([Sample(prompt="p")], [["r"]])
    assert [(s.reward, s.metrics["timeout"]) for s in zero] == [(0.0, 1.0)]


class SwallowsItsTimeout:
    """Catches every exception, the timeout's too, and scores 0 (or raises its own error)."""

    def __init__(self, raise_instead: bool):
        self.raise_instead = raise_instead

    def step(self, samples, responses):
        try:
            time.sleep(60)
        except BaseException:  # noqa: BLE001 - the fault under test
            if self.raise_instead:
                raise RuntimeError("grader failed") from None
        return [EnvStep(reward=0.0) for _ in samples]


@pytest.mark.parametrize("raise_instead", [False, True], ids=["returns", "raises-its-own"])
def test_an_environment_that_swallows_its_timeout_has_still_timed_out(raise_instead):
    env = TimedEnvironment(SwallowsItsTimeout(raise_instead), "greedy", timeout_s=0.3, on_timeout="stop")
    with pytest.raises(EnvironmentTimeout, match="'greedy' did not answer"):
        env.step([Sample(prompt="p")], [["r"]])


def test_a_prompt_environment_is_untouched_and_its_attributes_pass_through():
    env = _timed(0, "stop")
    assert [s.reward for s in env.step([Sample(prompt="p")], [["r"]])] == [1.0]
    env.close()
    assert env.inner.closed


class OuterDeadline(Exception):
    pass


def _raise_outer(signum, frame):
    raise OuterDeadline()


def test_an_earlier_outer_timer_still_fires_inside_a_bounded_call():
    """pytest-timeout's alarm (or anyone's) keeps its own time while an environment call runs."""
    import signal

    previous = signal.signal(signal.SIGALRM, _raise_outer)
    signal.setitimer(signal.ITIMER_REAL, 0.2)
    began = time.monotonic()
    try:
        with pytest.raises(OuterDeadline):
            TimedEnvironment(HungEnvironment(60), "sleepy", timeout_s=30, on_timeout="stop").step([Sample(prompt="p")], [["r"]])
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert time.monotonic() - began < 5


def test_a_later_outer_timer_is_rearmed_after_a_bounded_call():
    import signal

    previous = signal.signal(signal.SIGALRM, _raise_outer)
    signal.setitimer(signal.ITIMER_REAL, 30)
    try:
        _timed(0, "stop").step([Sample(prompt="p")], [["r"]])
        remaining, _ = signal.getitimer(signal.ITIMER_REAL)
        assert 25 < remaining <= 30
        assert signal.getsignal(signal.SIGALRM) is _raise_outer
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def test_bounded_calls_off_the_main_thread_reuse_their_helper_thread():
    from rlcore.deadlines import call_with_timeout

    helpers = []

    def calls():  # as the multi-turn runner's environment threads call it: one bounded call per turn
        for _ in range(50):
            helpers.append(call_with_timeout(threading.current_thread, 30.0, lambda: "hung"))  # kept: no id reused

    worker = threading.Thread(target=calls)
    worker.start()
    worker.join(timeout=60)
    assert len(helpers) == 50 and len(set(map(id, helpers))) == 1 and worker not in helpers


def test_an_environment_close_that_hangs_as_the_run_ends_is_named_and_left_behind(capsys):
    class HangsOnClose(HungEnvironment):
        def close(self):
            time.sleep(60)

    env = TimedEnvironment(HangsOnClose(0), "sticky", timeout_s=0.3, on_timeout="stop")
    began = time.monotonic()
    env.close()
    assert time.monotonic() - began < 5
    assert "timeout: environment 'sticky' (close) did not finish within 0.3s (cluster.timeout_s) as the run ended" in capsys.readouterr().out
    TimedEnvironment(object.__new__(type("NoClose", (), {"step": HungEnvironment.step})), "plain", 0.3, "stop").close()


def test_a_hung_logger_or_teacher_call_stops_the_run_naming_it():
    from rlcore.deadlines import CallTimeout, TimedTeacher, bounded_call

    with pytest.raises(CallTimeout, match=r"timeout: logger Mlflow \(log\) did not return within 0.3s \(cluster.timeout_s\) at step 4"):
        bounded_call(lambda: time.sleep(60), "logger Mlflow (log)", 0.3, step=4)

    class Teacher:
        name = "frozen"

        def logprobs(self, batch):
            time.sleep(60 if batch == "hangs" else 0)
            return ["lp"]

    teacher = TimedTeacher(Teacher(), 0.3)
    assert teacher.logprobs("batch") == ["lp"] and teacher.name == "frozen"
    with pytest.raises(CallTimeout, match=r"the teacher Teacher \(logprobs\) did not return within 0.3s"):
        teacher.logprobs("hangs")
