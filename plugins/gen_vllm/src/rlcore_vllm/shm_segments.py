"""The shared-memory segments of an engine's processes, removed once those processes have ended.

vLLM's multiprocess executor keeps the message queue to its workers in a shared-memory segment
(``/dev/shm/psm_*``) that the engine core creates, and removes it when that queue is garbage
collected as the engine core exits. vLLM's shutdown gives the engine core 5 seconds before it kills
it: on a loaded CPU machine that is often too short, the segment stays, and Python's resource
tracker says so as the run exits ("There appear to be 1 leaked shared_memory objects"), then
removes it. :class:`EngineProcesses` notes the processes an engine start spawned and the segments
they map (Linux's ``/proc/<pid>/maps``); :meth:`~EngineProcesses.release`, after the engine's shutdown,
waits for those processes to end and removes what they left, unregistering it from the tracker.
"""

from __future__ import annotations

import re
from pathlib import Path

_SEGMENT = re.compile(r"/dev/shm/(psm_[0-9a-f]+)")


def mapped_segments(pid: int | str) -> set[str]:
    """Names of the Python shared-memory segments process ``pid`` maps (none where /proc cannot be read)."""
    try:
        return set(_SEGMENT.findall(Path(f"/proc/{pid}/maps").read_text()))
    except OSError:
        return set()


def _children() -> dict[int, object]:
    import psutil  # a dependency of vLLM

    return {p.pid: p for p in psutil.Process().children(recursive=True)}


class EngineProcesses:
    """Use :meth:`before` and :meth:`after` around an engine's start, :meth:`release` after its shutdown."""

    def __init__(self):
        self._known: set[int] = set()
        self.processes: list = []
        self.segments: set[str] = set()

    def before(self) -> None:
        from multiprocessing import resource_tracker

        # Started now if it is not running, so it is not taken for one of the engine's processes
        # (it lives as long as this process: release() would wait for it in vain).
        resource_tracker.ensure_running()
        self._known = set(_children())

    def after(self) -> None:
        """The processes the start spawned, and the segments they map now (their queues exist once it returns)."""
        self.processes = [p for pid, p in _children().items() if pid not in self._known]
        for process in self.processes:
            self.segments |= mapped_segments(process.pid)

    def release(self, wait_s: float = 30.0) -> list[str]:
        """Once the engine's processes have ended (waiting up to ``wait_s``), remove the segments they
        left that no process of ours maps; returns their names."""
        import psutil

        _, alive = psutil.wait_procs(self.processes, timeout=wait_s)
        in_use = mapped_segments("self")
        for process in [*alive, *_children().values()]:
            in_use |= mapped_segments(process.pid)
        removed = []
        for name in sorted(self.segments - in_use):
            if Path("/dev/shm", name).exists() and _unlink(name):
                removed.append(name)
        self.segments.clear()
        return removed


def _unlink(name: str) -> bool:
    """Remove segment ``name`` and its entry in the resource tracker (attaching registers it there
    too, on Python before 3.13; unlinking unregisters it)."""
    from multiprocessing import shared_memory

    try:
        segment = shared_memory.SharedMemory(name=name)
    except (FileNotFoundError, PermissionError):
        return False
    segment.close()
    try:
        segment.unlink()
    except FileNotFoundError:  # gone meanwhile
        return False
    return True
