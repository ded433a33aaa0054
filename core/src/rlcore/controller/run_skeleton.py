"""The run skeleton every algorithm's loop plugs its step into: one place for what keeps a run safe.

:class:`RunSkeleton` owns, for the GRPO-family loop (:class:`rlcore.controller.loop.GRPOLoop`: GRPO,
its variants, PPO, distillation) and the offline loop (:class:`rlcore.controller.offline.OfflineLoop`:
SFT, DPO, reward models) alike:

- start: resume from the newest checkpoint of this run (``checkpointing.resume``), else the held-out
  evaluation before the first step (``train.val_at_start``);
- :meth:`~RunSkeleton.finish_step`: validation when due (``train.val_period``; a GRPO-family step's not after a stop signal), the step's timings,
  its record (``step``, ``data_position``, ``time/elapsed_s``), a checkpoint when due
  (``checkpointing.save_period``), and the loggers, each call bounded by ``cluster.timeout_s``
  (a logger whose network call hangs stops the run, naming it);
- stop: SIGTERM or a first Ctrl-C ends the run after the current step, with a checkpoint of it
  (:func:`~rlcore.controller.checkpoint.run_catching_sigterm`); a streak of
  ``train.max_consecutive_nonfinite`` skipped updates stops it
  (:class:`~rlcore.controller.nonfinite.NonfiniteStreak`, its count saved in every checkpoint);
- the end: a checkpoint of the last step (:func:`~rlcore.controller.run_end.save_final_checkpoint`),
  the loggers closed, each close bounded by ``cluster.timeout_s``.

A loop plugs in what differs (:class:`LoopParts`): how the trainer's state is saved and loaded, what
its held-out evaluation is, where its data stands, what it adds to the loop state and to each record,
and how a record is shown. The checks made before anything loads are
:func:`rlcore.controller.checks.check_before_start` and :func:`rlcore.controller.preflight.check_step_sizes`,
which every loop's builder calls.

Also here, for every loop and for ``rlcore.run`` that picks one: :func:`trains_on` and :func:`build_loggers`.
"""

from __future__ import annotations

import contextlib
import signal
import time
from collections.abc import Callable, Sequence
from typing import Any, ContextManager

import attrs

from rlcore.controller.checkpoint import (
    CheckpointManager, resume_loggers, rng_state, run_catching_sigterm, set_rng_state, stop_after_step,
)
from rlcore.deadlines import bounded_call, bounded_teardown
from rlcore.controller.heartbeat import doing
from rlcore.controller.nonfinite import NonfiniteStreak
from rlcore.controller.run_dir import check_owner, checkpoint_root
from rlcore.controller.timing import StepTimer
from rlcore.interfaces import MetricLogger
from rlcore.plugins import get_plugin_manager

__all__ = ["LoopParts", "Progress", "RunPosition", "RunSkeleton", "build_loggers", "trains_on"]


def trains_on(config: Any) -> str | None:
    """The ``trains_on`` capability of the recipe's algorithm: ``"pairs"`` (dpo, reward_model),
    ``"answers"`` (sft) or None (the GRPO loop: the policy's own rollouts)."""
    section = config.section("algorithm")
    if section is None:
        return None
    return get_plugin_manager().get("algorithm", section.name).capabilities.get("trains_on")


def build_loggers(config: Any, run_dir: Any) -> list[MetricLogger]:
    """The enabled logger plugins (``logger.<name>.enabled``), writing under ``run_dir``."""
    manager, loggers = get_plugin_manager(), []
    for reg in manager.registry["logger"].values():
        section = config.section(reg.section)
        if section is not None and section.enabled:
            loggers.append(reg.build(section, run_dir))
    return loggers


@attrs.define
class Progress:
    """The run's position: the step done last, its records, and the wall time across resumes."""

    step: int = 0
    records: list[dict] = attrs.field(factory=list)
    # ``time/elapsed_s`` of each record: wall seconds since the run began, counted across resumes
    # (a resumed run starts from its checkpoint's last record), so curves against wall time join up.
    started: float = attrs.field(factory=time.perf_counter)
    elapsed_before: float = 0.0
    # SIGTERM (a scheduler's preemption, a job's time limit) ends the run after the current
    # step, with a checkpoint of that step when checkpointing is on: nothing done is lost.
    stop_signal: int | None = None

    def elapsed(self) -> float:
        return self.elapsed_before + time.perf_counter() - self.started


