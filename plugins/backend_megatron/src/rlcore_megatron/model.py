"""Hugging Face config -> Megatron-Core ``TransformerConfig`` + ``GPTModel`` (this rank's shard).

Layer spec (:mod:`rlcore_megatron.kernels` decides): Transformer Engine's, or the local spec with
:class:`SDPACoreAttention` in place of the local ``DotProductAttention`` (which materializes the
s x s score matrix and runs out of memory at a few thousand tokens) and :class:`RMSNorm`. With
``core_attention: flash`` the TE spec keeps :class:`SDPACoreAttention` too: FlashAttention's varlen
kernel takes any packing, where cuDNN builds an execution plan per new (sequence count, longest
sequence) pair.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core import parallel_state as mpu
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig

from rlcore.training.attention import packed_causal_attention, sdpa
from rlcore.config import ConfigError
from rlcore.utils import torch_dtype
from rlcore_megatron.config import SECTION, MegatronConfig
from rlcore_megatron.kernels import Kernels, fuse_weight_gradient_accumulation

SUPPORTED = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3", "Qwen3MoeForCausalLM": "qwen3_moe"}


def architecture(hf_config) -> str:
    names = list(getattr(hf_config, "architectures", None) or [])
    for name in names:
        if name in SUPPORTED:
            return SUPPORTED[name]
    model_type = getattr(hf_config, "model_type", "")
    if model_type in SUPPORTED.values():
        return model_type
    raise ConfigError("policy.model_name", f"architecture {names or model_type!r} is not supported by rlcore-megatron "
                      f"(supported: {', '.join(SUPPORTED)})")


class SDPACoreAttention(MegatronModule):
    """Core attention on torch's flash kernels (:mod:`rlcore.training.attention`; never cuDNN, which re-plans
    for every new sequence length).

    Inputs ``query`` [s, b, heads, d], ``key``/``value`` [s, b, groups, d] (sbhd), or in the packed
    thd layout [t, heads, d] with ``packed_seq_params.cu_seqlens_q`` giving sequence boundaries:
    each packed sequence attends causally to itself only (FlashAttention varlen on CUDA). Output [s, b, heads*d] / [t, heads*d].
    With context parallelism, K/V are all-gathered over the CP group and each rank's queries use
    causal offsets (see :func:`rlcore_megatron.context_parallel.cp_attention`).
    """

    def __init__(self, config: TransformerConfig, layer_number: int, attn_mask_type: AttnMaskType, attention_type: str,
                 attention_dropout: float | None = None, softmax_scale: float | None = None, cp_comm_type: str | None = None,
                 pg_collection: Any = None):
        super().__init__(config=config)
        self.attn_mask_type = attn_mask_type
        head_dim = config.kv_channels
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim)
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout

    def _sdpa(self, q_BHSD, k_BGSD, v_BGSD, mask=None):
        return sdpa(q_BHSD, k_BGSD, v_BGSD, attn_mask=mask, is_causal=mask is None, scale=self.softmax_scale,
                    enable_gqa=True, dropout_p=self.dropout_p if self.training else 0.0)

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None, packed_seq_params=None):
        if attention_bias is not None:
            raise NotImplementedError("SDPACoreAttention does not take an attention bias")
        if packed_seq_params is not None and packed_seq_params.qkv_format == "thd":
            if self.config.context_parallel_size > 1:
                from rlcore_megatron.context_parallel import cp_attention

                return cp_attention(query, key, value, packed_seq_params, scale=self.softmax_scale,
                                    dropout=self.dropout_p if self.training else 0.0)
            return self._forward_thd(query, key, value, packed_seq_params)
        if self.config.context_parallel_size > 1:
            raise NotImplementedError("context parallelism needs the packed (thd) layout")
        # sbhd -> bhsd
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))
        out_BHSD = self._sdpa(q, k, v)
        s, b = query.shape[0], query.shape[1]
        return out_BHSD.permute(2, 0, 1, 3).reshape(s, b, -1)

    def _forward_thd(self, query_THD, key_TGD, value_TGD, params: PackedSeqParams):
        # One FlashAttention varlen kernel over the stream on CUDA (bf16/fp16); exact per-sequence
        # SDPA otherwise. Padding is the last segment of cu_seqlens (see packed_seq_params).
        out_THD = packed_causal_attention(query_THD, key_TGD, value_TGD, params.cu_seqlens_q, int(params.max_seqlen_q),
                                          scale=self.softmax_scale, dropout=self.dropout_p if self.training else 0.0)
        return out_THD.reshape(out_THD.shape[0], -1)


def _patch_router_gemm() -> None:
    """megatron-core 0.16.1 without Transformer Engine leaves ``te_general_gemm`` undefined in
    ``moe_utils`` while the fp32/fp64 router still tests it against None (NameError)."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


