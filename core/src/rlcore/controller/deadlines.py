"""Waits of the run loop bounded by ``cluster.timeout_s``: environment calls and generation.

Environments and generators are plugin code that may hang (a remote grader, a sandbox, an engine
process). Each call is bounded: in the main thread by a ``SIGALRM`` interval timer (so that an
environment's own main-thread deadlines, such as rlcore-math's inline grader, keep working: that
grader suspends and re-arms an outer timer), elsewhere by waiting on a helper thread (reused once
free: a multi-turn step makes one bounded call per trajectory turn, hundreds of them). A timer
someone else armed (pytest-timeout, say) still fires on time. A call in the main thread that sits
in one long C call is interrupted only when it returns to Python.

On expiry of an environment call the run stops with an error naming the environment and the step
(``env.on_timeout: stop``), or the batch scores 0 and is counted in ``env/timeout`` (``zero``;
the stuck call is abandoned, not killed).
"""

from __future__ import annotations

import queue
import signal
import threading
import time
from typing import Any, Callable

from rlcore.interfaces import EnvStep


class EnvironmentTimeout(TimeoutError):
    """An environment call took longer than ``cluster.timeout_s``."""


class GenerationTimeout(TimeoutError):
    """A generator call took longer than ``cluster.timeout_s``."""


def call_with_timeout(fn: Callable[[], Any], timeout_s: float, describe: Callable[[], str],
                      error: type[TimeoutError] = EnvironmentTimeout) -> Any:
    expired = lambda: error(describe())  # noqa: E731
    if hasattr(signal, "setitimer"):
        try:
            return _with_alarm(fn, timeout_s, expired)
        except _OffTheMainThread:  # only the main thread may take signals: bounded from another thread
            pass
    return _with_thread(fn, timeout_s, expired)


class _OffTheMainThread(Exception):
    """SIGALRM's handler could not be installed (not the main thread); ``fn`` has not run."""


def _with_alarm(fn, timeout_s: float, expired: Callable[[], TimeoutError]):
    previous = signal.getsignal(signal.SIGALRM)
    outer_delay, outer_interval = signal.getitimer(signal.ITIMER_REAL)
    outer_first = bool(outer_delay) and outer_delay <= timeout_s and callable(previous)
    started = time.monotonic()

    def expire(signum, frame):
        if outer_first and time.monotonic() - started < timeout_s:
            previous(signum, frame)  # the other deadline came first: it decides (pytest-timeout fails the test)
            signal.setitimer(signal.ITIMER_REAL, max(timeout_s - (time.monotonic() - started), 1e-3))
            return
        raise expired()

    try:
        signal.signal(signal.SIGALRM, expire)
    except ValueError as exc:  # "signal only works in main thread of the main interpreter"
        raise _OffTheMainThread from exc
    signal.setitimer(signal.ITIMER_REAL, outer_delay if outer_first else timeout_s)
    try:
        return fn()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        if outer_delay and not outer_first:
            signal.setitimer(signal.ITIMER_REAL, max(outer_delay - (time.monotonic() - started), 1e-3), outer_interval)


class _Helpers:
    """Daemon threads that run bounded calls, each reused once its call returns. A call that never
    returns keeps its thread (abandoned, as before); the next call gets another."""

    def __init__(self) -> None:
        self._idle: list[queue.SimpleQueue] = []
        self._lock = threading.Lock()

    def submit(self, fn: Callable[[], Any]) -> tuple[threading.Event, dict[str, Any]]:
        box: dict[str, Any] = {}
        done = threading.Event()
        with self._lock:
            inbox = self._idle.pop() if self._idle else None
        if inbox is None:
            inbox = queue.SimpleQueue()
            threading.Thread(target=self._serve, args=(inbox,), name="rlcore-bounded-call", daemon=True).start()
        inbox.put((fn, box, done))
        return done, box

    def _serve(self, inbox: queue.SimpleQueue) -> None:
        while True:
            fn, box, done = inbox.get()
            try:
                box["value"] = fn()
            except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread
                box["error"] = exc
            del fn
            with self._lock:
                self._idle.append(inbox)
            done.set()


_HELPERS = _Helpers()


def _with_thread(fn, timeout_s: float, expired: Callable[[], TimeoutError]):
    done, box = _HELPERS.submit(fn)
    if not done.wait(timeout_s):
        raise expired()
    if "error" in box:
        raise box["error"]
    return box["value"]


class TimedEnvironment:
    """Wraps an environment so that every ``step`` is bounded; other attributes pass through.
    ``current_step`` is set by the run loop, for the message."""

    def __init__(self, environment, name: str, timeout_s: float, on_timeout: str):
        self.inner, self.name = environment, name
        self.timeout_s, self.on_timeout = timeout_s, on_timeout
        self.current_step = 0

    def __getattr__(self, attr: str) -> Any:
        return getattr(self.inner, attr)

    def _describe(self) -> str:
        return (f"timeout: environment '{self.name}' did not answer within {self.timeout_s:g}s (cluster.timeout_s) "
                f"at step {self.current_step}; set env.on_timeout=zero to score such batches 0 and go on")

    def step(self, samples, responses):
        try:
            return call_with_timeout(lambda: self.inner.step(samples, responses), self.timeout_s, self._describe)
        except EnvironmentTimeout as exc:
            if self.on_timeout == "stop":
                raise
            print(f"warning: {exc}; the batch of {len(samples)} scores 0 (env.on_timeout=zero)", flush=True)
            return [EnvStep(reward=0.0, done=True, metrics={"timeout": 1.0}) for _ in samples]

    def step_trajectory(self, sample, trajectory: int, history):
        """:meth:`rlcore.interfaces.TrajectoryTurns.step_trajectory`, bounded as ``step`` is."""
        try:
            return call_with_timeout(lambda: self.inner.step_trajectory(sample, trajectory, history), self.timeout_s,
                                     self._describe)
        except EnvironmentTimeout as exc:
            if self.on_timeout == "stop":
                raise
            print(f"warning: {exc}; the trajectory scores 0 (env.on_timeout=zero)", flush=True)
            return EnvStep(reward=0.0, done=True, metrics={"timeout": 1.0})
