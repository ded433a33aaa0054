"""Schema of ``policy.generation`` when ``backend: sglang``. Imports no torch and no SGLang.

The sampling keys, ``colocated``, ``refit`` and ``gpu_memory_utilization`` are core's
(:class:`rlcore.config.GenerationConfig`); ``gpu_memory_utilization`` (the recipe's number, else the
run's memory plan) becomes SGLang's ``mem_fraction_static``. Keys that mean the same as the ``vllm``
generator's have its names (``enforce_eager``, ``colocated.sleep_level``, ``max_model_len``,
``prompt_overflow``), so a recipe switches engines with ``policy.generation.backend`` alone.
"""

from __future__ import annotations

from typing import Literal

import attrs
from attrs import field, frozen

from rlcore.config import GenerationConfig, doc
from rlcore.config import generation as core

_positive = attrs.validators.gt(0)


@frozen
class ColocatedConfig(core.ColocatedConfig):
    """Whether the engine shares devices with the trainer, and how it frees them while the trainer works."""

    sleep_level: Literal[0, 1, 2] = field(default=1, metadata=doc(
        "what the engine gives back while the trainer works (SGLang's release_memory_occupation of its 'weights' and "
        "'kv_cache'): 0 keeps the engine resident (no memory saver; both must fit one GPU beside the trainer), 1 releases "
        "both and keeps a host copy of the weights (enable_weights_cpu_backup: any wake-up is safe), 2 releases both "
        "without a copy (each wake-up must be followed by a full refit, which the GRPO loop does)"))


@frozen
class SglangConfig(GenerationConfig):
    """SGLang generation (its offline ``Engine``: tokenizer manager in this process, scheduler and
    detokenizer in processes of their own) for rollouts, scoring and in-place refit."""

    backend: str = field(default="sglang", metadata=doc("generator plugin; 'sglang' selects this one"))
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = field(default="auto", metadata=doc(
        "engine weights dtype; auto = policy.precision (refit sends this dtype)"))
    tp_size: int = field(default=1, validator=_positive, metadata=doc("SGLang tensor parallelism (GPUs of one engine)"))
    enforce_eager: bool = field(default=False, metadata=doc(
        "no CUDA graphs (SGLang's disable_cuda_graph): a faster start, slower decoding"))
    max_model_len: int | None = field(default=None, metadata=doc(
        "prompt + response limit (SGLang's context_length); None = policy.max_total_sequence_length"))
    prompt_overflow: Literal["truncate", "drop"] = field(default="truncate", metadata=doc(
        "over-long prompts: 'truncate' (keep the last tokens) or 'drop'"))
    seed: int | None = field(default=None, metadata=doc("engine seed (SGLang's random_seed); None = train.seed"))
    max_running_requests: int | None = field(default=None, validator=attrs.validators.optional(_positive), metadata=doc(
        "sequences decoded at once; None = SGLang's choice from the KV cache's size"))
    enable_prefix_caching: bool = field(default=True, metadata=doc(
        "SGLang's radix cache: reuse KV of shared prefixes (multi-turn, n > 1); false = disable_radix_cache"))
    log_level: Literal["error", "warning", "info", "debug"] = field(default="error", metadata=doc(
        "SGLang's own logging level (its processes included)"))
    colocated: ColocatedConfig = field(factory=ColocatedConfig, metadata=doc("placement"))

    def engine_in_own_process(self, async_grpo: bool) -> bool:
        return True  # SGLang's scheduler runs in a process of its own

    def __attrs_post_init__(self):
        if self.backend != "sglang":
            raise ValueError(f"backend must be 'sglang' for this schema, got {self.backend!r}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be at least 2, got {self.max_model_len}")
        if self.return_routed_experts:
            raise ValueError("return_routed_experts is not supported by the sglang generator (it does not report the "
                             "experts MoE layers route to); routing replay (R3) needs backend: vllm")
