"""What a run's collaborators share beside their own parts: the run's limits and clocks as one
frozen :class:`RunContext`, and the diagnostics that watch the run as :class:`RunObserver` s.

Made once from the config (:meth:`RunContext.of`) and handed to the rollouts, the learner, the
refitter and the validator, instead of each taking ``policy.max_total_sequence_length``,
``cluster.timeout_s`` and the generator's lock one by one.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import attrs

if TYPE_CHECKING:
    from rlcore.config import RunConfig


@runtime_checkable
class RunObserver(Protocol):
    """A diagnostic attached to a run: entered for the run's length, what it measured taken into each
    step's record (:class:`rlcore.controller.interpreter.GCClock`, ``LockLagProbe``)."""

    def __enter__(self) -> Any: ...

    def __exit__(self, *exc: Any) -> Any: ...

    def take(self) -> dict[str, float]: ...


@attrs.frozen
class RunContext:
    """The limits and clocks every collaborator of one run reads."""

    max_sequence_length: int  # policy.max_total_sequence_length: a batch's, a refit probe's and a validation's rows
    timeout_s: float | None = None  # cluster.timeout_s: the bound on each call into a plugin object; None: unbounded
    # Held by generation for its whole length: the refit and a validation wait for it (rollouts.py)
    generator_lock: threading.Lock = attrs.field(factory=threading.Lock, eq=False)
    observers: tuple[RunObserver, ...] = ()  # diagnostics whose measurements go into each step's record

    @classmethod
    def of(cls, config: RunConfig, observers: tuple[RunObserver, ...] = ()) -> RunContext:
        return cls(config.policy.max_total_sequence_length, config.cluster.timeout_s, observers=observers)

    def observed(self) -> dict[str, float]:
        """What every observer measured since the last step's record."""
        return {key: value for observer in self.observers for key, value in observer.take().items()}
