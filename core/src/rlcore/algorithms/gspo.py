"""GSPO: Group Sequence Policy Optimization (Zheng et al. 2025, Qwen).

GRPO advantages (:mod:`rlcore.algorithms.grpo`) with a *sequence-level* importance ratio, the
geometric mean of the token ratios of response i over its |y_i| valid tokens::

    s_i  = exp( 1/|y_i| * sum_t (log p(y_it) - log p_old(y_it)) )
    loss = 1/N_seqs * sum_i max(-s_i A_i, -clip(s_i, 1 - eps_lo, 1 + eps_hi) A_i)

(default eps_lo = 3e-4, eps_hi = 4e-4, as the paper). The sequence ratio is written onto every
token of the response and reduced at sequence level (mean over the response's tokens, then over
sequences), which gives exactly the value and gradient above.

Differences from the paper: optional truncated importance sampling from the generator's
logprobs and dual clip apply per token on top (off by default); KL to the reference is
available (the paper uses none; default 0).
"""

from __future__ import annotations

import torch

from rlcore.algorithms.base import per_seq_sum, spread_per_seq
from rlcore.algorithms.config import GSPOConfig
from rlcore.algorithms.grpo import GRPO
from rlcore.data.packing import MicroBatch


class GSPO(GRPO):
    name = "gspo"
    config_cls = GSPOConfig
    loss_level = "sequence"

    def ratio(self, log_ratio_T: torch.Tensor, mb: MicroBatch) -> torch.Tensor:
        tokens_n = per_seq_sum(mb.loss_mask_T.to(device=log_ratio_T.device, dtype=log_ratio_T.dtype), mb)
        mean_log_n = per_seq_sum(log_ratio_T, mb) / tokens_n.clamp(min=1)
        # padding tokens read 0: ratio 1, masked anyway
        return torch.exp(spread_per_seq(mean_log_n, mb))
