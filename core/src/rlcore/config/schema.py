"""The core's part of a run configuration. Plugins own the rest.

A recipe is one YAML document. The keys below belong to rlcore itself; the sections a plugin
registers (``policy.dtensor_cfg``, ``policy.megatron_cfg``, ``policy.generation``,
``algorithm``, ``data``, ``env.<name>``, ``logger.<name>``) are validated by that plugin's
schema and reached through :meth:`RunConfig.section`.
"""

from __future__ import annotations

from typing import Any, Literal

import attrs
from attrs import field, frozen

from rlcore.config.generation import GenerationConfig
from rlcore.config.structure import ConfigError, doc
from rlcore.config.traces import RolloutTracesConfig

_positive = attrs.validators.gt(0)
_non_negative = attrs.validators.ge(0)


def _betas(instance, attribute, value) -> None:
    if not all(0.0 <= b < 1.0 for b in value):
        raise ValueError(f"'{attribute.name}' must both be in [0, 1) (Adam's moving-average factors), got {list(value)}")


def _window(instance, attribute, value) -> None:
    if value is not None and not 1 <= value[0] <= value[1]:
        raise ValueError(f"'{attribute.name}' must be [first, last] steps with 1 <= first <= last, got {list(value)}")


@frozen
class OptimizerConfig:
    """AdamW settings used by backends that do not bring their own optimizer block."""

    lr: float = field(default=1e-6, validator=_positive, metadata=doc("peak learning rate"))
    min_lr: float = field(default=0.0, validator=_non_negative, metadata=doc("floor of the decay schedule"))
    weight_decay: float = field(default=0.01, validator=_non_negative, metadata=doc("decoupled weight decay"))
    betas: tuple[float, float] = field(default=(0.9, 0.999), validator=_betas, metadata=doc("Adam beta1, beta2, each in [0, 1)"))
    eps: float = field(default=1e-8, validator=_positive, metadata=doc("Adam epsilon"))


@frozen
class SchedulerConfig:
    """Learning-rate schedule in optimizer steps."""

    warmup_steps: int = field(default=0, validator=_non_negative, metadata=doc("linear warmup from 0"))
    decay_style: Literal["constant", "linear", "cosine"] = field(default="constant", metadata=doc("after warmup"))
    decay_steps: int | None = field(default=None, metadata=doc("steps to reach min_lr; None = train.max_num_steps"))


@frozen
class SequencePackingConfig:
    """Pack variable-length sequences into micro-batches of at most N tokens (core packer)."""

    enabled: bool = field(default=True, metadata=doc("pack sequences (else pad per micro-batch)"))
    train_mb_tokens: int = field(default=4096, validator=_positive, metadata=doc("token budget per training micro-batch"))
    logprob_mb_tokens: int = field(default=8192, validator=_positive, metadata=doc("token budget per logprob micro-batch"))


@frozen
class LoraConfig:
    """Low-rank adapters on the policy (fsdp2 backend through ``peft``; megatron backend): only the adapters train."""

    enabled: bool = field(default=False, metadata=doc("train LoRA adapters instead of the full model"))
    rank: int = field(default=8, validator=_positive, metadata=doc("adapter rank r"))
    alpha: float = field(default=16.0, validator=_positive, metadata=doc("scaling: the update is (alpha / r) * B A"))
    dropout: float = field(default=0.0, validator=[_non_negative, attrs.validators.lt(1.0)],
                           metadata=doc("dropout on the adapters' input"))
    target_modules: tuple[str, ...] = field(
        default=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
        metadata=doc("Hugging Face names of the linear layers that get adapters (megatron also takes linear_qkv, "
                     "linear_proj, linear_fc1, linear_fc2; a fused layer gets one adapter per projection named)"))


@frozen
class PolicyConfig:
    """The model being trained; backend and generator blocks are plugin sections inside it."""

    model_name: str = field(metadata=doc("Hugging Face model: a local directory or a hub id (passed to transformers as is)"))
    tokenizer_name: str | None = field(default=None, metadata=doc("tokenizer directory; None = model_name"))
    max_total_sequence_length: int = field(default=1024, validator=_positive, metadata=doc("prompt + response limit"))
    overlong_prompts: Literal["drop", "error"] = field(
        default="drop", metadata=doc("prompts leaving no room for a response within max_total_sequence_length: dropped at load (counted, first rows named) or an error"),
    )
    precision: Literal["float32", "bfloat16", "float16", "float64"] = field(default="bfloat16", metadata=doc("training dtype"))
    train_global_batch_size: int | None = field(
        default=None, validator=attrs.validators.optional(_positive),
        metadata=doc("sequences per optimizer step; None = all of a step's rollouts"),
    )
    train_micro_batch_size: int = field(default=4, validator=_positive, metadata=doc("sequences per micro-batch without packing"))
    logprob_batch_size: int = field(default=8, validator=_positive, metadata=doc("sequences per logprob micro-batch without packing"))
    max_grad_norm: float | None = field(default=1.0, validator=attrs.validators.optional(_positive),
                                        metadata=doc("gradient clipping at this norm (> 0); None disables"))
    optimizer: OptimizerConfig = field(factory=OptimizerConfig, metadata=doc("AdamW"))
    scheduler: SchedulerConfig = field(factory=SchedulerConfig, metadata=doc("learning-rate schedule"))
    sequence_packing: SequencePackingConfig = field(factory=SequencePackingConfig, metadata=doc("packing"))
    lora: LoraConfig = field(factory=LoraConfig, metadata=doc("LoRA adapters (refit and export send merged weights)"))


