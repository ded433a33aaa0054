"""Schema of ``policy.megatron_cfg``: NeMo-RL's user-facing Megatron keys, passed through to Megatron-Core.

No torch or megatron imports here: ``rlcore plugins`` and config validation stay light.
Defaults make a 1-GPU (or 1-process CPU) run work with no tuning. Combinations that depend on
the world size, the model or the packing settings are checked by :func:`validate_parallelism`
when the backend is built, and every error names the full key path.
"""

from __future__ import annotations

from typing import Literal

import attrs
from attrs import field, frozen

from rlcore.config.structure import ConfigError, doc

SECTION = "policy.megatron_cfg"
_positive = attrs.validators.gt(0)
_non_negative = attrs.validators.ge(0)
_optional_positive = attrs.validators.optional(attrs.validators.gt(0))
_optional_non_negative = attrs.validators.optional(attrs.validators.ge(0))
Dtype = Literal["float32", "bfloat16", "float16"]


@frozen
class MegatronOptimizerConfig:
    """-> ``megatron.core.optimizer.OptimizerConfig``. Unset (None) keys take the values of
    ``policy.optimizer`` / ``policy.max_grad_norm``, so switching backends keeps the recipe's settings."""

    optimizer: Literal["adam", "sgd"] = field(default="adam", metadata=doc("'adam' is AdamW (decoupled weight decay)"))
    lr: float | None = field(default=None, validator=_optional_positive, metadata=doc("peak learning rate; None = policy.optimizer.lr"))
    min_lr: float | None = field(default=None, validator=_optional_non_negative, metadata=doc("floor of the decay schedule; None = policy.optimizer.min_lr"))
    weight_decay: float | None = field(default=None, validator=_optional_non_negative, metadata=doc("decoupled weight decay; None = policy.optimizer.weight_decay"))
    bf16: bool | None = field(default=None, metadata=doc("bf16 params with fp32 main weights; None = policy.precision == bfloat16"))
    fp16: bool = field(default=False, metadata=doc("fp16 params with loss scaling"))
    params_dtype: Dtype | None = field(default=None, metadata=doc("dtype the model is built in; None = policy.precision"))
    adam_beta1: float | None = field(default=None, metadata=doc("Adam beta1; None = policy.optimizer.betas[0]"))
    adam_beta2: float | None = field(default=None, metadata=doc("Adam beta2; None = policy.optimizer.betas[1]"))
    adam_eps: float | None = field(default=None, validator=_optional_positive, metadata=doc("Adam epsilon; None = policy.optimizer.eps"))
    sgd_momentum: float = field(default=0.9, validator=_non_negative, metadata=doc("SGD momentum"))
    use_distributed_optimizer: bool = field(default=True, metadata=doc("shard optimizer state over data-parallel ranks (ZeRO-1)"))
    use_precision_aware_optimizer: bool = field(default=False, metadata=doc("keep optimizer state in lower precision (needs Transformer Engine's FusedAdam)"))
    clip_grad: float | None = field(default=None, validator=_optional_non_negative, metadata=doc("global gradient-norm clip, 0 disables; None = policy.max_grad_norm"))

    def __attrs_post_init__(self) -> None:
        for name in ("adam_beta1", "adam_beta2"):
            value = getattr(self, name)
            if value is not None and not 0.0 <= value < 1.0:
                raise ConfigError(f"{SECTION}.optimizer.{name}", f"must be in [0, 1), got {value!r}")
        if self.fp16 and self.bf16:
            raise ConfigError(f"{SECTION}.optimizer.fp16", "fp16 and bf16 are both true; choose one")


@frozen
class MegatronSchedulerConfig:
    """-> ``megatron.core.optimizer_param_scheduler.OptimizerParamScheduler`` (in optimizer steps).
    Unset (None) keys take the values of ``policy.scheduler``."""

    lr_warmup_iters: int | None = field(default=None, validator=attrs.validators.optional(_non_negative), metadata=doc("linear warmup steps; None = policy.scheduler.warmup_steps"))
    lr_warmup_init: float = field(default=0.0, validator=_non_negative, metadata=doc("learning rate at step 0 of warmup"))
    lr_decay_style: Literal["constant", "linear", "cosine", "inverse-square-root", "WSD"] | None = field(
        default=None, metadata=doc("decay after warmup; None = policy.scheduler.decay_style"))
    lr_decay_iters: int | None = field(default=None, validator=_optional_positive, metadata=doc("steps to reach min_lr; None = policy.scheduler.decay_steps or train.max_num_steps"))
    start_weight_decay: float | None = field(default=None, metadata=doc("weight decay at step 0; None = optimizer.weight_decay"))
    end_weight_decay: float | None = field(default=None, metadata=doc("weight decay at the end; None = optimizer.weight_decay"))
    weight_decay_incr_style: Literal["constant", "linear", "cosine"] = field(default="constant", metadata=doc("weight-decay schedule"))
    override_opt_param_scheduler: bool = field(default=False, metadata=doc("on resume, take these values over the checkpoint's"))
    use_checkpoint_opt_param_scheduler: bool = field(default=True, metadata=doc("on resume, restore the scheduler state"))


