"""Schema of ``policy.generation`` when ``backend: vllm``. Imports no torch and no vLLM."""

from __future__ import annotations

from typing import Literal

import attrs
from attrs import field, frozen

from rlcore.config import GenerationConfig, doc
from rlcore.config import generation as core
from rlcore.config.generation import fraction

_positive = attrs.validators.gt(0)

# Probe thresholds on the mean |logprob gap| between engine and trainer. bf16: core's default (about
# twice the noise measured between a bf16 engine and trainer at 8B). FP8 rounds weights and activations (per-tensor scales), which
# widens the gap the same probe sees with correct weights; a wrong layout or a stale layer still
# moves the mean to ~1, far above either threshold.
BF16_PROBE_THRESHOLD = 0.15
FP8_PROBE_THRESHOLD = 0.3


@frozen
class ColocatedConfig(core.ColocatedConfig):
    """Whether the engines share devices with the trainer, and how they free them while it trains."""

    sleep_level: Literal[0, 1, 2] = field(default=1, metadata=doc(
        "vLLM sleep level while the trainer works: 0 keeps the engine resident (no sleep mode: weights and KV cache "
        "stay on the GPU beside the trainer, when both fit; several runs can then share one GPU), "
        "1 backs the weights up to host memory (any wake-up is safe; "
        "the first sleep of a large model takes seconds, later ones less than one), 2 discards them (no copy; each wake-up must be followed by a "
        "full refit, which the GRPO loop does)"))


@frozen
class RefitConfig(core.RefitConfig):
    """Core's refit settings plus the non-colocated broadcast group's."""

    group_backend: Literal["auto", "gloo", "nccl"] = field(default="auto", metadata=doc("non-colocated broadcast group; auto = nccl on GPU, gloo on CPU"))
    group_host: str | None = field(default=None, metadata=doc(
        "address of the trainer's sending rank (non-colocated), where the engines join the broadcast group; "
        "None = the address of rank 0's Ray node (127.0.0.1 for a trainer in the driver or on a local Ray instance)"))
    timeout_s: float = field(default=600.0, validator=_positive, metadata=doc("limit of one refit"))
    probe_threshold: float | None = field(
        default=None, validator=attrs.validators.optional(_positive),
        metadata=doc(f"fail when the probe's mean |logprob gap| exceeds this; None = {BF16_PROBE_THRESHOLD} "
                     f"(bf16 engine) or {FP8_PROBE_THRESHOLD} (quantization: fp8)"))


@frozen
class VllmExperimentalConfig:
    """Experimental: switches that exist to measure an alternative against the default. The
    defaults are the settings measured best; these keys may change or go without notice."""

    executor: Literal["auto", "uni", "mp"] = field(default="auto", metadata=doc(
        "vLLM's executor (distributed_executor_backend): uni = the model runs in the engine process; mp = in a worker "
        "process, which busy-waits for about a second after each engine call; auto = vLLM's choice"))
    engine_process: bool | None = field(default=None, metadata=doc(
        "run vLLM's engine core (scheduler and model runner) in its own process; None = on CUDA, in this process for "
        "colocated sync runs (refit hands tensors over directly) and in its own process for async runs (the rollout "
        "thread would share this process's interpreter lock with the trainer, and both launch kernels from Python) and "
        "for engines on their own GPUs (which must pick their devices before CUDA starts here); on CPU, vLLM's default "
        "(its own process)"))
    request_seeds: bool = field(default=True, metadata=doc(
        "give each request its own seed (from the run's seed), so a sample repeats whatever batch it was scheduled in; "
        "false = only the engine's seed (vLLM draws a seeded request's sampling noise one request at a time in each "
        "decode step, which costs host time with many short sequences)"))
    engine_detokenize: bool = field(default=False, metadata=doc(
        "decode text token by token in vLLM's output loop; false = one batched decode per response (always on with "
        "stop strings)"))


