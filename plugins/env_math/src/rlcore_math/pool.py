"""Batched, parallel grading: a process pool with per-response deadlines, or Ray actors.

Each worker grades in its own main thread, so :func:`rlcore_math.grading.grade_text`'s signal
deadline works there. That deadline cannot interrupt a long C call (a huge sympy integer
power, say), so the parent also watches each worker's progress counter (shared memory, so
verdicts can travel in batches): a worker stuck for longer than ``timeout_s + kill_grace_s`` on
one response is killed and replaced, that response scores ``timeout`` and the rest of its chunk
goes to the next free worker. The parent runs :func:`~rlcore_math.grading.precheck` first, so
oversized responses never cross a pipe.
"""

from __future__ import annotations

import collections
import multiprocessing as mp
import os
import signal
import time
import weakref
from multiprocessing.connection import wait
from typing import Any

from rlcore.utils import resolve
from rlcore_math.config import GradingConfig
from rlcore_math.grading import Verdict, grade_text, precheck

Task = tuple[int, str, str]  # (index in the batch, pre-checked text, gold)
_STARTUP_GRACE_S = 60.0  # a fresh spawned worker imports sympy and math-verify first


def _grade_chunk(chunk: list[Task], options: GradingConfig, grade_fn=grade_text):
    for index, text, gold in chunk:
        yield index, grade_fn(text, gold, timeout_s=options.timeout_s, float_rounding=options.float_rounding,
                                answer_format=options.answer_format, strict_format=options.strict_format)


_FLUSH_S = 0.02  # a worker sends its verdicts at least this often (and at the end of a chunk)