@frozen
class MegatronDDPConfig:
    """-> ``megatron.core.distributed.DistributedDataParallelConfig``."""

    grad_reduce_in_fp32: bool = field(default=True, metadata=doc("accumulate and reduce gradients in fp32"))
    overlap_grad_reduce: bool = field(default=False, metadata=doc("overlap the gradient reduce-scatter with backward"))
    overlap_param_gather: bool = field(default=False, metadata=doc("overlap the parameter all-gather with forward (distributed optimizer)"))
    average_in_collective: bool = field(default=False, metadata=doc(
        "average inside the collective; rlcore losses are globally normalized, so gradients are SUMMED and this must stay false"))
    use_custom_fsdp: bool = field(default=False, metadata=doc("Megatron FSDP instead of DDP (not supported by this backend yet)"))
    data_parallel_sharding_strategy: Literal["no_shard", "optim", "optim_grads", "optim_grads_params"] = field(
        default="optim_grads_params", metadata=doc("Megatron FSDP sharding (used only with use_custom_fsdp)"))

    def __attrs_post_init__(self) -> None:
        if self.average_in_collective:
            raise ConfigError(f"{SECTION}.distributed_data_parallel_config.average_in_collective",
                              "must be false: rlcore losses are already divided by global token counts, "
                              "so data-parallel gradients are summed, not averaged")
        if self.use_custom_fsdp:
            raise ConfigError(f"{SECTION}.distributed_data_parallel_config.use_custom_fsdp",
                              "Megatron FSDP is not supported by rlcore-megatron yet; use the distributed optimizer "
                              "(optimizer.use_distributed_optimizer=true) or the fsdp2 backend")


@frozen
class MegatronFP8Config:
    """``policy.megatron_cfg.fp8_cfg`` (NeMo-RL's keys) -> ``TransformerConfig.fp8`` / ``fp8_recipe`` /
    ``fp8_param``. Needs the Transformer Engine layer spec; packed micro-batches are padded to the
    token multiple FP8 GEMMs need (:attr:`token_multiple`)."""

    enabled: bool = field(default=False, metadata=doc("train the linear layers' GEMMs in FP8 (Transformer Engine)"))
    fp8: Literal["e4m3", "hybrid"] = field(default="hybrid", metadata=doc("'e4m3' everywhere, or 'hybrid': e4m3 forward, e5m2 gradients"))
    fp8_recipe: Literal["tensorwise", "delayed", "blockwise"] = field(default="tensorwise", metadata=doc(
        "scaling: 'tensorwise' (current per-tensor amax), 'delayed' (amax history), 'blockwise' (1x128 / 128x128 blocks)"))
    fp8_param: bool = field(default=False, metadata=doc("keep the GEMM weights in FP8 (less memory; the main weights stay fp32)"))
    fp8_logprobs: bool = field(default=False, metadata=doc(
        "run the logprob passes (old, reference, refit probe) in FP8 too, the training forward's numerics; false: in bf16, "
        "as the generator computes them (the refit probe's mean gap is about ten times larger in FP8 than in bf16)"))

    def __attrs_post_init__(self) -> None:
        if self.fp8_param and not self.fp8_logprobs:
            raise ConfigError(f"{SECTION}.fp8_cfg.fp8_logprobs", "must be true with fp8_param: FP8 weights have no bf16 forward")

    @property
    def token_multiple(self) -> int:
        """Rows of an FP8 GEMM must be a multiple of 16 (tensor cores); the blockwise recipe quantizes
        activations in 128-row blocks along the token dimension of the weight-gradient GEMM."""
        return 128 if self.fp8_recipe == "blockwise" else 16


