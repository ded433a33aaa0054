"""SGLang's offline ``Engine`` on an event loop of its own thread.

The engine's tokenizer manager lives in this process and serves every request from the one event
loop it first ran on (``TokenizerManager.auto_create_handle_loop``); the engine's own blocking methods
(``flush_cache``, ``release_memory_occupation``, ``update_weights_from_tensor``, ...) each run that
loop with ``run_until_complete`` (``sglang/srt/entrypoints/engine.py``). rlcore calls a generator
from the run loop's thread, from rollout threads and from other event loops (``agenerate``), so here
the engine is built on a loop that runs for good in one thread, and everything, blocking calls
included, is a coroutine of the tokenizer manager submitted to that loop, as verl's SGLang server
does (``verl/workers/rollout/sglang_rollout/async_sglang_server.py``: ``await
self.tokenizer_manager.release_memory_occupation(obj, None)``).

SGLang is imported here only, and only when an engine is built.
"""

from __future__ import annotations

import asyncio
import atexit
import threading
from typing import Any

from rlcore.config import ConfigError

SGLANG_VERSION = "0.5.17"
INSTALL = f"pip install 'rlcore-sglang[cuda]' (sglang=={SGLANG_VERSION}, built for torch 2.11 / CUDA 13)"


def require_sglang() -> None:
    """A clear error, naming the package and the version to install, when SGLang is not importable."""
    try:
        import sglang.srt.entrypoints.engine  # noqa: F401
    except ImportError as exc:
        raise ConfigError("policy.generation.backend", f"'sglang' needs the sglang package, which does not import "
                          f"here ({type(exc).__name__}: {exc}): {INSTALL}") from None


class EngineThread:
    """One ``sglang.srt.entrypoints.engine.Engine``; every call goes through its loop thread."""

    def __init__(self, server_args: dict[str, Any], start_timeout_s: float = 900.0):
        require_sglang()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="rlcore-sglang", daemon=True)
        self._thread.start()
        try:
            self.engine = self.call(self._create(server_args), timeout=start_timeout_s)
        except BaseException:
            self._stop_loop()
            raise

    @staticmethod
    async def _create(server_args: dict[str, Any]):
        from sglang.srt.entrypoints.engine import Engine

        # Built inside the running loop: Engine.__init__ takes asyncio.get_running_loop() as its loop.
        engine = Engine(**server_args)
        # Engine.__init__ registers its shutdown at exit, which kills every child of this process
        # (kill_process_tree(os.getpid(), include_parent=False)): a Ray instance or a reaper started
        # by the run would go with it. shutdown() below ends the engine's own processes only.
        atexit.unregister(engine.shutdown)
        atexit.register(_end_processes, engine)
        return engine

    @property
    def manager(self):
        """The engine's tokenizer manager (requests, refits, memory release)."""
        return self.engine.tokenizer_manager

    def call(self, coro, timeout: float | None = None):
        """Run ``coro`` on the engine's loop; block until it is done."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    async def acall(self, coro):
        """Await ``coro`` on the engine's loop from any other event loop."""
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self._loop))

    def shutdown(self) -> None:
        engine, self.engine = getattr(self, "engine", None), None
        if engine is not None:
            atexit.unregister(_end_processes)
            _end_processes(engine)
        self._stop_loop()

    def _stop_loop(self) -> None:
        if self._loop.is_running():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)


def _end_processes(engine) -> None:
    """``Engine.shutdown`` less its kill of every child of this process: the watchdog stops first (a
    child it sees die would otherwise make it signal this process), then the engine's scheduler and
    detokenizer processes (``Engine.get_all_child_pids``) and theirs end."""
    from sglang.srt.utils import kill_process_tree

    manager = engine.tokenizer_manager
    watchdog = getattr(manager, "_subprocess_watchdog", None) if manager is not None else None
    if watchdog is not None:
        watchdog.stop()
    for pid in engine.get_all_child_pids():
        kill_process_tree(pid, include_parent=True, wait_timeout=60)