class RunPosition:
    """Where a run stands (its :class:`Progress`, ``self.progress``), as the skeleton and each loop answer it."""

    progress: Progress

    @property
    def step(self) -> int:
        return self.progress.step

    @property
    def records(self) -> list[dict]:
        return self.progress.records

    @property
    def stop_signal(self) -> int | None:
        return self.progress.stop_signal


def _nothing(*args: Any) -> dict:
    return {}


@attrs.define
class LoopParts:
    """What a loop plugs into :class:`RunSkeleton`."""

    save_backend: Callable[[str], None]  # the trainer's state (a critic's beside it) into a new directory
    load_backend: Callable[[str], None]  # and back
    data_position: Callable[[], int]  # examples drawn up to the batch trained on last: a resumed run draws on from it
    set_data_position: Callable[[int], None]  # restores it on resume
    validate: Callable[[int], dict[str, float]] | None  # held-out metrics at a step (val/*); None: the loop has none
    show: Callable[[dict], None]  # a finished record (step 0: the evaluation before the first step) to the person
    loop_state: Callable[[], dict] = _nothing  # saved beside the common loop state (GRPO: the policy's version)
    restore: Callable[[dict], None] = _nothing  # the loop's own part of a resumed state (GRPO: its version, a refit)
    step_metrics: Callable[[], dict] = _nothing  # joined to each step's record (GRPO: clocks, the policy's version)
    saving: Callable[[], ContextManager[Any]] = contextlib.nullcontext  # around a checkpoint's save
    # the held-out pass reads a generator the step's refit updates (GRPO): a stop signal, which skips the refit,
    # skips it too; an offline loop evaluates the trainer itself, so its validation stands after a stop signal
    validation_needs_refit: bool = False


