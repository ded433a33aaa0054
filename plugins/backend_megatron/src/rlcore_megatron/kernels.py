"""Which kernels a Megatron model is built with: Transformer Engine or the local spec, and the fusions.

``policy.megatron_cfg.transformer_impl`` (Megatron's own name) picks the layer implementation;
``auto`` takes Transformer Engine (TE) when its torch extension loads and the run is on CUDA.
The fusions that follow from it (RoPE, SwiGLU, weight-gradient accumulation, FP8) are resolved
here once, so the model builder, the backend and the benchmarks read one :class:`Kernels`.
MoE experts follow the same rule: grouped GEMM (TE's grouped linear) and fused permute/unpermute
are on with TE; the local spec keeps Megatron's loop over experts (its grouped path needs the
CUDA-only ``grouped_gemm`` package) and says so in :meth:`Kernels.describe`.

Weight-gradient accumulation fusion is switched on per TE module after the model is built, not
through ``TransformerConfig.gradient_accumulation_fusion``: that flag also reaches the output
layer, a Megatron ``ColumnParallelLinear`` whose fused path needs Apex's
``fused_weight_gradient_mlp_cuda`` (it refuses to build without it). TE's own linear layers
read ``fuse_wgrad_accumulation`` at every forward and write into ``weight.main_grad`` (the
fp32 buffer Megatron's DDP attaches), marking ``grad_added_to_main_grad`` for DDP's hook.
"""

from __future__ import annotations

import attrs

from rlcore.config import ConfigError
from rlcore.doctor import transformer_engine
from rlcore_megatron.config import SECTION, MegatronConfig, MegatronFP8Config


@attrs.frozen
class Kernels:
    """The resolved implementation of one Megatron model."""

    transformer_engine: bool  # TE's layer spec (fused norm + linear, TE linears, TE norms)
    core_attention: str  # "flash" (rlcore.attention) or "transformer_engine"
    rope_fusion: bool
    swiglu_fusion: bool
    wgrad_fusion: bool
    fp8: MegatronFP8Config | None  # None: no FP8
    te_op_fuser: bool = False  # dense MLPs as one TE op sequence
    moe_grouped_gemm: bool = False  # MoE experts as one TE grouped linear (else a loop over experts)
    moe_permute_fusion: bool = False  # TE's fused token permute/unpermute
    moe_device_splits: bool = False  # experts' token counts stay on the GPU (rlcore_megatron.moe_splits)

    @property
    def token_multiple(self) -> int:
        """Tokens of a micro-batch (per TP rank under sequence parallelism) must be a multiple of this."""
        return self.fp8.token_multiple if self.fp8 is not None else 1

    def describe(self) -> str:
        impl = "transformer_engine" if self.transformer_engine else "local"
        fused = [name for name, on in (("rope", self.rope_fusion), ("swiglu", self.swiglu_fusion),
                                       ("wgrad-accumulation", self.wgrad_fusion), ("te-op-fuser-mlp (dense layers)", self.te_op_fuser)) if on]
        fp8 = f", fp8 {self.fp8.fp8}/{self.fp8.fp8_recipe}" if self.fp8 is not None else ""
        moe = (f"; MoE experts: {'grouped GEMM' if self.moe_grouped_gemm else 'loop over experts'}"
               f"{' (device split sizes)' if self.moe_device_splits else ''}, "
               f"permute fusion {'on' if self.moe_permute_fusion else 'off'}")
        return f"{impl} layers, {self.core_attention} attention, fused: {', '.join(fused) or 'none'}{fp8}{moe}"


def resolve(cfg: MegatronConfig, *, on_cuda: bool) -> Kernels:
    """The kernels ``cfg`` asks for on this device; a request that cannot be met is a ConfigError that says why."""
    te = _use_transformer_engine(cfg.transformer_impl, on_cuda)
    if not te:
        for key, on in (("fp8_cfg.enabled", cfg.fp8_cfg.enabled), ("core_attention", cfg.core_attention == "transformer_engine"),
                        ("gradient_accumulation_fusion", cfg.gradient_accumulation_fusion),
                        ("apply_rope_fusion", cfg.apply_rope_fusion), ("use_te_op_fuser", cfg.use_te_op_fuser),
                        ("moe_grouped_gemm", cfg.moe_grouped_gemm), ("moe_permute_fusion", cfg.moe_permute_fusion),
                        ("moe_device_splits", cfg.moe_device_splits)):
            if on:
                raise ConfigError(f"{SECTION}.{key}", "needs Transformer Engine's layers, which this run does not use "
                                  f"(transformer_impl={cfg.transformer_impl!r}, {'CUDA' if on_cuda else 'no CUDA device'})")
    if cfg.bias_activation_fusion and not on_cuda:
        raise ConfigError(f"{SECTION}.bias_activation_fusion", "the fused SwiGLU kernel needs a CUDA device")
    grouped_gemm = te if cfg.moe_grouped_gemm is None else cfg.moe_grouped_gemm
    if cfg.moe_device_splits and not grouped_gemm:
        raise ConfigError(f"{SECTION}.moe_device_splits", "needs moe_grouped_gemm (TE's grouped linear takes the device counts)")
    if cfg.moe_device_splits and cfg.fp8_cfg.enabled:
        raise ConfigError(f"{SECTION}.moe_device_splits", "FP8 experts pad each expert's tokens from host counts; "
                          "set moe_device_splits to false (or null) with fp8_cfg.enabled")
    return Kernels(
        transformer_engine=te,
        core_attention="transformer_engine" if cfg.core_attention == "transformer_engine" else "flash",
        rope_fusion=te if cfg.apply_rope_fusion is None else cfg.apply_rope_fusion,
        swiglu_fusion=on_cuda if cfg.bias_activation_fusion is None else cfg.bias_activation_fusion,
        wgrad_fusion=te if cfg.gradient_accumulation_fusion is None else cfg.gradient_accumulation_fusion,
        fp8=cfg.fp8_cfg if cfg.fp8_cfg.enabled else None, te_op_fuser=te if cfg.use_te_op_fuser is None else cfg.use_te_op_fuser,
        moe_grouped_gemm=grouped_gemm,
        moe_device_splits=(grouped_gemm and not cfg.fp8_cfg.enabled) if cfg.moe_device_splits is None else cfg.moe_device_splits,
        moe_permute_fusion=te if cfg.moe_permute_fusion is None else cfg.moe_permute_fusion,
    )


def _use_transformer_engine(impl: str, on_cuda: bool) -> bool:
    if impl == "local":
        return False
    if not on_cuda:
        if impl == "transformer_engine":
            raise ConfigError(f"{SECTION}.transformer_impl", "'transformer_engine' needs a CUDA device; this run has none "
                              "(use 'auto' or 'local' for CPU runs)")
        return False
    status = transformer_engine()
    if impl == "transformer_engine" and not status["loads"]:
        raise ConfigError(f"{SECTION}.transformer_impl", f"'transformer_engine' asked for, but Transformer Engine's torch "
                          f"extension does not load ({status['error']}); `rlcore doctor` reports it. Install "
                          "transformer-engine[pytorch] for this torch and CUDA, or use 'local'")
    return bool(status["loads"])


def fuse_weight_gradient_accumulation(model) -> int:
    """Turn on TE's fused weight-gradient accumulation in every TE linear layer of ``model``; returns how many."""
    count = 0
    for module in model.modules():
        if hasattr(module, "fuse_wgrad_accumulation") and type(module).__module__.startswith(
                ("transformer_engine", "megatron.core.extensions.transformer_engine")):
            module.fuse_wgrad_accumulation = True
            count += 1
    return count