@frozen
class MegatronExperimentalConfig:
    """Experimental: switches that exist to measure an alternative against the default. The
    defaults are the settings measured best; these keys may change or go without notice."""

    gemm_sm_margin: int = field(default=0, validator=_non_negative, metadata=doc(
        "SMs every GEMM of the trainer leaves free, for a process sharing the GPU (one step off with a vLLM engine "
        "resident beside the trainer, under MPS): Transformer Engine's GEMMs through NVTE_EXT_MARGIN_SM, torch's (the "
        "output layer) through cuBLASLt's SM-count target. Process-wide while the backend lives; its shutdown restores "
        "the previous settings. 0 = every SM (CUDA only)"))


@frozen
class MegatronConfig:
    """``policy.megatron_cfg``: Megatron-Core training backend (selected by ``enabled: true``)."""

    enabled: bool = field(default=False, metadata=doc("train with Megatron-Core"))
    layout: Literal["manual", "auto"] = field(default="manual", metadata=doc(
        "'auto': the parallel sizes, sequence parallelism, recompute and offload this section leaves out are chosen by "
        "rlcore's planner (rlcore.planning: the fastest layout predicted to fit); the keys it sets are kept"))
    explicit_keys: frozenset = field(factory=frozenset, metadata={**doc("the keys the recipe set (filled in when read)"), "internal": True})
    activation_checkpointing: Literal[False, True, "full", "selective"] = field(
        default=False, metadata=doc("recompute activations in backward: true/'full' = whole layers, 'selective' = core attention"))
    tensor_model_parallel_size: int = field(default=1, validator=_positive, metadata=doc("TP: shard matmuls over this many ranks"))
    pipeline_model_parallel_size: int = field(default=1, validator=_positive, metadata=doc("PP: split layers into this many stages"))
    context_parallel_size: int = field(default=1, validator=_positive, metadata=doc("CP: split each sequence over this many ranks (needs packing)"))
    expert_model_parallel_size: int = field(default=1, validator=_positive, metadata=doc("EP: spread MoE experts over this many ranks"))
    expert_tensor_parallel_size: int | None = field(default=None, validator=_optional_positive, metadata=doc("TP inside experts; None = tensor_model_parallel_size"))
    sequence_parallel: bool = field(default=False, metadata=doc("shard norms/dropout activations along the sequence over TP ranks (needs TP > 1)"))
    num_layers_in_first_pipeline_stage: int | None = field(default=None, validator=_optional_positive, metadata=doc("uneven PP: layers of stage 0"))
    num_layers_in_last_pipeline_stage: int | None = field(default=None, validator=_optional_positive, metadata=doc("uneven PP: layers of the last stage"))
    pipeline_dtype: Dtype | None = field(default=None, metadata=doc("dtype of tensors sent between stages; None = policy.precision"))
    freeze_moe_router: bool = field(default=False, metadata=doc("do not train the MoE router weights"))
    moe_router_dtype: Literal["fp32", "fp64"] | None = field(default="fp32", metadata=doc("router logits/softmax dtype; None = model dtype"))
    moe_router_load_balancing_type: Literal["aux_loss", "seq_aux_loss", "sinkhorn", "none"] = field(
        default="none", metadata=doc("auxiliary load balancing ('none' keeps the loss exactly the algorithm's)"))
    moe_router_bias_update_rate: float = field(default=0.0, validator=_non_negative, metadata=doc("aux-loss-free expert bias update rate (0 = off)"))
    moe_aux_loss_coeff: float = field(default=0.0, validator=_non_negative, metadata=doc(
        "weight of the load-balancing auxiliary loss (aux_loss / seq_aux_loss); 0 keeps the loss exactly the algorithm's"))
    moe_token_dispatcher_type: Literal["alltoall", "allgather", "flex"] = field(default="alltoall", metadata=doc(
        "how tokens reach their experts' ranks: 'alltoall' (the one that takes packed, variable-length micro-batches)"))
    moe_grouped_gemm: bool | None = field(default=None, metadata=doc(
        "all local experts in one grouped GEMM (TE's grouped linear) instead of a loop over experts; None = as "
        "moe_experts_impl decides (the newer key, which also offers torch's grouped GEMM)"))
    moe_experts_impl: Literal["auto", "grouped_mm", "te_grouped", "loop"] = field(default="auto", metadata=doc(
        "MoE experts: 'grouped_mm' (each projection one torch grouped GEMM, rlcore_megatron.moe_grouped_mm; bf16 on "
        "CUDA, expert_tensor_parallel_size 1), 'te_grouped' (TE's grouped linear), 'loop' (one expert after another); "
        "'auto' = grouped_mm on CUDA in bf16 with one expert-tensor-parallel rank, else te_grouped with Transformer "
        "Engine's layers, else loop. moe_grouped_gemm true/false, if set, stands for te_grouped/loop"))
    moe_permute_fusion: bool | None = field(default=None, metadata=doc(
        "fused token permute/unpermute around the experts (TE); None = on with Transformer Engine's layers"))
    moe_device_splits: bool | None = field(default=None, metadata=doc(
        "keep the experts' token counts on the GPU: TE's native grouped GEMM (one kernel per expert projection), and with "
        "one expert- and tensor-parallel rank no device-to-host sync per MoE layer (rlcore_megatron.moe_splits); None = on "
        "with grouped experts (moe_experts_impl grouped_mm or te_grouped), off with FP8 (its padding needs host counts)"))
    moe_router_replay: Literal["none", "r2", "r3"] = field(default="none", metadata=doc(
        "routing replay: 'r2' trains with the experts each token got in the step's old-logprob pass; 'r3' with the "
        "experts the generator chose (needs policy.generation.return_routed_experts: true, vLLM on CUDA)"))
    moe_routing_metrics: bool = field(default=False, metadata=doc(
        "record the old-logprob pass's routing even without replay, to log moe/routing_mismatch_fraction (with r3 the "
        "fraction compares the trainer's routing with the generator's)"))
    transformer_impl: Literal["auto", "transformer_engine", "local"] = field(default="auto", metadata=doc(
        "layer implementation: 'transformer_engine' (TE's fused layers, needed for FP8), 'local' (Megatron's own with "
        "rlcore's attention and norms), 'auto' = TE when its torch extension loads and the run is on CUDA"))
    core_attention: Literal["auto", "flash", "transformer_engine"] = field(default="auto", metadata=doc(
        "attention kernel: 'flash' (FlashAttention varlen through torch, rlcore.training.attention), 'transformer_engine' "
        "(TE's DotProductAttention: cuDNN fused attention), 'auto' = flash"))
    apply_rope_fusion: bool | None = field(default=None, metadata=doc("fused RoPE kernel (TE); None = on with Transformer Engine"))
    bias_activation_fusion: bool | None = field(default=None, metadata=doc("fused SwiGLU; None = on with CUDA"))
    gradient_accumulation_fusion: bool | None = field(default=None, metadata=doc(
        "TE linear layers add their weight gradients straight into the fp32 main gradients; None = on with "
        "Transformer Engine (the output layer keeps the unfused path: Megatron's needs Apex for it)"))
    use_te_op_fuser: bool | None = field(default=None, metadata=doc(
        "dense MLPs as one Transformer Engine op sequence (norm, fc1, SwiGLU, fc2 fused and launched together); "
        "None = on with Transformer Engine's layers"))
    fp8_cfg: MegatronFP8Config = field(factory=MegatronFP8Config, metadata=doc("FP8 training (Transformer Engine)"))
    cuda_graph: Literal["none", "micro_batch"] = field(default="none", metadata=doc(
        "'micro_batch': each training micro-batch replays a CUDA graph of its forward, output layer, loss and backward, "
        "captured once per shape bucket (micro-batches padded to the token budget; rlcore_megatron.cuda_graph). CUDA "
        "with Transformer Engine's fused RoPE, sequence packing, PP = CP = 1, dense models, no recompute, no fp16, "
        "no FP8"))
    empty_unused_memory_level: Literal[0, 1, 2] | None = field(default=None, metadata=doc(
        "torch.cuda.empty_cache: 0 never, 1 after each optimizer step, 2 also after each forward(-backward) pass over the "
        "micro-batches; None: 1 when a colocated engine shares the GPU (it wakes up after training and needs the "
        "allocator's cached activation blocks), else 0 (re-allocating them costs host time)"))
    optimizer: MegatronOptimizerConfig = field(factory=MegatronOptimizerConfig, metadata=doc("optimizer"))
    scheduler: MegatronSchedulerConfig = field(factory=MegatronSchedulerConfig, metadata=doc("learning-rate/weight-decay schedule"))
    distributed_data_parallel_config: MegatronDDPConfig = field(factory=MegatronDDPConfig, metadata=doc("data-parallel gradient handling"))
    experimental: MegatronExperimentalConfig = field(factory=MegatronExperimentalConfig, metadata=doc(
        "experimental: switches kept to measure alternatives; the defaults are the measured best"))

    def __attrs_post_init__(self) -> None:
        if self.moe_token_dispatcher_type != "alltoall":
            raise ConfigError(f"{SECTION}.moe_token_dispatcher_type", f"{self.moe_token_dispatcher_type!r} is not supported: "
                              "'allgather' refuses variable sequence lengths (packed micro-batches), 'flex' needs DeepEP; "
                              "use 'alltoall'")
        if self.sequence_parallel and self.tensor_model_parallel_size == 1:
            raise ConfigError(f"{SECTION}.sequence_parallel", "needs tensor_model_parallel_size > 1")
        if self.pipeline_model_parallel_size == 1 and (self.num_layers_in_first_pipeline_stage or self.num_layers_in_last_pipeline_stage):
            key = "num_layers_in_first_pipeline_stage" if self.num_layers_in_first_pipeline_stage else "num_layers_in_last_pipeline_stage"
            raise ConfigError(f"{SECTION}.{key}", "needs pipeline_model_parallel_size > 1")
        if self.cuda_graph != "none":
            _check_cuda_graph(self)

    @property
    def recompute(self) -> str | None:
        """Megatron's ``recompute_granularity``."""
        if self.activation_checkpointing in (True, "full"):
            return "full"
        return "selective" if self.activation_checkpointing == "selective" else None

    @property
    def etp(self) -> int:
        return self.expert_tensor_parallel_size or self.tensor_model_parallel_size


