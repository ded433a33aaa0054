"""Run checkpoints: written to ``step_N.tmp``, renamed to ``step_N`` when complete, last K kept.

A checkpoint holds the backend's own state (model, optimizer, scheduler, RNG: written by the
backend with torch.distributed.checkpoint or Megatron's dist_checkpointing) and the loop's
state (step, data position, RNG of the driver, counters, the records so far, the run's
fingerprint) in ``loop_state.pt``, written last, so a directory without it was never finished
and is ignored on resume. The loop state holds only tensors, numbers, strings and containers:
it is read with ``weights_only=True`` (:mod:`rlcore.training.safe_load`).

A checkpoints directory may be shared (``checkpointing.checkpoint_dir``): each run writes its
partial checkpoint under a name of its own (``step_N.tmp.<run id>``), never overwrites a
``step_N`` another run wrote (an error naming both), and prunes only its own checkpoints; whose a
checkpoint is, is read from the ``owner`` file beside its loop state. Deleting and overwriting
touch only this run's own checkpoints: a ``step_N`` the run did not write (a user's directory, a
file, a symbolic link, an older rlcore's checkpoint) is left as it is, and saving over it is an
error naming it.

Resume takes the newest checkpoint that loads; a damaged one (truncated, garbled) is skipped
with a message saying which and why. A file refusing to load because it would run code stops
the run: that is not damage to route around.
"""

from __future__ import annotations

import contextlib
import inspect
import random
import re
import shutil
import signal
import threading
import warnings
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from rlcore.config.structure import ConfigError
from rlcore.deadlines import SIGTERM_DEADLINE
from rlcore.errors import RunStopped
from rlcore.interfaces import ResumableLogger
from rlcore.config.run_paths import disk_full, remove_no_follow
from rlcore.training.safe_load import CheckpointError, UnsafeCheckpointError, load_tensors

_STEP_DIR = re.compile(r"^step_(\d+)$")
LOOP_STATE = "loop_state.pt"
OWNER = "owner"  # the run id of the run that wrote the checkpoint (text)


# Set by the first Ctrl-C of a run: ``rlcore run`` then reports an error that follows it (a child
# process the terminal's SIGINT also ended) as the interruption it is, in one line.
INTERRUPTED = threading.Event()
# Set by SIGTERM: an error that follows it (vLLM's engine, in the same process group, died of it
# too) is reported by ``rlcore run`` as the stop the signal asked for, in one line, exit 143.
TERMINATED = threading.Event()
# Whether a wait inside ended_by_stop is open: the stop signals' handlers end it. Those handlers are
# installed by run_catching_sigterm in the main thread only, and they run there: the loop that opened
# the wait is the one they interrupt.
_WAIT_ENDED_BY_STOP: list[bool] = [False]


class StopSignalled(RuntimeError, RunStopped):
    """A stop signal (SIGTERM, Ctrl-C) ended a wait whose result only a later step needs (:func:`ended_by_stop`)."""


@contextlib.contextmanager
def ended_by_stop(loop: Any):
    """Within (a loop under :func:`run_catching_sigterm`): a stop signal ends what it waits for with
    :class:`StopSignalled`, at once if one arrived already (``loop.stop_signal``). For the step's refit,
    whose weights only the next step would use: a part the signal ended too (vLLM's engine, in the
    process group) would keep it waiting until cluster.timeout_s, and the step's training, done
    already, would not be checkpointed."""
    if loop.stop_signal is not None:
        raise StopSignalled(f"{signal.Signals(loop.stop_signal).name} received before the step's refit")
    _WAIT_ENDED_BY_STOP[0] = True
    try:
        yield
    finally:
        _WAIT_ENDED_BY_STOP[0] = False


def _end_the_wait(signum: int) -> None:
    if _WAIT_ENDED_BY_STOP[0]:
        _WAIT_ENDED_BY_STOP[0] = False  # once: what the wait's cleanup runs is not cut short again
        raise StopSignalled(f"{signal.Signals(signum).name} received during the step's refit")


