"""Validation: greedy answers to the held-out prompts, scored by the environment; with a teacher
(distillation) also the held-out reverse KL to it."""

from __future__ import annotations

import numpy as np
import torch

from rlcore.generation.batching import Trajectory, accuracy_by_task, is_correct, to_sequence_batch
from rlcore.controller.rollouts import Rollouts
from rlcore.controller.context import RunContext
from rlcore.interfaces import Teacher, TrainerHandle


class Validator:
    """The ``val/*`` metrics of the policy the generator holds (the trainer's, after a refit)."""

    def __init__(self, rollouts: Rollouts, trainer: TrainerHandle, max_val_samples: int, seed: int, context: RunContext,
                 teacher: Teacher | None = None):
        self.rollouts, self.trainer, self.teacher = rollouts, trainer, teacher
        self.max_val_samples, self.seed, self.max_length = max_val_samples, seed, context.max_sequence_length

    def validate(self, step: int) -> dict[str, float]:
        val = self.rollouts.dataset.validation
        if not val:
            return {}
        samples = list(val[: self.max_val_samples])
        results, _, final_steps, _ = self.rollouts.generate(samples, 1, self.seed, step, greedy=True)
        trajs = [Trajectory(s, i, rs[0]) for i, (s, rs) in enumerate(zip(samples, results)) if rs]  # an agent's failed group has none
        self.rollouts.score(trajs, final_steps, step)
        metrics = {
            "val/accuracy": float(np.mean([is_correct(t.reward, t.env_metrics) for t in trajs])),
            "val/reward_mean": float(np.mean([t.reward for t in trajs])),
            **accuracy_by_task(trajs, "val"),
        }
        if self.teacher is not None:
            metrics["val/reverse_kl"] = self.held_out_reverse_kl(samples, step)
        return metrics

    def held_out_reverse_kl(self, samples, step: int) -> float:
        """Mean over response tokens of log p_policy - log p_teacher on one seeded sample per prompt
        (y ~ p: the k1 estimate of the per-token reverse KL, the quantity distillation lowers)."""
        results, _, _, _ = self.rollouts.generate(samples, 1, self.seed, step)
        trajs = [Trajectory(s, i, rs[0]) for i, (s, rs) in enumerate(zip(samples, results))]
        batch = to_sequence_batch(trajs, torch.zeros(len(trajs)), self.max_length)
        policy = self.trainer.logprobs(batch, what="'logprobs' (validation)")
        teacher = self.teacher.logprobs(batch)
        diff = sum(float(((p - t) * m)[1:].sum()) for p, t, m in zip(policy, teacher, batch.loss_mask))
        tokens = sum(float(m[1:].sum()) for m in batch.loss_mask)
        return diff / max(tokens, 1.0)
