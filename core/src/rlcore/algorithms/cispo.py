"""CISPO: Clipped IS-weight Policy Optimization (MiniMax-M1, MiniMax 2025, arXiv:2506.13585, sec. 3.1).

GRPO advantages (:mod:`rlcore.algorithms.grpo`); instead of clipping the token's update, CISPO
clips a detached importance-sampling weight and keeps every token's gradient::

    r_t  = p(y_t) / p_old(y_t)
    w_t  = sg(clip(r_t, 1 - eps_lo, 1 + eps_hi))                  (sg: stop-gradient)
    J    = 1 / N_tokens * sum_t w_t A_t log p(y_t)
    grad = -1 / N_tokens * sum_t w_t A_t grad log p(y_t)

Written here as ``l_t = -sg(w_t / r_t) r_t A_t``: the same gradient (d r_t = r_t d log p), and a
value (-w_t A_t) on the scale of GRPO's ``policy_loss`` instead of the paper's log-probability-
weighted sum. ``clip_fraction`` counts the tokens whose weight was truncated (their gradient still
flows, scaled by the bound).

Differences from the paper: the paper has no lower bound (``ratio_clip_min: 1``, the default) and
tunes the upper one; 0.28 here is DAPO's clip-higher value, not a number from the paper. Token-
level normalization over the step (as the paper) is the default; ``loss_level: sequence`` is
available. KL to the reference and rollout correction compose as for GRPO (the paper uses none).
"""

from __future__ import annotations

import torch

from rlcore.algorithms.config import CISPOConfig
from rlcore.algorithms.grpo import GRPO


class CISPO(GRPO):
    name = "cispo"
    config_cls = CISPOConfig

    def surrogate(self, ratio_T: torch.Tensor, adv_T: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        cfg = self.config
        weight_T = ratio_T.detach().clamp(1.0 - cfg.ratio_clip_min, 1.0 + cfg.ratio_clip_max)
        # r is exp(log ratio) > 0 wherever it is used (masked tokens have ratio 1)
        loss_T = -(weight_T / ratio_T.detach()) * ratio_T * adv_T
        truncated_T = weight_T != ratio_T.detach()
        return loss_T, truncated_T, torch.zeros_like(truncated_T)
