"""Where a GRPO run stands (step, records, wall time, a stop signal), and its checkpoints.

A checkpoint holds the backend's state (and a critic's, beside it), and the loop's: step, policy version, the prompt cursor's
position, the records so far, the count of non-finite losses in a row, the driver's RNG and the
run's identity. Resuming restores all of it and refits the generator, so the next step is the one
the uninterrupted run would have taken.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import attrs

from rlcore.controller import critic_step
from rlcore.controller.batching import DataCursor
from rlcore.controller.checkpoint import CheckpointManager, resume_loggers, rng_state, set_rng_state, stop_after_step
from rlcore.controller.learner import Learner
from rlcore.controller.refitter import Refitter
from rlcore.controller.run_dir import check_owner
from rlcore.interfaces import Generator, MetricLogger, TrainerHandle


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


class LoopCheckpoints:
    """Saves and restores a GRPO run (``checkpointing``); ``ckpt`` is None when checkpointing is off."""

    def __init__(self, ckpt: CheckpointManager | None, root, progress: Progress, learner: Learner, cursor: DataCursor,
                 refitter: Refitter, generator: Generator, loggers: list[MetricLogger], identity: dict):
        self.ckpt, self.root, self.progress = ckpt, root, progress
        self.learner, self.cursor, self.refitter = learner, cursor, refitter
        self.generator, self.loggers, self.identity = generator, loggers, identity
        self.saved_step = -1
        # Prompts drawn up to the last batch trained on, where a driver draws ahead of training (async):
        # a resumed run generates the batches that were in flight again instead of skipping their prompts.
        self.trained_position: int | None = None

    @property
    def trainer(self) -> TrainerHandle:
        return self.learner.trainer

    @property
    def step(self) -> int:
        return self.progress.step

    @property
    def stop_signal(self) -> int | None:
        return self.progress.stop_signal

    def resume(self, enabled: bool) -> None:
        """The newest checkpoint of this run, when there is one and ``enabled``."""
        if self.ckpt is None or not enabled:
            return
        found = self.ckpt.resume(lambda path, state: check_owner(state.get("run"), self.identity, path),
                                 self._load_backend)
        if found is None:
            return
        latest, state = found
        p = self.progress
        p.step, p.records = state["step"], state["records"]
        self.learner.policy_version, self.learner.nonfinite.in_a_row = state["policy_version"], state["nonfinite_in_a_row"]
        self.cursor.position = state["data_position"]
        p.started = time.perf_counter()
        p.elapsed_before = p.records[-1].get("time/elapsed_s", 0.0) if p.records else 0.0
        set_rng_state(state["rng"])
        self.refitter.transfer()
        resume_loggers(self.loggers, p.step, p.records)  # steps after the checkpoint are redone; missing ones restored
        print(f"resumed from {latest} at step {p.step}")

    def data_position(self) -> int:
        """Prompts drawn up to the batch trained on last: where a resumed run draws on from."""
        return self.cursor.position if self.trained_position is None else self.trained_position

    def save(self) -> None:
        state = {
            "step": self.progress.step, "policy_version": self.learner.policy_version,
            "data_position": self.data_position(),
            "records": self.progress.records,
            "nonfinite_in_a_row": self.learner.nonfinite.in_a_row, "rng": rng_state(), "run": self.identity,
        }
        with self._training_state_on_device():
            self.ckpt.save(self.progress.step, self._save_backend, state)
        self.saved_step = self.progress.step

    def _save_backend(self, path: str) -> None:
        self.trainer.save_checkpoint(path)
        # ppo: the critic beside the policy (saves come after the step, the critic's state offloaded when the policy's is)
        critic_step.save_critic(self.learner.critic, path, offloaded=self.learner.offload_trainer_state)

    def _load_backend(self, path) -> None:
        self.trainer.load_checkpoint(str(path))
        critic_step.load_critic(self.learner.critic, str(path))

    @contextlib.contextmanager
    def _training_state_on_device(self) -> Iterator[None]:
        """A checkpoint reads the optimizer state where the backend keeps it while training: with
        ``offload_trainer_state`` the engines sleep while it comes back for the save (saves come
        after the refit, with the engines awake and the state on the host)."""
        if not self.learner.offload_trainer_state:
            yield
            return
        self.generator.sleep()
        try:
            with self.learner.state_on_device():  # timed within the step's "checkpoint" phase
                yield
        finally:
            self.generator.wake_up()

    def stop_requested(self) -> bool:
        """After a step: whether SIGTERM arrived; if so, checkpoint this step (unless just done)."""
        return stop_after_step(self, self.root)