class RMSNorm(torch.nn.RMSNorm):
    """RMSNorm for the local spec that also works with sequence parallelism.

    Megatron's ``WrappedTorchNorm`` refuses ``sequence_parallel``. With it, each TP rank
    normalizes its own slice of the sequence, so the weight's gradient is partial: marking the
    weight ``sequence_parallel`` makes ``finalize_model_grads`` sum it over the TP group, as
    Transformer Engine's norms are marked. Weights are in the model's dtype (``params_dtype``).
    """

    mark_sequence_parallel = True

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, **_unused):
        super().__init__(hidden_size, eps=eps, dtype=config.params_dtype)
        self.weight.sequence_parallel = bool(config.sequence_parallel and self.mark_sequence_parallel)


class QKRMSNorm(RMSNorm):
    """Per-head q/k norm: sees whole sequences (after the QKV all-gather); TP-summed as ``qk_layernorm``."""

    mark_sequence_parallel = False


def layer_spec(hf_config, tconfig: TransformerConfig, num_experts: int | None, kernels: Kernels):
    """The layer spec: TE's (with rlcore's flash attention unless TE's is asked for), or the local
    one with SDPA attention and our norms."""
    qk_norm = architecture(hf_config) in ("qwen3", "qwen3_moe")
    if kernels.transformer_engine:
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

        spec = get_gpt_layer_with_transformer_engine_spec(num_experts=num_experts, qk_layernorm=qk_norm,
                                                          use_te_op_fuser=kernels.te_op_fuser and not num_experts,
                                                          moe_grouped_gemm=bool(num_experts) and kernels.moe_grouped_gemm)
        if kernels.core_attention == "flash":
            spec.submodules.self_attention.submodules.core_attention = SDPACoreAttention
        if num_experts and kernels.moe_device_splits and kernels.moe_experts == "te_grouped":
            from rlcore_megatron.moe_splits import DeviceSplitsGroupedMLP

            _replace_experts(spec, DeviceSplitsGroupedMLP)
        if num_experts and kernels.moe_experts == "grouped_mm":
            _use_grouped_mm_experts(spec)
        return spec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build

    _patch_router_gemm()
    spec = get_gpt_layer_local_spec(num_experts=num_experts, qk_layernorm=qk_norm, normalization="RMSNorm")
    layer = spec.submodules
    layer.self_attention.submodules.core_attention = SDPACoreAttention
    layer.input_layernorm = layer.pre_mlp_layernorm = RMSNorm
    if qk_norm:
        layer.self_attention.submodules.q_layernorm = layer.self_attention.submodules.k_layernorm = QKRMSNorm
    if num_experts and kernels.moe_experts == "grouped_mm":
        _use_grouped_mm_experts(spec)
    return TransformerBlockSubmodules(layer_specs=[spec] * get_num_layers_to_build(tconfig), layer_norm=RMSNorm)


def _moe_submodules(spec):
    """The MoE layer's ``MoESubmodules`` in a layer spec: megatron-core 0.16 describes the MoE layer
    as a ``ModuleSpec``, 0.19 as ``functools.partial(MoELayer, submodules=...)``."""
    mlp = spec.submodules.mlp
    return mlp.keywords["submodules"] if isinstance(mlp, functools.partial) else mlp.submodules


def _replace_experts(spec, module) -> None:
    """Build the MoE layer's experts with ``module``, keeping the submodules Megatron chose for them
    (0.16: a ``ModuleSpec``; 0.19: a ``functools.partial`` builder)."""
    submodules = _moe_submodules(spec)
    experts = submodules.experts
    if isinstance(experts, functools.partial):
        submodules.experts = functools.partial(module, *experts.args, **experts.keywords)
    else:
        experts.module = module


def _use_grouped_mm_experts(spec) -> None:
    """Swap the MoE layer's experts for :class:`~rlcore_megatron.moe_grouped_mm.GroupedMMExperts`."""
    from megatron.core.transformer.spec_utils import ModuleSpec

    from rlcore_megatron.moe_grouped_mm import GroupedMMExperts

    submodules = _moe_submodules(spec)
    # 0.19 calls the experts builder itself; 0.16 builds it from a ModuleSpec.
    submodules.experts = GroupedMMExperts if isinstance(spec.submodules.mlp, functools.partial) else ModuleSpec(module=GroupedMMExperts)


