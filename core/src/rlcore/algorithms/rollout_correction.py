"""Rollout correction: reweighting or masking tokens by how far the trainer's probabilities are from the generator's.

Generator and trainer never compute the same probabilities (other kernels, bf16 or FP8, and in
async mode older weights). With ``r_t = p_train(y_t) / p_gen(y_t)`` per valid token t (p_train:
the old policy the PPO ratio is taken against) and ``rho_i = prod_t r_t`` per sequence i, each
preset multiplies the policy-gradient loss of token t by a detached weight ``w_t``:

    none       w_t = 1
    token_tis  w_t = min(r_t, C)                                   truncated IS (Yao et al. 2025,
                                                                  "Your efficient RL framework secretly
                                                                  brings you off-policy RL training")
    seq_tis    w_t = min(rho_i, C)                                 sequence-level truncated IS
    token_mis  w_t = r_t   if low <= r_t <= high  else 0           masked IS, per token
    seq_mis    w_t = rho_i if low <= rho_i <= high else 0          masked IS, per sequence (Liu et al.
                                                                  2025, "When speed kills stability")
    icepop     w_t = r_t   if 1/k <= r_t <= k     else 0           IcePop (Ling team 2025), its band
                                                                  written with one parameter k

A masked token keeps its place in the loss normalization (the step's global valid-token or
sequence count), so the loss stays invariant to micro-batch size; it only stops contributing.
Unlike the papers, the sequence ratio is computed in log space and clamped at exp(+-30) before
exponentiation, so one long sequence cannot overflow float32.

Metrics, as shares of the step (summed over micro-batches and ranks) unless their name ends in
``_max`` (the backends reduce those by maximum): ``rollout_kl_k3`` (k3 estimate of
KL(p_gen || p_train) per token: ``r - 1 - log r``), ``gen_kl_error`` (mean |log p_gen - log p_train|),
``rollout_masked_token_fraction``, ``rollout_masked_seq_fraction``, ``is_truncated_fraction``
(tokens whose weight was truncated), ``rollout_truncated_seq_fraction``, ``rollout_ratio_max``
(largest r_t) and, for sequence presets, ``rollout_seq_ratio_max``.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import attrs
import torch

from rlcore.algorithms.base import masked, per_seq_sum, spread_per_seq
from rlcore.interfaces import StepTotals
from rlcore.data.packing import MicroBatch

_LOG_CLAMP = 30.0


def _at_least_one(count):
    """``max(count, 1)`` for a Python count or a 0-d device tensor (StepTotals in a CUDA graph)."""
    return count.clamp(min=1) if torch.is_tensor(count) else max(count, 1)


def _largest(values: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Largest valid value, 0 when there is none (an empty micro-batch of a data-parallel rank)."""
    if values.numel() == 0:
        return values.new_zeros(())
    return torch.where(valid, values, torch.zeros_like(values)).amax()


@attrs.frozen
class Ratios:
    """The ratios of one micro-batch and the shares the metrics are reported in."""

    log_r_T: torch.Tensor  # log p_train - log p_gen on valid tokens, 0 elsewhere
    r_T: torch.Tensor  # exp(log_r_T), clamped in log space
    valid_T: torch.Tensor
    mb: MicroBatch
    totals: StepTotals

    @property
    def mask_T(self) -> torch.Tensor:
        return self.valid_T.to(self.log_r_T.dtype)

    @property
    def log_rho_n(self) -> torch.Tensor:
        return per_seq_sum(self.log_r_T, self.mb).clamp(-_LOG_CLAMP, _LOG_CLAMP)

    @property
    def seq_valid_n(self) -> torch.Tensor:
        return per_seq_sum(self.mask_T, self.mb) > 0

    def token_share(self, flag_T: torch.Tensor) -> torch.Tensor:
        return (flag_T.to(self.mask_T.dtype) * self.mask_T).sum() / _at_least_one(self.totals.num_valid_tokens)

    def seq_share(self, flag_n: torch.Tensor) -> torch.Tensor:
        return (flag_n & self.seq_valid_n).to(self.mask_T.dtype).sum() / _at_least_one(self.totals.num_valid_seqs)


def _token_tis(cfg, x: Ratios):
    r_T = x.r_T
    return r_T.clamp(max=cfg.cap), {"is_truncated_fraction": x.token_share(r_T > cfg.cap)}


def _seq_tis(cfg, x: Ratios):
    log_rho_n = x.log_rho_n
    rho_n = torch.exp(log_rho_n)
    return spread_per_seq(rho_n.clamp(max=cfg.cap), x.mb), {
        "rollout_truncated_seq_fraction": x.seq_share(log_rho_n > math.log(cfg.cap)),
        "rollout_seq_ratio_max": _largest(rho_n, x.seq_valid_n)}


def _seq_mis(cfg, x: Ratios):
    log_rho_n = x.log_rho_n
    rho_n = torch.exp(log_rho_n)
    kept_n = (log_rho_n >= math.log(cfg.low)) & (log_rho_n <= math.log(cfg.high))
    return spread_per_seq(torch.where(kept_n, rho_n, torch.zeros_like(rho_n)), x.mb), {
        "rollout_masked_seq_fraction": x.seq_share(~kept_n),
        "rollout_masked_token_fraction": x.token_share(spread_per_seq(kept_n.to(rho_n.dtype), x.mb) == 0),
        "rollout_seq_ratio_max": _largest(rho_n, x.seq_valid_n)}


def _token_band(low: float, high: float, x: Ratios):
    r_T = x.r_T
    kept_T = (r_T >= low) & (r_T <= high)
    dropped_n = per_seq_sum((~kept_T & x.valid_T).to(r_T.dtype), x.mb) > 0
    return torch.where(kept_T, r_T, torch.zeros_like(r_T)), {
        "rollout_masked_token_fraction": x.token_share(~kept_T), "rollout_masked_seq_fraction": x.seq_share(dropped_n)}


PRESETS: dict[str, Callable | None] = {
    "none": None,
    "token_tis": _token_tis,
    "seq_tis": _seq_tis,
    "token_mis": lambda cfg, x: _token_band(cfg.low, cfg.high, x),
    "seq_mis": _seq_mis,
    "icepop": lambda cfg, x: _token_band(1.0 / cfg.icepop_k, cfg.icepop_k, x),
}


def correct(cfg, train_T: torch.Tensor, gen_T: torch.Tensor, valid_T: torch.Tensor, mb: MicroBatch,
            totals: StepTotals) -> tuple[torch.Tensor | None, dict[str, torch.Tensor]]:
    """(detached weights [T], 0 on invalid tokens, or None for ``none``; metrics) of preset
    ``cfg.preset`` (a :class:`~rlcore.algorithms.config.RolloutCorrectionConfig`)."""
    log_r_T = masked(train_T.detach() - gen_T.to(train_T.dtype), valid_T)
    r_T = torch.exp(log_r_T.clamp(-_LOG_CLAMP, _LOG_CLAMP))
    x = Ratios(log_r_T, r_T, valid_T, mb, totals)
    metrics = {"rollout_kl_k3": x.token_share(r_T - 1 - x.log_r_T), "gen_kl_error": x.token_share(x.log_r_T.abs()),
               "rollout_ratio_max": _largest(r_T, valid_T)}
    preset = PRESETS[cfg.preset]
    if preset is None:
        return None, metrics
    weights_T, extra = preset(cfg, x)
    return (weights_T * x.mask_T).detach(), {**metrics, **extra}
