"""A colocated vLLM engine's sleep around the trainer's phases (vLLM's sleep mode); its wake-up in two halves, the
weights before the refit and the KV cache after it, is :class:`rlcore.generation.staged_wake.StagedWake`'s."""

from __future__ import annotations

from rlcore.generation.staged_wake import StagedWake


class SleepMode(StagedWake):
    """The sleep/wake half of :class:`rlcore_vllm.generator.VllmGenerator` (its ``config``, ``device``,
    ``engine``, ``memory_fraction`` and ``sleeping``)."""

    ENGINE_NAME = "vLLM"

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
            # what the wake-up maps back
            self._wake_bytes = self._released_bytes(lambda: self.engine.sleep(level=self.config.colocated.sleep_level))
        self.sleeping = True

    def _resume(self, tags: list[str]) -> None:
        self.engine.wake_up(tags)  # vLLM's tagged wake-up