@frozen
class AsyncConfig:
    """Overlap generation of step k+1 with training of step k."""

    enabled: bool = field(default=False, metadata=doc("async rollouts"))
    max_trajectory_age_steps: int = field(default=1, validator=_positive, metadata=doc("oldest policy version a trained trajectory may come from"))


@frozen
class TrainConfig:
    """What every trainer reads (section ``train``; GRPO, PPO, distillation, SFT, DPO, the reward model):
    how long the run is, how much data a step takes, when it validates, its seed, and when
    non-finite losses stop it."""

    max_num_steps: int = field(default=100, validator=_positive, metadata=doc("steps to run"))
    num_prompts_per_step: int = field(default=32, validator=_positive, metadata=doc(
        "P prompts drawn per step (sft: examples; dpo, reward_model: preference pairs)"))
    val_period: int = field(default=0, validator=_non_negative, metadata=doc("validate every N steps; 0 disables"))
    val_at_start: bool = field(default=False, metadata=doc("validate before the first step"))
    max_val_samples: int = field(default=256, validator=_positive, metadata=doc("held-out prompts (examples, pairs) per validation"))
    seed: int = field(default=42, validator=[_non_negative, attrs.validators.lt(2**32)],
                      metadata=doc("seed of data order, sampling and init (0 to 2**32-1: numpy's range)"))
    deterministic: bool = field(default=False, metadata=doc("deterministic kernels and sampling (resume equals uninterrupted)"))
    max_consecutive_nonfinite: int = field(default=3, validator=_positive, metadata=doc(
        "stop after this many steps in a row whose loss was not finite (their updates are skipped)"))


@frozen
class LoopConfig:
    """The rollout loop's own settings (section ``grpo``): the algorithms that sample a group of
    responses per prompt and score them (GRPO and its variants, PPO, distillation). The keys every
    trainer reads are under ``train``."""

    num_generations_per_prompt: int = field(default=8, validator=_positive, metadata=doc("G samples per prompt"))
    async_grpo: AsyncConfig = field(factory=AsyncConfig, metadata=doc("async mode"))
    summary_window: tuple[int, int] | None = field(default=None, validator=_window, metadata=doc("steps [first, last] averaged in the final summary (1 <= first <= last); None = all but the first"))


@frozen
class ClusterConfig:
    """Where the run's processes go."""

    num_nodes: int = field(default=1, validator=_positive, metadata=doc("nodes"))
    gpus_per_node: int = field(default=0, validator=_non_negative, metadata=doc("GPUs per node; 0 = CPU run"))
    cpu_workers: int = field(default=1, validator=_positive, metadata=doc("trainer processes on a CPU run"))
    use_ray: bool | None = field(default=None, metadata=doc("None = Ray when more than one process is needed"))
    ray_address: str | None = field(default=None, metadata=doc("existing Ray cluster; None = RAY_ADDRESS or a local instance, which listens on 127.0.0.1 only, dashboard off (no other machine can join it; no job or state API)"))
    timeout_s: float = field(default=1800.0, validator=_positive, metadata=doc("limit of any single blocking wait"))
    exit_timeout_s: float = field(default=300.0, validator=_positive, metadata=doc("once `rlcore run` has ended (summary written, or failed): how long its process may take to exit (threads, atexit handlers) before it prints every thread's stack and exits with the run's status"))
    gc_period: int = field(default=1, validator=_non_negative, metadata=doc("Python's garbage collector during the run: N > 0 moves the objects alive at the start (models, the engine's front end, modules) out of its reach (gc.freeze), turns automatic collection off and runs one full collection after every N steps' training, so that the collection, which stops every thread of the process, comes where the run chooses (one step off's threads otherwise meet automatic collections many times a step); 0 leaves the collector as Python runs it. Restored when the run ends"))
    placement_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = field(
        default="PACK", metadata=doc("Ray placement group of the trainer ranks (one bundle per rank): as few nodes as possible, as many, one node, one node per rank"),
    )


