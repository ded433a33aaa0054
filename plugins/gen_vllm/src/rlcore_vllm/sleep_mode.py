"""A colocated vLLM engine's sleep and wake-up around the trainer's phases (vLLM's sleep mode).

The engine releases its weights and KV cache while the trainer works, and takes them back in two halves:
the weights before the refit, the KV cache once the refit has loaded the new weights and released its
buffers. So a refit's chunks (and a LoRA merge's float32 buffers) never compete with the KV cache for
memory: the refit's peak is the trainer's state, the engine's weights and a chunk; generation's is the
trainer's state and the whole engine. verl and NeMo-RL order a colocated refit the same way.
"""

from __future__ import annotations

import threading


class SleepMode:
    """The sleep/wake half of :class:`rlcore_vllm.generator.VllmGenerator` (its ``config``, ``device``,
    ``engine``, ``memory_fraction`` and ``sleeping``)."""

    def _start_sleep_mode(self) -> None:
        self._wake_bytes = 0  # what the engine gave back at its last sleep, and maps back at wake-up
        self._cache_asleep = False  # weights awake, KV cache not yet (see wake_up)
        self._cache_bytes = 0  # of what the wake-up maps back, the KV cache's part
        self._cache_lock = threading.Lock()

    @property
    def _sleeps(self) -> bool:
        """Whether the engine gives its GPU memory back while the trainer works: colocated on a GPU,
        unless ``colocated.sleep_level`` is 0 (resident). vLLM has no sleep mode on CPU."""
        colocated = self.config.colocated
        return self.device != "cpu" and colocated.enabled and colocated.sleep_level > 0

    def sleep(self) -> None:
        """Release weights and KV cache (see ``_sleeps``); otherwise only marks the engine asleep, so that
        generating before ``wake_up`` fails the same way on every placement."""
        if self._sleeps and not self.sleeping:
            self._wake_cache()  # a wake-up no generation followed: vLLM sleeps only a whole engine
            free_before = _free_gpu_bytes()
            self.engine.sleep(level=self.config.colocated.sleep_level)
            self._wake_bytes = max(0, _free_gpu_bytes() - free_before)  # what the wake-up maps back
        self.sleeping = True

    def wake_up(self) -> None:
        """Map the engine's weights back; its KV cache follows once the refit that comes next has loaded
        the new weights and released its buffers (``update_weights``), or at the first generation or
        scoring call (vLLM's tagged wake-up). Refused, naming what each side holds, when the GPU has less
        free memory than the engine gave back at sleep (vLLM's allocator would fail midway)."""
        if self._sleeps and self.sleeping:
            need = self._wake_bytes
            free = _free_gpu_bytes()
            if need and free < need:
                raise MemoryError(wake_up_refusal(need, free, self.memory_fraction))
            self.engine.wake_up(["weights"])
            self._cache_bytes = max(0, need - max(0, free - _free_gpu_bytes()))
            self._cache_asleep = True
        self.sleeping = False

    def _wake_cache(self) -> None:
        """The KV cache's half of :meth:`wake_up`. What the trainer's allocator caches (the refit's freed
        buffers, the last phase's activations) goes back to the device first: the engine maps its
        cache outside torch's allocator."""
        with self._cache_lock:
            if not self._cache_asleep:
                return
            import torch

            torch.cuda.empty_cache()
            need, free = self._cache_bytes, _free_gpu_bytes()
            if free < need:
                raise MemoryError(wake_up_refusal(need, free, self.memory_fraction, part="KV cache"))
            self.engine.wake_up(["kv_cache"])
            self._cache_asleep = False

    def wake_to_end(self) -> None:
        """Wake an engine that sleeps (both halves) before it is shut down, where the GPU has room (the checks
        of :meth:`wake_up` and :meth:`_wake_cache`): vLLM's memory pool, freed asleep, unmaps again what its
        sleep unmapped, and the engine prints ``CUDA Error: invalid argument`` as the run ends. Where it cannot
        be woken it is shut down as it is."""
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
            raise RuntimeError("the vLLM generator is asleep; call wake_up() before generating")
        self._wake_cache()


def _free_gpu_bytes() -> int:
    """Free memory of this process's GPU, every process's use counted (the engine's may be another's)."""
    import torch

    return int(torch.cuda.mem_get_info()[0])


def wake_up_refusal(need: int, free: int, fraction: float, part: str = "weights and KV cache") -> str:
    """The wake-up's refusal: what the engine needs, what is free, what this process's allocator holds."""
    import torch

    gib = float(1 << 30)
    total = torch.cuda.mem_get_info()[1]
    return (f"vLLM cannot wake up: its {part} need{'s' if part == 'KV cache' else ''} {need / gib:.1f} GiB and the GPU has {free / gib:.1f} of "
            f"{total / gib:.1f} GiB free (the engine's share, policy.generation.gpu_memory_utilization, is {fraction:.2f}); "
            f"this process's tensors hold {torch.cuda.memory_allocated() / gib:.1f} GiB and its allocator caches "
            f"{(torch.cuda.memory_reserved() - torch.cuda.memory_allocated()) / gib:.1f} GiB more (the trainer's state and "
            "what its last phase left). To fit: policy.generation.colocated.offload_trainer_state: true (or auto), or a "
            "smaller policy.generation.gpu_memory_utilization (auto sizes it from the run's memory plan)")
