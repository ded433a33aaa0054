"""What Python's interpreter costs a run: the garbage collector's pauses, and waits for its lock.

A collection holds the interpreter lock from start to end, so every thread of the process stops
meanwhile: one step off's rollout thread, which feeds the engine, and the trainer launching its
kernels. A full collection walks every object the collector tracks, and a process that holds a
Megatron model, vLLM's front end and ``transformers`` tracks millions of them, almost all made
during setup and alive for the whole run. ``cluster.gc_period`` moves those to the permanent
generation once the setup is done (``gc.freeze()``, as vLLM freezes its engine's heap after
start-up), turns automatic collection off and collects after every N steps' training, as
Megatron-LM's ``--manual-gc`` and torchtitan's ``gc_freq`` do.

:class:`GCClock` records the collector's pauses with each step; :class:`LockLagProbe`
(``experimental.gil_lag_probe``) how late a thread that sleeps 5 ms at a time wakes, which is how long
a thread of the process waits for the interpreter lock.
"""

from __future__ import annotations

import gc
import threading
import time
from typing import Self


class GCClock:
    """Seconds this process spent in the garbage collector, from ``gc.callbacks``: :meth:`take` gives
    what happened since its last call; the run loop records it with each step as ``time/gc_s``,
    ``time/gc_longest_s`` and ``time/gc_full_collections``."""

    def __init__(self) -> None:
        self._began: float | None = None
        self._reset()

    def _reset(self) -> None:
        self.seconds, self.longest, self.full = 0.0, 0.0, 0

    def __enter__(self) -> Self:
        self._reset()
        gc.callbacks.append(self._on_collection)
        return self

    def __exit__(self, *exc) -> None:
        if self._on_collection in gc.callbacks:
            gc.callbacks.remove(self._on_collection)

    def _on_collection(self, phase: str, info: dict) -> None:
        full = info.get("generation") == 2
        now = time.perf_counter()
        if phase == "start":
            self._began = now
        elif self._began is not None:
            took, self._began = now - self._began, None
            self.seconds += took
            self.longest = max(self.longest, took)
            self.full += int(full)

    def take(self) -> dict[str, float]:
        out = {"time/gc_s": self.seconds, "time/gc_longest_s": self.longest, "time/gc_full_collections": float(self.full)}
        self._reset()
        return out


class CollectorPolicy:
    """``cluster.gc_period`` for the length of a run (``with``): with a period, the objects alive at
    the start frozen, automatic collection off, one full collection after every ``period`` steps'
    training; without one (0), nothing changes. What it changes is restored on exit."""

    def __init__(self, period: int):
        self.period = period
        self._frozen_before = 0
        self._enabled_before = True

    def __enter__(self) -> Self:
        if self.period:
            self._enabled_before = gc.isenabled()
            self._frozen_before = gc.get_freeze_count()
            gc.collect()
            gc.freeze()
            gc.disable()
        return self

    def after_training(self, step: int) -> None:
        """The collection of step ``step``, when due: the trainer is done, the engine may be generating."""
        if self.period and step % self.period == 0:
            gc.collect()

    def __exit__(self, *exc) -> None:
        if not self.period:
            return
        if self._enabled_before:
            gc.enable()
        # Undone only when nothing else in the process had frozen objects (vLLM's engine does in its own process).
        if self._frozen_before == 0:
            gc.unfreeze()


class LockLagProbe:
    """A daemon thread that sleeps ``period_s`` at a time and records how late it wakes up: waking
    needs the interpreter lock, so the lateness is what any thread of the process waits for it
    (plus the OS's wake-up, tens of microseconds). :meth:`take`: ``time/gil_lag_mean_s`` and
    ``time/gil_lag_max_s`` since its last call."""

    def __init__(self, enabled: bool, period_s: float = 0.005):
        self.enabled, self.period_s = enabled, period_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lags: list[float] = []

    def __enter__(self) -> Self:
        if self.enabled:
            self._thread = threading.Thread(target=self._run, name="rlcore-gil-lag", daemon=True)
            self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            began = time.perf_counter()
            time.sleep(self.period_s)
            self._lags.append(time.perf_counter() - began - self.period_s)

    def take(self) -> dict[str, float]:
        if not self.enabled:
            return {}
        lags, self._lags = self._lags, []
        if not lags:
            return {}
        return {"time/gil_lag_mean_s": sum(lags) / len(lags), "time/gil_lag_max_s": max(lags)}

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=1.0)
