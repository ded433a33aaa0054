"""GRPO: group-relative advantages with a clipped importance ratio (Shao et al. 2024, DeepSeekMath).

For the G responses of one prompt with rewards r_1..r_G::

    A_i = (r_i - b_i) / max(std(r_1..r_G), std_floor)      b_i = mean(r)  or, leave-one-out,
                                                           b_i = mean of the other G-1 rewards
    loss = reduce_t(max(-rho A_i, -clip(rho, 1 - eps_lo, 1 + eps_hi) A_i)) + beta * reduce_t(KL_t)

(see :mod:`rlcore.algorithms.policy_gradient` for the per-token loss, dual clip, KL estimators
and truncated importance sampling).

Differences from the paper: the paper averages each response's token losses, then the responses
(``loss_level: sequence``); the default here is the token-level mean over the whole step (DAPO's
choice, no length bias between responses of one batch). Normalization is global over the step,
not per micro-batch. The KL term uses the k3 estimator by default, as the paper, and can be
switched off (``kl_coef: 0``), which also skips the reference-policy pass. std is the unbiased
group std, floored (the paper adds no epsilon; NeMo-RL adds 1e-6).
"""

from __future__ import annotations

import torch

from rlcore.algorithms.advantages import group_advantages
from rlcore.algorithms.config import GRPOConfig
from rlcore.algorithms.policy_gradient import PolicyGradient


class GRPO(PolicyGradient):
    name = "grpo"
    config_cls = GRPOConfig

    def advantages(self, rewards_N: torch.Tensor, group_ids_N: torch.Tensor) -> torch.Tensor:
        cfg = self.config
        return group_advantages(rewards_N, group_ids_N, leave_one_out=cfg.leave_one_out_baseline,
                                normalize_std=cfg.normalize_std, std_floor=cfg.std_floor)
