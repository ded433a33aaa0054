"""Per-step phase timings and the end-of-run summary in NeMo-RL's table format."""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rlcore.controller.phase_memory import PhaseMemory

PHASES = ("generation", "reward", "refit", "logprobs", "values", "critic_train", "training", "validation", "checkpoint")


class StepTimer:
    """Accumulates wall-clock seconds per phase for one step; ``other`` is what no phase covered."""

    def __init__(self, memory: PhaseMemory | None = None) -> None:
        self.start = time.perf_counter()
        self.phases: dict[str, float] = {}
        self.memory = memory  # peak memory per (outermost) phase, on CUDA
        self._depth = 0

    @contextmanager
    def phase(self, name: str):
        began = time.perf_counter()
        outermost = self._depth == 0
        self._depth += 1
        if outermost and self.memory is not None:
            self.memory.begin(name)
        try:
            yield
        finally:
            self._depth -= 1
            if outermost and self.memory is not None:
                self.memory.end(name)
            self.phases[name] = self.phases.get(name, 0.0) + time.perf_counter() - began

    def finish(self) -> dict[str, float]:
        total = time.perf_counter() - self.start
        out = {f"timing/{k}": v for k, v in self.phases.items()}
        if self.memory is not None:
            out.update(self.memory.take())
        out["timing/total"] = total
        out["timing/other"] = max(0.0, total - sum(self.phases.values()))
        return out


def summarize(records: list[dict], window: tuple[int, int] | None = None) -> dict[str, float]:
    """Mean of the timing columns over steps ``window`` (inclusive); default: all but the first."""
    if not records:
        return {}
    if window is None:
        first = records[0]["step"] + (1 if len(records) > 1 else 0)
        window = (first, records[-1]["step"])
    chosen = [r for r in records if window[0] <= r["step"] <= window[1]] or records
    keys = ["timing/total", "timing/training", "timing/refit", "timing/generation", "timing/logprobs",
            "timing/reward", "timing/offload", "timing/values", "timing/critic_train", "rollout/mean_response_tokens",
            "train/reward_mean", "val/accuracy"]
    summary = {"window_first": window[0], "window_last": window[1], "num_steps": len(chosen)}
    for key in keys:
        values = [r[key] for r in chosen if key in r]
        if values:
            summary[key] = sum(values) / len(values)
    for key in sorted({k for r in chosen for k in r if k.startswith("memory/")}):  # peaks: the window's largest
        summary[key] = max(r[key] for r in chosen if key in r)
    return summary
