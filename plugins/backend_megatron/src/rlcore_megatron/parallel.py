"""Process groups, model construction and Megatron's DDP/optimizer/scheduler from ``policy.megatron_cfg``."""

from __future__ import annotations

import attrs
import torch
import torch.distributed as dist
from megatron.core import parallel_state as mpu
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

from rlcore.config import RunConfig
from rlcore.utils import torch_dtype
from rlcore_megatron.config import MegatronConfig, validate_parallelism
from rlcore_megatron.kernels import Kernels
from rlcore_megatron.model import build_gpt_model


@attrs.frozen
class Ranks:
    """This process's coordinates in the Megatron grid."""

    dp: int
    dp_size: int
    tp: int
    tp_size: int
    pp: int
    pp_size: int
    cp: int
    cp_size: int

    @classmethod
    def current(cls) -> Ranks:
        return cls(mpu.get_data_parallel_rank(), mpu.get_data_parallel_world_size(),
                   mpu.get_tensor_model_parallel_rank(), mpu.get_tensor_model_parallel_world_size(),
                   mpu.get_pipeline_model_parallel_rank(), mpu.get_pipeline_model_parallel_world_size(),
                   mpu.get_context_parallel_rank(), mpu.get_context_parallel_world_size())

    @property
    def is_last_stage(self) -> bool:
        return self.pp == self.pp_size - 1

    @property
    def reports(self) -> bool:
        """One rank per data-parallel replica reports losses/logprobs (last stage, TP/CP rank 0)."""
        return self.is_last_stage and self.tp == 0 and self.cp == 0


def initialize(cfg: MegatronConfig, hf_config, run: RunConfig, seed: int) -> int:
    """Check the layout, create Megatron's process groups (once per process) and seed; return DP size."""
    if not dist.is_initialized():
        raise RuntimeError("rlcore-megatron: torch.distributed must be initialized before the backend is built")
    dp = validate_parallelism(
        cfg, dist.get_world_size(), num_layers=hf_config.num_hidden_layers,
        num_experts=getattr(hf_config, "num_experts", None), packing=run.policy.sequence_packing.enabled,
        num_query_groups=hf_config.num_key_value_heads, num_heads=hf_config.num_attention_heads)
    if mpu.model_parallel_is_initialized():
        current = (mpu.get_tensor_model_parallel_world_size(), mpu.get_pipeline_model_parallel_world_size(),
                   mpu.get_context_parallel_world_size(), mpu.get_expert_model_parallel_world_size())
        wanted = (cfg.tensor_model_parallel_size, cfg.pipeline_model_parallel_size, cfg.context_parallel_size,
                  cfg.expert_model_parallel_size)
        if current != wanted or not _groups_registered():
            mpu.destroy_model_parallel()
    if not mpu.model_parallel_is_initialized():
        mpu.initialize_model_parallel(
            tensor_model_parallel_size=cfg.tensor_model_parallel_size,
            pipeline_model_parallel_size=cfg.pipeline_model_parallel_size,
            context_parallel_size=cfg.context_parallel_size,
            expert_model_parallel_size=cfg.expert_model_parallel_size,
            expert_tensor_parallel_size=cfg.etp,
        )
    model_parallel_cuda_manual_seed(seed)
    return dp


def _groups_registered() -> bool:
    """Whether Megatron's groups belong to the current torch.distributed world: they outlive a world
    that was destroyed and created again in the same process (one test module after another)."""
    try:
        dist.get_process_group_ranks(mpu.get_data_parallel_group())
    except (KeyError, ValueError):  # torch 2.13 raises KeyError for a group of a destroyed world
        return False
    return True


def params_dtype(cfg: MegatronConfig, run: RunConfig) -> torch.dtype:
    return torch_dtype(cfg.optimizer.params_dtype or run.policy.precision)


def build_model(cfg: MegatronConfig, hf_config, run: RunConfig, kernels: Kernels, *, on_cpu: bool,
                return_hidden_states: bool = False):
    dtype = params_dtype(cfg, run)
    model = build_gpt_model(hf_config, cfg, kernels, params_dtype=dtype, on_cpu=on_cpu, return_hidden_states=return_hidden_states)
    if cfg.freeze_moe_router:
        for name, param in model.named_parameters():
            if name.endswith("mlp.router.weight"):
                param.requires_grad_(False)
    return model


