"""Schema of ``policy.generation`` when ``backend: vllm``. Imports no torch and no vLLM."""

from __future__ import annotations

from typing import Literal

import attrs
from attrs import field, frozen

from rlcore.config import doc

_positive = attrs.validators.gt(0)
_non_negative = attrs.validators.ge(0)


def _fraction(instance, attribute, value):
    if not 0.0 < value <= 1.0:
        raise ValueError(f"{attribute.name} must be in (0, 1], got {value}")


@frozen
class ColocatedResources:
    """Devices of the engines when they do not share the trainer's."""

    gpus_per_node: int = field(default=0, validator=_non_negative, metadata=doc("GPUs per node for generation; 0 = CPU"))
    num_nodes: int = field(default=1, validator=_positive, metadata=doc("nodes for generation"))


@frozen
class ColocatedConfig:
    """Whether the engines share devices with the trainer."""

    enabled: bool = field(default=True, metadata=doc("share the trainer's devices; engines sleep while it trains"))
    resources: ColocatedResources = field(factory=ColocatedResources, metadata=doc("own devices when not colocated"))
    sleep_level: Literal[1, 2] = field(default=1, metadata=doc(
        "vLLM sleep level while the trainer works: 1 backs the weights up to host memory (any wake-up is safe; "
        "an 8B model's first sleep took 7-15 s on an H200, later ones 0.4 s), 2 discards them (no copy; each wake-up must be followed by a "
        "full refit, which the GRPO loop does)"))


@frozen
class RefitConfig:
    """Weight update after each training step, and its verification."""

    chunk_bytes: int = field(default=1 << 30, validator=_positive, metadata=doc("memory budget of one transferred chunk"))
    # bf16 noise between vLLM's kernels and the trainer's, measured on H200: max |gap| ~0.1 at 1.2B;
    # mean 0.073, max 0.33 at 8B (max alike with Megatron and FSDP2); a wrong weight layout gives ~1.
    probe_threshold: float = field(default=0.15, validator=_positive, metadata=doc("fail when the probe's mean |logprob gap| exceeds this"))
    probe_num_sequences: int = field(default=4, validator=_non_negative, metadata=doc("probe sequences scored after each refit; 0 disables"))
    group_backend: Literal["auto", "gloo", "nccl"] = field(default="auto", metadata=doc("non-colocated broadcast group; auto = nccl on GPU, gloo on CPU"))
    group_host: str = field(default="127.0.0.1", metadata=doc("address of the trainer's sending rank (non-colocated)"))
    timeout_s: float = field(default=600.0, validator=_positive, metadata=doc("limit of one refit"))


@frozen
class VllmConfig:
    """vLLM generation (sync ``LLM`` or ``AsyncLLM``) for rollouts."""

    backend: str = field(default="vllm", metadata=doc("generator plugin; 'vllm' selects this one"))
    async_engine: bool = field(default=False, metadata=doc("AsyncLLM (multi-turn, streaming) instead of the sync LLM"))
    temperature: float = field(default=1.0, validator=_non_negative, metadata=doc("sampling temperature; 0 = greedy"))
    top_p: float = field(default=1.0, validator=_fraction, metadata=doc("nucleus sampling"))
    top_k: int = field(default=-1, metadata=doc("top-k sampling; -1 disables"))
    max_new_tokens: int = field(default=512, validator=_positive, metadata=doc("response length limit"))
    stop_strings: tuple[str, ...] = field(default=(), metadata=doc("stop when any is generated (kept out of the response text)"))
    stop_token_ids: tuple[int, ...] = field(default=(), metadata=doc("stop on these ids besides EOS"))
    ignore_eos: bool = field(default=False, metadata=doc("keep generating past EOS (benchmarks)"))
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = field(default="auto", metadata=doc("engine weights dtype; auto = policy.precision"))
    gpu_memory_utilization: float = field(default=0.5, validator=_fraction, metadata=doc("share of GPU memory vLLM may take"))
    enforce_eager: bool = field(default=False, metadata=doc("no CUDA graphs / torch.compile"))
    tensor_parallel_size: int = field(default=1, validator=_positive, metadata=doc("vLLM tensor parallelism per replica"))
    num_replicas: int = field(default=1, validator=_positive, metadata=doc("data-parallel engine replicas; requests are balanced across them"))
    max_model_len: int | None = field(default=None, metadata=doc("prompt + response limit; None = policy.max_total_sequence_length"))
    prompt_overflow: Literal["truncate", "drop"] = field(default="truncate", metadata=doc("over-long prompts: 'truncate' (keep the last tokens) or 'drop'"))
    colocated: ColocatedConfig = field(factory=ColocatedConfig, metadata=doc("placement"))
    refit: RefitConfig = field(factory=RefitConfig, metadata=doc("weight updates"))
    kv_cache_space_gib: float = field(default=1.0, validator=_positive, metadata=doc("KV cache size on CPU (GiB)"))
    seed: int | None = field(default=None, metadata=doc("engine seed; None = grpo.seed"))
    max_num_seqs: int = field(default=256, validator=_positive, metadata=doc("sequences batched at once per engine"))
    enable_prefix_caching: bool = field(default=True, metadata=doc("reuse KV of shared prefixes (multi-turn, n > 1)"))
    engine_detokenize: bool = field(default=False, metadata=doc("decode text token by token in vLLM's output loop; false = one batched decode per response (always on with stop strings)"))

    def __attrs_post_init__(self):
        if self.backend != "vllm":
            raise ValueError(f"backend must be 'vllm' for this schema, got {self.backend!r}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be at least 2, got {self.max_model_len}")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"top_k must be -1 (off) or positive, got {self.top_k}")
