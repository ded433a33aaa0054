"""What every built-in algorithm shares: reward hooks, loss inputs, reductions and the clipped
policy-gradient objective. Each algorithm module picks its advantage estimator, its importance
ratio and its reduction; the pieces here are small functions so they can be tested alone.

Global normalization (see :mod:`rlcore.interfaces`): every reduction divides by a count of the
whole optimizer step (:class:`~rlcore.interfaces.StepTotals`), never by a count of the
micro-batch, so the sum of micro-batch losses over any packing, micro-batch size or
data-parallel split is the same number and so is its gradient. Metrics follow the same rule.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

import torch

from rlcore.algorithms import advantages as adv
from rlcore.interfaces import StepTotals
from rlcore.data.packing import MicroBatch


# ---- loss inputs -----------------------------------------------------------------------------
def check_loss_inputs(name: str, logprobs_T: torch.Tensor, mb: MicroBatch, totals: StepTotals, fields: dict[str, str]) -> None:
    """Shapes match the micro-batch, required token fields are there (``fields``: field -> why)."""
    if logprobs_T.shape != mb.input_ids_T.shape:
        raise ValueError(
            f"{name}.loss: logprobs_T has shape {tuple(logprobs_T.shape)}, the micro-batch has {mb.num_tokens} tokens"
        )
    for field, why in fields.items():
        if field not in mb.token_fields:
            raise ValueError(f"{name}.loss: token field '{field}' is missing ({why}); have {sorted(mb.token_fields)}")
        if mb.token_fields[field].shape != logprobs_T.shape:
            raise ValueError(
                f"{name}.loss: token field '{field}' has shape {tuple(mb.token_fields[field].shape)}, "
                f"logprobs_T has {tuple(logprobs_T.shape)}"
            )
    # Device-tensor totals (a replayed CUDA graph, see StepTotals) were checked when they were counted.
    counts = (totals.num_valid_tokens, totals.num_valid_seqs)
    if not any(torch.is_tensor(c) for c in counts) and min(counts) <= 0:
        raise ValueError(f"{name}.loss: the step has no valid tokens ({totals}); every response is masked")


def token_advantages(name: str, mb: MicroBatch) -> torch.Tensor:
    """Advantages per token [T]: the ``advantages`` token field, else the sequence field spread
    over each sequence's tokens (0 on padding)."""
    if "advantages" in mb.token_fields:
        adv_T = mb.token_fields["advantages"]
    elif "advantages" in mb.seq_fields:
        adv_T = spread_per_seq(mb.seq_fields["advantages"], mb)
    else:
        raise ValueError(f"{name}.loss: the micro-batch has no 'advantages' (token or sequence field); compute advantages first")
    if not capturing():  # a graph-capturing backend runs the check on the host
        check_finite_advantages(name, adv_T, mb)
    return adv_T


def capturing() -> bool:
    """Whether the current CUDA stream is capturing a graph (host reads of device values would fail)."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def check_finite_advantages(name: str, adv_T: torch.Tensor, mb: MicroBatch) -> None:
    """Every loss-masked token's advantage is finite (a ValueError naming the token and sequence)."""
    bad = (~torch.isfinite(adv_T) & (mb.loss_mask_T.to(adv_T.device) > 0)).nonzero().flatten()
    if bad.numel():
        t = int(bad[0])
        seq = mb.seq_ids[int(mb.seq_index_T[t])]
        raise ValueError(f"{name}.loss: advantage of token {t} (sequence {seq}) is {float(adv_T[t])}")


def masked(x_T: torch.Tensor, valid_T: torch.Tensor) -> torch.Tensor:
    """x on valid tokens, 0 elsewhere, without letting inf/NaN in masked slots reach sums or grads."""
    return torch.where(valid_T, x_T, torch.zeros((), dtype=x_T.dtype, device=x_T.device))


def spread_per_seq(values_n: torch.Tensor, mb: MicroBatch) -> torch.Tensor:
    """Each sequence's value on each of its tokens [T]; padding tokens (index -1) read an appended 0."""
    return torch.cat([values_n, values_n.new_zeros(1)])[mb.seq_index_T.to(values_n.device)]


def per_seq_sum(values_T: torch.Tensor, mb: MicroBatch) -> torch.Tensor:
    """Sum of each sequence's token values [n]; padding tokens (index -1) go to a dropped slot."""
    index_T = mb.seq_index_T.to(values_T.device)
    index_T = torch.where(index_T < 0, mb.num_seqs, index_T)
    return values_T.new_zeros(mb.num_seqs + 1).index_add(0, index_T, values_T)[:-1]


