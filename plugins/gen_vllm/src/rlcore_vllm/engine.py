"""The two vLLM engines behind one small interface: ``run(requests)``, ``arun(request)``, ``rpc``.

- :class:`SyncEngine` wraps ``vllm.LLM`` (batch rollouts). Concurrent ``arun`` calls are
  gathered into batches by one thread, since ``LLM`` is not reentrant.
- :class:`AsyncEngine` wraps ``AsyncLLM`` on its own event-loop thread, so callers from any
  thread or event loop can submit work (many requests in flight), and sync calls block on it.

A request is ``(prompt, vllm.SamplingParams)``, the prompt token ids or a ``TokensPrompt`` mapping (one with
images); results are vLLM ``RequestOutput`` objects.

Both start vLLM's processes (engine core, workers) with SIGINT blocked (:func:`terminal_sigint_held`):
a terminal's Ctrl-C goes to its whole foreground process group, and it is the caller's to handle
(``rlcore run`` ends the step and checkpoints it); the engine ends when its caller shuts it down or exits.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import queue
import signal
import threading
import uuid
from typing import Any

from rlcore_vllm.shm_segments import EngineProcesses


@contextlib.contextmanager
def terminal_sigint_held():
    """An engine start that a terminal's Ctrl-C neither breaks nor loses.

    SIGINT is blocked in the calling thread for the block, so the processes it starts (and theirs)
    inherit the blocked mask and never see the Ctrl-C that the terminal sends to its whole
    foreground process group: vLLM's engine core and workers take SIGINT as a request to shut down,
    and the run would lose its engine in the middle of a step. They still end on SIGTERM, which is
    what vLLM's shutdown sends, and when their parent dies.

    On the main thread a SIGINT that reaches this process during the block is held and raised again
    once it ends, for the handler in place then (KeyboardInterrupt, or ``rlcore run``'s stop after
    the step): vLLM's start swallows a KeyboardInterrupt that lands in its wait for the engine.

    Python's multiprocessing resource tracker, which a spawned process needs, unblocks SIGINT in the
    thread that starts it: it is started first, so vLLM's spawn finds it running."""
    if not hasattr(signal, "pthread_sigmask"):  # not POSIX
        yield
        return
    from multiprocessing import resource_tracker

    resource_tracker.ensure_running()
    held: list[int] = []
    main = threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGINT) is not None
    handler = signal.signal(signal.SIGINT, lambda signum, frame: held.append(signum)) if main else None
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        if main:
            signal.signal(signal.SIGINT, handler)  # runs a SIGINT still pending through the holding handler first
            if held:
                signal.raise_signal(signal.SIGINT)


def _prompt(prompt):
    """A request's prompt: token ids, or a ``TokensPrompt`` mapping already built (one with images)."""
    from vllm.inputs import TokensPrompt

    if isinstance(prompt, dict):
        return TokensPrompt(**prompt)
    return TokensPrompt(prompt_token_ids=list(prompt))


