"""Apply tensor/sequence parallelism, activation checkpointing and FSDP2 to a Hugging Face model.

One :func:`parallelize` made of small steps, in the order torchtitan's ``parallelize_llama``
uses (TP first, so FSDP shards DTensors over the data-parallel mesh dim; AC before FSDP, so the
FSDP hooks sit outside the recomputed region):

1. :func:`apply_tp` — DTensor ``parallelize_module`` with a plan per architecture
   (:func:`tp_plan`): column-parallel q/k/v and gate/up projections, row-parallel o/down
   projections, vocab-parallel embedding and LM head; with sequence parallelism the norms and
   residual stream are sharded along the sequence. MoE experts and the router stay replicated
   over TP ranks (each TP rank runs them on the full, gathered activations).
2. :func:`apply_compile` (optional) — ``torch.compile`` of each decoder layer's ``forward``
   (module names and the FSDP hooks stay outside the compiled code).
3. :func:`apply_ac` — ``checkpoint_wrapper`` around each decoder layer.
4. :func:`apply_fsdp` — ``fully_shard`` per decoder layer, then the root, with a
   ``MixedPrecisionPolicy`` (params cast to the compute dtype, gradients reduced in fp32/fp64)
   and optional CPU offload. With one data-parallel rank, no resharding and no offload, nothing
   is freed or communicated per layer, so only the root is wrapped: the per-layer hooks took
   a fifth of the host time of a compiled 1.2B step, and the host bounds that step. With one
   rank, the backend has :mod:`rlcore_fsdp2.one_rank` replace FSDP2's gradient accumulation over
   micro-batches and its copy into the reduce buffer with cheaper equivalents.
   Gradients are SUMMED over data-parallel ranks (divide factor 1): rlcore losses are already
   divided by global token counts.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from rlcore.utils import resolve
from rlcore_fsdp2.config import SECTION, DTensorConfig
from rlcore_fsdp2.parallel_dims import ParallelDims

AC_PREFIX = "_checkpoint_wrapped_module."


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    inner = model.model
    language_model = getattr(inner, "language_model", None)  # vision-language models: the text decoder's
    return (language_model if language_model is not None else inner).layers


def tp_plan(model: nn.Module, sequence_parallel: bool) -> dict[str, Any]:
    """DTensor plan for Llama / Qwen2 / Qwen3 / Qwen3-MoE module names of transformers."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, PrepareModuleOutput,
                                                   RowwiseParallel, SequenceParallel)

    config = model.config
    residual = Shard(1) if sequence_parallel else Replicate()
    layer = "model.layers.*."
    plan: dict[str, Any] = {
        layer + "self_attn.q_proj": ColwiseParallel(),
        layer + "self_attn.k_proj": ColwiseParallel(),
        layer + "self_attn.v_proj": ColwiseParallel(),
        layer + "self_attn.o_proj": RowwiseParallel(output_layouts=residual),
    }
    if config.model_type in ("qwen3", "qwen3_moe"):
        # q/k norms act per head on the local heads [B, T, H/tp, D]: replicated weights whose
        # gradients are summed over the TP ranks (each rank sees only its heads).
        plan[layer + "self_attn.q_norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
        plan[layer + "self_attn.k_norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
    if config.model_type == "qwen3_moe":
        if sequence_parallel:
            plan[layer + "mlp"] = _moe_sp_wrapper(PrepareModuleInput, PrepareModuleOutput)
    else:
        plan[layer + "mlp.gate_proj"] = ColwiseParallel()
        plan[layer + "mlp.up_proj"] = ColwiseParallel()
        plan[layer + "mlp.down_proj"] = RowwiseParallel(output_layouts=residual)
    if sequence_parallel:
        plan[layer + "input_layernorm"] = SequenceParallel()
        plan[layer + "post_attention_layernorm"] = SequenceParallel()
        plan[layer + "self_attn"] = PrepareModuleInput(input_kwarg_layouts={"hidden_states": Shard(1)},
                                                       desired_input_kwarg_layouts={"hidden_states": Replicate()},
                                                       use_local_output=True)
        if config.model_type != "qwen3_moe":
            plan[layer + "mlp"] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
                                                     use_local_output=True)
        plan["model.norm"] = SequenceParallel()
    plan.update(_embedding_plan(config, sequence_parallel))
    return plan


def _moe_sp_wrapper(PrepareModuleInput, PrepareModuleOutput):
    """The MoE block runs replicated: gather the sequence in, scatter it back out."""
    from torch.distributed.tensor import Replicate, Shard

    class _MoeSequenceParallel(PrepareModuleInput):
        def __init__(self):
            super().__init__(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_output=True)
            self.out = PrepareModuleOutput(output_layouts=(Replicate(),), desired_output_layouts=(Shard(1),))

        def _apply(self, module, device_mesh):
            super()._apply(module, device_mesh)
            return self.out._apply(module, device_mesh)

    return _MoeSequenceParallel()


def _embedding_plan(config: Any, sequence_parallel: bool) -> dict[str, Any]:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, PrepareModuleOutput, RowwiseParallel

    residual = Shard(1) if sequence_parallel else Replicate()
    if getattr(config, "tie_word_embeddings", False):
        # One tensor cannot be both row- and column-sharded: keep it replicated over TP.
        if not sequence_parallel:
            return {}
        return {
            "model.embed_tokens": PrepareModuleOutput(output_layouts=(Replicate(),), desired_output_layouts=(Shard(1),)),
            "lm_head": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_output=True),
        }
    return {
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=residual),
        # Logits are gathered over the vocab: token_logprobs needs whole rows.
        "lm_head": ColwiseParallel(input_layouts=residual, output_layouts=Replicate(), use_local_output=True),
    }


