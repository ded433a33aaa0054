"""The clipped importance-ratio policy-gradient loss the GRPO family shares.

Per valid token t of sequence i (m = loss mask, A = advantage, r = importance ratio)::

    l_pg(t)  = max(-r A, -clip(r, 1 - eps_lo, 1 + eps_hi) A)          (PPO clip, DAPO clip-higher)
    l_pg(t)  = min(l_pg(t), -c A)              if A < 0 and c is set  (dual clip, Ye et al. 2020)
    l_pg(t) *= w_t                             rollout correction w (detached): truncated or masked IS
                                               by p_train / p_gen, :mod:`rlcore.algorithms.rollout_correction`
    l_kl(t)  = k(log p_ref - log p)            k1, k2 or k3 estimator of KL(p || p_ref)
    loss     = reduce(l_pg) + beta * reduce(l_kl)

``p_train`` is the old policy's probability (``old_logprobs``) or, with ``use_old_logprobs:
false``, the current one, detached (one on-policy update per batch: r = 1 with the right
gradient; ``auto``, the default, is false when ``rlcore.run`` sees one optimizer step per generated
batch, sync or async: the old logprobs are taken from the weights that step starts at). ``reduce`` divides by the step's global count of valid tokens (token level) or
sequences (sequence level), so the loss is this micro-batch's share of the step loss. Subclasses
choose the advantage estimator, the ratio (GSPO: per sequence) and the reduction (Dr.GRPO).

Metrics, all shares that sum to the step value: ``policy_loss``, ``kl`` (the reduced KL
estimate, before beta), ``clip_fraction``, ``dual_clip_fraction``, ``ratio_mean`` and, when the
batch carries the generator's logprobs, the rollout-correction metrics (``gen_kl_error``, the mean
|log p_gen - log p_train| over valid tokens, ``rollout_kl_k3``, the masked / truncated fractions
and ``rollout_ratio_max``).
"""

from __future__ import annotations

import torch

from rlcore.algorithms import rollout_correction
from rlcore.algorithms.base import (
    KL_ESTIMATORS,
    REDUCTIONS,
    AlgorithmBase,
    check_loss_inputs,
    clipped_surrogate,
    masked,
    token_advantages,
    token_mean_share,
)
from rlcore.interfaces import StepTotals
from rlcore.data.packing import MicroBatch


class PolicyGradient(AlgorithmBase):
    """Base of the GRPO family; subclasses implement :meth:`advantages`."""

    capturable_loss = True  # audited with every subclass here (rlcore.interfaces.CapturableLoss)

    def __init__(self, config=None):
        super().__init__(config)
        self.uses_reference = self.config.kl_coef > 0
        # "auto" is decided by rlcore.run through choose_old_logprobs; undecided, the pass runs.
        self.uses_old_logprobs = self.config.use_old_logprobs is not False
        self.loss_level = getattr(self.config, "loss_level", type(self).loss_level)

    def choose_old_logprobs(self, one_update_per_batch: bool) -> bool:
        """:class:`rlcore.interfaces.OldLogprobsChoice`: ``use_old_logprobs: auto`` becomes false,
        skipping the pass, for one optimizer step per batch, else true; true/false stay."""
        if self.config.use_old_logprobs == "auto":
            self.uses_old_logprobs = not one_update_per_batch
        return self.uses_old_logprobs

    def required_fields(self) -> dict[str, str]:
        fields = {}
        if self.uses_old_logprobs:
            fields["old_logprobs"] = f"use_old_logprobs is {self.config.use_old_logprobs}" + (
                " (true for this run)" if self.config.use_old_logprobs == "auto" else "")
        if self.uses_reference:
            fields["ref_logprobs"] = f"kl_coef={self.config.kl_coef} > 0"
        preset = self.config.correction.preset
        if preset != "none":
            fields["gen_logprobs"] = (f"gen_is_cap={self.config.gen_is_cap} is set" if self.config.gen_is_cap is not None
                                      else f"rollout_correction.preset={preset!r}")
        return fields

    def ratio(self, log_ratio_T: torch.Tensor, mb: MicroBatch) -> torch.Tensor:
        """Importance ratio per token from log p - log p_train (0 on masked tokens)."""
        return torch.exp(log_ratio_T)

    def surrogate(self, ratio_T: torch.Tensor, adv_T: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Per-token policy loss and which tokens were clipped / dual-clipped (PPO's clipped surrogate)."""
        cfg = self.config
        return clipped_surrogate(ratio_T, adv_T, cfg.ratio_clip_min, cfg.ratio_clip_max, cfg.ratio_clip_c)

    def reduce(self, loss_T: torch.Tensor, mask_T: torch.Tensor, mb: MicroBatch, totals: StepTotals) -> torch.Tensor:
        return REDUCTIONS[self.loss_level](loss_T, mask_T, mb, totals)

    def loss(self, logprobs_T: torch.Tensor, mb: MicroBatch, totals: StepTotals) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        cfg = self.config
        check_loss_inputs(self.name, logprobs_T, mb, totals, self.required_fields())
        mask_T = mb.loss_mask_T.to(device=logprobs_T.device, dtype=logprobs_T.dtype)
        valid_T = mask_T > 0
        adv_T = token_advantages(self.name, mb).to(logprobs_T.device)
        train_T = mb.token_fields["old_logprobs"] if self.uses_old_logprobs else logprobs_T.detach()
        ratio_T = self.ratio(masked(logprobs_T - train_T, valid_T), mb)
        pg_T, clipped_T, dual_T = self.surrogate(ratio_T, adv_T)

        def share(x_T: torch.Tensor) -> torch.Tensor:
            return token_mean_share(x_T.to(mask_T.dtype).detach(), mask_T, mb, totals)

        metrics = {"clip_fraction": share(clipped_T), "ratio_mean": share(masked(ratio_T, valid_T))}
        if cfg.ratio_clip_c is not None:
            metrics["dual_clip_fraction"] = share(dual_T)
        if "gen_logprobs" in mb.token_fields:
            weights_T, correction = rollout_correction.correct(cfg.correction, train_T, mb.token_fields["gen_logprobs"],
                                                               valid_T, mb, totals)
            if weights_T is not None:
                pg_T = pg_T * weights_T
            metrics.update(correction)
        loss = self.reduce(pg_T, mask_T, mb, totals)
        metrics["policy_loss"] = loss
        if self.uses_reference:
            log_r_T = masked(mb.token_fields["ref_logprobs"] - logprobs_T, valid_T)
            kl = self.reduce(KL_ESTIMATORS[cfg.kl_estimator](log_r_T), mask_T, mb, totals)
            metrics["kl"] = kl
            loss = loss + cfg.kl_coef * kl
        return loss, {key: value.detach() for key, value in metrics.items()}
