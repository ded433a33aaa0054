"""PPO with a learned critic and generalized advantage estimation (Schulman et al. 2017; GAE:
Schulman et al. 2016; for language models as in Ouyang et al. 2022, InstructGPT).

Each step (:mod:`rlcore.controller.critic_step` runs it between the logprob passes and training):

1. the critic gives a value ``V_t`` for every response token (token-aligned, see
   :class:`rlcore.interfaces.CriticHandle`);
2. per-token rewards, GAE and whitening (:mod:`rlcore.algorithms.gae`)::

       r_t = -beta * KL_t + [t last] * R,   A_t = sum_l (gamma lambda)^l (r_{t+l} + gamma V_{t+l+1} - V_{t+l})
       G_t = A_t + V_t,                     A_t <- whiten(A_t) over the step's valid tokens

3. the critic trains on the clipped value loss (:mod:`rlcore.algorithms.value_loss`) toward ``G``;
4. after ``critic_warmup_steps`` steps, the policy trains on the clipped surrogate of
   :mod:`rlcore.algorithms.policy_gradient` with the per-token advantages ``A_t``::

       loss = reduce_t(max(-rho_t A_t, -clip(rho_t, 1 - eps_lo, 1 + eps_hi) A_t)) + kl_coef * reduce_t(KL_t)

Differences from the papers: InstructGPT adds a pretraining-mix term and trains policy and value
heads of one network jointly; here they are two models with two optimizers (as verl, OpenRLHF
and NeMo-RL do). The reward's KL penalty (``kl_penalty_coef``) uses the old policy's logprobs,
the ones the samples were scored with at the step's start; ``kl_coef`` adds GRPO's KL loss term
instead or as well. Normalization is global over the step, as every rlcore loss.
"""

from __future__ import annotations

import torch

from rlcore.algorithms import gae
from rlcore.algorithms.advantages import check_rewards
from rlcore.algorithms.config import PPOConfig
from rlcore.algorithms.policy_gradient import PolicyGradient
from rlcore.algorithms.value_loss import ValueLoss
from rlcore.interfaces import SequenceBatch


class PPO(PolicyGradient):
    name = "ppo"
    config_cls = PPOConfig
    uses_critic = True  # rlcore.interfaces.CriticAlgorithm

    def __init__(self, config=None):
        super().__init__(config)
        cfg = self.config
        self.uses_reference = cfg.kl_coef > 0 or cfg.kl_penalty_coef > 0
        if cfg.kl_penalty_coef > 0:
            if cfg.use_old_logprobs is False:
                raise ValueError(f"ppo: kl_penalty_coef={cfg.kl_penalty_coef} reads the old policy's logprobs; "
                                 "use_old_logprobs must be true or auto")
            self.uses_old_logprobs = True
        self.value_loss = ValueLoss(cfg.value_clip)

    def choose_old_logprobs(self, one_update_per_batch: bool) -> bool:
        if self.config.kl_penalty_coef > 0:  # the reward's KL term needs them whatever the update count
            self.uses_old_logprobs = True
            return True
        return super().choose_old_logprobs(one_update_per_batch)

    def required_fields(self) -> dict[str, str]:
        return {**super().required_fields(),
                "returns": "set with the token advantages by the critic step (rlcore.controller.critic_step); ppo runs with a critic"}

    def advantages(self, rewards_N: torch.Tensor, group_ids_N: torch.Tensor) -> torch.Tensor:
        """Zeros: PPO's advantages are per token and need the critic's values (:meth:`token_targets`)."""
        check_rewards(rewards_N, group_ids_N)
        return torch.zeros_like(rewards_N)

    def trains_policy(self, step: int) -> bool:
        """Whether run-loop step ``step`` (from 1) trains the policy: not during the critic's warm-up."""
        return step > self.config.critic_warmup_steps

    def token_targets(self, batch: SequenceBatch, values: list[torch.Tensor],
                      rewards_N: torch.Tensor) -> tuple[dict[str, list[torch.Tensor]], dict[str, float]]:
        """Token fields ``advantages`` (whitened GAE), ``returns`` and ``values`` (the critic's, old)
        of ``batch`` from the critic's ``values`` and the shaped sequence rewards; and their metrics."""
        cfg = self.config
        check_rewards(rewards_N)
        gae.check_values(values, batch)
        positions = gae.valid_positions(batch)
        lengths_N = torch.tensor([p.numel() for p in positions])
        width = int(lengths_N.max()) if len(positions) else 0
        rewards_NK = gae.token_rewards(batch, rewards_N, positions, kl_coef=cfg.kl_penalty_coef,
                                       kl_estimator=cfg.kl_penalty_estimator)
        values_NK = gae.padded(values, positions, width)
        adv_NK, returns_NK = gae.gae(rewards_NK, values_NK, lengths_N, cfg.gamma, cfg.gae_lambda)
        steps_NK = torch.arange(width)[None, :] < lengths_N[:, None]
        metrics = {"critic/values_mean": float(values_NK[steps_NK].mean()),
                   "critic/returns_mean": float(returns_NK[steps_NK].mean()),
                   "critic/advantages_mean": float(adv_NK[steps_NK].mean()),
                   "critic/explained_variance": _explained_variance(values_NK[steps_NK], returns_NK[steps_NK])}
        if cfg.kl_penalty_coef > 0:
            metrics["critic/token_reward_mean"] = float(rewards_NK[steps_NK].mean())
        if cfg.whiten_advantages:
            adv_NK = gae.whiten(adv_NK, lengths_N)
        lengths = batch.lengths()
        fields = {"advantages": gae.scatter_back(adv_NK, positions, lengths),
                  "returns": gae.scatter_back(returns_NK, positions, lengths),
                  "values": gae.scatter_back(values_NK, positions, lengths)}
        return fields, metrics


def _explained_variance(values: torch.Tensor, returns: torch.Tensor) -> float:
    """1 - var(G - V) / var(G): 1 when the critic predicts the returns, 0 for a constant guess."""
    if returns.numel() < 2:
        return 0.0
    var = float(returns.var())
    return 1.0 - float((returns - values).var()) / var if var > 0 else 0.0
