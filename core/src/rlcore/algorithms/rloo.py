"""RLOO: REINFORCE with a leave-one-out baseline (Kool et al. 2019; Ahmadian et al. 2024).

For the G responses of one prompt::

    A_i = r_i - 1/(G-1) * sum_{j != i} r_j          (no std normalization)

and the clipped policy-gradient loss of :mod:`rlcore.algorithms.policy_gradient`.

Differences from the paper: the paper treats a whole response as one action (its loss is
-A_i * sum_t log p_t, unclipped); here the loss is per token with the PPO clip, mean-reduced at
token or sequence level. With one update per batch the ratio is 1 and the clip never binds, so
the gradient is the paper's up to the per-token normalization.
"""

from __future__ import annotations

import torch

from rlcore.algorithms.advantages import group_advantages
from rlcore.algorithms.config import RLOOConfig
from rlcore.algorithms.policy_gradient import PolicyGradient


class RLOO(PolicyGradient):
    name = "rloo"
    config_cls = RLOOConfig

    def advantages(self, rewards_N: torch.Tensor, group_ids_N: torch.Tensor) -> torch.Tensor:
        return group_advantages(rewards_N, group_ids_N, leave_one_out=True, normalize_std=False, std_floor=1.0)
