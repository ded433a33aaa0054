"""Waits of the run loop bounded by ``cluster.timeout_s``: environment calls and generation.

Environments and generators are plugin code that may hang (a remote grader, a sandbox, an engine
process). Each call is bounded: in the main thread by a ``SIGALRM`` interval timer (so that an
environment's own main-thread deadlines, such as rlcore-math's inline grader, keep working: that
grader suspends and re-arms an outer timer), elsewhere by waiting on a helper thread (reused once
free: a multi-turn step makes one bounded call per trajectory turn, hundreds of them). A timer
someone else armed (pytest-timeout, say) still fires on time. A call in the main thread that sits
in one long C call is interrupted only when it returns to Python. A call that catches its timeout (a
broad ``except`` in a reward function) and returns, or raises something else, has still timed out.

On expiry of an environment call the run stops with an error naming the environment, the call and
the step (``env.on_timeout: stop``), or the batch (the trajectory, for a multi-turn environment's
calls) scores 0 and is counted in ``env/timeout`` (``zero``; the stuck call is abandoned, not
killed: its helper thread is the one a timed-out call leaves behind).

A batch bounded as a whole (the multi-turn rollouts, by ``cluster.timeout_s``) sets a
:func:`batch_deadline` ``batch_margin_s`` before its own end: the environment calls inside it are
cut to the time left, so that their error (or, with ``zero``, their trajectories' 0) comes first
and the batch ends within ``cluster.timeout_s``.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import contextvars
import faulthandler
import os
import queue
import signal
import sys
import threading
import time
from typing import Any, Callable

from rlcore.errors import RunStopped
from rlcore.interfaces import ClosableEnvironment, EnvStep, SessionEnvironment, TrajectoryTurns


class EnvironmentTimeout(TimeoutError, RunStopped):
    """An environment call took longer than ``cluster.timeout_s``."""


class EnvironmentExit(RuntimeError, RunStopped):
    """An environment called ``sys.exit`` (``SystemExit``): the run stops saying so, not silently."""


class GenerationTimeout(TimeoutError, RunStopped):
    """A generator call took longer than ``cluster.timeout_s``."""


class CallTimeout(TimeoutError, RunStopped):
    """A call of the run loop into a plugin other than the environment and the generator (a metric
    logger, a distillation teacher) took longer than ``cluster.timeout_s``."""


class _Wrapper:
    """Attributes other than a wrapper's own pass through to the object it wraps (``inner``)."""

    def __getattr__(self, attr: str) -> Any:
        if attr == "inner":  # not set yet (unpickling): no recursion
            raise AttributeError(attr)
        return getattr(self.inner, attr)


def bounded_call(fn: Callable[[], Any], what: str, timeout_s: float | None, step: int | None = None) -> Any:
    """``fn()`` bounded by ``timeout_s`` (None: unbounded); on expiry a :class:`CallTimeout` naming ``what`` and the step."""
    if timeout_s is None:
        return fn()
    at = "" if step is None else f" at step {step}"
    return call_with_timeout(fn, timeout_s, lambda: f"timeout: {what} did not return within {timeout_s:g}s "
                                                    f"(cluster.timeout_s){at}", CallTimeout)


class TimedTeacher(_Wrapper):
    """A :class:`rlcore.interfaces.Teacher` whose ``logprobs`` is bounded (:func:`bounded_call`); other attributes pass through."""

    def __init__(self, teacher, timeout_s: float):
        self.inner, self.timeout_s = teacher, timeout_s

    def logprobs(self, batch):
        return bounded_call(lambda: self.inner.logprobs(batch), f"the teacher {type(self.inner).__name__} (logprobs)",
                            self.timeout_s)


class TeardownTimeout(TimeoutError):
    """A component's close or shutdown at the run's end took longer than ``cluster.timeout_s``."""


