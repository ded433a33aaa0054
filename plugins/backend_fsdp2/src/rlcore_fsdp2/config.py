"""Schema of ``policy.dtensor_cfg``: NeMo-RL's DTensor (FSDP2) keys plus a few of our own.

No torch imports here: ``rlcore plugins`` and config validation stay light. Combinations that
depend on the world size or the model (the device mesh, head counts divisible by the tensor
parallel size) are checked when the backend is built (:mod:`rlcore_fsdp2.parallel_dims`), and
every error names the full key path.
"""

from __future__ import annotations

from typing import Literal

import attrs
from attrs import field, frozen

from rlcore.config.structure import ConfigError, doc

SECTION = "policy.dtensor_cfg"
_positive = attrs.validators.gt(0)


@frozen
class DTensorExperimentalConfig:
    """Experimental: switches that exist to measure an alternative against the default. The
    defaults are the settings measured best; these keys may change or go without notice."""

    empty_cache_after_train: bool | None = field(default=None, metadata=doc(
        "torch.cuda.empty_cache() at the end of each train(): hands the allocator's cached blocks to a colocated "
        "generation engine; re-allocating them costs host time every step (about a tenth of a small model's step); "
        "None = on when generation is colocated (policy.generation.colocated.enabled), off otherwise"))
    one_rank_fast_paths: bool = field(default=True, metadata=doc(
        "with one data-parallel rank, replace two private FSDP2 functions (the reduce buffer's copy-in and the "
        "per-group post-backward accumulation) with cheaper equivalents (rlcore_fsdp2.one_rank) while the backend "
        "lives; its shutdown restores them. false leaves FSDP2 as it is"))
    preallocate_grad_accumulators: bool = field(default=False, metadata=doc(
        "with the gradient sync deferred (defer_grad_sync), allocate FSDP2's float32 gradient accumulators at the "
        "start of each step from the second on, before any activation, rather than among the activations' blocks "
        "during the first backward (rlcore_fsdp2.accumulators): measures whether the allocator then reserves no "
        "more than the step's tensors need"))


@frozen
class DTensorConfig:
    """PyTorch-native parallelism: FSDP2 (``fully_shard``) over data-parallel ranks, DTensor
    tensor/sequence parallelism inside each layer."""

    enabled: bool = field(default=True, metadata=doc("use this backend (a higher-precedence enabled backend wins)"))
    layout: Literal["manual", "auto"] = field(default="manual", metadata=doc(
        "'auto': the parallel sizes, sequence parallelism, recompute and offload this section leaves out are chosen by "
        "rlcore's planner (rlcore.planning: the fastest layout predicted to fit); the keys it sets are kept"))
    explicit_keys: frozenset = field(factory=frozenset, metadata={**doc("the keys the recipe set (filled in when read)"), "internal": True})
    freeze_vision_tower: bool = field(default=False, metadata=doc(
        "vision-language models: keep the vision tower (and its merger) at its initial weights; only the language "
        "model trains. Ignored for text-only models"))
    cpu_offload: bool = field(default=False, metadata=doc("keep sharded params, grads and optimizer state in CPU memory (FSDP2 CPUOffloadPolicy; CUDA only)"))
    sequence_parallel: bool = field(default=False, metadata=doc("shard norms and residuals over the sequence on the tensor-parallel ranks (needs tensor_parallel_size > 1)"))
    activation_checkpointing: bool = field(default=False, metadata=doc("recompute each decoder layer's activations in the backward pass"))
    tensor_parallel_size: int = field(default=1, validator=_positive, metadata=doc("tensor-parallel ranks (DTensor parallelize_module)"))
    context_parallel_size: int = field(default=1, validator=_positive, metadata=doc("context-parallel ranks; only 1 is supported by this backend"))
    custom_parallel_plan: str | None = field(default=None, metadata=doc(
        "'module:attr' naming a dict {module pattern: ParallelStyle} or a callable(model) -> dict, "
        "used instead of the built-in tensor-parallel plan"))
    reshard_after_forward: bool | None = field(default=None, metadata=doc(
        "free gathered params after forward (ZeRO-3); false keeps them until backward (ZeRO-2 like); "
        "default: true with several data-parallel ranks, false with one (nothing to free)"))
    defer_grad_sync: bool | None = field(default=None, metadata=doc(
        "accumulate unsharded fp32 gradients over a step's micro-batches and reduce-scatter once, after the last "
        "(fewer collectives and hook work per micro-batch, a full gradient copy more memory per rank); "
        "default: on with one data-parallel rank (no memory cost), off otherwise; never with cpu_offload"))
    compile: bool = field(default=False, metadata=doc("torch.compile each decoder layer's forward (fuses norm/rotary/SwiGLU ops; the first steps compile)"))
    logprob_chunk_tokens: int = field(default=1024, validator=_positive, metadata=doc("rows of the logits turned into float32 log-softmax at a time"))
    experimental: DTensorExperimentalConfig = field(factory=DTensorExperimentalConfig, metadata=doc(
        "experimental: switches kept to measure alternatives; the defaults are the measured best"))

    def __attrs_post_init__(self) -> None:
        if self.context_parallel_size != 1:
            raise ConfigError(
                f"{SECTION}.context_parallel_size",
                f"is {self.context_parallel_size}, but the fsdp2 backend supports only 1 (packed sequences would need "
                "varlen ring attention); use policy.megatron_cfg for context parallelism",
            )
        if self.sequence_parallel and self.tensor_parallel_size == 1:
            raise ConfigError(f"{SECTION}.sequence_parallel", "needs tensor_parallel_size > 1 (it shards over the tensor-parallel ranks)")
        if self.custom_parallel_plan is not None and ":" not in self.custom_parallel_plan:
            raise ConfigError(f"{SECTION}.custom_parallel_plan", f"expected 'module:attr', got {self.custom_parallel_plan!r}")


def apply_auto_layout(cfg: DTensorConfig, run, hf_config: dict, world_size: int, device: str, *, local_ranks: int | None = None,
                      report=print) -> DTensorConfig:
    """``layout: auto``: the planner's fastest fitting layout (rlcore.planning.runtime) for ``world_size`` ranks;
    the keys the section sets are kept. Rank-independent, so every rank takes the same one."""
    if cfg.layout != "auto":
        return cfg
    from rlcore.runtime import choose_layout, describe_layout

    best, runner_up = choose_layout(run, hf_config, world_size, device, local_ranks=local_ranks)
    lay = best.layout
    report(f"rlcore-fsdp2: {describe_layout(best, runner_up, world_size)}")
    return attrs.evolve(cfg, tensor_parallel_size=lay.tp, sequence_parallel=lay.sp, activation_checkpointing=lay.recompute != "none",
                        cpu_offload=lay.offload)