def run_catching_sigterm(loop: Any, body: Callable[[], Any], checkpointed: bool = False,
                         timeout_s: float | None = None) -> Any:
    """``body()`` with SIGTERM recorded in ``loop.stop_signal`` instead of ending the process: the
    loop ends its step, writes a checkpoint of it and stops (exit 143 in ``rlcore run``). The first
    Ctrl-C (SIGINT) does the same (exit 130); a second one stops at once (KeyboardInterrupt, which
    ``rlcore run`` reports in one line). ``loop`` has ``step`` and ``stop_signal``; ``checkpointed``
    says whether the stop writes a checkpoint. With ``timeout_s`` (``cluster.timeout_s``), SIGTERM
    also arms :data:`~rlcore.deadlines.SIGTERM_DEADLINE`: the process ends that long
    after the signal whatever it waits for. Off the main thread, where Python cannot catch
    signals, ``body()`` runs as it is."""

    def on_sigterm(signum, frame):
        TERMINATED.set()
        loop.stop_signal = signum
        if timeout_s is not None:
            SIGTERM_DEADLINE.arm(timeout_s, signum)
        _end_the_wait(signum)

    def on_interrupt(signum, frame):
        if loop.stop_signal == signal.SIGINT:
            raise KeyboardInterrupt
        INTERRUPTED.set()
        loop.stop_signal = signum
        print(f"\nCtrl-C: stopping after step {max(loop.step, 1)} ends"
              f"{' and is checkpointed' if checkpointed else ''} (Ctrl-C again stops at once)", flush=True)
        _end_the_wait(signum)

    TERMINATED.clear()
    INTERRUPTED.clear()
    try:
        previous = signal.signal(signal.SIGTERM, on_sigterm)
    except ValueError:  # "signal only works in main thread of the main interpreter"
        return body()
    previous_int = signal.signal(signal.SIGINT, on_interrupt)
    try:
        return body()
    finally:
        signal.signal(signal.SIGTERM, previous)
        signal.signal(signal.SIGINT, previous_int)


def stop_after_step(loop: Any, checkpoint_dir: Any) -> bool:
    """After a step: whether SIGTERM arrived (``loop.stop_signal``); if so, checkpoint this step
    through ``loop.save()`` unless that was just done, and say where it went."""
    if loop.stop_signal is None:
        return False
    log_dir = loop.identity.get("log_dir", "<logger.log_dir>")
    # A new run is refused in a directory that holds another's records (run_dir): say what will work.
    where = (f"no checkpoint (checkpointing.enabled is false): the model of this step goes to {log_dir}/model. "
             f"To start afresh, delete {log_dir} or run again with logger.log_dir=<another directory>")
    if loop.ckpt is not None:
        if loop.saved_step != loop.step:
            loop.save()
        where = f"checkpoint of step {loop.step} in {checkpoint_dir}; the same command resumes from it"
    print(f"{signal.Signals(loop.stop_signal).name} received: stopped after step {loop.step}, {where}", flush=True)
    return True


def resume_loggers(loggers: Any, step: int, records: list[dict]) -> None:
    """Each logger with ``resume_at`` drops the records of steps after ``step`` (they are redone);
    one that takes them also gets the checkpoint's ``records``, to put back those it lacks."""
    for logger in loggers:
        if not isinstance(logger, ResumableLogger):
            continue
        resume_at = logger.resume_at
        try:
            takes_records = len(inspect.signature(resume_at).parameters) >= 2
        except (TypeError, ValueError):
            takes_records = False
        resume_at(step, records) if takes_records else resume_at(step)


# What every loop's state holds (the GRPO loop's has more): a crafted or truncated one lacking
# them is damage, reported by name, not a KeyError after the backend has loaded.
REQUIRED_LOOP_STATE = {"step": int, "data_position": int, "records": list, "rng": dict}


def check_loop_state(state: Any) -> None:
    if not isinstance(state, dict):
        raise CheckpointError(f"{LOOP_STATE} holds a {type(state).__name__}, not the loop's state")
    for key, kind in REQUIRED_LOOP_STATE.items():
        if key not in state:
            raise CheckpointError(f"{LOOP_STATE} has no '{key}'")
        if not isinstance(state[key], kind) or isinstance(state[key], bool):
            raise CheckpointError(f"{LOOP_STATE}'s '{key}' is a {type(state[key]).__name__}, not a {kind.__name__}")
    if state["step"] < 0 or state["data_position"] < 0:
        raise CheckpointError(f"{LOOP_STATE} has a negative step or data_position")


