"""The two vLLM engines behind one small interface: ``run(requests)``, ``arun(request)``, ``rpc``.

- :class:`SyncEngine` wraps ``vllm.LLM`` (batch rollouts). Concurrent ``arun`` calls are
  gathered into batches by one thread, since ``LLM`` is not reentrant.
- :class:`AsyncEngine` wraps ``AsyncLLM`` on its own event-loop thread, so callers from any
  thread or event loop can submit work (many requests in flight), and sync calls block on it.

A request is ``(prompt_ids, vllm.SamplingParams)``; results are vLLM ``RequestOutput`` objects.
"""

from __future__ import annotations

import asyncio
import itertools
import queue
import threading
import uuid
from typing import Any


def _prompt(ids: list[int]):
    from vllm.inputs import TokensPrompt

    return TokensPrompt(prompt_token_ids=list(ids))


class SyncEngine:
    def __init__(self, engine_kwargs: dict[str, Any]):
        from vllm import LLM

        self.llm = LLM(**engine_kwargs)
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

    def sleep(self, level: int) -> None:
        with self._lock:
            self.llm.sleep(level=level)

    def wake_up(self) -> None:
        with self._lock:
            self.llm.wake_up()

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
        self.engine = self._call(self._create(engine_kwargs), timeout=start_timeout_s)

    @staticmethod
    async def _create(engine_kwargs):
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

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

    def sleep(self, level: int) -> None:
        self._call(self.engine.sleep(level))

    def wake_up(self) -> None:
        self._call(self.engine.wake_up())

    def shutdown(self) -> None:
        engine, self.engine = getattr(self, "engine", None), None
        if engine is not None:
            engine.shutdown()
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