# ---- reductions: micro-batch share of a step mean -------------------------------------------
def token_mean_share(loss_T: torch.Tensor, mask_T: torch.Tensor, mb: MicroBatch, totals: StepTotals) -> torch.Tensor:
    """sum_t m_t l_t / (valid tokens of the step)."""
    return (loss_T * mask_T).sum() / totals.num_valid_tokens


def sequence_mean_share(loss_T: torch.Tensor, mask_T: torch.Tensor, mb: MicroBatch, totals: StepTotals) -> torch.Tensor:
    """sum_i [sum_t m_t l_t / sum_t m_t]_i / (valid sequences of the step)."""
    tokens_n = per_seq_sum(mask_T, mb)
    sums_n = per_seq_sum(loss_T * mask_T, mb)
    return (sums_n / tokens_n.clamp(min=1)).sum() / totals.num_valid_seqs


REDUCTIONS: dict[str, Callable[..., torch.Tensor]] = {"token": token_mean_share, "sequence": sequence_mean_share}


# ---- objective pieces ------------------------------------------------------------------------
def clipped_surrogate(ratio_T: torch.Tensor, adv_T: torch.Tensor, clip_min: float, clip_max: float,
                      clip_c: float | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """PPO loss per token, -min(r A, clip(r, 1-clip_min, 1+clip_max) A), and with dual clip
    min(that, -c A) where A < 0. Returns (loss_T, clipped_T, dual_clipped_T) (bools)."""
    unclipped = -ratio_T * adv_T
    clipped = -ratio_T.clamp(1.0 - clip_min, 1.0 + clip_max) * adv_T
    loss_T = torch.maximum(unclipped, clipped)
    clipped_T = clipped > unclipped
    dual_T = torch.zeros_like(clipped_T)
    if clip_c is not None:
        bound = -clip_c * adv_T
        dual_T = (adv_T < 0) & (loss_T > bound)
        loss_T = torch.where(dual_T, bound, loss_T)
    return loss_T, clipped_T, dual_T


KL_ESTIMATORS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    # argument: log r = log p_ref - log p (per token); all three estimate KL(p || p_ref)
    "k1": lambda log_r: -log_r,
    "k2": lambda log_r: 0.5 * log_r**2,
    "k3": lambda log_r: torch.exp(log_r) - 1.0 - log_r,
}


# ---- metrics ---------------------------------------------------------------------------------
def merge_metric(name: str, a, b):
    """How one metric of two micro-batches (or ranks) combines: losses' metrics are shares of the
    step and add up; a name ending in ``_max`` is a largest value and takes the maximum."""
    if not name.endswith("_max"):
        return a + b
    if torch.is_tensor(a) or torch.is_tensor(b):
        return torch.maximum(torch.as_tensor(a), torch.as_tensor(b))
    return max(a, b)


def merge_metrics(into: dict, new) -> dict:
    """``into`` updated with ``new`` by :func:`merge_metric` (keys missing from ``into`` are copied)."""
    for key, value in new.items():
        into[key] = merge_metric(key, into[key], value) if key in into else value
    return into


# ---- algorithm bases -------------------------------------------------------------------------
class AlgorithmBase:
    """Defaults of the :class:`~rlcore.interfaces.Algorithm` hooks: rewards pass through
    (checked), every trajectory is kept; and of its optional members: no refill rounds
    (:class:`~rlcore.interfaces.RefillRounds`), a loss no backend captures
    (:class:`~rlcore.interfaces.CapturableLoss`)."""

    name: ClassVar[str]
    config_cls: ClassVar[type]
    max_refill_rounds: int = 0  # dynamic-sampling refill rounds the run loop may do (rlcore.interfaces.RefillRounds)
    uses_reference: bool = False
    uses_old_logprobs: bool = False
    loss_level: str = "token"
    capturable_loss: bool = False  # rlcore.interfaces.CapturableLoss: audited losses say True

    def __init__(self, config: Any = None):
        if config is None:
            config = self.config_cls()
        if not isinstance(config, self.config_cls):
            raise TypeError(f"algorithm '{self.name}' needs a {self.config_cls.__name__}, got {type(config).__name__}")
        self.config = config

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.config!r})"

    def shape_rewards(self, rewards_N: torch.Tensor, response_lengths_N: torch.Tensor, truncated_N: torch.Tensor) -> torch.Tensor:
        adv.check_rewards(rewards_N)
        adv.check_per_sequence("response_lengths", response_lengths_N, rewards_N.numel())
        adv.check_per_sequence("truncated", truncated_N, rewards_N.numel())
        return rewards_N

    def keep_trajectories(self, rewards_N: torch.Tensor, group_ids_N: torch.Tensor, truncated_N: torch.Tensor) -> torch.Tensor:
        adv.check_rewards(rewards_N, group_ids_N)
        return torch.ones(rewards_N.shape, dtype=torch.bool)
