"""The learner's step: advantages, the training batch, old/reference/teacher logprobs, the update
(and, for an algorithm that trains a critic, the critic's values, per-token targets and update,
:mod:`rlcore.controller.critic_step`).

The learner owns the policy's version (one per optimizer step that happened) and the count of
non-finite losses in a row, which stops a run that has diverged rather than skipping updates forever.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from rlcore.agents.segments import with_segments
from rlcore.controller import critic_step
from rlcore.controller.context import RunContext
from rlcore.generation.batching import Trajectory, to_sequence_batch
from rlcore.controller.nonfinite import NonfiniteStreak
from rlcore.controller.rollouts import reward_tensors
from rlcore.controller.timing import StepTimer
from rlcore.interfaces import Algorithm, CriticHandle, Generator, SequenceBatch, Teacher, TrainerHandle


class Learner:
    """Trains the policy on one step's trajectories through the trainer handle."""

    def __init__(self, trainer: TrainerHandle, algorithm: Algorithm, context: RunContext, max_consecutive_nonfinite: int,
                 teacher: Teacher | None = None, offload_trainer_state: bool = False, critic: CriticHandle | None = None,
                 may_offload: bool = False):
        self.trainer, self.algorithm, self.teacher, self.critic = trainer, algorithm, teacher, critic
        self.max_length = context.max_sequence_length
        self.nonfinite = NonfiniteStreak(max_consecutive_nonfinite)
        self.offload_trainer_state = offload_trainer_state
        # offload_trainer_state: auto on a synchronous colocated GPU run: a wake-up refused for memory turns it on
        self.may_offload = may_offload
        self.policy_version = 0  # optimizer steps taken (a skipped non-finite update is none)

    def batch(self, trajectories: list[Trajectory]) -> SequenceBatch:
        """The training batch: group-relative advantages of the shaped rewards; trajectories the
        algorithm filters (overlong) keep their place in their group's baseline, with no loss. An agent's
        earlier segments (a rewritten history) follow as rows of their own with their trajectory's advantage."""
        return self.batch_and_rewards(trajectories)[0]

    def batch_and_rewards(self, trajectories: list[Trajectory]) -> tuple[SequenceBatch, torch.Tensor]:
        """:meth:`batch`, and each row's shaped sequence reward (a critic's per-token targets start
        from them; an agent's earlier segments carry their trajectory's)."""
        rewards_N, groups_N, truncated_N = reward_tensors(trajectories)
        lengths_N = torch.tensor([len(t.result.response_ids) for t in trajectories])
        shaped_N = self.algorithm.shape_rewards(rewards_N, lengths_N, truncated_N)
        advantages_N = self.algorithm.advantages(shaped_N, groups_N)
        batch = to_sequence_batch(trajectories, advantages_N, self.max_length)
        keep_N = self.algorithm.keep_trajectories(rewards_N, groups_N, truncated_N)
        for i in torch.nonzero(~keep_N).flatten().tolist():
            batch.loss_mask[i] = torch.zeros_like(batch.loss_mask[i])
        batch = with_segments(batch, trajectories, advantages_N, keep_N, self.max_length)
        segment_of = [i for i, t in enumerate(trajectories) for _ in (t.result.segments or ())]  # appended in this order
        return batch, torch.cat([shaped_N, shaped_N[segment_of]]) if segment_of else shaped_N

    def add_logprobs(self, batch: SequenceBatch) -> None:
        """The logprobs the algorithm's loss reads besides the rollout's own."""
        if self.algorithm.uses_old_logprobs:
            batch.token_fields["old_logprobs"] = self.trainer.logprobs(batch, what="'logprobs' (policy)")
        if self.algorithm.uses_reference:
            batch.token_fields["ref_logprobs"] = self.trainer.logprobs(batch, reference=True, what="'logprobs' (reference)")
        if self.teacher is not None:
            batch.token_fields["teacher_logprobs"] = self.teacher.logprobs(batch)

    def train_on(self, trajectories: list[Trajectory], timer: StepTimer, step: int) -> tuple[dict, SequenceBatch | None]:
        """One step's update: its metrics, and the batch (the refit probe's sequences come from it)."""
        if not trajectories:
            return {"train/skipped_empty": 1.0}, None
        batch, shaped_N = self.batch_and_rewards(trajectories)
        with timer.phase("logprobs"):
            self.add_logprobs(batch)
        # ppo: the critic's values, per-token advantages and returns, the critic's update
        critic = critic_step.before_training(self.critic, self.algorithm, batch, shaped_N, step, timer,
                                             self.offload_trainer_state)
        if not critic.trains_policy:  # the critic's warm-up: no policy update, the policy's version stays
            return critic.metrics, batch
        with timer.phase("training"):
            out = self.trainer.train(batch, self.algorithm)
        self._count(out, step)
        return {**{f"train/{k}": float(v) for k, v in out.items()}, **critic.metrics}, batch

    def _count(self, out: dict, step: int) -> None:
        if self.nonfinite.after_step(bool(out.get("skipped_nonfinite")), step):
            self.policy_version += 1

    @contextlib.contextmanager
    def state_on_device(self, timer: StepTimer | None = None) -> Iterator[None]:
        """``policy.generation.colocated.offload_trainer_state``: the trainer's optimizer state and
        gradients come back before the trainer works and leave before the engines wake; ``timer``
        counts the moves as the step's "offload" phase."""
        if not self.offload_trainer_state:
            yield
            return
        self._move(out=False, timer=timer)
        yield  # a failed step propagates as it is, the state left where it is
        self._move(out=True, timer=timer)

    def wake(self, generator: Generator, timer: StepTimer | None = None) -> None:
        """The engines' wake-up after training. A wake-up refused for memory (the generator raises
        :class:`MemoryError` before it maps anything back) while the trainer's state is on the GPU and the
        recipe left ``offload_trainer_state`` auto: the state (and a critic's) goes to host memory, the
        wake-up is tried once more, and from then on the state leaves while the engine is awake."""
        try:
            generator.wake_up()
        except MemoryError as exc:
            if self.offload_trainer_state or not self.may_offload:
                raise
            print(f"memory: {exc}. The trainer's gradients and optimizer state leave the GPU while the engine is awake "
                  "from now on (policy.generation.colocated.offload_trainer_state: auto)", flush=True)
            self.offload_trainer_state = True
            self._move(out=True, timer=timer)
            if self.critic is not None:
                self.critic.offload()
            generator.wake_up()

    def _move(self, out: bool, timer: StepTimer | None) -> None:
        with timer.phase("offload") if timer is not None else contextlib.nullcontext():
            if out:
                self.trainer.offload(keep_weights=True)  # the refit that follows reads them on the GPU
            else:
                self.trainer.onload()
