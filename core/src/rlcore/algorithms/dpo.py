"""DPO: Direct Preference Optimization (Rafailov et al. 2023, arXiv:2305.18290, eq. 7).

For a pair (prompt x, chosen y_c, rejected y_r), with log p(y|x) the sum of the response's token
logprobs under the policy p and the frozen reference p_ref (the initial policy)::

    h    = beta * [(log p(y_c|x) - log p_ref(y_c|x)) - (log p(y_r|x) - log p_ref(y_r|x))]
    l    = -(1 - eps) log sigmoid(h) - eps log sigmoid(-h)             (eps: label_smoothing)
    loss = 1/P sum_pairs l  +  alpha * 1/P sum_pairs (-1/|y_c| sum_t log p(y_c,t))

- ``label_smoothing`` eps > 0 is conservative DPO (Mitchell 2023, "A note on DPO with noisy
  preferences"): the label is assumed flipped with probability eps.
- ``sft_loss_weight`` alpha > 0 adds the chosen response's NLL (RPO, Pang et al. 2024,
  arXiv:2404.19733; NeMo-RL's ``sft_loss_weight``), here the per-token mean of each chosen
  response, averaged over pairs.
- ``reference_free``: log p_ref = 0 (TRL's ``reference_free``); no reference pass.

P is the step's pair count (global normalization, :mod:`rlcore.algorithms.pairs`), so the loss
of a micro-batch is its share of the step loss whatever the packing or data-parallel split; the
two sequences of a pair always share a micro-batch. The reference logprobs are computed once per
batch, before the optimizer step(s) (token field ``ref_logprobs``).

Metrics (shares of the step mean): ``preference_loss``, ``sft_loss`` (when alpha > 0),
``accuracy`` (h > 0), ``reward_margin`` (h), ``chosen_reward`` and ``rejected_reward``
(beta * log p / p_ref of each response).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from rlcore.algorithms.base import AlgorithmBase, check_loss_inputs, masked, per_seq_sum
from rlcore.algorithms.config import DPOConfig
from rlcore.algorithms.pairs import num_pairs, pair_index
from rlcore.interfaces import StepTotals
from rlcore.data.packing import MicroBatch


class DPO(AlgorithmBase):
    name = "dpo"
    config_cls = DPOConfig
    loss_level = "sequence"

    def __init__(self, config=None):
        super().__init__(config)
        self.uses_reference = not self.config.reference_free

    def advantages(self, rewards_N: torch.Tensor, group_ids_N: torch.Tensor) -> torch.Tensor:
        raise TypeError("dpo trains on preference pairs, not on rollouts: use a preference dataset "
                        "(data.name: preference); rlcore.run then drives the pairwise loop")

    def loss(self, logprobs_T: torch.Tensor, mb: MicroBatch, totals: StepTotals) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        cfg = self.config
        fields = {"ref_logprobs": "reference_free is false"} if self.uses_reference else {}
        check_loss_inputs(self.name, logprobs_T, mb, totals, fields)
        pairs = num_pairs(self.name, totals)
        slot_n, sign_n, p = pair_index(self.name, mb)
        mask_T = mb.loss_mask_T.to(device=logprobs_T.device, dtype=logprobs_T.dtype)
        valid_T = mask_T > 0
        seq_logp_n = per_seq_sum(masked(logprobs_T, valid_T), mb)
        ref_logp_n = (per_seq_sum(masked(mb.token_fields["ref_logprobs"].to(logprobs_T.dtype), valid_T), mb)
                      if self.uses_reference else torch.zeros_like(seq_logp_n))
        reward_n = cfg.beta * (seq_logp_n - ref_logp_n)
        sign_n, slot_n = sign_n.to(reward_n), slot_n.to(reward_n.device)
        h_p = reward_n.new_zeros(p).index_add(0, slot_n, sign_n * reward_n)
        eps = cfg.label_smoothing
        pref_p = -(1.0 - eps) * F.logsigmoid(h_p) - eps * F.logsigmoid(-h_p)
        loss = pref_p.sum() / pairs
        chosen_n = (sign_n > 0).to(reward_n.dtype)
        metrics = {
            "preference_loss": loss,
            "accuracy": (h_p > 0).to(h_p.dtype).sum() / pairs,
            "reward_margin": h_p.sum() / pairs,
            "chosen_reward": (reward_n * chosen_n).sum() / pairs,
            "rejected_reward": (reward_n * (1 - chosen_n)).sum() / pairs,
        }
        if cfg.sft_loss_weight > 0:
            tokens_n = per_seq_sum(mask_T, mb).clamp(min=1)
            sft = (-seq_logp_n / tokens_n * chosen_n).sum() / pairs
            metrics["sft_loss"] = sft
            loss = loss + cfg.sft_loss_weight * sft
        return loss, {key: value.detach() for key, value in metrics.items()}