def load_custom_plan(spec: str, model: nn.Module, sequence_parallel: bool) -> dict[str, Any]:
    try:
        obj = resolve(spec)
    except Exception as exc:  # noqa: BLE001 - name the key that pointed here
        raise ValueError(f"{SECTION}.custom_parallel_plan: cannot import {spec!r}: {exc!r}") from exc
    plan = obj(model, sequence_parallel) if callable(obj) else obj
    if not isinstance(plan, dict):
        raise ValueError(f"{SECTION}.custom_parallel_plan: {spec!r} gave {type(plan).__name__}, expected a dict "
                         "{module pattern: ParallelStyle}")
    return plan


def apply_tp(model: nn.Module, tp_mesh: Any, cfg: DTensorConfig) -> None:
    from torch.distributed.tensor.parallel import parallelize_module

    if cfg.custom_parallel_plan:
        plan = load_custom_plan(cfg.custom_parallel_plan, model, cfg.sequence_parallel)
    else:
        plan = tp_plan(model, cfg.sequence_parallel)
    parallelize_module(model, tp_mesh, plan)


def apply_compile(model: nn.Module) -> None:
    for layer in decoder_layers(model):
        layer.forward = torch.compile(layer.forward)


def apply_ac(model: nn.Module) -> None:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    layers = decoder_layers(model)
    for i, layer in enumerate(layers):
        layers[i] = checkpoint_wrapper(layer, preserve_rng_state=False)


def apply_fsdp(model: nn.Module, dp_mesh: Any, *, param_dtype: torch.dtype, reduce_dtype: torch.dtype,
               cpu_offload: bool, reshard_after_forward: bool, per_layer: bool = True) -> None:
    from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    kwargs = dict(
        mesh=dp_mesh,
        mp_policy=MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype),
        offload_policy=CPUOffloadPolicy(pin_memory=True) if cpu_offload else OffloadPolicy(),
    )
    if per_layer:
        for layer in decoder_layers(model):
            fully_shard(layer, reshard_after_forward=reshard_after_forward, **kwargs)
    fully_shard(model, reshard_after_forward=reshard_after_forward, **kwargs)
    if dp_mesh.size() == 1:
        # One rank already sums (FSDP2's default divides by the world size, 1), and a factor set
        # anyway costs a division pass over all fp32 gradients in torch 2.11's single-rank path.
        return
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            # Plain SUM collectives (gloo has no PREMUL_SUM; with factor 1 nothing is divided).
            if hasattr(module, "set_force_sum_reduction_for_comms"):
                module.set_force_sum_reduction_for_comms(True)


def reshard_after_forward(cfg: DTensorConfig, dims: ParallelDims) -> bool:
    """``reshard_after_forward`` if set, else only when there are shards to free memory for."""
    return cfg.reshard_after_forward if cfg.reshard_after_forward is not None else dims.dp_shard > 1


def defer_grad_sync(cfg: DTensorConfig, dims: ParallelDims) -> bool:
    """``defer_grad_sync`` if set, else only with one data-parallel rank (unsharded grads cost nothing more)."""
    if cfg.cpu_offload:
        return False
    return cfg.defer_grad_sync if cfg.defer_grad_sync is not None else dims.dp_shard == 1


def parallelize(model: nn.Module, dims: ParallelDims, mesh: Any, cfg: DTensorConfig, *, param_dtype: torch.dtype,
                reduce_dtype: torch.dtype, device_type: str) -> nn.Module:
    """TP/SP -> compile -> AC -> FSDP2, in place; returns ``model``."""
    dims.check_model(model.config)
    if dims.tp_enabled:
        apply_tp(model, mesh["tp"], cfg)
    if cfg.compile:
        apply_compile(model)
    if cfg.activation_checkpointing:
        apply_ac(model)
    cpu_offload = cfg.cpu_offload and device_type == "cuda"
    reshard = reshard_after_forward(cfg, dims)
    apply_fsdp(model, mesh["dp_shard"], param_dtype=param_dtype, reduce_dtype=reduce_dtype, cpu_offload=cpu_offload,
               reshard_after_forward=reshard, per_layer=dims.dp_shard > 1 or cpu_offload or reshard)
    return model


def hf_name(name: str) -> str:
    """Parameter name without wrapper prefixes (activation checkpointing)."""
    return name.replace(AC_PREFIX, "")