def transformer_config(hf_config, cfg: MegatronConfig, kernels: Kernels, *, params_dtype: torch.dtype,
                       on_cpu: bool) -> TransformerConfig:
    arch = architecture(hf_config)
    num_heads = hf_config.num_attention_heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads
    moe: dict[str, Any] = {}
    if arch == "qwen3_moe":
        moe = moe_config(hf_config, cfg, kernels)
    else:
        from rlcore_megatron.routing_replay import check_replay

        check_replay(cfg, None)
    pipeline_dtype = torch_dtype(cfg.pipeline_dtype) if cfg.pipeline_dtype else params_dtype
    recompute = cfg.recompute
    fp8: dict[str, Any] = {}
    if kernels.fp8 is not None:
        fp8 = dict(fp8=kernels.fp8.fp8, fp8_recipe=kernels.fp8.fp8_recipe, fp8_param=kernels.fp8.fp8_param)
    return TransformerConfig(
        num_layers=hf_config.num_hidden_layers, hidden_size=hf_config.hidden_size, num_attention_heads=num_heads,
        num_query_groups=hf_config.num_key_value_heads, kv_channels=head_dim, ffn_hidden_size=hf_config.intermediate_size,
        normalization="RMSNorm", layernorm_epsilon=hf_config.rms_norm_eps, gated_linear_unit=True, activation_func=F.silu,
        add_bias_linear=False, add_qkv_bias=arch == "qwen2", qk_layernorm=arch in ("qwen3", "qwen3_moe"),
        hidden_dropout=0.0, attention_dropout=0.0, bias_activation_fusion=kernels.swiglu_fusion, masked_softmax_fusion=False,
        gradient_accumulation_fusion=False, bias_dropout_fusion=False, persist_layer_norm=False,
        apply_rope_fusion=kernels.rope_fusion, params_dtype=params_dtype, bf16=params_dtype == torch.bfloat16,
        fp16=params_dtype == torch.float16, pipeline_dtype=pipeline_dtype, use_cpu_initialization=on_cpu,
        perform_initialization=True, tensor_model_parallel_size=cfg.tensor_model_parallel_size,
        pipeline_model_parallel_size=cfg.pipeline_model_parallel_size, context_parallel_size=cfg.context_parallel_size,
        expert_model_parallel_size=cfg.expert_model_parallel_size, expert_tensor_parallel_size=cfg.etp,
        sequence_parallel=cfg.sequence_parallel, num_layers_in_first_pipeline_stage=cfg.num_layers_in_first_pipeline_stage,
        num_layers_in_last_pipeline_stage=cfg.num_layers_in_last_pipeline_stage, variable_seq_lengths=True,
        recompute_granularity=recompute, recompute_method="uniform" if recompute == "full" else None,
        recompute_num_layers=1 if recompute == "full" else None,
        recompute_modules=["core_attn"] if recompute == "selective" else None,
        cross_entropy_loss_fusion=False, moe_token_dispatcher_type=cfg.moe_token_dispatcher_type, **moe, **fp8,
    )


def moe_config(hf_config, cfg: MegatronConfig, kernels: Kernels) -> dict[str, Any]:
    """``TransformerConfig`` MoE fields for Qwen3-MoE from ``policy.megatron_cfg``; combinations
    Megatron would refuse deep inside its config are ConfigErrors naming the key."""
    if cfg.moe_router_bias_update_rate > 0:
        raise ConfigError(f"{SECTION}.moe_router_bias_update_rate", "Megatron's aux-loss-free expert bias needs the sigmoid "
                          "router score, and Qwen3-MoE routes with softmax; keep it 0")
    if cfg.moe_aux_loss_coeff > 0 and cfg.moe_router_load_balancing_type not in ("aux_loss", "seq_aux_loss"):
        raise ConfigError(f"{SECTION}.moe_aux_loss_coeff", f"is {cfg.moe_aux_loss_coeff} but moe_router_load_balancing_type is "
                          f"{cfg.moe_router_load_balancing_type!r}; set it to 'aux_loss' or 'seq_aux_loss'")
    from rlcore_megatron.routing_replay import check_replay

    check_replay(cfg, hf_config.num_experts)
    return dict(
        num_moe_experts=hf_config.num_experts, moe_router_topk=hf_config.num_experts_per_tok,
        moe_ffn_hidden_size=hf_config.moe_intermediate_size, moe_router_pre_softmax=not hf_config.norm_topk_prob,
        moe_router_score_function="softmax", moe_grouped_gemm=kernels.moe_grouped_gemm,
        moe_aux_loss_coeff=cfg.moe_aux_loss_coeff, moe_router_load_balancing_type=cfg.moe_router_load_balancing_type,
        moe_router_dtype=cfg.moe_router_dtype, moe_router_bias_update_rate=cfg.moe_router_bias_update_rate,
        moe_router_enable_expert_bias=cfg.moe_router_bias_update_rate > 0, moe_permute_fusion=kernels.moe_permute_fusion,
        moe_enable_routing_replay=cfg.moe_router_replay != "none" or cfg.moe_routing_metrics,
    )


