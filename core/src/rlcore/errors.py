"""Errors a run reports as one clear message (the CLI prints them without a traceback).

Kept free of heavy imports so that ``rlcore`` commands that never touch torch can catch them.
"""

from __future__ import annotations


class CheckpointError(RuntimeError):
    """A checkpoint cannot be used or written; the message names the file or directory."""


class UnsafeCheckpointError(CheckpointError):
    """A checkpoint file holds objects that loading would have to construct by running code."""


class DamagedCheckpointError(CheckpointError):
    """A checkpoint file is truncated or garbled."""


class DataError(ValueError):
    """A dataset cannot be used as given (a malformed row, a missing file or column); the message
    names the file and the line or row. Dataset plugins raise it, or a subclass of it."""


class RolloutError(RuntimeError):
    """Rollouts that cannot go on: agent trajectories still open when their batch's time ran out, or
    a batch in which every agent group failed. The message names the trajectories."""
