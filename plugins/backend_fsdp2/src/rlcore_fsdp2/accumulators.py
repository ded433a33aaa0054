"""Experimental: FSDP2's float32 gradient accumulators allocated before a step's first forward.

With the gradient sync deferred over a step's micro-batches (``policy.dtensor_cfg.defer_grad_sync``, the
default with one data-parallel rank), FSDP2 creates one float32 accumulator per parameter during the first
micro-batch's backward, as each layer's activations are freed: the caching allocator places these tensors,
which live until the step's last backward, inside the activations' blocks, and the next micro-batches' activations
(of other lengths) find those blocks split. On the 1.2B training step of ``docs/performance.md`` fsdp2's allocator
reserves 11 GiB more than its tensors' peak, Megatron's 0.55 GiB (its gradient buffer is allocated once).

``policy.dtensor_cfg.experimental.preallocate_grad_accumulators`` allocates the accumulators (zeros) at the
start of each step from the second on, before any activation, so that the first backward adds into them as the
later ones do. Written here because FSDP2 has no option for it; it reads FSDP2's private parameter groups, as
:mod:`rlcore_fsdp2.one_rank` does. A parameter no micro-batch reaches gets a zero gradient instead of none.
"""

from __future__ import annotations

from typing import Any

import torch


def _param_groups(module: Any) -> list[Any]:
    state = module._get_fsdp_state()
    groups = getattr(state, "_fsdp_param_groups", None)  # a list in the torch read here (2.13); else one group
    if groups is None:
        group = getattr(state, "_fsdp_param_group", None)
        groups = [group] if group is not None else []
    return list(groups)


def preallocate(fsdp_modules: list[Any]) -> int:
    """Zero float32 accumulators for every trained parameter that FSDP2 would accumulate in its reduce dtype and
    that has no accumulator yet; returns how many were allocated (0 before the first step has gathered the
    parameters: their unsharded shapes are not known yet)."""
    made = 0
    for module in fsdp_modules:
        for group in _param_groups(module):
            for fsdp_param in group.fsdp_params:
                param = getattr(fsdp_param, "_unsharded_param", None)
                reduce_dtype = getattr(fsdp_param, "reduce_dtype", None)  # set at the first gather
                if (param is None or fsdp_param.unsharded_accumulated_grad is not None or reduce_dtype is None
                        or reduce_dtype == param.dtype or not fsdp_param.sharded_param.requires_grad):
                    continue
                fsdp_param.unsharded_accumulated_grad = torch.zeros(param.shape, dtype=reduce_dtype, device=param.device)
                made += 1
    return made