def bounded_teardown(fn: Callable[[], Any], what: str, timeout_s: float) -> None:
    """``fn()`` (a close or shutdown as the run ends), bounded by ``timeout_s``: on expiry a warning naming
    ``what``, and the run ends as it would have (the stuck call is left behind)."""
    try:
        call_with_timeout(fn, timeout_s, lambda: f"timeout: {what} did not finish within {timeout_s:g}s "
                                                 "(cluster.timeout_s) as the run ended; left behind", TeardownTimeout)
    except TeardownTimeout as exc:
        print(f"warning: {exc}", flush=True)


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
    fired: list[TimeoutError] = []

    def expire(signum, frame):
        if outer_first and time.monotonic() - started < timeout_s:
            previous(signum, frame)  # the other deadline came first: it decides (pytest-timeout fails the test)
            signal.setitimer(signal.ITIMER_REAL, max(timeout_s - (time.monotonic() - started), 1e-3))
            return
        fired.append(expired())
        raise fired[-1]

    try:
        signal.signal(signal.SIGALRM, expire)
    except ValueError as exc:  # "signal only works in main thread of the main interpreter"
        raise _OffTheMainThread from exc
    signal.setitimer(signal.ITIMER_REAL, outer_delay if outer_first else timeout_s)
    try:
        value = fn()
    except BaseException as exc:
        # The call caught its timeout and raised something else instead: still timed out, unless what it raised
        # names what stopped the run more closely (an inner part's own deadline, expiring with this one).
        if fired and exc is not fired[0] and not isinstance(exc, RunStopped):
            raise fired[0] from None
        raise
    else:
        if fired:  # the call caught its timeout (a broad ``except`` inside it) and returned: it still timed out
            raise fired[0]
        return value
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        if outer_delay and not outer_first:
            signal.setitimer(signal.ITIMER_REAL, max(outer_delay - (time.monotonic() - started), 1e-3), outer_interval)


class _Helpers:
    """Daemon threads that run bounded calls, each reused once its call returns. A call that never
    returns keeps its thread (abandoned, as before); the next call gets another."""

    def __init__(self, name: str = "rlcore-bounded-call") -> None:
        self._idle: list[queue.SimpleQueue] = []
        self._lock = threading.Lock()
        self.name = name

    def submit(self, fn: Callable[[], Any]) -> tuple[threading.Event, dict[str, Any]]:
        box: dict[str, Any] = {}
        done = threading.Event()
        with self._lock:
            inbox = self._idle.pop() if self._idle else None
        if inbox is None:
            inbox = queue.SimpleQueue()
            threading.Thread(target=self._serve, args=(inbox,), name=self.name, daemon=True).start()
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


class DaemonThreads(concurrent.futures.Executor):
    """An executor whose threads are daemons, reused once free, started on demand (no bound of its own:
    the caller bounds how many calls run at once). A call that never returns keeps its thread, as a
    timed-out bounded call does, and nothing joins it at exit, as ``ThreadPoolExecutor``'s workers are."""

    def __init__(self, name: str):
        self._helpers = _Helpers(name)

    def submit(self, fn, /, *args, **kwargs) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()

        def run() -> None:
            if not future.set_running_or_notify_cancel():
                return
            try:
                future.set_result(fn(*args, **kwargs))
            except BaseException as exc:  # noqa: BLE001 - handed to the waiting side
                future.set_exception(exc)

        self._helpers.submit(run)
        return future


def _with_thread(fn, timeout_s: float, expired: Callable[[], TimeoutError]):
    done, box = _HELPERS.submit(fn)
    if not done.wait(timeout_s):
        raise expired()
    if "error" in box:
        raise box["error"]
    return box["value"]


class TimedEnvironment(_Wrapper):
    """Wraps an environment so that every call into it is bounded: ``step``; a multi-turn
    environment's ``step_trajectory`` and ``turn_max_new_tokens``; a session environment's
    ``open_session`` and its sessions' ``step`` and ``close``. The wrapper implements exactly the
    protocols the environment does (:class:`rlcore.interfaces.TrajectoryTurns`,
    :class:`rlcore.interfaces.SessionEnvironment`); other attributes pass through.
    ``current_step`` is set by the run loop, for the message."""

    def __new__(cls, environment=None, *args, **kwargs):  # no arguments: unpickling
        if cls is TimedEnvironment and environment is not None:
            cls = _timed_kind(isinstance(environment, TrajectoryTurns), isinstance(environment, SessionEnvironment))
        return super().__new__(cls)

    def __init__(self, environment, name: str, timeout_s: float, on_timeout: str):
        self.inner, self.name = environment, name
        self.timeout_s, self.on_timeout = timeout_s, on_timeout
        self.current_step = 0

    def _step(self, samples, responses):
        try:
            return self.inner.step(samples, responses)
        except SystemExit as exc:
            raise EnvironmentExit(f"environment '{self.name}' called sys.exit({exc.code!r}) at step {self.current_step}; "
                                  "an environment returns EnvSteps (a failed call may raise an Exception, counted in "
                                  "env/errors), it never ends the process") from None

    def _limit(self) -> float:
        """``cluster.timeout_s``, or less inside a batch that must end by a deadline (:func:`batch_deadline`)."""
        return within_batch(self.timeout_s)

    def _describe(self, call: str = "", limit: float | None = None) -> str:
        limit = self.timeout_s if limit is None else limit
        within = (f"{self.timeout_s:g}s (cluster.timeout_s)" if limit >= self.timeout_s else
                  f"{limit:.3g}s (what was left of the batch's cluster.timeout_s={self.timeout_s:g}s)")
        what = f"environment '{self.name}'" + (f" ({call})" if call else "")
        advice = (f"; set env.on_timeout=zero to score such {'trajectories' if call else 'batches'} 0 and go on"
                  if self.on_timeout == "stop" else "")  # with zero, the warning says what happens instead
        return f"timeout: {what} did not answer within {within} at step {self.current_step}{advice}"

    def _bounded(self, fn: Callable[[], Any], call: str = "") -> Any:
        limit = self._limit()
        return call_with_timeout(fn, limit, lambda: self._describe(call, limit))

    def _zero_or_raise(self, exc: EnvironmentTimeout, what: str) -> None:
        if self.on_timeout == "stop":
            raise exc
        print(f"warning: {exc}; {what} (env.on_timeout=zero)", flush=True)

    def close(self) -> None:
        """The environment's own ``close`` (if it has one) as the run ends, bounded (:func:`bounded_teardown`)."""
        if isinstance(self.inner, ClosableEnvironment):
            bounded_teardown(self.inner.close, f"environment '{self.name}' (close)", self.timeout_s)

    def step(self, samples, responses):
        try:
            return self._bounded(lambda: self._step(samples, responses))
        except EnvironmentTimeout as exc:
            self._zero_or_raise(exc, f"the batch of {len(samples)} scores 0")
            return [_timed_out() for _ in samples]


