"""A line at least every few seconds while a run is busy and otherwise silent.

vLLM's engine start, the held-out pass before the first step, or a step on a loaded machine can
each take a minute with nothing on the console (the libraries' own logs are off by default): a
person cannot tell a slow run from a hung one. While a :func:`heartbeat` block runs, a thread
prints what the run is doing and for how long (``... starting the generator (vllm): 20s``) once
nothing was printed for ``every_s`` seconds. Parts of the run say what they start with
:func:`doing`, and :func:`said` after a line of their own; both do nothing outside a block.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator

_ACTIVE: Heartbeat | None = None


class Heartbeat:
    def __init__(self, every_s: float, write: Callable[[str], None]):
        self.every_s, self.write = every_s, write
        self.what, self.since = "starting the run", time.monotonic()
        self.last = self.since  # when a line was last printed, by the run or by this
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="rlcore-heartbeat", daemon=True)

    def doing(self, what: str) -> None:
        self.what, self.since = what, time.monotonic()

    def said(self) -> None:
        self.last = time.monotonic()

    def _beat(self) -> None:
        while not self._stop.wait(min(1.0, self.every_s)):
            now = time.monotonic()
            if now - self.last >= self.every_s:
                self.write(f"... {self.what}: {now - self.since:.0f}s")
                self.last = now


@contextlib.contextmanager
def heartbeat(enabled: bool = True, every_s: float = 10.0, write: Callable[[str], None] | None = None) -> Iterator[None]:
    """Within the block, a line whenever nothing was printed for ``every_s`` seconds (not nested:
    an inner block leaves the outer one's)."""
    global _ACTIVE
    if not enabled or _ACTIVE is not None:
        yield
        return
    beat = Heartbeat(every_s, write or (lambda line: print(line, flush=True)))
    _ACTIVE = beat
    beat._thread.start()
    try:
        yield
    finally:
        beat._stop.set()
        beat._thread.join(timeout=5)
        _ACTIVE = None


def doing(what: str) -> None:
    """The run starts ``what`` (the heartbeat's lines name it, with the seconds since)."""
    if _ACTIVE is not None:
        _ACTIVE.doing(what)


def said() -> None:
    """The run printed a line of its own: the next heartbeat is ``every_s`` from now."""
    if _ACTIVE is not None:
        _ACTIVE.said()
