"""A colocated engine's wake-up in two halves, shared by the generators whose engines sleep (``vllm``, ``sglang``).

While the trainer works the engine gives its weights and KV cache back to the GPU; it takes them back in two
halves: the weights before the refit, the KV cache once the refit has loaded the new weights and freed its
chunks, or at the first generation or scoring call. So a refit's chunks (and a LoRA merge's float32 buffers) never
compete with the KV cache: the refit's peak is the trainer's state, the engine's weights and a chunk; generation's
is the trainer's state and the whole engine (verl and NeMo-RL order a colocated refit the same way). Each half is
refused, naming what holds the GPU, when less is free than the engine gave back at sleep: the engines map that
memory outside torch's allocator, and their own out-of-memory error would end the run midway.

Before an engine is shut down it is woken where there is room (:meth:`StagedWake.wake_to_end`): both engines'
pools, freeing memory they released at sleep, can release it a second time (vLLM's prints ``CUDA Error: invalid
argument`` as the run ends; torch_memory_saver, SGLang's, released a paused allocation's handle twice before the
fix of its issue 92).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

GIB = float(1 << 30)


def free_gpu_bytes() -> int:
    """Free memory of this process's GPU, every process's use counted (the engine's may be another's)."""
    import torch

    return int(torch.cuda.mem_get_info()[0])


def wake_up_refusal(engine: str, need: int, free: int, fraction: float, part: str = "weights and KV cache") -> str:
    """The refusal: what the engine needs, what is free, what this process's allocator holds, the keys that make room."""
    import torch

    total = torch.cuda.mem_get_info()[1]
    held = torch.cuda.memory_allocated()
    cached = torch.cuda.memory_reserved() - held
    return (f"{engine} cannot wake up: its {part} need{'s' if part == 'KV cache' else ''} {need / GIB:.1f} GiB and the GPU "
            f"has {free / GIB:.1f} of {total / GIB:.1f} GiB free (the engine's share, policy.generation.gpu_memory_utilization, "
            f"is {fraction:.2f}); this process's tensors hold {held / GIB:.1f} GiB and its allocator caches {cached / GIB:.1f} "
            "GiB more (the trainer's state and what its last phase left). To fit: "
            "policy.generation.colocated.offload_trainer_state: true (or auto), or a smaller "
            "policy.generation.gpu_memory_utilization (auto sizes it from the run's memory plan)")


class StagedWake:
    """The wake-up half of a generator whose engine sleeps. The generator has ``sleeping``, ``memory_fraction``,
    ``_sleeps`` (whether its engine gives memory back), ``ENGINE_NAME``, and ``_resume(tags)`` (map the named halves,
    ``"weights"`` or ``"kv_cache"``, back); its own ``sleep`` releases both halves and records what the GPU got back
    (:meth:`_released_bytes`) in ``_wake_bytes``. :meth:`_start_staged_wake` in its constructor."""

    ENGINE_NAME = "the engine"

    def _start_staged_wake(self) -> None:
        self._wake_bytes = 0  # what the engine gave back at its last sleep, and maps back at wake-up
        self._cache_asleep = False  # weights awake, KV cache not yet (see wake_up)
        self._cache_bytes = 0  # of what the wake-up maps back, the KV cache's part
        self._cache_lock = threading.Lock()

    def _resume(self, tags: list[str]) -> None:
        raise NotImplementedError

    @staticmethod
    def _released_bytes(release: Callable[[], None]) -> int:
        """Run the engine's ``release``; what the GPU got back (the engine's memory may be another process's)."""
        free = free_gpu_bytes()
        release()
        return max(0, free_gpu_bytes() - free)

    def wake_up(self) -> None:
        """Map the engine's weights back; its KV cache follows once the refit that comes next has loaded the new
        weights and released its buffers (``update_weights``), or at the first generation or scoring call."""
        if self._sleeps and self.sleeping:
            need, free = self._wake_bytes, free_gpu_bytes()
            if need and free < need:
                raise MemoryError(wake_up_refusal(self.ENGINE_NAME, need, free, self.memory_fraction))
            self._resume(["weights"])
            self._cache_bytes = max(0, need - max(0, free - free_gpu_bytes()))
            self._cache_asleep = True
        self.sleeping = False

    def _wake_cache(self) -> None:
        """The KV cache's half of :meth:`wake_up`, once: callers in several threads (rollouts) may race here, and
        an engine fails a resume of a half that is not released. What this process's allocator caches (the refit's
        freed buffers, the last phase's activations) goes back to the device first."""
        with self._cache_lock:
            if not self._cache_asleep:
                return
            import torch

            torch.cuda.empty_cache()
            need, free = self._cache_bytes, free_gpu_bytes()
            if free < need:
                raise MemoryError(wake_up_refusal(self.ENGINE_NAME, need, free, self.memory_fraction, part="KV cache"))
            self._resume(["kv_cache"])
            self._cache_asleep = False

    def wake_to_end(self) -> None:
        """Wake an engine that sleeps (both halves) before it is shut down, where the GPU has room (the checks of
        :meth:`wake_up` and :meth:`_wake_cache`); where it cannot be woken it is shut down as it is."""
        if not self._sleeps:
            return
        try:
            if self.sleeping:
                self.wake_up()
            self._wake_cache()
        except Exception:  # noqa: BLE001 - no room beside what the trainer still holds, or a dead engine: shut down anyway
            pass

    def _check_awake(self) -> None:
        if self.sleeping:
            raise RuntimeError(f"the {self.ENGINE_NAME} generator is asleep; call wake_up() before generating")
        self._wake_cache()
