"""Dr. GRPO: GRPO "done right" (Liu et al. 2025, Understanding R1-Zero-Like Training).

Removes GRPO's two biases: no std normalization of advantages, and no per-response length
normalization — token losses are summed and divided by a constant::

    A_i  = r_i - mean(r_1..r_G)
    loss = sum_i sum_t m_it l_it / (N_seqs * L)        L = normalizer_length (constant)

with l_it the clipped per-token loss of :mod:`rlcore.algorithms.policy_gradient`.

Differences from the paper: N_seqs is the step's number of sequences with a valid token (the
paper's batch size, the same unless a response is fully masked); the normalization is global
over the step, so the constant is the only length scale, as the paper intends.
"""

from __future__ import annotations

import torch

from rlcore.algorithms.advantages import group_advantages
from rlcore.algorithms.config import DrGRPOConfig
from rlcore.algorithms.policy_gradient import PolicyGradient
from rlcore.interfaces import StepTotals
from rlcore.data.packing import MicroBatch


class DrGRPO(PolicyGradient):
    name = "dr_grpo"
    config_cls = DrGRPOConfig
    loss_level = "sequence"

    def advantages(self, rewards_N: torch.Tensor, group_ids_N: torch.Tensor) -> torch.Tensor:
        return group_advantages(rewards_N, group_ids_N, leave_one_out=False, normalize_std=False, std_floor=1.0)

    def reduce(self, loss_T: torch.Tensor, mask_T: torch.Tensor, mb: MicroBatch, totals: StepTotals) -> torch.Tensor:
        return (loss_T * mask_T).sum() / (totals.num_valid_seqs * self.config.normalizer_length)
