"""Steps whose loss was not finite: the backend skips their update (``skipped_nonfinite`` in its
metrics); after ``train.max_consecutive_nonfinite`` of them in a row every trainer stops."""

from __future__ import annotations

import warnings

from rlcore.errors import RunStopped


class NonFiniteLossError(RuntimeError, RunStopped):
    """Too many non-finite losses in a row."""


class NonfiniteStreak:
    """Counts a run's skipped updates in a row (``in_a_row`` is saved in checkpoints)."""

    def __init__(self, limit: int):
        self.limit = limit
        self.in_a_row = 0

    def after_step(self, skipped: bool, step: int) -> bool:
        """Whether the step updated the weights (not ``skipped``); raises once ``limit`` steps in a row did not."""
        if not skipped:
            self.in_a_row = 0
            return True
        self.in_a_row += 1
        warnings.warn(f"step {step}: non-finite loss, update skipped ({self.in_a_row} in a row)")
        if self.in_a_row >= self.limit:
            raise NonFiniteLossError(f"{self.in_a_row} non-finite losses in a row (train.max_consecutive_nonfinite); stopping")
        return False