def _timed_out() -> EnvStep:
    return EnvStep(reward=0.0, done=True, metrics={"timeout": 1.0})


class _BoundedTurns:
    """:class:`rlcore.interfaces.TrajectoryTurns`' calls, bounded as ``step`` is."""

    def step_trajectory(self, sample, trajectory: int, history):
        try:
            return self._bounded(lambda: self.inner.step_trajectory(sample, trajectory, history), "step_trajectory")
        except EnvironmentTimeout as exc:
            self._zero_or_raise(exc, "the trajectory scores 0")
            return _timed_out()

    def turn_max_new_tokens(self, sample, trajectory: int, turn: int):
        try:
            return self._bounded(lambda: self.inner.turn_max_new_tokens(sample, trajectory, turn), "turn_max_new_tokens")
        except EnvironmentTimeout as exc:
            self._zero_or_raise(exc, "the turn gets no budget of its own")
            return None


class _BoundedSessions:
    """:class:`rlcore.interfaces.SessionEnvironment`'s ``open_session`` and its sessions' calls, bounded
    as ``step`` is. A session that opens after its deadline is closed as soon as it does; a session
    whose ``step`` timed out is closed without waiting (its ``close`` runs on a helper thread)."""

    def open_session(self, sample):
        lock, cell = threading.Lock(), {}

        def open_or_close_late():
            session = self.inner.open_session(sample)
            with lock:
                late = cell.setdefault("abandoned", False)
                cell["session"] = session
            if late:
                _close_quietly(session)
            return session

        try:
            session = self._bounded(open_or_close_late, "open_session")
        except EnvironmentTimeout as exc:
            with lock:
                session = cell.get("session")  # it came as the deadline passed: keep it
                cell["abandoned"] = session is None
            if session is None:
                self._zero_or_raise(exc, "the trajectory scores 0")
                return _TimedOutSession()
        return TimedSession(session, self)


def _close_quietly(session) -> None:
    try:
        session.close()
    except Exception:  # noqa: BLE001 - an abandoned session's close: nobody is left to tell
        pass


class _TimedOutSession:
    """Stands for a session that did not open in time (``env.on_timeout: zero``): it scores 0."""

    def step(self, turn: str) -> EnvStep:
        return _timed_out()

    def close(self) -> None:
        pass


class TimedSession(_Wrapper):
    """An :class:`rlcore.interfaces.EnvironmentSession` whose ``step`` and ``close`` are bounded by its
    :class:`TimedEnvironment`'s limit and ``on_timeout``."""

    def __init__(self, session, environment: TimedEnvironment):
        self.inner, self.environment, self.timed_out = session, environment, False

    def step(self, turn: str) -> EnvStep:
        try:
            return self.environment._bounded(lambda: self.inner.step(turn), "session step")
        except EnvironmentTimeout as exc:
            self.timed_out = True
            self.environment._zero_or_raise(exc, "the trajectory scores 0")
            return _timed_out()

    def close(self) -> None:
        if self.timed_out:  # its step is still stuck: close beside it, without waiting
            _HELPERS.submit(lambda: _close_quietly(self.inner))
            return
        try:
            self.environment._bounded(self.inner.close, "session close")
        except EnvironmentTimeout as exc:
            self.environment._zero_or_raise(exc, "the trajectory keeps its score")