def _check_cuda_graph(cfg: MegatronConfig) -> None:
    """What a captured micro-batch cannot hold, named by key (rlcore_megatron.cuda_graph checks the
    rest once the model and device are known)."""
    ddp = cfg.distributed_data_parallel_config
    refusals = [
        ("pipeline_model_parallel_size", cfg.pipeline_model_parallel_size > 1,
         "pipeline stages exchange activations through the 1F1B schedule's host-driven sends and receives; use 1"),
        ("context_parallel_size", cfg.context_parallel_size > 1,
         "the context-parallel layout is computed per micro-batch on the host; use 1"),
        ("activation_checkpointing", cfg.recompute is not None,
         "Megatron's recompute saves and restores the CUDA RNG state, which cannot be read while capturing; use false"),
        ("optimizer.fp16", cfg.optimizer.fp16, "fp16 loss scaling has not been checked under capture; use bf16"),
        ("fp8_cfg.enabled", cfg.fp8_cfg.enabled,
         "the fixed-shape path's FP8 steps, graphed or run eagerly alike, move the step's metrics and gradients "
         "several times further from bf16's than Megatron's own FP8 schedule does; use false, or cuda_graph 'none' "
         "with FP8"),
        ("core_attention", cfg.core_attention == "transformer_engine",
         "Transformer Engine's attention plans cuDNN graphs per packing on the host; use 'flash' or 'auto'"),
        ("distributed_data_parallel_config.overlap_grad_reduce", ddp.overlap_grad_reduce,
         "the overlapped reduce is launched from per-parameter Python hooks, which a replay does not run; use false"),
        ("distributed_data_parallel_config.overlap_param_gather", ddp.overlap_param_gather,
         "the overlapped parameter gather waits in Python forward hooks, which a replay does not run; use false"),
    ]
    for key, refused, why in refusals:
        if refused:
            raise ConfigError(_key(key), f"cannot be used with {SECTION}.cuda_graph={cfg.cuda_graph!r}: {why}")