def _worker_main(conn, progress, options: GradingConfig, grade_fn_path: str) -> None:
    """Grade chunks; ``progress.value`` counts responses started, so the parent can tell which one is stuck."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    grade_fn = resolve(grade_fn_path)
    import rlcore_math.warm  # noqa: F401 - already done when forked from a preloaded forkserver
    conn.send([])  # ready: the parent starts its stall clock now
    while True:
        try:
            chunk = conn.recv()
        except (EOFError, OSError):
            return  # parent went away
        if chunk is None:
            return
        out, flushed = [], time.monotonic()
        for task in chunk:
            progress.value += 1
            for index, verdict in _grade_chunk([task], options, grade_fn):
                out.append((index, tuple(verdict)))
            if time.monotonic() - flushed > _FLUSH_S:
                conn.send(out)
                out, flushed = [], time.monotonic()
        conn.send(out)


class _Worker:
    """One grader process, its pipe, and what the parent knows of its progress."""

    def __init__(self, ctx, options: GradingConfig, grade_fn_path: str):
        self.conn, child = ctx.Pipe(duplex=True)
        self.progress = ctx.Value("q", 0, lock=False)  # shared memory: read without any message
        self.process = ctx.Process(target=_worker_main, args=(child, self.progress, options, grade_fn_path),
                                   daemon=True, name="rlcore-math-grader")
        self.process.start()
        child.close()
        self.chunk: dict[int, Task] = {}  # batch index -> task, not yet answered
        self.order: list[int] = []  # batch indices of the current chunk, in grading order
        self.sent = 0  # responses sent before the current chunk
        self.seen = (0, time.monotonic() + _STARTUP_GRACE_S)  # (progress, when it was first seen)

    def assign(self, chunk: list[Task]) -> None:
        self.sent = self.progress.value
        self.chunk = {task[0]: task for task in chunk}
        self.order = [task[0] for task in chunk]
        self.seen = (self.progress.value, max(self.seen[1], time.monotonic()))
        self.conn.send(chunk)

    def stalled_since(self) -> float:
        value = self.progress.value
        if value != self.seen[0]:
            self.seen = (value, time.monotonic())
        return self.seen[1]

    def current(self) -> int | None:
        """Batch index of the response being graded now (None if it has not started one)."""
        position = self.progress.value - self.sent - 1
        return self.order[position] if 0 <= position < len(self.order) else None

    def kill(self) -> None:
        self.process.kill()
        self.process.join(timeout=5)
        self.conn.close()


def _context(start_method: str):
    """A multiprocessing context; for "forkserver", one whose server preloads :mod:`rlcore_math.warm`.

    The fork server is started once per process, from a clean interpreter (no threads, no torch),
    and forks workers that already have math-verify imported and warm. If something else started
    it first, workers import math-verify themselves: slower to start, otherwise the same.
    """
    ctx = mp.get_context(start_method)
    if start_method == "forkserver":
        from multiprocessing import forkserver

        server = forkserver._forkserver  # noqa: SLF001 - the stdlib exposes no "is it running?"
        if getattr(server, "_forkserver_pid", None) is None:
            preload = list(getattr(server, "_preload_modules", ["__main__"]))
            ctx.set_forkserver_preload(preload + [m for m in ("rlcore_math.warm",) if m not in preload])
    return ctx


class ProcessGradingPool:
    """``num_workers`` spawned grader processes; :meth:`grade` scores a batch in parallel.

    A worker whose progress counter has not moved for ``timeout_s + kill_grace_s`` is killed
    and replaced; the response it was on scores ``timeout`` (``error`` if the worker died on its
    own), and its other unanswered responses go back in the queue. A worker found dead when it is
    handed a chunk (killed while idle, by the OS for memory say) is replaced and the chunk goes to
    the next free worker, unscored by it.

    ``grade_fn`` ("module:attr", signature of :func:`~rlcore_math.grading.grade_text`) is what
    workers call per response; tests swap it to exercise the kill-and-replace path.
    """

    def __init__(self, options: GradingConfig, start_method: str = "forkserver", grade_fn: str = "rlcore_math.grading:grade_text"):
        self.options = options
        self._ctx = _context(start_method)
        self._grade_fn = grade_fn
        self._workers = [_Worker(self._ctx, options, grade_fn) for _ in range(options.num_workers)]
        self.restarts = 0
        self._finalizer = weakref.finalize(self, _shutdown, self._workers)  # also runs at exit

    def grade(self, responses: list[Any], golds: list[Any]) -> list[Verdict]:
        verdicts, tasks = _prechecked(responses, golds, self.options)
        size = max(1, min(self.options.chunk_size, -(-len(tasks) // len(self._workers))))
        pending = collections.deque(tasks[i : i + size] for i in range(0, len(tasks), size))
        hard_limit = self.options.timeout_s + self.options.kill_grace_s
        busy: dict[int, _Worker] = {}
        restarts_before = self.restarts
        while pending or busy:
            self._check_restarts(restarts_before, len(tasks))
            for slot, worker in enumerate(self._workers):
                if slot not in busy and pending:
                    busy[slot] = worker
                    try:
                        worker.assign(pending.popleft())
                    except (BrokenPipeError, ConnectionResetError, EOFError):  # it died while idle (OOM killer, say)
                        self._replace(slot, verdicts, busy, pending, "error")
            if not busy:  # every free worker was found dead and replaced: hand the chunks to the new ones
                continue
            conns = {worker.conn: slot for slot, worker in busy.items()}
            deadline = min(w.stalled_since() for w in busy.values()) + hard_limit
            for conn in wait(list(conns), timeout=max(0.0, deadline - time.monotonic())):
                self._receive(conns[conn], verdicts, busy, pending)
            now = time.monotonic()
            for slot, worker in list(busy.items()):
                if now - worker.stalled_since() > hard_limit:
                    self._replace(slot, verdicts, busy, pending, "timeout")
        return verdicts

    def _check_restarts(self, restarts_before: int, num_tasks: int) -> None:
        """Every replacement either scores one response (the one its worker was on) or none (the worker
        died before starting one); more replacements than that allows mean workers die on their own."""
        allowed = num_tasks + 2 * len(self._workers)
        if self.restarts - restarts_before > allowed:
            raise RuntimeError(
                f"rlcore_math grading pool: {self.restarts - restarts_before} grader workers were replaced while grading "
                f"{num_tasks} responses; workers die before grading anything (see their stderr: an import error of "
                f"grade_fn {self._grade_fn!r}, or the host out of memory)")

    def _receive(self, slot: int, verdicts: list, busy: dict, pending: collections.deque) -> None:
        worker = busy[slot]
        try:
            answered = worker.conn.recv()
        except (EOFError, OSError):  # the worker died (e.g. killed by the OS for memory)
            self._replace(slot, verdicts, busy, pending, "error")
            return
        for index, verdict in answered:
            verdicts[index] = Verdict(*verdict)
            worker.chunk.pop(index, None)
        worker.seen = (worker.progress.value, time.monotonic())  # alive (also ends the start-up grace)
        if not worker.chunk:
            del busy[slot]

    def _replace(self, slot: int, verdicts: list, busy: dict, pending: collections.deque, status: str) -> None:
        """Kill a stuck or dead worker: its current response gets ``status``, the rest is re-queued."""
        worker = busy.pop(slot)
        stuck = worker.current()
        worker.kill()
        if stuck is not None and stuck in worker.chunk:
            del worker.chunk[stuck]
            verdicts[stuck] = Verdict(False, False, status)
        if worker.chunk:
            pending.appendleft([worker.chunk[i] for i in worker.order if i in worker.chunk])
        self._workers[slot] = _Worker(self._ctx, self.options, self._grade_fn)
        self.restarts += 1

    def close(self) -> None:
        self._finalizer()


def _shutdown(workers: list[_Worker]) -> None:
    for worker in workers:
        try:
            worker.conn.send(None)
        except (OSError, ValueError):
            pass
    for worker in workers:  # stateless workers: a short wait, then no ceremony
        worker.process.join(timeout=0.5)
        if worker.process.is_alive():
            worker.process.kill()
            worker.process.join(timeout=2)


def _prechecked(responses: list[Any], golds: list[Any], options: GradingConfig) -> tuple[list[Verdict | None], list[Task]]:
    """Verdicts of the responses the pre-check rejects, and tasks for the others."""
    verdicts: list[Verdict | None] = [None] * len(responses)
    tasks: list[Task] = []
    for i, (response, gold) in enumerate(zip(responses, golds, strict=True)):
        text, status = precheck(response, options.max_response_chars, options.answer_window_chars, options.max_nesting_depth)
        if text is None:
            verdicts[i] = Verdict(False, False, status)
        else:
            tasks.append((i, text, "" if gold is None else str(gold)))
    return verdicts, tasks


class InlineGrader:
    """Grades in the calling thread (signal deadline only in the main thread). For tests and debugging."""

    def __init__(self, options: GradingConfig):
        self.options = options

    def grade(self, responses: list[Any], golds: list[Any]) -> list[Verdict]:
        verdicts, tasks = _prechecked(responses, golds, self.options)
        for index, verdict in _grade_chunk(tasks, self.options):
            verdicts[index] = verdict
        return verdicts

    def close(self) -> None:
        pass


class RayGradingPool:
    """``num_workers`` Ray actors (0 CPUs reserved, so they never wait for trainer resources).

    A Ray actor method runs in the actor's main thread, so the signal deadline works; a chunk
    whose actor overruns every response's hard limit is killed, its actor replaced, and its
    ungraded responses score ``timeout``.
    """

    def __init__(self, options: GradingConfig):
        import ray

        if not ray.is_initialized():
            if options.ray_address or os.environ.get("RAY_ADDRESS"):
                ray.init(address=options.ray_address, include_dashboard=False, log_to_driver=False)
            else:  # a local instance listening on loopback only, as rlcore's own
                from rlcore.runtime import start_local_ray

                start_local_ray(log_to_driver=False)
        self._ray = ray
        self.options = options
        self._actor_cls = ray.remote(num_cpus=0, max_restarts=0)(_RayGrader)
        self._actors = [self._actor_cls.remote(options) for _ in range(options.num_workers)]
        self.restarts = 0

    def grade(self, responses: list[Any], golds: list[Any]) -> list[Verdict]:
        verdicts, tasks = _prechecked(responses, golds, self.options)
        if not tasks:
            return verdicts
        n = len(self._actors)
        size = max(1, min(self.options.chunk_size, -(-len(tasks) // n)))
        chunks = [tasks[i : i + size] for i in range(0, len(tasks), size)]
        hard_limit = self.options.timeout_s + self.options.kill_grace_s
        for first in range(0, len(chunks), n):
            wave = chunks[first : first + n]
            refs = [self._actors[k].grade.remote(chunk) for k, chunk in enumerate(wave)]
            done, _ = self._ray.wait(refs, num_returns=len(refs), timeout=hard_limit * size + _STARTUP_GRACE_S)
            for k, (ref, chunk) in enumerate(zip(refs, wave)):
                if ref in done:
                    try:
                        for index, verdict in self._ray.get(ref):
                            verdicts[index] = Verdict(*verdict)
                        continue
                    except Exception:  # noqa: BLE001 - a dead actor: its chunk scores 'error'
                        status = "error"
                else:
                    status = "timeout"
                for index, _, _ in chunk:
                    verdicts[index] = verdicts[index] or Verdict(False, False, status)
                self._ray.kill(self._actors[k])
                self._actors[k] = self._actor_cls.remote(self.options)
                self.restarts += 1
        return verdicts

    def close(self) -> None:
        for actor in self._actors:
            self._ray.kill(actor)
        self._actors = []


class _RayGrader:
    def __init__(self, options: GradingConfig):
        self.options = options
        grade_text("1", "1", timeout_s=None)

    def grade(self, chunk: list[Task]) -> list[tuple[int, tuple]]:
        return [(index, tuple(verdict)) for index, verdict in _grade_chunk(chunk, self.options)]


def make_grader(options: GradingConfig):
    """The grader ``options.executor`` names; each has ``grade(responses, golds)`` and ``close()``."""
    if options.executor == "inline":
        return InlineGrader(options)
    if options.executor == "ray":
        return RayGradingPool(options)
    return ProcessGradingPool(options)
