"""What plugins build and what the run loop calls: the data passed around and the protocols; imports nothing else of rlcore.

Conventions every plugin follows:

- **Tokens, never re-tokenized text**, cross the generator/trainer boundary.
- **Token-aligned per-token values**: for a sequence ``ids`` of length L, ``logprobs[t]`` is
  ``log p(ids[t] | ids[:t])``; ``logprobs[0]`` is 0 and always masked. ``loss_mask[t]`` is 1
  where ``ids[t]`` was produced by the model and should be trained on.
- **Flat packed layout** inside micro-batches (``*_T`` tensors over all tokens of the
  micro-batch, see :mod:`rlcore.data.packing`); losses are written over it.
- **Global normalization**: a loss (and each of its metrics) returned for a micro-batch is that
  micro-batch's *share* of the step value: it is divided by the step's global count of valid
  tokens or sequences (:class:`StepTotals`), so summing over micro-batches and data-parallel
  ranks gives the step value. Backends therefore **sum** gradients over data-parallel ranks.

Optional members: a protocol lists what the run calls on every plugin of its kind. A member the
run calls only when a plugin has it is declared by a small protocol of its own beside it
(:class:`RefillRounds`, :class:`GeneratorMetrics`, :class:`ResumableLogger`, ...), which the run
tests with ``isinstance`` (never ``getattr``/``hasattr`` by name); the kind's docstring says what
the run does without it, and a built-in base class a plugin may subclass
(:class:`rlcore.algorithms.base.AlgorithmBase`) gives the default. The conformance suites
(:mod:`rlcore.testing.conformance`) check the required members by name and the optional ones a
plugin has.

The protocols are split by part (:mod:`rlcore.interfaces.data`, :mod:`rlcore.interfaces.training`,
:mod:`rlcore.interfaces.generation`, :mod:`rlcore.interfaces.loggers`) and all importable from here.

What a plugin may import (the public API; ``examples/ddp_backend_plugin`` and
``examples/hf_static_generator_plugin`` are built on it alone): this module; the package's
``__all__`` (``hookimpl`` for the hooks of :mod:`rlcore.hookspecs`, ``get_plugin_manager``,
``build_config``); :mod:`rlcore.config` (its ``__all__``, and the schema classes of :mod:`rlcore.config.schema` that ``RunConfig.policy`` holds); for training
backends :mod:`rlcore.data.packing` (``make_micro_batches``, ``step_totals``, ``unpack``,
``MicroBatch``), :func:`rlcore.training.ops.token_logprobs`, :mod:`rlcore.training.steps`, :mod:`rlcore.training.schedule`
(``policy.scheduler`` as a ``LambdaLR`` factor), :func:`rlcore.algorithms.base.merge_metrics` and
:func:`rlcore.algorithms.base.token_advantages` (a backend that captures the loss runs its finiteness check on the host);
:mod:`rlcore.training.weights` (chunks, the gather to rank 0, ``stream_into``, the Hugging Face writer);
:mod:`rlcore.data.multimodal` (image prompts, multimodal positions; :class:`ImageInputs` is here) for vision-language models;
:mod:`rlcore.testing` in tests. Names starting with ``_`` and :mod:`rlcore.controller` are not.

This package imports no torch at import time.
"""

from __future__ import annotations

from rlcore.interfaces.data import (
    EnvStep,
    GenerationResult,
    ImageInputs,
    Named,
    NamedTensors,
    PackedMicroBatch,
    Placement,
    plugin_name,
    PreferenceDataset,
    PreferencePair,
    PromptDataset,
    Sample,
    SamplingParams,
    SequenceBatch,
    StepTotals,
    WorldInfo,
)
from rlcore.interfaces.training import (
    Algorithm,
    CapturableLoss,
    CriticAlgorithm,
    CriticHandle,
    OffloadingBackend,
    OldLogprobsChoice,
    PairTrainer,
    RefillRounds,
    TrainerHandle,
    TrainingBackend,
)
from rlcore.interfaces.generation import (
    AsyncTokenGenerator,
    ClosableEnvironment,
    Environment,
    EnvironmentSession,
    Generator,
    GeneratorMetrics,
    ImageGenerator,
    SessionEnvironment,
    Teacher,
    TrajectoryTurns,
    WeightTransport,
)
from rlcore.interfaces.loggers import (
    MetricLogger,
    ResumableLogger,
    RolloutTableLogger,
)

__all__ = [
    "Algorithm",
    "AsyncTokenGenerator",
    "CapturableLoss",
    "ClosableEnvironment",
    "CriticAlgorithm",
    "CriticHandle",
    "Environment",
    "EnvironmentSession",
    "EnvStep",
    "GenerationResult",
    "Generator",
    "GeneratorMetrics",
    "ImageGenerator",
    "ImageInputs",
    "MetricLogger",
    "Named",
    "NamedTensors",
    "OffloadingBackend",
    "OldLogprobsChoice",
    "PackedMicroBatch",
    "PairTrainer",
    "Placement",
    "plugin_name",
    "PreferenceDataset",
    "PreferencePair",
    "PromptDataset",
    "RefillRounds",
    "ResumableLogger",
    "RolloutTableLogger",
    "Sample",
    "SamplingParams",
    "SequenceBatch",
    "SessionEnvironment",
    "StepTotals",
    "Teacher",
    "TrainerHandle",
    "TrainingBackend",
    "TrajectoryTurns",
    "WeightTransport",
    "WorldInfo",
]
