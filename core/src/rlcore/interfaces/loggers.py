"""What the run calls on a metric logger (resume, rollout tables)."""

from __future__ import annotations

from typing import Protocol, runtime_checkable


@runtime_checkable
class MetricLogger(Protocol):
    """Records each step's metrics. Optional: ``resume_at`` (:class:`ResumableLogger`); without it a
    resumed run's logger keeps whatever it recorded after the checkpoint."""

    def log(self, metrics: dict[str, float], step: int) -> None: ...

    def close(self) -> None: ...


@runtime_checkable
class ResumableLogger(Protocol):
    """A :class:`MetricLogger` that takes back what it recorded after the checkpoint a run resumes from."""

    def resume_at(self, step: int, records: list[dict] | None = None) -> None:
        """Drop the records of steps after ``step`` (they are redone). ``records``, the checkpoint's
        own (one dict a step), let it put back those it lacks; a logger may take ``step`` alone."""


@runtime_checkable
class RolloutTableLogger(Protocol):
    """A logger that also shows a few of each step's rollout traces as a table (:mod:`rlcore.loggers.traces`)."""

    def log_rollouts(self, rows: list[list], step: int) -> None:
        """``rows`` of :data:`rlcore.loggers.traces.TABLE_COLUMNS` (sample, reward, advantage, prompt, completion)."""