@frozen
class VllmConfig(GenerationConfig):
    """vLLM generation (sync ``LLM`` or ``AsyncLLM``) for rollouts; the sampling keys, ``colocated``
    and ``refit`` are core's (:class:`rlcore.config.GenerationConfig`)."""

    backend: str = field(default="vllm", metadata=doc("generator plugin; 'vllm' selects this one"))
    async_engine: bool = field(default=False, metadata=doc("AsyncLLM (multi-turn, streaming) instead of the sync LLM"))
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = field(default="auto", metadata=doc("engine weights dtype; auto = policy.precision"))
    enforce_eager: bool | None = field(default=None, metadata=doc(
        "no CUDA graphs / torch.compile; null: eager on CPU (vLLM's Inductor compile adds 10-25 s to each engine start "
        "on 2 cores and decodes the tiny CPU models no faster), compiled with CUDA graphs on a GPU"))
    tensor_parallel_size: int = field(default=1, validator=_positive, metadata=doc("vLLM tensor parallelism per replica"))
    num_replicas: int = field(default=1, validator=_positive, metadata=doc("data-parallel engine replicas; requests are balanced across them"))
    max_model_len: int | None = field(default=None, metadata=doc("prompt + response limit; None = policy.max_total_sequence_length"))
    prompt_overflow: Literal["truncate", "drop"] = field(default="truncate", metadata=doc("over-long prompts: 'truncate' (keep the last tokens) or 'drop'"))
    colocated: ColocatedConfig = field(factory=ColocatedConfig, metadata=doc("placement"))
    refit: RefitConfig = field(factory=RefitConfig, metadata=doc("weight updates"))
    kv_cache_space_gib: float = field(default=1.0, validator=_positive, metadata=doc("KV cache size on CPU (GiB)"))
    gpu_kv_cache_gib: float | None = field(
        default=None, validator=attrs.validators.optional(_positive),
        metadata=doc("KV cache size on GPU (GiB); set = vLLM skips its memory profiling, whose check fails while "
                     "another process on the same GPU frees memory (several runs sharing one GPU); None = sized from gpu_memory_utilization"))
    seed: int | None = field(default=None, metadata=doc("engine seed; None = train.seed"))
    max_num_seqs: int = field(default=256, validator=_positive, metadata=doc("sequences batched at once per engine"))
    enable_prefix_caching: bool = field(default=True, metadata=doc("reuse KV of shared prefixes (multi-turn, n > 1)"))
    quantization: Literal["none", "fp8"] = field(default="none", metadata=doc(
        "fp8: vLLM's online FP8 quantization (per-tensor W8A8, CUDA only): the engine quantizes the bf16 weights as they load, "
        "at start and at every refit; pair it with algorithm.rollout_correction {preset: token_tis} (the probe threshold "
        "defaults to the FP8 one)"))
    kv_cache_dtype: Literal["auto", "fp8"] = field(default="auto", metadata=doc(
        "KV cache storage: auto = the engine dtype; fp8 halves the cache's memory and the bytes each decode step reads "
        "(CUDA only; per-tensor scales of 1.0, as vLLM does without calibrated scales)"))
    experimental: VllmExperimentalConfig = field(factory=VllmExperimentalConfig, metadata=doc(
        "experimental: switches kept to measure alternatives; the defaults are the measured best"))

    def engine_in_own_process(self, async_grpo: bool) -> bool:
        """AsyncLLM's engine core always runs in a process of its own; the sync engine's process is
        :func:`rlcore_vllm.generator.engine_in_own_process`'s choice, as the generator starts it."""
        from rlcore_vllm.generator import engine_in_own_process

        return self.async_engine or bool(engine_in_own_process(self.experimental.engine_process, device="cuda",
                                                                colocated=True, async_grpo=async_grpo))

    def __attrs_post_init__(self):
        if self.backend != "vllm":
            raise ValueError(f"backend must be 'vllm' for this schema, got {self.backend!r}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be at least 2, got {self.max_model_len}")
        if self.refit.probe_threshold is None:  # resolved here so that the run loop reads one number
            threshold = FP8_PROBE_THRESHOLD if self.quantization == "fp8" else BF16_PROBE_THRESHOLD
            object.__setattr__(self, "refit", attrs.evolve(self.refit, probe_threshold=threshold))
