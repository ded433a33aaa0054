"""Python's garbage collector in a run: its pauses measured, and the setup's objects out of its reach.

A collection holds the interpreter lock from start to end, so every thread of the process stops
meanwhile: one step off's rollout thread, which feeds the engine, and the trainer launching its
kernels. A full collection walks every object the collector tracks, and a process that holds a
Megatron model, vLLM's front end and ``transformers`` tracks millions of them, almost all made
during setup and alive for the whole run. ``gc.freeze()`` once the setup is done moves those to
the permanent generation, which collections skip; what the run makes afterwards is collected as
before. vLLM freezes its engine's heap after start-up the same way (``freeze_gc_heap``); SGLang
exposes it as an API for the same latency.
"""

from __future__ import annotations

import contextlib
import gc
import time
from collections.abc import Iterator


class GCClock:
    """Seconds this process spent in the garbage collector, from ``gc.callbacks``: :meth:`take` gives
    what happened since its last call; the run loop records it with each step as ``time/gc_s``,
    ``time/gc_longest_s`` and ``time/gc_full_collections``."""

    def __init__(self) -> None:
        self._began: float | None = None
        self._reset()

    def _reset(self) -> None:
        self.seconds, self.longest, self.full = 0.0, 0.0, 0

    def __enter__(self) -> GCClock:
        self._reset()
        gc.callbacks.append(self._on_collection)
        return self

    def __exit__(self, *exc) -> None:
        if self._on_collection in gc.callbacks:
            gc.callbacks.remove(self._on_collection)

    def _on_collection(self, phase: str, info: dict) -> None:
        now = time.perf_counter()
        if phase == "start":
            self._began = now
        elif self._began is not None:
            took, self._began = now - self._began, None
            self.seconds += took
            self.longest = max(self.longest, took)
            self.full += int(info.get("generation") == 2)

    def take(self) -> dict[str, float]:
        out = {"time/gc_s": self.seconds, "time/gc_longest_s": self.longest, "time/gc_full_collections": float(self.full)}
        self._reset()
        return out


@contextlib.contextmanager
def setup_objects_frozen(enabled: bool) -> Iterator[None]:
    """Collect, then freeze every object alive now (``cluster.gc_freeze_setup``); undone on exit when
    nothing else in the process had frozen objects before (vLLM's engine does so in its own process)."""
    if not enabled:
        yield
        return
    frozen_before = gc.get_freeze_count()
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        if frozen_before == 0:
            gc.unfreeze()
