"""On-policy distillation: the student samples, a teacher scores the student's own tokens, and the
per-token reverse KL to the teacher is the (negative) advantage (Agarwal et al. 2024, GKD,
arXiv:2306.13649, with lambda = 1 and the reverse KL; Lu & Thinking Machines 2025, "On-Policy
Distillation", its advantage form).

For a response y ~ p (the student) and teacher q, the reverse KL's gradient is::

    grad KL(p || q) = E_y~p [ sum_t (log p(y_t|y_<t) - log q(y_t|y_<t)) grad log p(y_t|y_<t) ]   (+ future terms)

so each token gets the detached advantage ``A_t = log q(y_t) - log p_train(y_t)`` and the GRPO
family's clipped policy-gradient loss (:mod:`rlcore.algorithms.policy_gradient`) trains on it::

    loss = reduce_t(max(-r_t A_t, -clip(r_t, 1 - eps_lo, 1 + eps_hi) A_t))

with ``p_train`` the old policy (``use_old_logprobs: true``) or the current one, detached (the
default: one on-policy update per batch, r = 1). Differences: the per-token advantage leaves out
the future tokens' KL (discount 0, as Thinking Machines' recipe); the environment's rewards are
not used for training (they are still logged, and validation still grades). Teacher logprobs come
from :mod:`rlcore.generation.teacher` (token field ``teacher_logprobs``). Metric ``reverse_kl``: the mean over
valid tokens of log p_train - log q, the k1 estimate of the per-token reverse KL.
"""

from __future__ import annotations

import attrs
import torch

from rlcore.algorithms.advantages import check_rewards
from rlcore.algorithms.base import check_loss_inputs, masked, token_mean_share
from rlcore.algorithms.config import DistillationConfig
from rlcore.algorithms.policy_gradient import PolicyGradient
from rlcore.interfaces import StepTotals
from rlcore.data.packing import MicroBatch


class Distillation(PolicyGradient):
    name = "distillation"
    config_cls = DistillationConfig

    def required_fields(self) -> dict[str, str]:
        return {**super().required_fields(), "teacher_logprobs": "the teacher scores the rollouts (rlcore.generation.teacher)"}

    def advantages(self, rewards_N: torch.Tensor, group_ids_N: torch.Tensor) -> torch.Tensor:
        check_rewards(rewards_N, group_ids_N)
        return torch.zeros_like(rewards_N)  # per-token advantages come from the teacher in loss()

    def loss(self, logprobs_T: torch.Tensor, mb: MicroBatch, totals: StepTotals) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        check_loss_inputs(self.name, logprobs_T, mb, totals, self.required_fields())
        valid_T = mb.loss_mask_T.to(logprobs_T.device) > 0
        student_T = mb.token_fields["old_logprobs"] if self.uses_old_logprobs else logprobs_T.detach()
        teacher_T = mb.token_fields["teacher_logprobs"].to(student_T)
        reverse_kl_T = masked(student_T - teacher_T, valid_T)
        mb = attrs.evolve(mb, token_fields={**mb.token_fields, "advantages": -reverse_kl_T})
        loss, metrics = super().loss(logprobs_T, mb, totals)
        metrics["reverse_kl"] = token_mean_share(reverse_kl_T.detach(), valid_T.to(student_T.dtype), mb, totals)
        return loss, metrics
