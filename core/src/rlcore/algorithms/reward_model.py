"""Reward-model training: the Bradley-Terry pairwise loss on scalar scores (Bradley & Terry 1952;
as used for RLHF reward models by Ouyang et al. 2022, arXiv:2203.02155, eq. 1).

A scalar head on the causal LM scores prompt + response (the last token's hidden state through
a linear layer: ``AutoModelForSequenceClassification`` with one label). For P pairs::

    loss = 1/P sum_pairs [ -log sigmoid(r(x, y_c) - r(x, y_r)) + lambda (r(x, y_c) + r(x, y_r))^2 ]

The second term (``center_coef`` lambda, default 0) keeps rewards centred on 0, as Eisenstein et
al. 2023 (arXiv:2312.09244) do; Ouyang et al. instead normalize the trained model's rewards once.
Differences: each pair is one comparison (InstructGPT batches all K-choose-2 comparisons of a
prompt together); ``train.num_prompts_per_step`` pairs make a step.

Metrics: ``loss``, ``accuracy`` (r_c > r_r), ``reward_margin`` (mean r_c - r_r),
``chosen_reward`` and ``rejected_reward`` (means).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from rlcore.algorithms.base import AlgorithmBase
from rlcore.algorithms.config import RewardModelConfig


class RewardModel(AlgorithmBase):
    name = "reward_model"
    config_cls = RewardModelConfig
    loss_level = "sequence"

    def advantages(self, rewards_N: torch.Tensor, group_ids_N: torch.Tensor) -> torch.Tensor:
        raise TypeError("reward_model trains a scorer on preference pairs, not a policy on rollouts: use a "
                        "preference dataset (data.name: preference)")

    def loss(self, logprobs_T, mb, totals):
        raise TypeError("reward_model's loss is on scalar scores (pair_loss), not on token logprobs; it does not run "
                        "through a policy training backend")

    def pair_loss(self, chosen_P: torch.Tensor, rejected_P: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Mean Bradley-Terry loss of P pairs' scores (each [P]) and its metrics."""
        if chosen_P.shape != rejected_P.shape or chosen_P.dim() != 1 or chosen_P.numel() == 0:
            raise ValueError(f"reward_model.pair_loss: chosen scores {tuple(chosen_P.shape)} and rejected scores "
                             f"{tuple(rejected_P.shape)} must both be [P] with P > 0")
        margin_P = chosen_P - rejected_P
        loss = -F.logsigmoid(margin_P).mean()
        metrics = {"bt_loss": loss}
        if self.config.center_coef > 0:
            center = ((chosen_P + rejected_P) ** 2).mean()
            metrics["center_loss"] = center
            loss = loss + self.config.center_coef * center
        metrics.update(accuracy=(margin_P > 0).float().mean(), reward_margin=margin_P.mean(),
                       chosen_reward=chosen_P.mean(), rejected_reward=rejected_P.mean())
        return loss, {k: v.detach() for k, v in metrics.items()}