class CheckpointWriteError(CheckpointError):
    """A checkpoint could not be written (typically: the disk is full); its ``.tmp`` was removed."""


def rng_state() -> dict[str, Any]:
    # numpy's state as a tensor: an ndarray would need numpy globals in a weights_only load.
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    return {"python": random.getstate(), "torch": torch.get_rng_state(),
            "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                      "has_gauss": int(has_gauss), "cached_gaussian": float(cached)}}


def set_rng_state(state: dict[str, Any]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    saved = state["numpy"]
    np.random.set_state((saved["kind"], saved["keys"].numpy().astype(np.uint32), saved["pos"], saved["has_gauss"],
                         saved["cached_gaussian"]))
    torch.set_rng_state(state["torch"])


class CheckpointManager:
    def __init__(self, root: str | Path, keep_last_k: int):
        self.root = Path(root)
        self.keep_last_k = keep_last_k

    def complete(self) -> list[tuple[int, Path]]:
        if not self.root.is_dir():
            return []
        found = []
        for child in self.root.iterdir():
            match = _STEP_DIR.match(child.name)
            if match and (child / LOOP_STATE).is_file():
                found.append((int(match.group(1)), child))
        return sorted(found)

    def latest(self) -> Path | None:
        done = self.complete()
        return done[-1][1] if done else None

    def save(self, step: int, save_backend, loop_state: dict[str, Any]) -> Path:
        """``save_backend(path)`` writes the backend's part; the loop state goes in last. The run id
        in ``loop_state["run"]`` names the writer: its partial directory, its checkpoints to prune."""
        run_id = str((loop_state.get("run") or {}).get("run_id") or "")
        final = self.root / f"step_{step:06d}"
        tmp = self.root / f"step_{step:06d}.tmp.{re.sub(r'[^A-Za-z0-9_-]', '_', run_id) or 'run'}"
        self._refuse_others(final, run_id)
        remove_no_follow(tmp)  # this run's own leftover (a killed save): the run directory's lock makes it ours
        try:
            tmp.mkdir(parents=True)
            (tmp / OWNER).write_text(run_id)
            save_backend(str(tmp / "backend"))
            # Through a Python file: torch's own file writer reports a full disk as "unexpected pos".
            with (tmp / LOOP_STATE).open("wb") as f:
                torch.save(loop_state, f)
        except BaseException as exc:
            shutil.rmtree(tmp, ignore_errors=True)
            if not isinstance(exc, (KeyboardInterrupt, SystemExit)) and disk_full(exc, self.root):
                free = shutil.disk_usage(self.root).free / 2**20 if self.root.exists() else float("nan")
                raise CheckpointWriteError(
                    f"no space left on device: the checkpoint of step {step} could not be written to {self.root} "
                    f"({free:.0f} MiB free); its partial {tmp.name} was removed and earlier checkpoints are kept. "
                    "Free some space, or lower checkpointing.keep_last_k / raise checkpointing.save_period"
                ) from exc
            raise
        try:
            self._refuse_others(final, run_id)  # another run finished this step meanwhile
        except CheckpointWriteError:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        if final.exists():  # this run's own (checked above): a step redone after a resume
            shutil.rmtree(final)
        tmp.rename(final)
        # Pruned once this step's checkpoint is complete; it holds the step's record too (the loop
        # state's records), so a kill from here to the metrics write loses nothing on resume.
        self.prune(run_id)
        return final

    def prune(self, run_id: str) -> None:
        """Delete this run's checkpoints but its newest ``keep_last_k``; other runs' are left alone."""
        ours = [path for _, path in self.complete() if self.is_own(path, run_id)]
        for old in ours[: -self.keep_last_k]:
            shutil.rmtree(old, ignore_errors=True)

    @staticmethod
    def owner(path: Path) -> str | None:
        """The run id that wrote checkpoint ``path`` (None: an older rlcore's, or unreadable)."""
        try:
            return (Path(path) / OWNER).read_text().strip()
        except OSError:
            return None

    @classmethod
    def is_own(cls, path: Path, run_id: str) -> bool:
        """Whether ``path`` is a checkpoint directory (not a link to one) that run ``run_id`` wrote."""
        return path.is_dir() and not path.is_symlink() and cls.owner(path) == run_id

    def not_checkpoints(self) -> list[tuple[int, Path]]:
        """The ``step_N`` entries that are no rlcore checkpoint at all, by step: a symbolic link, a
        file, or a directory with neither an owner file nor a loop state (a user's own)."""
        if not self.root.is_dir():
            return []
        found = []
        for path in self.root.iterdir():
            match = _STEP_DIR.match(path.name)
            if match and (path.is_symlink() or not path.is_dir()
                          or (self.owner(path) is None and not (path / LOOP_STATE).exists())):
                found.append((int(match.group(1)), path))
        return sorted(found)

    def _refuse_others(self, final: Path, run_id: str) -> None:
        """Saving may replace ``final`` only when it is absent or this run's own checkpoint."""
        if not (final.exists() or final.is_symlink()) or self.is_own(final, run_id):
            return
        owner = None if final.is_symlink() else self.owner(final)
        if owner is None:
            raise CheckpointWriteError(
                f"{final} is in the way of this run's checkpoint and is not one of its checkpoints "
                f"({'a symbolic link' if final.is_symlink() else 'it has no rlcore owner file'}); it was left as it is. "
                "Move it away, or set another checkpointing.checkpoint_dir")
        ours = [path.name for _, path in self.complete() if self.owner(path) == run_id]
        keep = (f"; to keep this run's progress, move its own checkpoints ({', '.join(ours)}) into that directory "
                "first") if ours else ""
        raise CheckpointWriteError(
            f"{final} belongs to run {owner}, not this run ({run_id}): checkpointing.checkpoint_dir "
            f"{self.root} is shared by two runs. Give each run its own checkpointing.checkpoint_dir (the default, "
            f"<logger.log_dir>/checkpoints, is){keep}")

    @staticmethod
    def load_loop_state(path: Path) -> dict[str, Any]:
        return load_tensors(Path(path) / LOOP_STATE)

    def resume(self, check: Callable[[Path, dict], None], load_backend: Callable[[Path], None]) -> tuple[Path, dict] | None:
        """The newest checkpoint whose loop state and backend state both load: ``check(path, state)``
        may refuse it (raise, e.g. another run's checkpoint), ``load_backend(path)`` restores the
        backend. Damaged checkpoints are skipped, each with a warning; None when there are none.

        In a directory two runs share, another run's newer checkpoints are passed over for this
        run's own newest (``check`` refuses theirs with a ConfigError); only when none is this
        run's is the refusal raised."""
        skipped: list[str] = []
        others: list[ConfigError] = []
        for _, path in reversed(self.complete()):
            try:
                state = self.load_loop_state(path)
                check_loop_state(state)
                check(path, state)
                load_backend(path / "backend")
            except ConfigError as exc:  # another run's checkpoint: this run's own may be older
                others.append(exc)
                continue
            except Exception as exc:  # noqa: BLE001 - any failure to load marks it damaged; the reason is shown
                if _is_refusal(exc):
                    raise
                reason = _reason(exc)
                skipped.append(f"{path.name}: {reason}")
                warnings.warn(f"checkpoint {path} is damaged and was skipped: {reason}", stacklevel=2)
                print(f"warning: skipped checkpoint {path} (damaged: {reason}); trying the previous one", flush=True)
                continue
            if others:
                print(f"note: {len(others)} newer checkpoint(s) in {self.root} belong to other runs; resuming from "
                      f"this run's own {path.name}", flush=True)
            return path, state
        if others:
            raise others[0]
        if skipped:
            raise CheckpointError(f"no usable checkpoint in {self.root}: " + "; ".join(skipped)
                                  + ". Move them away, or start afresh in another logger.log_dir with --no-resume")
        return None


def _is_refusal(exc: BaseException) -> bool:
    """Errors that mean "do not use this checkpoint at all": code in a file, or another run's checkpoint.
    Ray re-raises a rank's error as a subclass of both RayTaskError and the original class, and
    names the original in its text."""
    return isinstance(exc, (UnsafeCheckpointError, ConfigError)) or "UnsafeCheckpointError" in str(exc)


def _reason(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[-1] if text else ''}"[:400]
