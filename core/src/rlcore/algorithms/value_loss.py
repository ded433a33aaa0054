"""PPO's clipped value loss: the critic's regression on the GAE returns (Schulman et al. 2017;
the value clip as in OpenAI baselines' PPO2).

Per valid token t (m = loss mask, V = the critic's current value, V_old = its value when the
advantages were computed, G = the return ``A + V_old`` of :mod:`rlcore.algorithms.gae`)::

    V_clip(t) = V_old + clip(V - V_old, -eps_v, eps_v)
    l_v(t)    = 1/2 * max((V - G)^2, (V_clip - G)^2)         (eps_v None: 1/2 * (V - G)^2)
    loss      = sum_t m_t l_v(t) / (valid tokens of the step)

It reads the token fields ``returns`` and, with the clip, ``values`` (V_old). Like every rlcore
loss it is the micro-batch's share of the step value (global normalization), so a critic's step
is the same for any micro-batch size, packing or data-parallel size.

Metrics (shares of the step): ``value_loss``, ``value_clip_fraction`` (tokens where the clipped
term is the larger), ``value_mean`` and ``value_error`` (mean |V - G|).
"""

from __future__ import annotations

from typing import Any

import torch

from rlcore.algorithms.base import check_loss_inputs, masked, token_mean_share
from rlcore.interfaces import StepTotals
from rlcore.data.packing import MicroBatch


class ValueLoss:
    """What a critic trains on (:meth:`rlcore.interfaces.CriticHandle.train`): ``loss(values_T, mb, totals)``."""

    name = "value"
    loss_level = "token"
    uses_reference = False
    uses_old_logprobs = False
    capturable_loss = True  # rlcore.interfaces.CapturableLoss: arithmetic on device tensors only

    def __init__(self, clip: float | None = 0.2):
        if clip is not None and clip <= 0:
            raise ValueError(f"value clip must be > 0 or None (no clip), got {clip}")
        self.clip = clip

    def __repr__(self) -> str:
        return f"ValueLoss(clip={self.clip})"

    def required_fields(self) -> dict[str, str]:
        fields = {"returns": "the critic's regression target, GAE advantages + old values"}
        if self.clip is not None:
            fields["values"] = f"the value clip ({self.clip}) is taken around the old values"
        return fields

    def loss(self, values_T: torch.Tensor, mb: MicroBatch, totals: StepTotals) -> tuple[torch.Tensor, dict[str, Any]]:
        check_loss_inputs(self.name, values_T, mb, totals, self.required_fields())
        mask_T = mb.loss_mask_T.to(device=values_T.device, dtype=values_T.dtype)
        valid_T = mask_T > 0
        returns_T = mb.token_fields["returns"].to(values_T)
        values_T = masked(values_T, valid_T)
        loss_T = (values_T - returns_T) ** 2
        clipped_T = torch.zeros_like(valid_T)
        if self.clip is not None:
            old_T = mb.token_fields["values"].to(values_T)
            v_clip_T = old_T + (values_T - old_T).clamp(-self.clip, self.clip)
            clipped_loss_T = (v_clip_T - returns_T) ** 2
            clipped_T = clipped_loss_T > loss_T
            loss_T = torch.maximum(loss_T, clipped_loss_T)
        loss = 0.5 * token_mean_share(loss_T, mask_T, mb, totals)

        def share(x_T: torch.Tensor) -> torch.Tensor:
            return token_mean_share(x_T.detach().to(mask_T.dtype), mask_T, mb, totals)

        metrics = {"value_loss": loss.detach(), "value_clip_fraction": share(clipped_T), "value_mean": share(values_T),
                   "value_error": share((values_T - returns_T).abs())}
        return loss, metrics
