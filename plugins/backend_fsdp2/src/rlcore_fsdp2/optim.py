"""AdamW stepping the local shards of DTensor parameters, with clipping and skipping on the device.

torch's :class:`~torch.optim.AdamW` hands FSDP2's DTensor parameters to its (fused) kernel, and
DTensor dispatch of that one ``_fused_adamw_`` call over ~150 parameter lists costs ~15 ms of host
time a step at 1.2B (mostly placement checks of the plain ``step`` tensors). The
update is element-wise, so each rank updating its own shards *is* the whole update: this class
runs torch's functional ``adam`` on the ``_local_tensor`` of every parameter, gradient and moment.
The optimizer state stays DTensors, so ``state_dict`` and the DCP checkpoints are unchanged.

``step(grad_scale=, found_inf=)`` passes torch's GradScaler arguments through to the fused kernel,
which divides the gradients by ``grad_scale`` (here: the clipping factor) and skips the whole
update where ``found_inf`` is non-zero (a non-finite loss or gradient norm). Both are device
tensors, so the host launches the update without waiting for the backward pass to finish.

Written here because torch has no switch for it (torchtitan also steps torch's optimizers on the
DTensors and pays the dispatch).
"""

from __future__ import annotations

import torch
from torch.optim.adam import adam

from rlcore_fsdp2.weights import local


def _local(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    return [local(t) for t in tensors]


class ShardLocalAdamW(torch.optim.AdamW):
    """:class:`torch.optim.AdamW` whose update runs on local shards (see the module docstring)."""

    @torch.no_grad()
    def step(self, closure=None, *, grad_scale: torch.Tensor | None = None, found_inf: torch.Tensor | None = None):
        """One update. ``grad_scale`` / ``found_inf``: 0-d float32 tensors on the parameters'
        device, fused AdamW only (torch's other AdamW kernels reject them)."""
        if closure is not None:
            raise ValueError("ShardLocalAdamW.step does not take a closure")
        for group in self.param_groups:
            params: list[torch.Tensor] = []
            grads: list[torch.Tensor] = []
            exp_avgs: list[torch.Tensor] = []
            exp_avg_sqs: list[torch.Tensor] = []
            max_exp_avg_sqs: list[torch.Tensor] = []
            state_steps: list[torch.Tensor] = []
            has_complex = self._init_group(group, params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps)
            beta1, beta2 = group["betas"]
            adam(_local(params), _local(grads), _local(exp_avgs), _local(exp_avg_sqs), _local(max_exp_avg_sqs),
                 state_steps, amsgrad=group["amsgrad"], has_complex=has_complex, beta1=beta1, beta2=beta2,
                 lr=group["lr"], weight_decay=group["weight_decay"], eps=group["eps"], maximize=group["maximize"],
                 foreach=group["foreach"], capturable=group["capturable"], differentiable=group["differentiable"],
                 fused=group["fused"], grad_scale=grad_scale, found_inf=found_inf,
                 decoupled_weight_decay=group.get("decoupled_weight_decay", True))
