"""What the GRPO loop plugs into the run skeleton's checkpoints (:mod:`rlcore.controller.run_skeleton`).

A checkpoint holds the backend's state (and a critic's, beside it), and the loop's: the skeleton's
(step, the prompt cursor's position, the records so far, the count of non-finite losses in a row, the
driver's RNG, the run's identity) and the policy's version. Resuming restores all of it and refits the
generator, so the next step is the one the uninterrupted run would have taken.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from rlcore.controller import critic_step
from rlcore.generation.batching import DataCursor
from rlcore.controller.learner import Learner
from rlcore.controller.refitter import Refitter
from rlcore.interfaces import Generator, TrainerHandle


class LoopCheckpoints:
    """The GRPO loop's part of saving and restoring a run: the backend's state and the critic's, the
    policy's version, the prompts drawn, and the refit that follows a resume."""

    def __init__(self, learner: Learner, cursor: DataCursor, refitter: Refitter, generator: Generator):
        self.learner, self.cursor, self.refitter, self.generator = learner, cursor, refitter, generator
        # Prompts drawn up to the last batch trained on, where a driver draws ahead of training (async):
        # a resumed run generates the batches that were in flight again instead of skipping their prompts.
        self.trained_position: int | None = None

    @property
    def trainer(self) -> TrainerHandle:
        return self.learner.trainer

    def data_position(self) -> int:
        """Prompts drawn up to the batch trained on last: where a resumed run draws on from."""
        return self.cursor.position if self.trained_position is None else self.trained_position

    def set_data_position(self, position: int) -> None:
        self.cursor.position = position

    def loop_state(self) -> dict:
        return {"policy_version": self.learner.policy_version}

    def restore(self, state: dict) -> None:
        """The policy's version back, and its weights to the generator."""
        self.learner.policy_version = state["policy_version"]
        self.refitter.transfer()

    def save_backend(self, path: str) -> None:
        self.trainer.save_checkpoint(path)
        # ppo: the critic beside the policy (saves come after the step, the critic's state offloaded when the policy's is)
        critic_step.save_critic(self.learner.critic, path, offloaded=self.learner.offload_trainer_state)

    def load_backend(self, path: str) -> None:
        self.trainer.load_checkpoint(path)
        critic_step.load_critic(self.learner.critic, path)

    @contextlib.contextmanager
    def training_state_on_device(self) -> Iterator[None]:
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
