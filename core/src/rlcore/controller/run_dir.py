"""The run directory (``logger.log_dir``): one writer at a time, a run id, and whose checkpoints are whose.

- ``run.lock`` is held (``flock``) by the process writing the directory and names it; the
  kernel drops the lock when that process dies, so a killed run never blocks its resume.
- ``run.json`` holds the run id and the run's fingerprint: the settings a checkpoint must share
  to be resumed by this run (model, data, algorithm, seed). Every checkpoint's loop state carries
  the same, and resuming from one whose fingerprint differs is an error naming both runs.
- A directory that already holds another run's records is refused unless this run resumes it:
  records of two runs are never appended to one ``metrics.jsonl``.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from rlcore.config import ConfigError, RunConfig, to_dict
from rlcore.controller.checkpoint import CheckpointManager

RUN_FILE = "run.json"
LOCK_FILE = "run.lock"
FINGERPRINT_KEYS = ("policy.model_name", "data", "algorithm", "grpo.seed")


def checkpoint_root(config: RunConfig) -> Path:
    """``checkpointing.checkpoint_dir``, or ``<logger.log_dir>/checkpoints`` when it is unset."""
    chosen = config.checkpointing.checkpoint_dir
    return Path(chosen) if chosen else Path(config.logger.log_dir) / "checkpoints"


def fingerprint(config: RunConfig) -> dict[str, str]:
    """The settings (as JSON text, by dotted key) a resumed checkpoint must share with this run."""
    tree = to_dict(config)
    out = {}
    for key in FINGERPRINT_KEYS:
        node: Any = tree
        for part in key.split("."):
            node = node.get(part) if isinstance(node, dict) else None
        out[key] = json.dumps(node, sort_keys=True, default=str)
    return out


_FRESH = "set checkpointing.resume=false (rlcore run --no-resume) or another checkpointing.checkpoint_dir"


def check_owner(theirs: dict | None, ours: dict, where: Path, fix: str = _FRESH) -> None:
    """Raise a ConfigError naming both runs and the first differing key, unless ``theirs`` (a
    checkpoint's ``run`` entry, or a run directory's ``run.json``) has this run's fingerprint;
    ``fix`` says how to start afresh instead."""
    if not theirs or "fingerprint" not in theirs:
        raise ConfigError("checkpointing.resume", f"checkpoint {where} records no run fingerprint (written by another "
                          f"program or an older rlcore); {fix}")
    for key, value in ours["fingerprint"].items():
        saved = theirs["fingerprint"].get(key)
        if saved != value:
            raise ConfigError(key, f"checkpoint {where} belongs to run {theirs.get('run_id')} (logger.log_dir "
                              f"{theirs.get('log_dir')}), which had {key}={_short(saved)}; this run "
                              f"({ours.get('log_dir')}) has {_short(value)}. Resuming it would mix the two runs: {fix}")


def _short(text: str | None) -> str:
    return "nothing" if text is None else (text if len(text) <= 120 else text[:117] + "...")


def _holder() -> str:
    return (f"pid {os.getpid()} on {socket.gethostname()}, started {time.strftime('%Y-%m-%d %H:%M:%S')}: "
            f"{' '.join(sys.argv)[:300]}")


class RunDir:
    """Open with :meth:`open` before anything is written there; :meth:`close` releases the lock."""

    def __init__(self, config: RunConfig):
        self.config = config
        self.path = Path(config.logger.log_dir)
        self.run_id = ""
        self.fingerprint = fingerprint(config)
        self._lock = None

    def identity(self) -> dict[str, Any]:
        """What every checkpoint of this run records about it."""
        return {"run_id": self.run_id, "log_dir": str(self.path), "fingerprint": self.fingerprint}

    def open(self) -> "RunDir":
        self.path.mkdir(parents=True, exist_ok=True)
        self._acquire()
        try:
            previous = self._previous()
            self.run_id = self._choose_run_id(previous)
            (self.path / RUN_FILE).write_text(json.dumps({**self.identity(), "started": time.time()}, indent=1))
        except BaseException:
            self.close()
            raise
        return self

    def _acquire(self) -> None:
        lock = (self.path / LOCK_FILE).open("a+")
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.seek(0)
            holder = lock.read().strip() or "another process"
            lock.close()
            raise ConfigError("logger.log_dir", f"{self.path} is in use by another run ({holder}); wait for it to "
                              "finish or choose another logger.log_dir") from None
        lock.seek(0)
        lock.truncate()
        lock.write(_holder() + "\n")
        lock.flush()
        self._lock = lock

    def _previous(self) -> dict | None:
        try:
            return json.loads((self.path / RUN_FILE).read_text())
        except (OSError, ValueError):
            return None

    def _has_records(self) -> bool:
        if (self.path / "summary.json").exists():
            return True
        return any(p.stat().st_size > 0 for p in self.path.glob("*.jsonl"))

    def _choose_run_id(self, previous: dict | None) -> str:
        fresh = f"{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"
        if previous is None or not self._has_records():
            return fresh
        cfg = self.config.checkpointing
        resumable = cfg.enabled and cfg.resume and CheckpointManager(checkpoint_root(self.config), cfg.keep_last_k).complete()
        if not resumable:
            why = ("checkpointing.resume is false" if cfg.enabled and not cfg.resume else
                   "it has no checkpoint to resume from" if cfg.enabled else "checkpointing is disabled")
            raise ConfigError("logger.log_dir", f"{self.path} already holds the records of run {previous.get('run_id')}, "
                              f"and this run would not resume it ({why}): its records would be mixed with that run's. "
                              f"Choose another logger.log_dir, or delete {self.path}")
        check_owner(previous, self.identity(), self.path / RUN_FILE, fix=f"choose another logger.log_dir, or delete {self.path}")
        return str(previous.get("run_id") or fresh)

    def close(self) -> None:
        if self._lock is not None:
            fcntl.flock(self._lock, fcntl.LOCK_UN)
            self._lock.close()
            self._lock = None
