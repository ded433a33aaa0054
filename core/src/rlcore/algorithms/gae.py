"""Per-token rewards, generalized advantage estimation and whitening for PPO (on CPU, float64).

A sequence's *valid* tokens are those with ``loss_mask > 0`` (the tokens the model wrote); its
steps k = 1..K are its valid tokens in order. Tokens the model did not write (the prompt, a
multi-turn environment's observations) are not steps: GAE runs over the valid tokens only, so an
observation between two turns neither earns nor discounts anything. With ``V_k`` the critic's
value before step k (token-aligned: the critic reads the prefix up to the token before it) and
``R`` the sequence's reward::

    r_k  = -beta * KL_k + [k == K] * R              KL_k = k(log p_old - log p_ref), optional (beta = 0: none)
    d_k  = r_k + gamma * V_{k+1} - V_k               V_{K+1} = 0 (the response ends the episode)
    A_k  = d_k + gamma * lambda * A_{k+1}            A_{K+1} = 0
    G_k  = A_k + V_k                                 (the critic's regression target, "returns")
    A_k <- (A_k - mean(A)) / sqrt(var(A) + 1e-8)     whitening over every valid token of the step

The whitening statistics (mean, unbiased variance) are over all valid tokens of the whole step,
on the driver before the batch is split over ranks, so they do not depend on the data-parallel
layout. Returns are taken before whitening.

Hand-written rather than taken from a library: the recursion is a few lines over a padded
``[N, K]`` block, and the libraries that have it (TRL, verl, torchrl) either bring their own
tensor containers or assume every token of a row is a step.
"""

from __future__ import annotations

import torch

from rlcore.algorithms.base import KL_ESTIMATORS
from rlcore.interfaces import SequenceBatch

WHITEN_EPS = 1e-8


def valid_positions(batch: SequenceBatch) -> list[torch.Tensor]:
    """Indices of each sequence's valid tokens (loss mask > 0; a sequence's first token never is)."""
    out = []
    for mask in batch.loss_mask:
        valid = mask.reshape(-1) > 0
        valid[0] = False  # token 0 has no logprob and no value (see rlcore.interfaces)
        out.append(torch.nonzero(valid).flatten())
    return out


def padded(values: list[torch.Tensor], positions: list[torch.Tensor], width: int) -> torch.Tensor:
    """[N, width] float64: each sequence's values at its valid positions, left-aligned, 0 after."""
    out = torch.zeros(len(values), width, dtype=torch.float64)
    for i, (v, pos) in enumerate(zip(values, positions)):
        out[i, : pos.numel()] = v.reshape(-1)[pos].double()
    return out


def token_rewards(batch: SequenceBatch, rewards_N: torch.Tensor, positions: list[torch.Tensor], *,
                  kl_coef: float = 0.0, kl_estimator: str = "k1") -> torch.Tensor:
    """``r_k`` [N, K]: the sequence reward on its last valid token, minus ``kl_coef`` times the
    per-token KL estimate of the old policy against the reference (token fields ``old_logprobs``
    and ``ref_logprobs``, needed only when ``kl_coef > 0``)."""
    width = max((p.numel() for p in positions), default=0)
    rewards_NK = torch.zeros(len(positions), width, dtype=torch.float64)
    for i, pos in enumerate(positions):
        if pos.numel():
            rewards_NK[i, pos.numel() - 1] = float(rewards_N[i])
    if kl_coef > 0:
        for field in ("old_logprobs", "ref_logprobs"):
            if field not in batch.token_fields:
                raise ValueError(f"ppo: the KL penalty in the reward (kl_penalty_coef={kl_coef}) needs the token field "
                                 f"'{field}'; have {sorted(batch.token_fields)}")
        log_r_NK = (padded(batch.token_fields["ref_logprobs"], positions, width)
                    - padded(batch.token_fields["old_logprobs"], positions, width))
        valid_NK = padded([torch.ones_like(m) for m in batch.loss_mask], positions, width) > 0
        rewards_NK = rewards_NK - kl_coef * torch.where(valid_NK, KL_ESTIMATORS[kl_estimator](log_r_NK), 0.0)
    return rewards_NK


def gae(rewards_NK: torch.Tensor, values_NK: torch.Tensor, lengths_N: torch.Tensor, gamma: float,
        lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages ``A`` [N, K], returns ``A + V`` [N, K]) by the backward recursion above; each
    row's steps are its first ``lengths_N[i]`` columns (the others are 0 and stay 0)."""
    if rewards_NK.shape != values_NK.shape:
        raise ValueError(f"gae: rewards {tuple(rewards_NK.shape)} and values {tuple(values_NK.shape)} differ in shape")
    steps_NK = torch.arange(rewards_NK.shape[1])[None, :] < lengths_N[:, None]
    values_NK = torch.where(steps_NK, values_NK.double(), 0.0)
    rewards_NK = torch.where(steps_NK, rewards_NK.double(), 0.0)
    adv_NK = torch.zeros_like(values_NK)
    next_adv_N = torch.zeros(values_NK.shape[0], dtype=torch.float64)
    next_value_N = torch.zeros_like(next_adv_N)
    for k in reversed(range(values_NK.shape[1])):
        delta_N = rewards_NK[:, k] + gamma * next_value_N - values_NK[:, k]
        next_adv_N = torch.where(steps_NK[:, k], delta_N + gamma * lam * next_adv_N, 0.0)
        adv_NK[:, k] = next_adv_N
        next_value_N = values_NK[:, k]
    return adv_NK, adv_NK + values_NK


def whiten(x_NK: torch.Tensor, lengths_N: torch.Tensor) -> torch.Tensor:
    """(x - mean) / sqrt(var + 1e-8) over the valid entries (unbiased variance); 0 elsewhere."""
    steps_NK = torch.arange(x_NK.shape[1])[None, :] < lengths_N[:, None]
    count = int(steps_NK.sum())
    if count < 2:
        raise ValueError(f"ppo: advantage whitening needs at least 2 valid tokens in the step, got {count}; "
                         "set algorithm.whiten_advantages: false or train on longer responses")
    x = x_NK.double()[steps_NK]
    mean, var = x.mean(), x.var(unbiased=True)
    return torch.where(steps_NK, (x_NK.double() - mean) * torch.rsqrt(var + WHITEN_EPS), 0.0)


def scatter_back(values_NK: torch.Tensor, positions: list[torch.Tensor], lengths: list[int]) -> list[torch.Tensor]:
    """Token-aligned float32 tensors [L_i]: the [N, K] values at each sequence's valid positions, 0 elsewhere."""
    out = []
    for i, (pos, length) in enumerate(zip(positions, lengths)):
        t = torch.zeros(length, dtype=torch.float32)
        t[pos] = values_NK[i, : pos.numel()].float()
        out.append(t)
    return out


def check_values(values: list[torch.Tensor], batch: SequenceBatch) -> None:
    """One finite token-aligned value tensor per sequence (a NaN value would poison every advantage)."""
    if len(values) != len(batch):
        raise ValueError(f"ppo: the critic returned {len(values)} value tensors for {len(batch)} sequences")
    for i, (v, ids) in enumerate(zip(values, batch.input_ids)):
        if v.shape != ids.shape:
            raise ValueError(f"ppo: the critic's values of sequence {i} have shape {tuple(v.shape)}, the sequence {tuple(ids.shape)}")
        mask = batch.loss_mask[i] > 0
        if not torch.isfinite(v[mask]).all():
            bad = int(torch.nonzero(~torch.isfinite(v) & mask).flatten()[0])
            raise ValueError(f"ppo: the critic's value of token {bad} of sequence {i} is {float(v[bad])}")