def rope_kwargs(hf_config) -> dict[str, Any]:
    params = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {}
    theta = params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    kwargs: dict[str, Any] = {"rotary_base": int(theta)}
    rope_type = params.get("rope_type", "default")
    if rope_type == "llama3":
        kwargs.update(rope_scaling=True, rope_scaling_factor=float(params.get("factor", 8.0)))
    elif rope_type not in ("default", None):
        raise ConfigError("policy.model_name", f"rope type {rope_type!r} is not supported by rlcore-megatron yet")
    return kwargs


class PolicyGPTModel(GPTModel):
    """Megatron's ``GPTModel`` whose last pipeline stage can return the final hidden states
    ``[s, 1, h]`` (after the final norm; sequence-sharded under sequence parallelism) instead of
    logits, with ``return_hidden_states=True``: the backend then runs ``output_layer`` itself on
    the rows a loss reads (:mod:`rlcore_megatron.output`). Parameters, state dict and sharded
    checkpoints are the parent's. rlcore builds no multi-token-prediction block, the one part of
    ``_postprocess`` besides the output layer and Megatron's own loss."""

    def __init__(self, *args, return_hidden_states: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        self.return_hidden_states = return_hidden_states

    def _postprocess(self, hidden_states, *args, **kwargs):
        if self.return_hidden_states and self.post_process and not self.mtp_process:
            return hidden_states
        return super()._postprocess(hidden_states, *args, **kwargs)


def build_gpt_model(hf_config, cfg: MegatronConfig, kernels: Kernels, *, params_dtype: torch.dtype, on_cpu: bool,
                    return_hidden_states: bool = False) -> PolicyGPTModel:
    """This rank's shard of the model (random init; weights are loaded by :mod:`rlcore_megatron.convert`).
    ``return_hidden_states``: the last stage returns hidden states, not logits (:class:`PolicyGPTModel`)."""
    tp = cfg.tensor_model_parallel_size
    if hf_config.vocab_size % tp:
        raise ConfigError(f"{SECTION}.tensor_model_parallel_size",
                          f"{tp} does not divide the model's vocabulary size {hf_config.vocab_size}")
    tconfig = transformer_config(hf_config, cfg, kernels, params_dtype=params_dtype, on_cpu=on_cpu)
    num_experts = getattr(hf_config, "num_experts", None) if architecture(hf_config) == "qwen3_moe" else None
    model = PolicyGPTModel(
        config=tconfig, transformer_layer_spec=layer_spec(hf_config, tconfig, num_experts, kernels), vocab_size=hf_config.vocab_size,
        max_sequence_length=hf_config.max_position_embeddings, pre_process=mpu.is_pipeline_first_stage(),
        post_process=mpu.is_pipeline_last_stage(), parallel_output=True,
        share_embeddings_and_output_weights=bool(getattr(hf_config, "tie_word_embeddings", False)),
        position_embedding_type="rope", rotary_percent=1.0, return_hidden_states=return_hidden_states, **rope_kwargs(hf_config),
    )
    if not on_cpu:
        model.cuda(torch.cuda.current_device())
    if kernels.wgrad_fusion:
        fuse_weight_gradient_accumulation(model)
    if num_experts and kernels.moe_device_splits:
        from rlcore_megatron.moe_splits import keep_splits_on_device

        keep_splits_on_device(model)
    return model


def packed_seq_params(cu_seqlens_N1: torch.Tensor, total: int, max_seqlen: int, device=None) -> PackedSeqParams:
    """thd parameters for one packed micro-batch; trailing padding is one extra (masked) sequence."""
    bounds = [int(b) for b in cu_seqlens_N1.cpu().tolist()]
    if bounds[-1] < total:
        max_seqlen = max(max_seqlen, total - bounds[-1])
        bounds.append(total)
    cu = torch.tensor(bounds, dtype=torch.int32).to(device, non_blocking=True)  # no stream sync (see MicroBatch.to)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max_seqlen, max_seqlen_kv=max_seqlen)
    params.host_bounds = tuple(bounds)
    return params