def _key(name: str) -> str:
    return f"{SECTION}.{name}"


def validate_parallelism(cfg: MegatronConfig, world_size: int, *, num_layers: int, num_experts: int | None = None,
                         packing: bool = True, num_query_groups: int | None = None, num_heads: int | None = None) -> int:
    """Check the parallel sizes against the world, the model and packing; return the data-parallel size.

    Raises :class:`ConfigError` naming the offending keys.
    """
    tp, pp, cp, ep = (cfg.tensor_model_parallel_size, cfg.pipeline_model_parallel_size,
                      cfg.context_parallel_size, cfg.expert_model_parallel_size)
    model_parallel = tp * pp * cp
    if world_size % model_parallel:
        raise ConfigError(_key("tensor_model_parallel_size"),
                          f"tensor_model_parallel_size ({tp}) x pipeline_model_parallel_size ({pp}) x context_parallel_size "
                          f"({cp}) = {model_parallel} does not divide the world size {world_size}")
    dp = world_size // model_parallel
    expert_parallel = cfg.etp * ep * pp
    if world_size % expert_parallel:
        raise ConfigError(_key("expert_model_parallel_size"),
                          f"expert_tensor_parallel_size ({cfg.etp}) x expert_model_parallel_size ({ep}) x "
                          f"pipeline_model_parallel_size ({pp}) = {expert_parallel} does not divide the world size {world_size}")
    if cp > 1 and not packing:
        raise ConfigError(_key("context_parallel_size"), f"context parallelism ({cp}) needs sequence packing: set policy.sequence_packing.enabled=true")
    _validate_layers(cfg, num_layers)
    if ep > 1 or cfg.expert_tensor_parallel_size:
        if not num_experts:
            raise ConfigError(_key("expert_model_parallel_size"), f"is {ep} but the model is dense (no experts)")
        if num_experts % ep:
            raise ConfigError(_key("expert_model_parallel_size"), f"{ep} does not divide the model's {num_experts} experts")
    if num_experts and ep == 1 and cfg.etp < tp:
        # Megatron marks expert weights for the dense data-parallel reduction when EP is 1, which
        # leaves out the tensor-parallel ranks that each trained the same experts on other tokens
        # (measured: the loop over experts' gradient norm and weights off the one-process step).
        raise ConfigError(_key("expert_tensor_parallel_size"), f"{cfg.etp} below tensor_model_parallel_size ({tp}) needs "
                          "expert_model_parallel_size > 1 (with one expert-parallel rank Megatron does not sum the "
                          "experts' gradients over the tensor-parallel ranks); leave it unset or raise "
                          "expert_model_parallel_size")
    if num_experts and tp > 1 and not cfg.sequence_parallel:
        raise ConfigError(_key("sequence_parallel"), f"must be true for a mixture-of-experts model with "
                          f"tensor_model_parallel_size={tp} (Megatron-Core trains MoE under TP only with sequence parallelism)")
    if num_query_groups is not None and num_query_groups % tp:
        raise ConfigError(_key("tensor_model_parallel_size"), f"{tp} does not divide the model's {num_query_groups} key/value heads")
    if num_heads is not None and num_heads % tp:
        raise ConfigError(_key("tensor_model_parallel_size"), f"{tp} does not divide the model's {num_heads} attention heads")
    return dp