class TimedTurnsEnvironment(_BoundedTurns, TimedEnvironment):
    """A :class:`TimedEnvironment` of a :class:`rlcore.interfaces.TrajectoryTurns` environment."""


class TimedSessionEnvironment(_BoundedSessions, TimedEnvironment):
    """A :class:`TimedEnvironment` of a :class:`rlcore.interfaces.SessionEnvironment`."""


class TimedTurnsSessionEnvironment(_BoundedTurns, _BoundedSessions, TimedEnvironment):
    """A :class:`TimedEnvironment` of an environment that is both."""


def _timed_kind(turns: bool, sessions: bool) -> type:
    """The :class:`TimedEnvironment` class with exactly the environment's protocols: a class of its own,
    since a runtime protocol check may look at the class only (Python 3.12's does)."""
    return {(False, False): TimedEnvironment, (True, False): TimedTurnsEnvironment,
            (False, True): TimedSessionEnvironment, (True, True): TimedTurnsSessionEnvironment}[turns, sessions]


# ---- a batch's deadline ----------------------------------------------------------------------
_BATCH_DEADLINE: contextvars.ContextVar[float | None] = contextvars.ContextVar("rlcore_batch_deadline", default=None)


def batch_margin_s(timeout_s: float) -> float:
    """What a batch bounded as a whole by ``timeout_s`` keeps back so that the error of a call inside
    it (naming the environment or the agent) comes before the batch's own: 5% of it, between 1 s and
    5 s, and at most half of it."""
    return min(5.0, max(1.0, 0.05 * timeout_s), 0.5 * timeout_s)


@contextlib.contextmanager
def batch_deadline(seconds: float):
    """Calls bounded inside (in this context; threads given it with ``contextvars.copy_context``) end
    within ``seconds`` from now, whatever their own limit."""
    token = _BATCH_DEADLINE.set(time.monotonic() + seconds)
    try:
        yield
    finally:
        _BATCH_DEADLINE.reset(token)


def within_batch(limit_s: float) -> float:
    """``limit_s``, or the time left before the current batch's deadline when that is less (at least 1 ms)."""
    deadline = _BATCH_DEADLINE.get()
    if deadline is None:
        return limit_s
    return max(min(limit_s, deadline - time.monotonic()), 1e-3)


# ---- the process's own end -------------------------------------------------------------------
def exit_after(timeout_s: float, status: int, why: Callable[[], str],
               cancelled: threading.Event | None = None) -> threading.Thread:
    """A daemon thread that ends this process with ``status`` ``timeout_s`` from now, unless
    ``cancelled`` is set first: it writes ``rlcore: <why()>`` and every thread's Python stack to the
    process's own stderr (what it waited for), then ``os._exit`` (no handler or thread can keep it)."""
    cancelled = cancelled or threading.Event()

    def end_the_process() -> None:
        if cancelled.wait(timeout_s):
            return
        stream = sys.__stderr__
        if stream is not None:
            stream.write(f"rlcore: {why()}; every thread's stack follows, then it exits\n")
            stream.flush()
            faulthandler.dump_traceback(file=stream, all_threads=True)
            stream.flush()
        os._exit(status)

    watchdog = threading.Thread(target=end_the_process, name="rlcore-exit-watchdog", daemon=True)
    watchdog.start()
    return watchdog


class SigtermDeadline:
    """After SIGTERM (a scheduler's stop, ``timeout`` on the process group), the run has
    ``cluster.timeout_s`` to end: its step, its checkpoint and its teardown. A part the signal
    killed too (vLLM's engine, in the same process group) can leave a call into it waiting: each
    such call is bounded on its own, but one after another (a refit, then the generator's shutdown)
    they could add up to several times the limit. :meth:`arm` (by the SIGTERM handler) starts the
    process's end at the deadline (exit 128 + the signal); :meth:`disarm` (as ``rlcore.run`` returns)
    cancels it."""

    def __init__(self) -> None:
        self._cancelled: threading.Event | None = None

    def arm(self, timeout_s: float, signum: int) -> None:
        if self._cancelled is not None:
            return
        self._cancelled = threading.Event()
        name = signal.Signals(signum).name
        exit_after(timeout_s, 128 + signum, lambda: f"{name} received {timeout_s:g}s ago (cluster.timeout_s) and the run "
                                                   "has not ended (a call into a part the signal ended too may never "
                                                   "return); its newest checkpoint is kept", self._cancelled)

    def disarm(self) -> None:
        if self._cancelled is not None:
            self._cancelled.set()
            self._cancelled = None


SIGTERM_DEADLINE = SigtermDeadline()
