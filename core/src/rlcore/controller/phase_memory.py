"""Peak GPU memory per phase of a step, recorded beside the phase's time (CUDA runs of the sync loop).

Two measures, because a colocated engine's memory is not torch's: ``memory/<phase>_torch_gib``, the peak
of this process's torch allocator (reserved: what it holds from the device, cache included); and
``memory/<phase>_device_gib``, the device's used memory as NVML reports it (every process and every
allocator: vLLM's weights and KV cache, CUDA contexts), sampled every 10 ms by a thread, so a spike
shorter than that can be missed. These are what the run's memory plan predicts, per phase. A third,
``memory/<phase>_growth_gib``, tells the phase's own tensors from what it found: the peak of the tensors
allocated during the phase above those allocated when it began (training: activations, logits and transient
buffers; an in-process engine's sleep-mode pool, counted in torch's figures, is in both and cancels).
"""

from __future__ import annotations

import threading

GIB = float(1 << 30)
PERIOD_S = 0.01


class PhaseMemory:
    """Started once per run (``start``), told where each phase begins and ends by :class:`StepTimer`."""

    def __init__(self) -> None:
        import torch

        self._torch = torch
        self._device_used = torch.cuda.device_memory_used  # NVML (pynvml, which vLLM installs)
        self._device_used()  # fails here, not in the thread, where NVML is missing
        self._lock = threading.Lock()
        self._phase: str | None = None
        self._device_peak = 0
        self._allocated_at_begin = 0
        self._peaks: dict[str, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, name="rlcore-phase-memory", daemon=True)

    @classmethod
    def on_cuda(cls) -> PhaseMemory | None:
        """A started probe when this process uses CUDA and NVML answers; else None."""
        try:
            import torch

            if not torch.cuda.is_available() or not torch.cuda.is_initialized():
                return None
            probe = cls()
        except Exception:  # noqa: BLE001 - no NVML (pynvml missing, no driver access): no device column
            return None
        probe._thread.start()
        return probe

    def _sample(self) -> None:
        while not self._stop.wait(PERIOD_S):
            used = self._device_used()
            with self._lock:
                if self._phase is not None and used > self._device_peak:
                    self._device_peak = used

    def begin(self, phase: str) -> None:
        self._torch.cuda.reset_peak_memory_stats()
        self._allocated_at_begin = self._torch.cuda.memory_allocated()
        with self._lock:
            self._phase, self._device_peak = phase, self._device_used()

    def end(self, phase: str) -> None:
        torch_peak = self._torch.cuda.max_memory_reserved()
        growth = max(0, self._torch.cuda.max_memory_allocated() - self._allocated_at_begin)
        with self._lock:
            device_peak, self._phase = max(self._device_peak, self._device_used()), None
        for key, value in ((f"memory/{phase}_torch_gib", torch_peak / GIB), (f"memory/{phase}_device_gib", device_peak / GIB),
                           (f"memory/{phase}_growth_gib", growth / GIB)):
            self._peaks[key] = max(self._peaks.get(key, 0.0), value)

    def take(self) -> dict[str, float]:
        """This step's peaks, then forgets them."""
        peaks, self._peaks = self._peaks, {}
        return peaks

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=1.0)