def _validate_layers(cfg: MegatronConfig, num_layers: int) -> None:
    pp = cfg.pipeline_model_parallel_size
    first, last = cfg.num_layers_in_first_pipeline_stage, cfg.num_layers_in_last_pipeline_stage
    if first is None and last is None:
        if num_layers % pp:
            raise ConfigError(_key("pipeline_model_parallel_size"), f"{pp} stages do not divide the model's {num_layers} layers; "
                              "set num_layers_in_first_pipeline_stage / num_layers_in_last_pipeline_stage for uneven stages")
        return
    middle_stages = pp - (first is not None) - (last is not None)
    rest = num_layers - (first or 0) - (last or 0)
    if rest < 0 or (middle_stages == 0 and rest != 0) or (middle_stages > 0 and (rest % middle_stages or rest == 0)):
        raise ConfigError(_key("num_layers_in_first_pipeline_stage"),
                          f"num_layers_in_first_pipeline_stage={first}, num_layers_in_last_pipeline_stage={last} leave "
                          f"{rest} of the model's {num_layers} layers for {middle_stages} middle stage(s) of "
                          f"pipeline_model_parallel_size={pp}; they must divide evenly")


def apply_auto_layout(cfg: MegatronConfig, run, hf_config: dict, world_size: int, device: str, *, local_ranks: int | None = None,
                      report=print) -> MegatronConfig:
    """``layout: auto``: the planner's fastest fitting layout (rlcore.planning.runtime) for ``world_size`` ranks;
    the keys the section sets are kept. Rank-independent, so every rank takes the same one."""
    if cfg.layout != "auto":
        return cfg
    from rlcore.runtime import choose_layout, describe_layout

    best, runner_up = choose_layout(run, hf_config, world_size, device, local_ranks=local_ranks)
    lay = best.layout
    report(f"rlcore-megatron: {describe_layout(best, runner_up, world_size)}")
    recompute = {"none": False, "full": "full", "selective": "selective"}[lay.recompute]
    return attrs.evolve(cfg, tensor_model_parallel_size=lay.tp, pipeline_model_parallel_size=lay.pp, context_parallel_size=lay.cp,
                        expert_model_parallel_size=lay.ep, expert_tensor_parallel_size=lay.etp if lay.ep > 1 or lay.etp != lay.tp else None,
                        sequence_parallel=lay.sp, activation_checkpointing=recompute)
