"""SFT as an algorithm: masked negative log-likelihood of reference answers.

``rlcore run`` with ``algorithm.name: sft`` runs the SFT loop (:mod:`rlcore.controller.sft`:
prompt + reference response, the loss on the response tokens only); the demo's warm start
trains with it too.

    loss = -sum_t m_t log p(y_t | y_<t) / N_tokens           (N_tokens: valid tokens of the step)

Metric ``nll`` (the same value, a share of the step mean). Rewards and advantages are ignored
(advantages are 0); no reference or old-logprob pass is needed.
"""

from __future__ import annotations

import torch

from rlcore.algorithms.advantages import check_rewards
from rlcore.algorithms.base import AlgorithmBase, check_loss_inputs, masked, token_mean_share
from rlcore.algorithms.config import SFTConfig
from rlcore.interfaces import StepTotals
from rlcore.data.packing import MicroBatch


class SFT(AlgorithmBase):
    name = "sft"
    config_cls = SFTConfig
    capturable_loss = True  # rlcore.interfaces.CapturableLoss

    def advantages(self, rewards_N: torch.Tensor, group_ids_N: torch.Tensor) -> torch.Tensor:
        check_rewards(rewards_N, group_ids_N)
        return torch.zeros_like(rewards_N)

    def loss(self, logprobs_T: torch.Tensor, mb: MicroBatch, totals: StepTotals) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        check_loss_inputs(self.name, logprobs_T, mb, totals, {})
        mask_T = mb.loss_mask_T.to(device=logprobs_T.device, dtype=logprobs_T.dtype)
        loss = token_mean_share(-masked(logprobs_T, mask_T > 0), mask_T, mb, totals)
        return loss, {"nll": loss.detach()}
