"""MoE experts fed split sizes on the GPU: Transformer Engine's grouped-tensor GEMM, and no host sync per layer.

Megatron-Core 0.16.1's ``TEGroupedMLP`` turns the tokens-per-expert counts into a host list
(``tokens_per_expert.tolist()``), and its all-to-all dispatcher copies them to the host and waits
for that copy in every MoE layer of every micro-batch. With a host list, TE's ``GroupedLinear``
takes its split-quantize path, which prepares and launches each expert's GEMM from the host. For
Qwen3-30B-A3B's 128 experts that is about 11 ms of host time per forward call and 14 ms per
backward call, which leaves the GPU idle most of a training step. TE 2.20 has a native grouped path
(``GroupedLinear.use_grouped_tensor``): one grouped GEMM whose split sizes stay in a CUDA tensor.
Megatron-Core 0.16.1 has no switch for it, hence this module:

- :class:`DeviceSplitsGroupedMLP` is Megatron's ``TEGroupedMLP`` with its two grouped linears on
  the native path. Counts that arrive on the host are copied to the GPU without a sync; counts
  already there stay there.
- :func:`keep_splits_on_device` makes each all-to-all dispatcher of a model with one expert-parallel
  and one tensor-parallel rank keep the counts on the GPU, and skip its second permutation, which
  with one rank is the identity. With more ranks the all-to-all needs host split sizes, so
  Megatron's own path stays. torch's grouped GEMM experts (:mod:`rlcore_megatron.moe_grouped_mm`)
  take the device counts too, on either layer spec.

Outside these cases (FP8 experts, whose padding needs host counts; the local spec) Megatron's
code runs unchanged.
"""

from __future__ import annotations

import torch
from megatron.core.transformer.moe.experts import TEGroupedMLP
from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

from rlcore_megatron.moe_grouped_mm import device_counts


class _DeviceCounts:
    """What ``TEGroupedMLP.forward`` gets as ``tokens_per_expert``: its one use, ``.tolist()``, returns
    the int64 CUDA tensor itself. TE's ``GroupedLinear`` takes that as ``m_splits``. Bias is off in
    these models, so the other user, ``_apply_bias``, never splits by it."""

    def __init__(self, counts_E: torch.Tensor):
        self.counts_E = counts_E

    def tolist(self) -> torch.Tensor:
        return self.counts_E


class DeviceSplitsGroupedMLP(TEGroupedMLP):
    """Megatron's ``TEGroupedMLP`` with the expert GEMMs in TE's native grouped-tensor path."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        for linear in (self.linear_fc1, self.linear_fc2):
            linear.use_grouped_tensor = True

    def forward(self, permuted_local_hidden_states, tokens_per_expert, permuted_probs):
        if self.config.fp8 or self.config.fp4 or self.config.add_bias_linear:
            return super().forward(permuted_local_hidden_states, tokens_per_expert, permuted_probs)
        counts_E = device_counts(tokens_per_expert, permuted_local_hidden_states.device, torch.int64)
        return super().forward(permuted_local_hidden_states, _DeviceCounts(counts_E), permuted_probs)


class DeviceSplitsAlltoAllDispatcher(MoEAlltoAllTokenDispatcher):
    """The all-to-all dispatcher for one expert-parallel and one tensor-parallel rank, dropless: the
    counts stay on the GPU, and the sort of tokens by local expert is skipped (identity with one rank)."""

    def _maybe_dtoh_and_synchronize(self, point, tokens_per_expert=None):
        return tokens_per_expert

    def dispatch_postprocess(self, global_input_tokens, global_probs):
        tokens_per_expert, self.tokens_per_expert = self.tokens_per_expert, None
        return global_input_tokens, tokens_per_expert, global_probs

    def combine_preprocess(self, hidden_states):
        return hidden_states


def keep_splits_on_device(model) -> int:
    """Switch every eligible dispatcher of ``model`` to :class:`DeviceSplitsAlltoAllDispatcher`; returns how many."""
    count = 0
    for module in model.modules():
        dispatcher = getattr(module, "token_dispatcher", None)
        if type(dispatcher) is not MoEAlltoAllTokenDispatcher:
            continue
        cfg = dispatcher.config
        if (dispatcher.ep_size == 1 and dispatcher.tp_size == 1 and not dispatcher.drop_and_pad and dispatcher.shared_experts is None
                and cfg.moe_expert_capacity_factor is None and not cfg.moe_router_padding_for_quantization):
            dispatcher.__class__ = DeviceSplitsAlltoAllDispatcher  # same state, three methods replaced
            count += 1
    return count
