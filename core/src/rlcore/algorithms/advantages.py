"""Reward checks and advantage estimators shared by the algorithms (per sequence, on CPU).

Statistics are computed in float64 and returned in the rewards' dtype. Bad input (non-finite
rewards, mismatched shapes, a group too small for the requested statistic) is a ValueError that
names the offending trajectory or group: a NaN advantage would otherwise poison a whole step.
"""

from __future__ import annotations

import torch


def check_rewards(rewards_N: torch.Tensor, group_ids_N: torch.Tensor | None = None, *, what: str = "rewards") -> None:
    if rewards_N.dim() != 1:
        raise ValueError(f"{what} must be 1-D [N], got shape {tuple(rewards_N.shape)}")
    if group_ids_N is not None and group_ids_N.shape != rewards_N.shape:
        raise ValueError(f"group_ids has shape {tuple(group_ids_N.shape)}, {what} has {tuple(rewards_N.shape)}")
    bad = (~torch.isfinite(rewards_N)).nonzero().flatten()
    if bad.numel():
        i = int(bad[0])
        raise ValueError(f"{what}[{i}] is {float(rewards_N[i])} ({bad.numel()} non-finite of {rewards_N.numel()}): "
                         "rewards must be finite; check the environment's reward function")


def check_per_sequence(name: str, values_N: torch.Tensor, n: int) -> None:
    if values_N.shape != (n,):
        raise ValueError(f"{name} has shape {tuple(values_N.shape)}, expected [{n}] (one per trajectory)")


def _groups(group_ids_N: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(unique ids [G], inverse [N] -> 0..G-1, counts [G])."""
    return torch.unique(group_ids_N, return_inverse=True, return_counts=True)


def _require_size(counts_G: torch.Tensor, ids_G: torch.Tensor, minimum: int, why: str) -> None:
    small = (counts_G < minimum).nonzero().flatten()
    if small.numel():
        g = int(small[0])
        raise ValueError(f"group {int(ids_G[g])} has {int(counts_G[g])} trajectory(ies); {why} needs at least {minimum} "
                         "per group (raise num_generations_per_prompt or change the setting)")


def group_mean_baseline(rewards_N: torch.Tensor, group_ids_N: torch.Tensor, *, leave_one_out: bool) -> torch.Tensor:
    """Mean reward of each trajectory's group [N]; leave-one-out: mean of the *other* members."""
    ids_G, inv_N, counts_G = _groups(group_ids_N)
    r = rewards_N.double()
    sums_G = torch.zeros(ids_G.numel(), dtype=torch.float64).index_add_(0, inv_N, r)
    if not leave_one_out:
        return (sums_G / counts_G)[inv_N]
    _require_size(counts_G, ids_G, 2, "a leave-one-out baseline")
    return (sums_G[inv_N] - r) / (counts_G[inv_N] - 1)


def group_std(rewards_N: torch.Tensor, group_ids_N: torch.Tensor) -> torch.Tensor:
    """Unbiased (Bessel) standard deviation of each trajectory's group [N]."""
    ids_G, inv_N, counts_G = _groups(group_ids_N)
    _require_size(counts_G, ids_G, 2, "std normalization")
    r = rewards_N.double()
    mean_G = torch.zeros(ids_G.numel(), dtype=torch.float64).index_add_(0, inv_N, r) / counts_G
    sq_G = torch.zeros(ids_G.numel(), dtype=torch.float64).index_add_(0, inv_N, (r - mean_G[inv_N]) ** 2)
    return (sq_G / (counts_G - 1)).sqrt()[inv_N]


def group_advantages(rewards_N: torch.Tensor, group_ids_N: torch.Tensor, *, leave_one_out: bool,
                     normalize_std: bool, std_floor: float) -> torch.Tensor:
    """A_i = (r_i - b_i) / max(std_group, std_floor) (the division only with ``normalize_std``)."""
    check_rewards(rewards_N, group_ids_N)
    adv_N = rewards_N.double() - group_mean_baseline(rewards_N, group_ids_N, leave_one_out=leave_one_out)
    if normalize_std:
        adv_N = adv_N / group_std(rewards_N, group_ids_N).clamp(min=std_floor)
    return adv_N.to(rewards_N.dtype)


def batch_normalize(adv_N: torch.Tensor, *, std_floor: float) -> torch.Tensor:
    """(A - mean(A)) / max(std(A), std_floor) over the whole batch (REINFORCE++)."""
    if adv_N.numel() < 2:
        raise ValueError(f"batch advantage normalization needs at least 2 trajectories, got {adv_N.numel()}")
    a = adv_N.double()
    return ((a - a.mean()) / a.std().clamp(min=std_floor)).to(adv_N.dtype)


def all_equal_groups(rewards_N: torch.Tensor, group_ids_N: torch.Tensor) -> torch.Tensor:
    """Bool [N]: the trajectory's group has identical rewards (so zero group-relative advantage)."""
    ids_G, inv_N, _ = _groups(group_ids_N)
    lo_G = torch.full((ids_G.numel(),), float("inf"), dtype=torch.float64).scatter_reduce(0, inv_N, rewards_N.double(), "amin")
    hi_G = torch.full((ids_G.numel(),), float("-inf"), dtype=torch.float64).scatter_reduce(0, inv_N, rewards_N.double(), "amax")
    return (lo_G == hi_G)[inv_N]