class SyncEngine:
    def __init__(self, engine_kwargs: dict[str, Any]):
        from vllm import LLM

        self._processes = EngineProcesses()  # what the engine's processes leave in /dev/shm goes with them
        self._processes.before()
        with terminal_sigint_held():
            self.llm = LLM(**engine_kwargs)
        self._processes.after()
        wake_waiters_when_the_engine_dies(self.llm.llm_engine.engine_core)
        self._lock = threading.Lock()
        self._lock_start = threading.Lock()
        self._queue: queue.Queue = queue.Queue()
        self._batcher: threading.Thread | None = None
        self._closed = False

    @property
    def in_process(self) -> bool:
        """True when the engine core (and its worker) runs in this process."""
        return type(self.llm.llm_engine.engine_core).__name__ == "InprocClient"

    def run(self, requests: list[tuple[list[int], Any]]) -> list[Any]:
        if not requests:
            return []
        with self._lock:
            return self.llm.generate([_prompt(p) for p, _ in requests], [sp for _, sp in requests], use_tqdm=False)

    async def arun(self, prompt_ids: list[int], sampling_params) -> Any:
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        with self._lock_start:
            if self._batcher is None:
                self._batcher = threading.Thread(target=self._batch_loop, name="rlcore-vllm-batcher", daemon=True)
                self._batcher.start()
        self._queue.put((prompt_ids, sampling_params, future, loop))
        return await future

    def _batch_loop(self) -> None:
        """Runs until shutdown: each batch is whatever ``arun`` calls queued while the last one ran."""
        while not self._closed:
            try:
                batch = [self._queue.get(timeout=0.5)]
            except queue.Empty:
                continue
            while True:
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            try:
                outputs = self.run([(p, sp) for p, sp, _, _ in batch])
                for (_, _, fut, loop), out in zip(batch, outputs):
                    loop.call_soon_threadsafe(_resolve, fut, out, None)
            except Exception as exc:  # noqa: BLE001 - handed to every waiting caller
                for _, _, fut, loop in batch:
                    loop.call_soon_threadsafe(_resolve, fut, None, exc)

    def rpc(self, method: str, *args) -> list[Any]:
        with self._lock:
            return self.llm.collective_rpc(method, args=args)

    def reset_prefix_cache(self) -> None:
        with self._lock:
            self.llm.reset_prefix_cache()

    def reset_encoder_cache(self) -> None:
        with self._lock:
            self.llm.llm_engine.reset_encoder_cache()

    def sleep(self, level: int) -> None:
        with self._lock:
            self.llm.sleep(level=level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        with self._lock:
            self.llm.wake_up(tags)

    def shutdown(self) -> None:
        self._closed = True
        llm, self.llm = self.llm, None
        if llm is not None:
            engine = getattr(llm, "llm_engine", None)
            core = getattr(engine, "engine_core", None)
            if core is not None and hasattr(core, "shutdown"):
                core.shutdown()
            del llm, engine, core
            _release_device_memory()
            self._processes.release()


def wake_waiters_when_the_engine_dies(client) -> None:
    """A ``generate`` waiting on an engine core whose process has died raises vLLM's ``EngineDeadError``.

    vLLM's sync client (``SyncMPClient``) notices the death of its engine core's process, marks the
    engine dead and shuts itself down, but a call already waiting on its output queue is never woken:
    it would wait forever (a SIGTERM to the run's process group, a killed or crashed engine core).
    After that shutdown, the error put in the queue ends the wait; later calls raise it before
    sending. An in-process engine core (no process to die) has no such queue and is left as it is."""
    outputs, resources = getattr(client, "outputs_queue", None), getattr(client, "resources", None)
    if outputs is None or not hasattr(resources, "engine_dead"):
        return
    shutdown = client.shutdown

    def shutdown_then_wake(*args, **kwargs):
        try:
            return shutdown(*args, **kwargs)
        finally:
            if resources.engine_dead:
                from vllm.v1.engine.exceptions import EngineDeadError

                outputs.put_nowait(EngineDeadError())

    client.shutdown = shutdown_then_wake


def _release_device_memory() -> None:
    """Return an in-process engine's weights and KV cache to the device once it is shut down, so a
    later run in the same process (a sweep, a notebook) finds the memory free."""
    import gc

    gc.collect()
    try:
        import torch

        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.empty_cache()
    except Exception:  # noqa: BLE001 - best effort at teardown
        pass


def _resolve(future: asyncio.Future, value: Any, exc: BaseException | None) -> None:
    if future.done():
        return
    if exc is not None:
        future.set_exception(exc)
    else:
        future.set_result(value)


class AsyncEngine:
    in_process = False  # AsyncLLM always runs its engine core in a separate process

    def __init__(self, engine_kwargs: dict[str, Any], start_timeout_s: float = 900.0):
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="rlcore-vllm-async", daemon=True)
        self._thread.start()
        self._ids = itertools.count()
        self._processes = EngineProcesses()
        self._processes.before()
        self.engine = self._call(self._create(engine_kwargs), timeout=start_timeout_s)
        self._processes.after()

    @staticmethod
    async def _create(engine_kwargs):
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        with terminal_sigint_held():  # in the event-loop thread, which starts the engine core
            return AsyncLLM.from_engine_args(AsyncEngineArgs(**engine_kwargs))

    def _call(self, coro, timeout: float | None = None):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    async def _generate(self, prompt_ids: list[int], sampling_params) -> Any:
        final = None
        request_id = f"rlcore-{next(self._ids)}-{uuid.uuid4().hex[:8]}"
        async for out in self.engine.generate(_prompt(prompt_ids), sampling_params, request_id):
            final = out
        return final

    def run(self, requests: list[tuple[list[int], Any]]) -> list[Any]:
        async def all_of():
            return await asyncio.gather(*(self._generate(p, sp) for p, sp in requests))

        return self._call(all_of()) if requests else []

    async def arun(self, prompt_ids: list[int], sampling_params) -> Any:
        future = asyncio.run_coroutine_threadsafe(self._generate(prompt_ids, sampling_params), self._loop)
        return await asyncio.wrap_future(future)

    def rpc(self, method: str, *args) -> list[Any]:
        return self._call(self.engine.collective_rpc(method, args=args))

    def reset_prefix_cache(self) -> None:
        self._call(self.engine.reset_prefix_cache())

    def reset_encoder_cache(self) -> None:
        self._call(self.engine.reset_encoder_cache())

    def sleep(self, level: int) -> None:
        self._call(self.engine.sleep(level))

    def wake_up(self, tags: list[str] | None = None) -> None:
        self._call(self.engine.wake_up(tags))

    def shutdown(self) -> None:
        engine, self.engine = getattr(self, "engine", None), None
        if engine is not None:
            engine.shutdown()
            self._processes.release()
        if self._loop.is_running():
            try:
                self._call(_cancel_other_tasks(), timeout=10)
            except Exception:  # noqa: BLE001 - shutting down anyway
                pass
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)


async def _cancel_other_tasks() -> None:
    """Cancel AsyncLLM's background tasks so the loop stops without 'Task was destroyed' noise."""
    tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
