"""The run directory (``logger.log_dir``): one writer at a time, a run id, and whose checkpoints are whose.

- ``run.lock`` is held (``flock``) by the process writing the directory and names it; the
  kernel drops the lock when that process dies, so a killed run never blocks its resume.
- ``run.json`` (written atomically) holds the run id and the run's fingerprint: every setting of
  the resolved config except those that may change when a run is resumed (:data:`RESUMABLE_KEYS`:
  how long it runs, where and how often it logs, checkpoints and validates, timeouts and cluster
  plumbing). Every checkpoint's loop state carries the same, and resuming from one whose
  fingerprint differs (another learning rate, another seed) is an error naming both runs and the key.
- Every file and directory the run writes there is checked before anything is written
  (:func:`output_paths`, :func:`rlcore.config.run_paths.inside`): a symbolic link that leads one out of
  the directory is refused, naming it, and so are the writers' own checks when they write.
- A directory that already holds another run's records is refused unless this run resumes it:
  records of two runs are never appended to one file (``metrics.jsonl``, ``rollouts.jsonl``, or
  whatever ``logger.jsonl.filename`` and ``logger.rollouts.filename`` name). A missing or unreadable
  ``run.json`` does not lift that: the newest checkpoint's identity stands in for it, and with
  none the directory is refused.
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

import yaml

from rlcore.config import ConfigError, RunConfig
from rlcore.loading.loader import to_dict
from rlcore.config.structure import MOVED_KEYS
from rlcore.controller.checkpoint import CheckpointManager
from rlcore.config.run_paths import CONTROL_FILES, disk_full, inside, settle_leftovers, write_file

RUN_FILE = "run.json"
LOCK_FILE = "run.lock"
# Dotted prefixes left out of the fingerprint: a resumed run may change them without changing what
# it trains. Everything else (model, data, algorithm, optimizer, seed, batch sizes, generation) must match.
RESUMABLE_KEYS = (
    "train.max_num_steps", "train.val_period", "train.val_at_start", "train.max_val_samples", "grpo.summary_window",
    "checkpointing", "logger", "cluster",
)


def checkpoint_root(config: RunConfig) -> Path:
    """``checkpointing.checkpoint_dir``, or ``<logger.log_dir>/checkpoints`` when it is unset."""
    chosen = config.checkpointing.checkpoint_dir
    return Path(chosen) if chosen else Path(config.logger.log_dir) / "checkpoints"


def record_files(config: RunConfig) -> list[tuple[str, str]]:
    """The files the run appends its records to, by name inside ``logger.log_dir`` and the key that
    names each: the metrics (``logger.jsonl.filename``) and the rollout traces (``logger.rollouts.filename``)."""
    found = []
    jsonl = config.section("logger.jsonl")
    if jsonl is not None and jsonl.enabled:
        found.append((jsonl.filename, "logger.jsonl.filename"))
    if config.logger.rollouts.enabled:
        found.append((config.logger.rollouts.filename, "logger.rollouts.filename"))
    return found


def output_paths(config: RunConfig) -> list[tuple[str, str, bool]]:
    """What the run writes under ``logger.log_dir``: (relative path, the config key that names or
    enables it, whether it is a file). Two keys naming one file are refused (a ConfigError)."""
    found = [(name, "logger.log_dir", True) for name in CONTROL_FILES if name != "curves.png" or config.logger.plot]
    found += [("model", "logger.log_dir", False), ("critic", "logger.log_dir", False)]
    if not config.checkpointing.checkpoint_dir:
        found.append(("checkpoints", "checkpointing.checkpoint_dir", False))
    found += [(name, key, True) for name, key in record_files(config)]
    for name in ("tensorboard", "wandb"):  # the directories these loggers write in logger.log_dir
        section = config.section(f"logger.{name}")
        if section is not None and section.enabled:
            found.append((name, f"logger.{name}.enabled", False))
    names = [name for name, _ in record_files(config)]
    if len(set(names)) < len(names):
        raise ConfigError("logger.rollouts.filename", f"{names[-1]!r} is logger.jsonl.filename too: the metrics and the "
                          "rollout traces would be appended to one file; give each its own name")
    return found


def fingerprint(config: RunConfig) -> dict[str, str]:
    """The settings (as JSON text, by dotted key of each leaf) a resumed checkpoint must share with
    this run: the whole resolved config but :data:`RESUMABLE_KEYS`."""
    out: dict[str, str] = {}

    def walk(node: Any, prefix: str) -> None:
        if any(prefix == k or prefix.startswith(k + ".") for k in RESUMABLE_KEYS):
            return
        if isinstance(node, dict) and node:
            for key, value in node.items():
                walk(value, f"{prefix}.{key}" if prefix else str(key))
        else:
            out[prefix] = json.dumps(node, sort_keys=True, default=str)

    walk(to_dict(config), "")
    return out


_FRESH = "set checkpointing.resume=false (rlcore run --no-resume) or another checkpointing.checkpoint_dir"


def check_owner(theirs: dict | None, ours: dict, where: Path, fix: str = _FRESH) -> None:
    """Raise a ConfigError naming both runs and the first differing key, unless ``theirs`` (a
    checkpoint's ``run`` entry, or a run directory's ``run.json``) has this run's fingerprint;
    ``fix`` says how to start afresh instead."""
    if not theirs or "fingerprint" not in theirs:
        raise ConfigError("checkpointing.resume", f"checkpoint {where} records no run fingerprint (written by another "
                          f"program or an older rlcore); {fix}")
    # An older rlcore's fingerprint spells a moved key the old way: the same setting, compared as such.
    theirs_fp = {MOVED_KEYS.get(key, key): value for key, value in theirs["fingerprint"].items()}
    ours_fp = ours["fingerprint"]
    for key in [*ours_fp, *(k for k in theirs_fp if k not in ours_fp)]:
        saved, value = theirs_fp.get(key), ours_fp.get(key)
        if saved != value:
            raise ConfigError(key, f"checkpoint {where} belongs to run {theirs.get('run_id')} (logger.log_dir "
                              f"{theirs.get('log_dir')}), which had {key}={_short(saved)}"
                              + (" (it records no such setting: written by an older rlcore?)" if key not in theirs_fp else "")
                              + f"; this run "
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
        self._created = False  # whether open() made the directory
        self._fresh = False  # whether it held no records when opened (no run resumed here)

    def identity(self) -> dict[str, Any]:
        """What every checkpoint of this run records about it: run id, log dir, fingerprint, and the
        resolved config (``rlcore export`` reads it from the checkpoint, never from a path it names)."""
        return {"run_id": self.run_id, "log_dir": str(self.path), "fingerprint": self.fingerprint,
                "config": yaml.safe_dump(to_dict(self.config), sort_keys=False)}

    def open(self) -> "RunDir":
        self._created = not self.path.exists()
        self.path.mkdir(parents=True, exist_ok=True)
        for relative, key, is_file in output_paths(self.config):
            inside(self.path, relative, key, file=is_file)
        self._acquire()
        try:
            self._fresh = not holds_records(self.path, self.config)
            previous = self._previous()
            self.run_id = self._choose_run_id(previous)
            self._check_checkpoint_places()
            settle_run_leftovers(self.config)
            write_file(self.path / RUN_FILE, json.dumps({**self.identity(), "started": time.time()}, indent=1),
                       "the run's identity")
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
        self._lock = lock
        try:  # who holds it, for the message of a run refused above
            os.truncate(lock.fileno(), 0)
            os.pwrite(lock.fileno(), (_holder() + "\n").encode(), 0)
        except OSError as exc:
            if not disk_full(exc):
                raise
            # the lock holds without its text; run.json, written next, says the disk is full in one line

    def _previous(self) -> dict | None:
        try:
            return json.loads((self.path / RUN_FILE).read_text())
        except (OSError, ValueError):
            return None

    def _choose_run_id(self, previous: dict | None) -> str:
        fresh = f"{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"
        if not holds_records(self.path, self.config):
            return fresh
        cfg = self.config.checkpointing
        resumable = cfg.enabled and cfg.resume and CheckpointManager(checkpoint_root(self.config), cfg.keep_last_k).complete()
        if previous is None and resumable:  # run.json lost: the newest checkpoint says whose records these are
            previous = _checkpoint_identity(resumable[-1][1])
        if not resumable or previous is None:
            why = ("checkpointing.resume is false" if cfg.enabled and not cfg.resume else
                   "it has no checkpoint to resume from" if cfg.enabled and not resumable else
                   "checkpointing is disabled" if not cfg.enabled else "its newest checkpoint names no run")
            who = f"run {previous.get('run_id')}" if previous else f"another run ({RUN_FILE} is missing or unreadable)"
            raise ConfigError("logger.log_dir", f"{self.path} already holds the records of {who}, "
                              f"and this run would not resume it ({why}): its records would be mixed with that run's. "
                              f"Choose another logger.log_dir, or delete {self.path}")
        check_owner(previous, self.identity(), self.path / RUN_FILE, fix=f"choose another logger.log_dir, or delete {self.path}")
        return str(previous.get("run_id") or fresh)

    def discard_if_unused(self) -> None:
        """After a run that ended before its first record (a model that does not load, Ctrl-C while
        starting): remove what :meth:`open` and ``rlcore.run`` wrote (``config.yaml``, ``run.json``,
        ``run.lock``, and the directory if it made it and nothing else is there), so the directory
        is as it was. A directory that held records, or now holds a record or a checkpoint, is kept."""
        if not self._fresh or holds_records(self.path, self.config) or CheckpointManager(checkpoint_root(self.config), 1).complete():
            return
        for name in ("config.yaml", RUN_FILE, LOCK_FILE):
            (self.path / name).unlink(missing_ok=True)  # the lock file goes while held: no other run took it
        if self._created and not any(self.path.iterdir()):
            self.path.rmdir()

    def _check_checkpoint_places(self) -> None:
        """Refuse, before anything trains, a ``step_N`` in the checkpoints directory that this run
        would save over and that is no rlcore checkpoint (a user's directory, a file, a link)."""
        cfg, last = self.config.checkpointing, self.config.train.max_num_steps
        if not cfg.enabled:
            return
        blocked = [str(path) for step, path in CheckpointManager(checkpoint_root(self.config), cfg.keep_last_k)
                   .not_checkpoints() if step <= last and (step % cfg.save_period == 0 or step == last)]
        if blocked:
            raise ConfigError("checkpointing.checkpoint_dir", f"{', '.join(blocked[:3])}{' ...' if len(blocked) > 3 else ''}: "
                              f"not rlcore checkpoints, where this run would save its own (every "
                              f"checkpointing.save_period={cfg.save_period} steps and the last); nothing was changed. "
                              "Move them away, or set another checkpointing.checkpoint_dir")

    def close(self) -> None:
        if self._lock is not None:
            fcntl.flock(self._lock, fcntl.LOCK_UN)
            self._lock.close()
            self._lock = None


def holds_records(log_dir: Path, config: RunConfig | None = None) -> bool:
    """Whether a run directory holds a run's records (a summary, a non-empty ``*.jsonl``, or a non-empty
    record file ``config`` names, whatever its name): such a directory is refused to a new run that would
    not resume it."""
    log_dir = Path(log_dir)
    if (log_dir / "summary.json").exists():
        return True
    for name, _ in record_files(config) if config is not None else ():
        if (log_dir / name).is_file() and (log_dir / name).stat().st_size > 0:
            return True
    return any(p.stat().st_size > 0 for p in log_dir.glob("*.jsonl"))


def _checkpoint_identity(step_dir: Path) -> dict | None:
    try:
        run = CheckpointManager.load_loop_state(step_dir).get("run")
    except Exception:  # noqa: BLE001 - a damaged checkpoint names no one; resume skips it with its reason
        return None
    return run if isinstance(run, dict) else None


def write_run_config(config: RunConfig) -> Path:
    """``<logger.log_dir>/config.yaml``: the resolved config, whole or not at all (:func:`rlcore.config.run_paths.write_file`)."""
    path = inside(config.logger.log_dir, "config.yaml", file=True)
    return write_file(path, yaml.safe_dump(to_dict(config), sort_keys=False), "the run's config")


def settle_run_leftovers(config: RunConfig) -> list[str]:
    """What a killed earlier process of this run left half-written beside the run's outputs (its final
    model, ``run.json``, its records' rewrite on resume): :func:`rlcore.config.run_paths.settle_leftovers`
    of each, under the run directory's lock (no other process writes them)."""
    log_dir, done = Path(config.logger.log_dir), []
    for relative, _, _ in output_paths(config):
        done += settle_leftovers((log_dir / relative).parent, [Path(relative).name])
    return done
