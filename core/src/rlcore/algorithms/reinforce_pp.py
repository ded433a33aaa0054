"""REINFORCE++ (Hu 2025): PPO-style clipped REINFORCE with batch-level advantage normalization.

    A_i  = r_i - mean(r of i's group)               (REINFORCE++-baseline; group_baseline: false -> r_i)
    A_i <- (A_i - mean_batch(A)) / max(std_batch(A), std_floor)

over every trajectory of the step, then the clipped loss of
:mod:`rlcore.algorithms.policy_gradient`.

Differences from the paper: the paper folds a per-token k1 KL penalty into the reward and
normalizes the resulting per-token returns over the batch; here advantages are per sequence
(computed before the reference pass) and the KL, when ``kl_coef > 0``, is a loss term as in
GRPO (k3 by default, as the paper's -baseline variant).
"""

from __future__ import annotations

import torch

from rlcore.algorithms.advantages import batch_normalize, check_rewards, group_mean_baseline
from rlcore.algorithms.config import ReinforcePPConfig
from rlcore.algorithms.policy_gradient import PolicyGradient


class ReinforcePP(PolicyGradient):
    name = "reinforce_pp"
    config_cls = ReinforcePPConfig

    def advantages(self, rewards_N: torch.Tensor, group_ids_N: torch.Tensor) -> torch.Tensor:
        check_rewards(rewards_N, group_ids_N)
        adv_N = rewards_N.double()
        if self.config.group_baseline:
            adv_N = adv_N - group_mean_baseline(rewards_N, group_ids_N, leave_one_out=False)
        return batch_normalize(adv_N, std_floor=self.config.std_floor).to(rewards_N.dtype)