class RunSkeleton(RunPosition):
    """Start, per-step record, checkpoints, logging, stop and end of one run, whatever its loop.

    ``loggers`` get every record; they and ``resumed_too`` (the rollout traces) drop the records of
    steps a resume redoes. ``nonfinite`` is the streak the loop's trainer counts (default: one of
    ``train.max_consecutive_nonfinite``)."""

    def __init__(self, config: Any, identity: dict, parts: LoopParts, loggers: Sequence[MetricLogger],
                 nonfinite: NonfiniteStreak | None = None, resumed_too: Sequence[Any] = ()):
        self.config, self.identity, self.parts, self.loggers = config, identity, parts, list(loggers)
        self.resumed_too = list(resumed_too)
        self.nonfinite = NonfiniteStreak(config.train.max_consecutive_nonfinite) if nonfinite is None else nonfinite
        self.progress = Progress()
        self.root = checkpoint_root(config)
        cfg = config.checkpointing
        self.ckpt = CheckpointManager(self.root, cfg.keep_last_k) if cfg.enabled else None
        self.saved_step = -1

    def run(self, steps: Callable[[], None]) -> list[dict]:
        """Resume or evaluate at the start, then ``steps()`` (the loop's driver) until the last step or a stop
        signal, which ends the step under way and checkpoints it. Returns the records."""
        def body() -> list[dict]:
            self._start()
            steps()
            return self.progress.records

        return run_catching_sigterm(self.progress, body, checkpointed=self.ckpt is not None,
                                    timeout_s=self.config.cluster.timeout_s)

    def _start(self) -> None:
        self.resume()
        if not (self.config.train.val_at_start and self.progress.step == 0 and self.parts.validate is not None):
            return
        doing("held-out evaluation before the first step")
        start = self.parts.validate(0)
        if start:
            start["time/elapsed_s"] = self.progress.elapsed()
            record = {"step": 0, **start}
            self.progress.records.append(record)
            self.log(start, 0)
            self.parts.show(record)

    def next_step(self) -> int:
        self.progress.step += 1
        return self.progress.step

    def more_steps(self) -> bool:
        return self.progress.step < self.config.train.max_num_steps

    def validates(self) -> bool:
        period = self.config.train.val_period
        return self.parts.validate is not None and bool(period) and self.progress.step % period == 0

    def trained(self, skipped_nonfinite: bool) -> bool:
        """After the step's update: whether it changed the weights; raises
        :class:`~rlcore.controller.nonfinite.NonFiniteLossError` at the end of a streak of skipped ones."""
        return self.nonfinite.after_step(skipped_nonfinite, self.progress.step)

    def finish_step(self, record: dict, timer: StepTimer) -> None:
        """Validation when due, the step's timings, its record, a checkpoint when due, the loggers."""
        p = self.progress
        if self.validates() and p.stop_signal is not None and self.parts.validation_needs_refit:
            # A stop signal skips the step's refit (the generator keeps the older weights and, after
            # training, sleeps): a held-out pass would measure the wrong weights or fail on every problem.
            print(f"{signal.Signals(p.stop_signal).name} received: the held-out validation of step {p.step} is skipped",
                  flush=True)
        elif self.validates():
            with timer.phase("validation"):
                record.update(self.parts.validate(p.step))
        record.update(timer.finish())
        record.update(self.parts.step_metrics())
        record["step"] = p.step
        # The examples drawn up to this step's batch (a count over epochs): each step's batch is the
        # range from the step before's, so a run's records show every example drawn once, in order.
        record["data_position"] = self.parts.data_position()
        p.records.append(record)
        record["time/elapsed_s"] = p.elapsed()  # before saving, so that a resumed run counts on from it
        if self.ckpt is not None and p.step % self.config.checkpointing.save_period == 0:
            # Saved after the record joins the list, so a resumed run's summary has this step too
            # (its saved timing lacks only the checkpoint's own time).
            with timer.phase("checkpoint"):
                self.save()
            record.update(timer.finish())
        record["time/elapsed_s"] = p.elapsed()
        self.log({k: v for k, v in record.items() if k != "step"}, p.step)
        self.parts.show(record)

    def log(self, metrics: dict, step: int) -> None:
        for logger in self.loggers:  # a logger's network call that hangs stops the run, naming it
            bounded_call(lambda lg=logger: lg.log(metrics, step), f"logger {type(logger).__name__} (log)",
                         self.config.cluster.timeout_s, step)

    def close_loggers(self) -> None:
        """Each logger's ``close`` as the run ends, bounded by ``cluster.timeout_s``: one that hangs is
        named and left behind, and the run ends as it would have."""
        for logger in self.loggers:
            bounded_teardown(logger.close, f"logger {type(logger).__name__} (close)", self.config.cluster.timeout_s)

    def save(self) -> None:
        """A checkpoint of this step: the trainer's state, then the loop's."""
        state = {"step": self.progress.step, "data_position": self.parts.data_position(),
                 "records": self.progress.records, "nonfinite_in_a_row": self.nonfinite.in_a_row,
                 "rng": rng_state(), "run": self.identity, **self.parts.loop_state()}
        with self.parts.saving():
            self.ckpt.save(self.progress.step, self.parts.save_backend, state)
        self.saved_step = self.progress.step

    def resume(self) -> None:
        """The newest checkpoint of this run, when there is one and ``checkpointing.resume``: the next
        step is the one the uninterrupted run would have taken."""
        if self.ckpt is None or not self.config.checkpointing.resume:
            return
        found = self.ckpt.resume(lambda path, state: check_owner(state.get("run"), self.identity, path),
                                 lambda path: self.parts.load_backend(str(path)))
        if found is None:
            return
        latest, state = found
        p = self.progress
        p.step, p.records = state["step"], state["records"]
        self.nonfinite.in_a_row = state.get("nonfinite_in_a_row", 0)  # absent from older offline checkpoints
        self.parts.set_data_position(state["data_position"])
        p.started = time.perf_counter()
        p.elapsed_before = p.records[-1].get("time/elapsed_s", 0.0) if p.records else 0.0
        set_rng_state(state["rng"])
        self.parts.restore(state)
        # steps after the checkpoint are redone; missing ones restored
        resume_loggers([*self.loggers, *self.resumed_too], p.step, p.records)
        print(f"resumed from {latest} at step {p.step}", flush=True)

    def stop_requested(self) -> bool:
        """After a step: whether a stop signal arrived; if so, checkpoint this step (unless just done)."""
        return stop_after_step(self, self.root)
