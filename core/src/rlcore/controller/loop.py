"""A GRPO run: its collaborators, and the sync driver that reads like the algorithm.

:class:`GRPOLoop` wires the parts of one run (:class:`Components`) into small collaborators:
:class:`~rlcore.controller.rollouts.Rollouts` (generate, score, keep or refill whole groups),
:class:`~rlcore.controller.learner.Learner` (advantages, batch, logprobs, train),
:class:`~rlcore.controller.refitter.Refitter` (transfer and probe),
:class:`~rlcore.controller.validation.Validator` and
:class:`~rlcore.controller.resume.LoopCheckpoints` (the trainer's and the loop's own state), and plugs
them into the run skeleton every algorithm shares (:class:`~rlcore.controller.run_skeleton.RunSkeleton`:
start, resume, records, checkpoints, bounded loggers, stop on signals and non-finite streaks).
A driver runs the steps: :func:`run_sync` here (on-policy), or
:func:`rlcore.controller.async_driver.run_async` (one step off and beyond), which owns its threads.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import TYPE_CHECKING

import attrs

from rlcore.controller.checkpoint import StopSignalled, ended_by_stop
from rlcore.controller.context import RunContext
from rlcore.deadlines import TimedTeacher
from rlcore.controller.interpreter import CollectorPolicy, GCClock, LockLagProbe
from rlcore.controller.learner import Learner
from rlcore.controller.nonfinite import NonFiniteLossError
from rlcore.controller.phase_memory import PhaseMemory
from rlcore.controller.refitter import Refitter
from rlcore.controller.resume import LoopCheckpoints
from rlcore.controller.rollouts import Rollouts
from rlcore.controller.run_dir import fingerprint
from rlcore.controller.run_skeleton import LoopParts, RunPosition, RunSkeleton
from rlcore.controller.timing import StepTimer
from rlcore.controller.validation import Validator
from rlcore.interfaces import (
    Algorithm, CriticHandle, Environment, Generator, MetricLogger, Placement, PromptDataset, Teacher, TrainerHandle,
    WeightTransport,
)

if TYPE_CHECKING:
    from rlcore.config import RunConfig
    from rlcore.planning.run_memory import RunMemoryPlan
    from rlcore.controller.report import Reporter
    from rlcore.generation.rollout import MultiTurnRunner
    from rlcore.loggers.traces import RolloutTraces

__all__ = ["Components", "GRPOLoop", "NonFiniteLossError", "run_sync"]


@attrs.define
class Components:
    """What one run is made of; each part is reached only through its protocol."""

    config: RunConfig
    trainer: TrainerHandle
    generator: Generator
    environment: Environment
    algorithm: Algorithm
    dataset: PromptDataset
    transport: WeightTransport
    loggers: list[MetricLogger]
    reporter: Reporter
    multi_turn: MultiTurnRunner | None = None  # rollouts of multi-turn environments
    run_identity: dict | None = None  # RunDir.identity(): run id, log dir, fingerprint (checkpoints record it)
    teacher: Teacher | None = None  # scores rollouts for algorithms registered with a teacher (distillation)
    critic: CriticHandle | None = None  # the value model of algorithms that train one (ppo)
    placement: Placement = attrs.Factory(Placement)  # where the parts run, and the memory plan's decisions
    memory_plan: RunMemoryPlan | None = None  # what the run predicted each phase holds (rlcore.planning.run_memory)
    traces: RolloutTraces | None = None  # rollout traces of each step (logger.rollouts); None: none written


class GRPOLoop(RunPosition):
    """The collaborators of one GRPO run, plugged into the run skeleton (:class:`RunSkeleton`: start,
    records, checkpoints, loggers, stop) that every driver steps through."""

    def __init__(self, c: Components):
        self.c, cfg = c, c.config
        self.train_cfg, self.grpo = cfg.train, cfg.grpo
        # the garbage collector's pauses and, when asked, the interpreter lock's waits, recorded with each step
        observers = (GCClock(),) + ((LockLagProbe(True),) if cfg.experimental.gil_lag_probe else ())
        self.context = context = RunContext.of(cfg, observers)
        self.rollouts = Rollouts(cfg, context, c.generator, c.environment, c.algorithm, c.dataset, c.multi_turn)
        teacher = None if c.teacher is None else TimedTeacher(c.teacher, context.timeout_s)
        may_offload = (cfg.generation.colocated.offload_trainer_state == "auto" and c.placement.device == "cuda"
                       and c.placement.colocated and not cfg.grpo.async_grpo.enabled)
        self.learner = Learner(c.trainer, c.algorithm, context, cfg.train.max_consecutive_nonfinite, teacher,
                               c.placement.offload_trainer_state, c.critic, may_offload=may_offload)
        self.refitter = Refitter(c.trainer, c.generator, c.transport, cfg.generation.refit, context)
        self.validator = Validator(self.rollouts, c.trainer, cfg.train.max_val_samples, cfg.train.seed, context, teacher)
        identity = c.run_identity or {"run_id": "", "log_dir": cfg.logger.log_dir, "fingerprint": fingerprint(cfg)}
        self.checkpoints = LoopCheckpoints(self.learner, self.rollouts.cursor, self.refitter, c.generator)
        parts = LoopParts(save_backend=self.checkpoints.save_backend, load_backend=self.checkpoints.load_backend,
                          data_position=self.checkpoints.data_position, set_data_position=self.checkpoints.set_data_position,
                          validate=self.validator.validate, show=self._show, loop_state=self.checkpoints.loop_state,
                          restore=self.checkpoints.restore, step_metrics=self._step_metrics,
                          saving=self.checkpoints.training_state_on_device, validation_needs_refit=True)
        self.skeleton = RunSkeleton(cfg, identity, parts, c.loggers, nonfinite=self.learner.nonfinite,
                                    resumed_too=[c.traces] if c.traces else [])
        self.progress = self.skeleton.progress
        self.collector = CollectorPolicy(cfg.cluster.gc_period)  # the collector's collections, between steps
        self.phase_memory: PhaseMemory | None = None  # peak GPU memory per phase (the sync loop on CUDA)
        # the plan's prediction, with this process's first step record (beside the measured peaks)
        self._plan_metrics = c.memory_plan.metrics() if c.memory_plan is not None else {}

    def run(self, driver: Callable[[GRPOLoop], None]) -> list[dict]:
        """Resume or validate at the start, then ``driver(self)`` until the last step or a stop signal."""
        self.phase_memory = PhaseMemory.on_cuda() if driver is run_sync else None
        try:
            with self.collector, contextlib.ExitStack() as observing:
                for observer in self.context.observers:
                    observing.enter_context(observer)
                return self.skeleton.run(lambda: driver(self))
        finally:
            if self.phase_memory is not None:
                self.phase_memory.close()

    def next_step(self) -> int:
        """Advances to the next step and tells the trainer its number."""
        step = self.skeleton.next_step()
        self.c.trainer.loop_step = step
        return step

    def train(self, trajectories, timer: StepTimer):
        """The learner's step, then the garbage collector's collection when due (``cluster.gc_period``)."""
        out = self.learner.train_on(trajectories, timer, self.progress.step)
        self.collector.after_training(self.progress.step)
        if self.c.traces is not None:  # a sample of what was just trained, as it was trained
            self.c.traces.write(self.progress.step, trajectories, out[1], self.rollouts.take_failures(self.progress.step))
        return out

    def validates(self) -> bool:
        return self.skeleton.validates()

    def finish_step(self, record: dict, timer: StepTimer) -> None:
        """The skeleton's end of a step: validation when due, timings, record, checkpoint when due, loggers."""
        self.skeleton.finish_step(record, timer)

    def stop_requested(self) -> bool:
        """After a step: whether a stop signal arrived; if so, this step is checkpointed."""
        return self.skeleton.stop_requested()

    def _step_metrics(self) -> dict:
        plan, self._plan_metrics = self._plan_metrics, {}
        return {**self.context.observed(), "policy_version": self.learner.policy_version, **plan}

    def _show(self, record: dict) -> None:
        if record["step"] == 0:
            self.c.reporter.start(record)
        else:
            self.c.reporter.step(record, record["step"])


def run_sync(run: GRPOLoop) -> None:
    """On-policy GRPO: each step's rollouts come from the weights it trains."""
    generator = run.c.generator
    while run.step < run.train_cfg.max_num_steps:
        step = run.next_step()
        timer = StepTimer(run.phase_memory)
        # Draw P prompts, generate G responses to each, score them, keep whole groups.
        trajectories, record, _ = run.rollouts.collect(step, timer)
        # Colocated engines release their memory while the trainer works (a no-op on CPU).
        with timer.phase("generation"):
            generator.sleep()
        # Advantages, logprobs, one update.
        with run.learner.state_on_device(timer):
            metrics, batch = run.train(trajectories, timer)
        record.update(metrics)
        # The new weights to the generator, checked by the probe; a stop signal ends the step here.
        with contextlib.suppress(StopSignalled), ended_by_stop(run.progress):
            with timer.phase("refit"):
                run.learner.wake(generator, timer)
            record.update(run.refitter.refit(batch, timer, step))
        run.finish_step(record, timer)
        if run.stop_requested():
            break