def wrap_ddp(model, cfg: MegatronConfig):
    ddp = cfg.distributed_data_parallel_config
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=ddp.grad_reduce_in_fp32, overlap_grad_reduce=ddp.overlap_grad_reduce,
        overlap_param_gather=ddp.overlap_param_gather and cfg.optimizer.use_distributed_optimizer,
        average_in_collective=False, use_distributed_optimizer=cfg.optimizer.use_distributed_optimizer,
        check_for_nan_in_grad=False, bucket_size=None if ddp.overlap_grad_reduce else 40_000_000,
        fp8_param_gather=cfg.fp8_cfg.enabled and cfg.fp8_cfg.fp8_param,
    )
    tconfig = model.config
    # rlcore losses are already divided by global token counts: gradients are summed over data-parallel
    # ranks (per-token-loss mode makes Megatron's DDP use a scaling factor of 1).
    tconfig.calculate_per_token_loss = True
    wrapped = DistributedDataParallel(config=tconfig, ddp_config=ddp_config, module=model)
    tconfig.no_sync_func = wrapped.no_sync
    tconfig.finalize_model_grads_func = lambda models, num_tokens=None, **kw: finalize_model_grads(models, None, **kw)
    return wrapped


def _pick(value, default):
    return default if value is None else value


def optimizer_config(cfg: MegatronConfig, run: RunConfig) -> OptimizerConfig:
    """``policy.megatron_cfg.optimizer`` with unset keys taken from ``policy.optimizer``/``max_grad_norm``."""
    o, p = cfg.optimizer, run.policy.optimizer
    dtype = params_dtype(cfg, run)
    return OptimizerConfig(
        optimizer=o.optimizer, lr=_pick(o.lr, p.lr), min_lr=_pick(o.min_lr, p.min_lr),
        weight_decay=_pick(o.weight_decay, p.weight_decay), bf16=_pick(o.bf16, dtype == torch.bfloat16), fp16=o.fp16,
        params_dtype=dtype, adam_beta1=_pick(o.adam_beta1, p.betas[0]), adam_beta2=_pick(o.adam_beta2, p.betas[1]),
        adam_eps=_pick(o.adam_eps, p.eps), sgd_momentum=o.sgd_momentum, use_distributed_optimizer=o.use_distributed_optimizer,
        use_precision_aware_optimizer=o.use_precision_aware_optimizer,
        clip_grad=_pick(o.clip_grad, run.policy.max_grad_norm or 0.0),
    )


def build_optimizer(wrapped, cfg: MegatronConfig, run: RunConfig):
    optimizer = get_megatron_optimizer(optimizer_config(cfg, run), [wrapped])
    if wrapped.ddp_config.overlap_param_gather:
        wrapped.config.param_sync_func = wrapped.start_param_sync
    if cfg.optimizer.fp16:
        wrapped.config.grad_scale_func = optimizer.scale_loss
    return optimizer


def build_scheduler(optimizer, cfg: MegatronConfig, run: RunConfig) -> OptimizerParamScheduler:
    s, o, ps = cfg.scheduler, optimizer_config(cfg, run), run.policy.scheduler
    warmup = _pick(s.lr_warmup_iters, ps.warmup_steps)
    decay = s.lr_decay_iters or ps.decay_steps or run.train.max_num_steps
    wd_start = _pick(s.start_weight_decay, o.weight_decay)
    wd_end = _pick(s.end_weight_decay, o.weight_decay)
    return OptimizerParamScheduler(
        optimizer, init_lr=s.lr_warmup_init, max_lr=o.lr, min_lr=o.min_lr, lr_warmup_steps=warmup,
        lr_decay_steps=max(decay, warmup + 1), lr_decay_style=_pick(s.lr_decay_style, ps.decay_style), start_wd=wd_start,
        end_wd=wd_end, wd_incr_steps=max(decay, 1), wd_incr_style=s.weight_decay_incr_style,
        use_checkpoint_opt_param_scheduler=s.use_checkpoint_opt_param_scheduler,
        override_opt_param_scheduler=s.override_opt_param_scheduler,
    )
