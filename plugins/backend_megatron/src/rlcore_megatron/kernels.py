"""Which kernels a Megatron model is built with: Transformer Engine or the local spec, and the fusions.

``policy.megatron_cfg.transformer_impl`` (Megatron's own name) picks the layer implementation;
``auto`` takes Transformer Engine (TE) when its torch extension loads and the run is on CUDA.
The fusions that follow from it (RoPE, SwiGLU, weight-gradient accumulation, FP8) are resolved
here once, so the model builder, the backend and the benchmarks read one :class:`Kernels`.
MoE experts (``moe_experts_impl``): ``grouped_mm`` runs each expert projection as one torch grouped
GEMM (:mod:`rlcore_megatron.moe_grouped_mm`, either layer spec), ``te_grouped`` is TE's grouped
linear, ``loop`` Megatron's loop over experts. ``auto`` takes ``grouped_mm`` on CUDA in bf16 with
one expert-tensor-parallel rank, else TE's grouped linear with TE and the loop without (Megatron's
own grouped path needs the CUDA-only ``grouped_gemm`` package). Fused permute/unpermute is on with
TE. :meth:`Kernels.describe` names the choice.

Weight-gradient accumulation fusion is switched on per TE module after the model is built, not
through ``TransformerConfig.gradient_accumulation_fusion``: that flag also reaches the output
layer, a Megatron ``ColumnParallelLinear`` whose fused path needs Apex's
``fused_weight_gradient_mlp_cuda`` (it refuses to build without it). TE's own linear layers
read ``fuse_wgrad_accumulation`` at every forward and write into ``weight.main_grad`` (the
fp32 buffer Megatron's DDP attaches), marking ``grad_added_to_main_grad`` for DDP's hook.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import attrs
import torch

from rlcore.config import ConfigError
from rlcore.training.doctor import transformer_engine
from rlcore_megatron.config import SECTION, MegatronConfig, MegatronFP8Config


@attrs.frozen
class Kernels:
    """The resolved implementation of one Megatron model."""

    transformer_engine: bool  # TE's layer spec (fused norm + linear, TE linears, TE norms)
    core_attention: str  # "flash" (rlcore.training.attention) or "transformer_engine"
    rope_fusion: bool
    swiglu_fusion: bool
    wgrad_fusion: bool
    fp8: MegatronFP8Config | None  # None: no FP8
    te_op_fuser: bool = False  # dense MLPs as one TE op sequence
    moe_grouped_gemm: bool = False  # MoE experts as one TE grouped linear (moe_experts == "te_grouped")
    moe_permute_fusion: bool = False  # TE's fused token permute/unpermute
    moe_device_splits: bool = False  # experts' token counts stay on the GPU (rlcore_megatron.moe_splits)
    moe_experts: str = "loop"  # "grouped_mm" (torch grouped GEMM), "te_grouped" (TE's grouped linear) or "loop"

    @property
    def token_multiple(self) -> int:
        """Tokens of a micro-batch (per TP rank under sequence parallelism) must be a multiple of this."""
        return self.fp8.token_multiple if self.fp8 is not None else 1

    def describe(self) -> str:
        impl = "transformer_engine" if self.transformer_engine else "local"
        fused = [name for name, on in (("rope", self.rope_fusion), ("swiglu", self.swiglu_fusion),
                                       ("wgrad-accumulation", self.wgrad_fusion), ("te-op-fuser-mlp (dense layers)", self.te_op_fuser)) if on]
        fp8 = f", fp8 {self.fp8.fp8}/{self.fp8.fp8_recipe}" if self.fp8 is not None else ""
        experts = {"grouped_mm": "torch grouped_mm", "te_grouped": "grouped GEMM", "loop": "loop over experts"}[self.moe_experts]
        moe = (f"; MoE experts: {experts}"
               f"{' (device split sizes)' if self.moe_device_splits else ''}, "
               f"permute fusion {'on' if self.moe_permute_fusion else 'off'}")
        return f"{impl} layers, {self.core_attention} attention, fused: {', '.join(fused) or 'none'}{fp8}{moe}"


def resolve(cfg: MegatronConfig, *, on_cuda: bool, bf16: bool = False) -> Kernels:
    """The kernels ``cfg`` asks for on this device (``bf16``: the model's dtype); a request that cannot be
    met is a ConfigError that says why."""
    te = _use_transformer_engine(cfg.transformer_impl, on_cuda)
    experts = _moe_experts(cfg, te=te, on_cuda=on_cuda, bf16=bf16)
    if not te:
        for key, on in (("fp8_cfg.enabled", cfg.fp8_cfg.enabled), ("core_attention", cfg.core_attention == "transformer_engine"),
                        ("gradient_accumulation_fusion", cfg.gradient_accumulation_fusion),
                        ("apply_rope_fusion", cfg.apply_rope_fusion), ("use_te_op_fuser", cfg.use_te_op_fuser),
                        ("moe_grouped_gemm", cfg.moe_grouped_gemm), ("moe_permute_fusion", cfg.moe_permute_fusion),
                        ("moe_experts_impl", cfg.moe_experts_impl == "te_grouped"),
                        ("moe_device_splits", cfg.moe_device_splits and experts != "grouped_mm")):
            if on:
                raise ConfigError(f"{SECTION}.{key}", "needs Transformer Engine's layers, which this run does not use "
                                  f"(transformer_impl={cfg.transformer_impl!r}, {'CUDA' if on_cuda else 'no CUDA device'})")
    if cfg.bias_activation_fusion and not on_cuda:
        raise ConfigError(f"{SECTION}.bias_activation_fusion", "the fused SwiGLU kernel needs a CUDA device")
    grouped_gemm = experts == "te_grouped"
    device_counts = experts != "loop"  # both grouped kernels take the counts as a device tensor
    if cfg.moe_device_splits and not device_counts:
        raise ConfigError(f"{SECTION}.moe_device_splits", "needs moe_grouped_gemm (TE's grouped linear) or moe_experts_impl "
                          "'grouped_mm': both take the device counts, the loop over experts splits by host counts")
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
        moe_device_splits=(device_counts and not cfg.fp8_cfg.enabled) if cfg.moe_device_splits is None else cfg.moe_device_splits,
        moe_permute_fusion=te if cfg.moe_permute_fusion is None else cfg.moe_permute_fusion, moe_experts=experts,
    )


def _moe_experts(cfg: MegatronConfig, *, te: bool, on_cuda: bool, bf16: bool) -> str:
    """``moe_experts_impl`` resolved, with the older ``moe_grouped_gemm`` switch (true: TE's grouped
    linear, false: the loop) standing for an explicit choice when the new key is ``auto``."""
    impl, legacy = cfg.moe_experts_impl, cfg.moe_grouped_gemm
    if legacy is not None and impl != "auto" and legacy != (impl == "te_grouped"):
        raise ConfigError(f"{SECTION}.moe_grouped_gemm", f"is {legacy} but moe_experts_impl is {impl!r}; set only "
                          "moe_experts_impl ('grouped_mm', 'te_grouped' or 'loop')")
    if impl == "auto" and legacy is not None:
        impl = "te_grouped" if legacy else "loop"
    if impl == "grouped_mm":
        if cfg.etp != 1:
            raise ConfigError(f"{SECTION}.expert_tensor_parallel_size", f"is {cfg.etp}, but moe_experts_impl 'grouped_mm' "
                              "holds whole experts on each rank; set expert_tensor_parallel_size to 1")
        if cfg.fp8_cfg.enabled:
            raise ConfigError(f"{SECTION}.moe_experts_impl", "'grouped_mm' experts have no FP8 path; FP8 experts need "
                              "'te_grouped' (or 'auto')")
        if not grouped_mm_available(on_cuda):
            raise ConfigError(f"{SECTION}.moe_experts_impl", "'grouped_mm' needs torch.nn.functional.grouped_mm (torch "
                              f"{torch.__version__} has none, or the GPU is older than compute capability 8.0)")
        return impl
    if impl == "auto":
        fast = on_cuda and bf16 and cfg.etp == 1 and not cfg.fp8_cfg.enabled and grouped_mm_available(on_cuda)
        return "grouped_mm" if fast else ("te_grouped" if te else "loop")
    return impl


def grouped_mm_available(on_cuda: bool) -> bool:
    """Whether torch has a grouped GEMM here (``F.grouped_mm``, or ``torch._grouped_mm`` before it was
    public; on CUDA a GPU of compute capability 8.0 or newer)."""
    if not (hasattr(torch.nn.functional, "grouped_mm") or hasattr(torch, "_grouped_mm")):
        return False
    return not on_cuda or torch.cuda.get_device_capability() >= (8, 0)


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


def leave_sms_free(margin: int) -> tuple[str, Callable[[], None]]:
    """Make every GEMM of this process target ``SM count - margin`` SMs (``experimental.gemm_sm_margin``);
    returns what was set, for the log, and a function that restores the previous settings (the
    backend's shutdown calls it: the settings are process-wide).

    Hopper's GEMM kernels are persistent: one CTA per SM loops over the output tiles for the kernel's
    whole length, so another process's kernel (a vLLM decode step beside the trainer, under MPS) waits
    for an SM until the GEMM ends, whatever the MPS client priorities say. Transformer Engine reads
    ``NVTE_EXT_MARGIN_SM`` at each GEMM; torch's own matmuls (Megatron's output layer, the largest GEMMs
    of a 1.2B step) honour the SM carveout only through cuBLASLt in the torch releases in use, so
    cuBLASLt becomes torch's BLAS library here. Set before the model is built and its micro-batches
    captured: a CUDA graph keeps the grid its GEMMs were captured with.
    """
    sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    if margin >= sms:
        raise ConfigError(f"{SECTION}.experimental.gemm_sm_margin", f"is {margin}, but this GPU has {sms} SMs; leave fewer free")
    if not hasattr(torch._C, "_set_sm_carveout_experimental"):
        raise ConfigError(f"{SECTION}.experimental.gemm_sm_margin", f"needs torch's SM carveout (torch._C._set_sm_carveout_experimental, "
                          f"torch >= 2.7); torch {torch.__version__} has none")
    previous = (os.environ.get("NVTE_EXT_MARGIN_SM"), torch.backends.cuda.preferred_blas_library(),
                torch._C._get_sm_carveout_experimental())

    def restore() -> None:
        env, library, carveout = previous
        if env is None:
            os.environ.pop("NVTE_EXT_MARGIN_SM", None)
        else:
            os.environ["NVTE_EXT_MARGIN_SM"] = env
        torch.backends.cuda.preferred_blas_library(library)
        torch._C._set_sm_carveout_experimental(carveout)

    os.environ["NVTE_EXT_MARGIN_SM"] = str(margin)
    torch.backends.cuda.preferred_blas_library("cublaslt")
    torch._C._set_sm_carveout_experimental(margin)
    return f"every GEMM targets {sms - margin} of {sms} SMs (gemm_sm_margin {margin}; TE and torch through cuBLASLt)", restore