@frozen
class CheckpointingConfig:
    enabled: bool = field(default=False, metadata=doc("write checkpoints"))
    checkpoint_dir: str | None = field(default=None, metadata=doc("where; None = <logger.log_dir>/checkpoints, so a run resumes only its own"))
    save_period: int = field(default=10, validator=_positive, metadata=doc("every N steps"))
    keep_last_k: int = field(default=2, validator=_positive, metadata=doc("this run's older checkpoints are deleted (never another run's, nor a step_N directory, file or link it did not write)"))
    resume: bool = field(default=True, metadata=doc("continue from the newest checkpoint that loads, if any (it must be this run's: the same config but run length, logging, checkpointing, validation and cluster keys)"))


@frozen
class EnvConfig:
    """Which environment scores the rollouts; its settings live in ``env.<name>``."""

    name: str = field(default="math", metadata=doc("registered environment (unused when env.reward_fn is set)"))
    reward_fn: str | None = field(
        default=None, metadata=doc("'module:function': a plain reward function fn(prompts, completions, **kwargs) -> "
                                   "list[float] (TRL's signature) scores the rollouts instead of env.name (rlcore.data.reward_fn)"),
    )
    on_timeout: Literal["stop", "zero"] = field(
        default="stop", metadata=doc("an environment call over cluster.timeout_s stops the run, or scores its batch (a multi-turn or session call: its trajectory) 0, counted in env/timeout"),
    )


@frozen
class LoggerConfig:
    """Where metrics go; each logger plugin has a section ``logger.<name>``."""

    log_dir: str = field(default="runs/latest", metadata=doc("metrics, plots, resolved config"))
    print_table: bool = field(default=True, metadata=doc("print the per-step timing table"))
    plot: bool = field(default=True, metadata=doc("write curves.png (train reward and held-out accuracy by step) when the run ends; "
                                                   "needs matplotlib (about 1 s)"))
    verbosity: Literal["quiet", "verbose"] = field(
        default="quiet", metadata=doc("quiet: the libraries underneath (vLLM, transformers, Ray, torch.distributed) print "
                                      "errors only; verbose: their own INFO logs and progress bars too (rlcore run --verbose)"),
    )
    rollouts: RolloutTracesConfig = field(factory=RolloutTracesConfig, metadata=doc("rollout traces (rlcore.loggers.traces)"))


@frozen
class ExperimentalConfig:
    """Experimental settings (section ``experimental``): measurement probes and GPU-sharing knobs whose
    benefit is not established or depends on the host. They may change or go without notice."""

    gil_lag_probe: bool = field(default=False, metadata=doc("a thread that sleeps 5 ms at a time records how late it wakes, i.e. how long a thread of this process waits for the interpreter lock: time/gil_lag_mean_s and time/gil_lag_max_s with each step"))
    trainer_mps_priority: Literal["normal", "below_normal"] | None = field(default=None, metadata=doc("one GPU shared by the trainer and a resident vLLM engine (one step off): the trainer's CUDA context is created as a client of the running MPS daemon (nvidia-cuda-mps-control -d) at this priority, the engine's at normal; below_normal with policy.megatron_cfg.gemm_sm_margin at half the SMs lets the engine keep its speed beside the trainer. None = CUDA as it comes (rlcore.controller.mps_client)"))


@frozen
class RunConfig:
    """A whole run. Plugin-owned sections are in ``sections`` by dotted path."""

    policy: PolicyConfig
    train: TrainConfig = field(factory=TrainConfig)
    grpo: LoopConfig = field(factory=LoopConfig)
    cluster: ClusterConfig = field(factory=ClusterConfig)
    checkpointing: CheckpointingConfig = field(factory=CheckpointingConfig)
    env: EnvConfig = field(factory=EnvConfig)
    logger: LoggerConfig = field(factory=LoggerConfig)
    experimental: ExperimentalConfig = field(factory=ExperimentalConfig)
    sections: dict[str, Any] = field(factory=dict, metadata={**doc("plugin sections by dotted path"), "internal": True})

    def section(self, path: str, default: Any = None) -> Any:
        """The structured plugin section at ``path`` (e.g. ``policy.megatron_cfg``)."""
        return self.sections.get(path, default)

    @property
    def generation(self) -> GenerationConfig:
        """``policy.generation`` as its contract (the base schema's defaults when the recipe has no
        such section, e.g. a generator object passed to ``rlcore.run``). Core reads the section only
        through this: a section of another type is refused here, naming the key."""
        section = self.sections.get("policy.generation")
        if section is None:
            return GenerationConfig()
        if not isinstance(section, GenerationConfig):
            raise ConfigError("policy.generation", f"the section is a {type(section).__name__}, not a "
                              "rlcore.config.GenerationConfig (every generator's schema must extend it)")
        return section

    def require_section(self, path: str) -> Any:
        if path not in self.sections:
            raise ConfigError(path, "this section is required for the run but the recipe does not set it")
        return self.sections[path]
