"""The contract of ``policy.generation``: what every generator's section has, and all the core reads.

Every generator plugin's ``config_cls`` extends :class:`GenerationConfig` (checked when it
registers; a generator registered without one gets this base schema). The run loop reads the
sampling keys and ``refit``; the placement planner reads ``colocated``. Plugins add their own keys
in their subclass; core never reads those. The sampling keys' defaults are the same for every generator
(``max_new_tokens``: :data:`DEFAULT_MAX_NEW_TOKENS`), so a recipe means the same with any of them.
Imports no torch.
"""

from __future__ import annotations

from typing import Literal

import attrs
from attrs import field, frozen

from rlcore.config.structure import doc

_positive = attrs.validators.gt(0)
# Every generator's default response length (its schema extends GenerationConfig and keeps this).
DEFAULT_MAX_NEW_TOKENS = 256
# An engine's share of a GPU when the recipe says auto and the run made no memory plan (a model shape the planner
# cannot read, or a generator built outside a run): vLLM's own default less the room a colocated trainer needs.
UNPLANNED_ENGINE_FRACTION = 0.5
_non_negative = attrs.validators.ge(0)


def fraction(instance, attribute, value):
    """attrs validator: ``value`` in (0, 1]."""
    if not 0.0 < value <= 1.0:
        raise ValueError(f"{attribute.name} must be in (0, 1], got {value}")


def fraction_or_auto(instance, attribute, value):
    """attrs validator: ``"auto"`` or a fraction in (0, 1]."""
    if value != "auto":
        fraction(instance, attribute, value)


def _top_k(instance, attribute, value):
    if value == 0 or value < -1:
        raise ValueError(f"top_k must be -1 (off) or positive, got {value}")


@frozen
class GenerationResources:
    """The devices generation gets of its own; read only when ``colocated.enabled`` is false (the
    key path is NeMo-RL's)."""

    gpus_per_node: int = field(default=0, validator=_non_negative, metadata=doc("GPUs per node for generation when not colocated; 0 = CPU"))
    num_nodes: int = field(default=1, validator=_positive, metadata=doc("nodes for generation when not colocated"))


@frozen
class ColocatedConfig:
    """Whether generation shares the trainer's devices."""

    enabled: bool = field(default=True, metadata=doc("share the trainer's devices (the generator sleeps while it trains)"))
    resources: GenerationResources = field(factory=GenerationResources, metadata=doc("generation's own devices when enabled is false"))
    offload_trainer_state: bool | Literal["auto"] = field(default="auto", metadata=doc(
        "move the trainer's optimizer state and gradients to host memory while the engines are awake (after each "
        "training phase, back before the next), for models whose training state and engine do not fit one GPU "
        "together; costs two host copies of that state a step (timed as timing/offload: seconds a step for a "
        "model of a few billion parameters); synchronous GRPO with colocated engines only. auto: on when the "
        "run's memory plan needs it (the engine would get less KV cache than a step's sequences need), which "
        "the run's console line says"))


@frozen
class RefitConfig:
    """Weight update after each training step, and its verification."""

    chunk_bytes: int = field(default=1 << 30, validator=_positive, metadata=doc("memory budget of one transferred chunk"))
    # bf16 noise between vLLM's kernels and the trainer's, measured on H200: max |gap| ~0.1 at 1.2B;
    # mean 0.073, max 0.33 at 8B (max alike with Megatron and FSDP2); a wrong weight layout gives ~1.
    probe_threshold: float = field(default=0.15, validator=_positive, metadata=doc("fail when the probe's mean |logprob gap| exceeds this"))
    probe_num_sequences: int = field(default=4, validator=_non_negative, metadata=doc("probe sequences scored after each refit; 0 disables"))


@frozen
class GenerationConfig:
    """``policy.generation``: which generator (``backend``), how to sample, placement and refit."""

    backend: str = field(default="", metadata=doc("generator plugin by name"))
    temperature: float = field(default=1.0, validator=_non_negative, metadata=doc("sampling temperature; 0 = greedy"))
    top_p: float = field(default=1.0, validator=fraction, metadata=doc("nucleus sampling"))
    top_k: int = field(default=-1, validator=_top_k, metadata=doc("top-k sampling; -1 disables"))
    max_new_tokens: int = field(default=DEFAULT_MAX_NEW_TOKENS, validator=_positive, metadata=doc("response length limit"))
    stop_strings: tuple[str, ...] = field(default=(), metadata=doc("stop when any is generated (kept out of the response text)"))
    stop_token_ids: tuple[int, ...] = field(default=(), metadata=doc("stop on these ids besides EOS"))
    ignore_eos: bool = field(default=False, metadata=doc("keep generating past EOS (benchmarks)"))
    gpu_memory_utilization: float | Literal["auto"] = field(default="auto", validator=fraction_or_auto, metadata=doc(
        "share of a GPU the engine may take (weights, KV cache, activations, CUDA graphs; vLLM's key). auto: the "
        "run's memory plan gives a colocated engine its weights, overhead and twice the KV cache a step needs at "
        "once, within what the trainer leaves free while the engine is awake less a headroom (0.9 on GPUs of its "
        "own); the run's console line says what it chose. Generators "
        "that size their memory themselves (hf) ignore it"))
    return_routed_experts: bool = field(default=False, metadata=doc(
        "MoE models: the generator reports the experts every MoE layer chose for each token "
        "(GenerationResult.routed_experts), for the trainer's routing replay R3; a generator that cannot refuses it"))
    colocated: ColocatedConfig = field(factory=ColocatedConfig, metadata=doc("placement"))
    refit: RefitConfig = field(factory=RefitConfig, metadata=doc("weight updates and their verification"))

    def engine_in_own_process(self, async_grpo: bool) -> bool:
        """Whether a colocated engine on CUDA runs in a process of its own (``async_grpo``: the one-step-off loop),
        whose CUDA context and workspace then stay on the trainer's GPU while the engine sleeps: the run's memory plan
        counts them. A generator whose engine does overrides this; here, the engine shares the trainer's process."""
        return False

    def engine_memory_fraction(self, planned: float | None) -> float:
        """The engine's share of a GPU: the recipe's ``gpu_memory_utilization``, else the run's plan (``planned``),
        else :data:`UNPLANNED_ENGINE_FRACTION`; every generator that sizes an engine reads it so."""
        if self.gpu_memory_utilization != "auto":
            return float(self.gpu_memory_utilization)
        return planned if planned is not None else UNPLANNED_ENGINE_FRACTION
