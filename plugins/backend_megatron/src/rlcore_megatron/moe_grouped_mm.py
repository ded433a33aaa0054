"""MoE experts on torch's grouped GEMM: each expert projection of a layer is one ``F.grouped_mm`` call.

Megatron-Core 0.16.1 has two grouped paths for its ``MoELayer``, and neither serves a bf16 run on
these GPUs: ``TEGroupedMLP`` (Transformer Engine's ``GroupedLinear``) prepares and launches every
expert's GEMM from the host (11-14 ms of host time per call with Qwen3-30B-A3B's 128 experts, which
left an H200 idle most of a training step; TE's single-kernel grouped-tensor path needs cuBLASLt
>= 13.4 on Hopper), and ``GroupedMLP`` needs the CUDA-only ``grouped_gemm`` package. torch's
``F.grouped_mm`` (``torch._grouped_mm`` before it was public) does the whole projection in one kernel,
forward and backward, and takes the split points as a device tensor, so nothing waits for the host.
Hugging Face transformers 5 runs its own Qwen3-MoE experts on the same call.

:class:`GroupedMMExperts` is built by ``MoELayer`` through ``build_module(spec, num_local_experts,
config, pg_collection=...)`` and matches ``TEGroupedMLP.forward``: ``(permuted tokens sorted by local
expert, tokens per local expert, router probabilities) -> (output, None)``, GLU ``[gate; up]`` in
fc1, the probabilities applied after the activation in the activation's dtype.

Weights, one stacked parameter per projection (Hugging Face's in-memory layout in transformers 5,
under the names TE uses for its grouped weights):

- ``linear_fc1.weight``: ``[E_local, 2 * moe_ffn_hidden_size, hidden]``, rows ``[gate; up]``;
- ``linear_fc2.weight``: ``[E_local, hidden, moe_ffn_hidden_size]``.

Expert tensor parallelism is not supported (each rank holds whole experts); any expert-parallel
size and any tensor-parallel size of the attention part are. Checkpoints shard the expert axis over
the expert-parallel ranks, under the keys and global shapes of Megatron's ``SequentialMLP``, so the
model part of a checkpoint reads into either layout, at any expert-parallel size.

Without a kernel for the dtype (CUDA outside bf16: torch's CUDA grouped GEMM is bf16 only) the
experts run as a loop of matmuls over the same weights, which needs the counts on the host.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.dist_checkpointing.mapping import ShardedTensor
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from megatron.core.tensor_parallel.random import get_cuda_rng_tracker, get_expert_parallel_rng_tracker_name
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.utils import make_sharded_object_for_checkpoint

from rlcore.config import ConfigError
from rlcore_megatron.config import SECTION

_grouped_mm = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


def uses_kernel(device: torch.device, dtype: torch.dtype) -> bool:
    """The grouped kernel serves this device and dtype: CPU any float dtype, CUDA bf16 only."""
    return _grouped_mm is not None and (device.type != "cuda" or dtype == torch.bfloat16)


def device_counts(tokens_per_expert, device: torch.device, dtype: torch.dtype = torch.int32) -> torch.Tensor:
    """Tokens per local expert as a ``dtype`` tensor on ``device``, without waiting: counts already there
    stay there; host counts go through pinned memory, whose copy does not synchronize the stream."""
    counts_E = torch.as_tensor(tokens_per_expert)
    if counts_E.device.type == "cpu" and device.type == "cuda":
        counts_E = counts_E.to(dtype).pin_memory()
    return counts_E.to(device, dtype, non_blocking=True)


def _drop_extra_state(module, incompatible_keys) -> None:
    """The loop-compatible extra states of :meth:`GroupedMMExperts.sharded_state_dict` hold nothing to load."""
    incompatible_keys.unexpected_keys[:] = [k for k in incompatible_keys.unexpected_keys if not k.endswith("_extra_state")]


class _ExpertsWeight(torch.nn.Module):
    """Holds one stacked projection weight, so that its name is ``linear_fc<n>.weight``."""

    def __init__(self, weight_EOI: torch.nn.Parameter):
        super().__init__()
        self.weight = weight_EOI


class GroupedMMExperts(MegatronModule):
    """This rank's experts of one MoE layer, each projection one ``F.grouped_mm`` call."""

    def __init__(self, num_local_experts: int, config: TransformerConfig, submodules: Any = None, pg_collection: Any = None,
                 name: str | None = None):  # name: megatron-core 0.19 passes the module's path
        super().__init__(config=config)
        self.num_local_experts = num_local_experts
        self.ep_group, self.tp_group, self.dp_group = pg_collection.ep, pg_collection.expt_tp, pg_collection.expt_dp
        if self.tp_group.size() != 1:
            raise ConfigError(f"{SECTION}.expert_tensor_parallel_size", f"is {self.tp_group.size()}, but the grouped_mm "
                              "experts hold whole experts per rank; set it to 1 or choose moe_experts_impl te_grouped/loop")
        if config.add_bias_linear or config.moe_latent_size is not None or config.fp8 or config.fp4:
            raise ConfigError(f"{SECTION}.moe_experts_impl", "'grouped_mm' takes bias-free experts without latent "
                              "projection or FP8/FP4; choose 'te_grouped' or 'loop'")
        ffn, hidden = config.moe_ffn_hidden_size, config.hidden_size
        fc1_rows = 2 * ffn if config.gated_linear_unit else ffn
        # partition_dim: the axis Megatron's column-/row-parallel expert linears would split (over one rank here)
        self.linear_fc1 = _ExpertsWeight(self._weight((num_local_experts, fc1_rows, hidden), config.init_method, partition_dim=1))
        self.linear_fc2 = _ExpertsWeight(self._weight((num_local_experts, hidden, ffn), config.output_layer_init_method,
                                                      partition_dim=2))
        self.register_load_state_dict_post_hook(_drop_extra_state)

    def _weight(self, shape: tuple[int, int, int], init_method, partition_dim: int) -> torch.nn.Parameter:
        cfg = self.config
        device = "cpu" if cfg.use_cpu_initialization else torch.cuda.current_device()
        weight = torch.nn.Parameter(torch.empty(shape, dtype=cfg.params_dtype, device=device))
        if cfg.perform_initialization:
            # Megatron's init methods fill any shape (normal with the configured std); the expert
            # RNG stream makes each expert-parallel rank draw different experts, as its layers do.
            with torch.no_grad():
                if cfg.use_cpu_initialization:
                    init_method(weight)
                else:
                    with get_cuda_rng_tracker().fork(get_expert_parallel_rng_tracker_name()):
                        init_method(weight)
        # Megatron's rule for expert weights: with expert parallelism their gradients are reduced
        # over the expert-data-parallel group (DDP's expert buffers), else with the dense weights.
        weight.allreduce = not (cfg.expert_model_parallel_size > 1)
        # Tensor-parallel, as Megatron's expert linears are (over the expert-tensor-parallel group, one
        # rank): otherwise the gradient norm counts them on tensor-parallel rank 0 only, as duplicates.
        set_tensor_model_parallel_attributes(weight, is_parallel=True, dim=partition_dim, stride=1)
        return weight

    def forward(self, permuted_local_hidden_states: torch.Tensor, tokens_per_expert, permuted_probs: torch.Tensor):
        hidden_TH = permuted_local_hidden_states
        probs_T1 = permuted_probs.unsqueeze(-1)
        if self.config.moe_apply_probs_on_input:
            if self.config.moe_router_topk != 1:
                raise ValueError("moe_apply_probs_on_input only works with moe_router_topk=1")
            hidden_TH = (probs_T1 * hidden_TH).to(permuted_local_hidden_states.dtype)
            probs_T1 = torch.ones_like(probs_T1)
        w1_EOH, w2_EHF = self.linear_fc1.weight, self.linear_fc2.weight
        if hidden_TH.shape[0] == 0:
            # No token reached this rank's experts (the kernel refuses empty operands). The weights
            # stay in the graph with zero gradients, so DDP sees every expert gradient arrive.
            return hidden_TH.new_zeros(0, w2_EHF.shape[1]) + 0 * (w1_EOH.sum() + w2_EHF.sum()).to(hidden_TH.dtype), None
        if uses_kernel(hidden_TH.device, hidden_TH.dtype):
            offsets_E = torch.cumsum(device_counts(tokens_per_expert, hidden_TH.device), 0, dtype=torch.int32)
            fc1_TO = _grouped_mm(hidden_TH, w1_EOH.transpose(-2, -1), offs=offsets_E)
            act_TF = self._activation(fc1_TO, probs_T1)
            return _grouped_mm(act_TF, w2_EHF.transpose(-2, -1), offs=offsets_E), None
        counts = torch.as_tensor(tokens_per_expert).tolist()  # loop fallback: host split sizes
        outs = [self._activation(x_TH @ w1.t(), p_T1) @ w2.t()
                for x_TH, p_T1, w1, w2 in zip(hidden_TH.split(counts), probs_T1.split(counts), w1_EOH, w2_EHF)]
        return torch.cat(outs) if outs else hidden_TH[:0], None

    def _activation(self, fc1_TO: torch.Tensor, probs_T1: torch.Tensor) -> torch.Tensor:
        """Megatron's experts: act(gate) * up, times the router probability, cast back to the input's dtype."""
        cfg = self.config
        if cfg.bias_activation_fusion and cfg.gated_linear_unit and cfg.activation_func is F.silu:
            from megatron.core.fusions.fused_bias_swiglu import weighted_bias_swiglu_impl

            return weighted_bias_swiglu_impl(fc1_TO, None, probs_T1, cfg.activation_func_fp8_input_store)
        if cfg.gated_linear_unit:
            gate_TF, up_TF = torch.chunk(fc1_TO, 2, dim=-1)
            act_TF = cfg.activation_func(gate_TF) * up_TF
        else:
            act_TF = cfg.activation_func(fc1_TO)
        return (act_TF * probs_T1).to(fc1_TO.dtype)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None) -> dict:
        """The stacked weights as ``dist_checkpointing`` tensors: the expert axis split over the
        expert-parallel ranks, replicated over the expert-data-parallel ranks. Keys and global shapes
        ``[E, rows, cols]`` are ``SequentialMLP``'s (``<prefix>experts.linear_fc1.weight``)."""
        ep_rank, ep_size = self.ep_group.rank(), self.ep_group.size()
        axis = len(sharded_offsets)
        out = {}
        for name in ("linear_fc1", "linear_fc2"):
            key = f"{prefix}experts.{name}.weight"  # SequentialMLP's (and TEGroupedMLP's) key
            out[f"{prefix}{name}.weight"] = ShardedTensor.from_rank_offsets(
                key, getattr(self, name).weight, *sharded_offsets, (axis, ep_rank, ep_size),
                replica_id=(0, 0, self.dp_group.rank()), prepend_axis_num=axis)
            # The loop's per-expert linears also save an (empty) extra state; writing one too lets a
            # model with the loop read this checkpoint (``rlcore export`` builds one on the CPU), as
            # Megatron's GroupedMLP does. Loading drops it again (_drop_extra_state).
            for local in range(self.num_local_experts):
                expert = ep_rank * self.num_local_experts + local
                out[f"{prefix}expert{expert}.{name}._extra_state"] = make_sharded_object_for_checkpoint(
                    None, f"{prefix}experts.{name}._extra_state",
                    (*sharded_offsets, (axis, expert, ep_size * self.num_local_experts)), (0, 0, self.dp_group.rank()))
        return out

    def backward_dw(self):
        """Weight gradients are computed in the backward pass itself (no delayed wgrad)."""
