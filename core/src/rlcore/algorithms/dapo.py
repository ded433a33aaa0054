"""DAPO: GRPO with clip-higher, dynamic sampling and overlong shaping (Yu et al. 2025).

Same loss as GRPO (:mod:`rlcore.algorithms.grpo`) with defaults eps_lo = 0.2, eps_hi = 0.28,
token-level normalization and no KL. On top:

- **Dynamic sampling** (:meth:`DAPO.keep_trajectories`): groups whose rewards are all equal carry no
  gradient and are dropped; the run loop generates more prompts to refill the batch, at most
  ``max_refill_rounds`` extra rounds.
- **Overlong reward shaping** (:meth:`DAPO.shape_rewards`), with L_max = ``max_response_length``
  and L_c = ``overlong_buffer_length``, for a response of |y| tokens::

      R_len(y) = 0                                   |y| <= L_max - L_c
               = ((L_max - L_c) - |y|) / L_c         L_max - L_c < |y| <= L_max
               = -1                                  |y| > L_max
      r' = r + overlong_penalty_factor * R_len(y)

- **Overlong filtering** (``overlong_filtering``): truncated responses are not trained on.

Differences from the paper: the paper filters groups on accuracy (all right or all wrong); here
on the rewards the run loop passes (after shaping, if it shapes first), which is the same for
0/1 rewards. The paper keeps sampling until the batch is full; the refill is capped here so a
run whose groups are all solved or all failed cannot loop forever. Overlong filtering drops the
trajectory from the trained batch (``keep_trajectories``); the run loop should compute group
advantages before dropping, as the paper masks the loss but keeps the group statistics.
"""

from __future__ import annotations

import torch

from rlcore.algorithms.advantages import all_equal_groups, check_per_sequence
from rlcore.algorithms.config import DAPOConfig
from rlcore.algorithms.grpo import GRPO


class DAPO(GRPO):
    name = "dapo"
    config_cls = DAPOConfig

    def __init__(self, config=None):
        super().__init__(config)
        self.max_refill_rounds = self.config.max_refill_rounds if self.config.dynamic_sampling else 0

    def shape_rewards(self, rewards_N: torch.Tensor, response_lengths_N: torch.Tensor, truncated_N: torch.Tensor) -> torch.Tensor:
        rewards_N = super().shape_rewards(rewards_N, response_lengths_N, truncated_N)
        cfg = self.config
        if cfg.overlong_buffer_length == 0:
            return rewards_N
        expected = cfg.max_response_length - cfg.overlong_buffer_length
        excess_N = (response_lengths_N.double() - expected).clamp(min=0)
        penalty_N = -(excess_N / cfg.overlong_buffer_length).clamp(max=1.0) * cfg.overlong_penalty_factor
        return (rewards_N.double() + penalty_N).to(rewards_N.dtype)

    def keep_trajectories(self, rewards_N: torch.Tensor, group_ids_N: torch.Tensor, truncated_N: torch.Tensor) -> torch.Tensor:
        keep_N = super().keep_trajectories(rewards_N, group_ids_N, truncated_N)
        check_per_sequence("truncated", truncated_N, rewards_N.numel())
        if self.config.dynamic_sampling:
            keep_N &= ~all_equal_groups(rewards_N, group_ids_N)
        if self.config.overlong_filtering:
            keep_N &= ~truncated_N.bool()
        return keep_N
