"""What plugins build and what the run loop calls: the data passed around and the protocols.

Conventions every plugin follows:

- **Tokens, never re-tokenized text**, cross the generator/trainer boundary.
- **Token-aligned per-token values**: for a sequence ``ids`` of length L, ``logprobs[t]`` is
  ``log p(ids[t] | ids[:t])``; ``logprobs[0]`` is 0 and always masked. ``loss_mask[t]`` is 1
  where ``ids[t]`` was produced by the model and should be trained on.
- **Flat packed layout** inside micro-batches (``*_T`` tensors over all tokens of the
  micro-batch, see :mod:`rlcore.packing`); losses are written over it.
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

What a plugin may import (the public API; ``examples/ddp_backend_plugin`` and
``examples/hf_static_generator_plugin`` are built on it alone): this module; the package's
``__all__`` (``hookimpl`` for the hooks of :mod:`rlcore.hookspecs`, ``get_plugin_manager``,
``build_config``); :mod:`rlcore.config` (its ``__all__``, and the schema classes of :mod:`rlcore.config.schema` that ``RunConfig.policy`` holds); for training
backends :mod:`rlcore.packing` (``make_micro_batches``, ``step_totals``, ``unpack``,
``MicroBatch``), :func:`rlcore.ops.token_logprobs`, :mod:`rlcore.training`, :mod:`rlcore.schedule`
(``policy.scheduler`` as a ``LambdaLR`` factor), :func:`rlcore.algorithms.base.merge_metrics` and
:func:`rlcore.algorithms.base.token_advantages` (a backend that captures the loss runs its finiteness check on the host);
:mod:`rlcore.weights` (chunks, the gather to rank 0, ``stream_into``, the Hugging Face writer);
:mod:`rlcore.multimodal` (``ImageInputs``, image prompts, multimodal positions) for vision-language models;
:mod:`rlcore.testing` in tests. Names starting with ``_`` and :mod:`rlcore.controller` are not.

This module imports no torch at import time.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

import attrs

if TYPE_CHECKING:
    import torch

    from rlcore.multimodal import ImageInputs

NamedTensors = list[tuple[str, "torch.Tensor"]]


# ---- data ------------------------------------------------------------------------------------
@attrs.define
class Sample:
    """One prompt of a dataset, with what the environment needs to score answers to it."""

    prompt: str | list[dict[str, str]]  # plain text, or chat messages
    answer: Any = None  # ground truth, for the environment
    prompt_ids: list[int] | None = None  # filled by the dataset (chat template applied)
    metadata: dict[str, Any] = attrs.field(factory=dict)
    index: int = -1  # position in its dataset (data-order resume)
    response: str | None = None  # a reference response (the ``sft`` loop's target); None: ``str(answer)``
    # The prompt's processed images (vision-language models, :mod:`rlcore.multimodal`): ``prompt_ids``
    # then hold each image's placeholder tokens. None: a text-only prompt.
    images: ImageInputs | None = None


@attrs.define
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 256  # = rlcore.config.generation.DEFAULT_MAX_NEW_TOKENS (test_config_core checks)
    n: int = 1
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None
    ignore_eos: bool = False


@attrs.define
class GenerationResult:
    """One sampled response. ``response_mask`` is 0 on tokens the model did not write
    (observations spliced in by a multi-turn environment); None means all ones."""

    prompt_ids: list[int]
    response_ids: list[int]
    response_logprobs: list[float]  # generator's logprob of each response token (0 where mask is 0)
    finish_reason: str  # "stop", "length", "abort", or "truncated_prompt"
    text: str = ""
    response_mask: list[int] | None = None
    policy_version: int = 0
    num_turns: int = 1
    # Mixture-of-experts generators that report their routing (routing replay R3): an integer array
    # [len(prompt_ids) + len(response_ids) - 1, MoE layers, top-k], the experts each MoE layer chose
    # for every token fed to the model (the last sampled token never is). None: not reported.
    routed_experts: Any = None
    # Earlier segments of an agent's trajectory whose history the agent rewrote (compaction, edits,
    # a dropped ``<think>``): sequences of their own that train with this trajectory's reward and
    # advantage (:mod:`rlcore.agents`). None: one sequence.
    segments: list[GenerationResult] | None = None
    # What an agent's conversation held beyond its tokens, request by request: the messages each
    # request added (tool results among them), the reply and its tool calls (rollout traces,
    # :mod:`rlcore.traces`). None: not recorded.
    turns: list[dict] | None = None

    @classmethod
    def dropped(cls, prompt_ids: list[int], policy_version: int) -> GenerationResult:
        """The empty answer to a prompt the engine's context cannot hold (``prompt_overflow: drop``)."""
        return cls(prompt_ids=list(prompt_ids), response_ids=[], response_logprobs=[], finish_reason="truncated_prompt",
                   policy_version=policy_version)


@attrs.define
class EnvStep:
    """An environment's answer to one trajectory's latest model turn."""

    reward: float = 0.0
    done: bool = True
    observation: str | None = None  # shown to the model as the next user/tool turn when not done
    metrics: dict[str, float] = attrs.field(factory=dict)


@attrs.define
class StepTotals:
    """Global counts of one optimizer step, over every micro-batch and data-parallel rank.

    A backend that replays a captured CUDA graph of the loss passes the same counts as 0-d device
    tensors (float64), refilled before each replay: a Python number would be baked into the graph.
    Losses that declare :class:`CapturableLoss` use them in arithmetic only."""

    num_valid_tokens: int
    num_valid_seqs: int


@attrs.define
class SequenceBatch:
    """The sequences of one training step, on CPU.

    ``input_ids[i]`` is prompt + response of sequence i (1-D int64); ``loss_mask[i]`` matches it.
    ``token_fields`` hold token-aligned per-token floats (``advantages``, ``old_logprobs``,
    ``ref_logprobs``, ``gen_logprobs``); ``seq_fields`` hold one float per sequence
    (``rewards``, ``advantages``).
    """

    input_ids: list[torch.Tensor]
    loss_mask: list[torch.Tensor]
    token_fields: dict[str, list[torch.Tensor]] = attrs.field(factory=dict)
    seq_fields: dict[str, torch.Tensor] = attrs.field(factory=dict)
    # The generator's MoE routing per sequence (routing replay R3): int16 [len, MoE layers, top-k],
    # -1 where it reported none; None when the generator reported no routing.
    routed_experts: list[torch.Tensor] | None = None
    # Each sequence's prompt images (vision-language models), None where it has none; None: a
    # text-only batch. A sequence's image placeholder tokens in ``input_ids`` match its images.
    images: list[ImageInputs | None] | None = None

    def __len__(self) -> int:
        return len(self.input_ids)

    def lengths(self) -> list[int]:
        return [int(x.numel()) for x in self.input_ids]

    def select(self, indices: Sequence[int]) -> SequenceBatch:
        return SequenceBatch(
            input_ids=[self.input_ids[i] for i in indices],
            loss_mask=[self.loss_mask[i] for i in indices],
            token_fields={k: [v[i] for i in indices] for k, v in self.token_fields.items()},
            seq_fields={k: v[list(indices)] for k, v in self.seq_fields.items()},
            routed_experts=None if self.routed_experts is None else [self.routed_experts[i] for i in indices],
            images=None if self.images is None else [self.images[i] for i in indices],
        )


@attrs.frozen
class Placement:
    """Where a run's trainer and generator go. Computed once by core
    (:func:`rlcore.controller.placement.plan_placement`) and handed, the same object, to the
    backend factory (``WorldInfo.placement``) and to the generator factory."""

    device: Literal["cpu", "cuda"] = "cpu"
    trainer_ranks: int = 1  # trainer processes (GPUs on a GPU run)
    use_ray: bool = False  # trainer ranks are Ray actors (else the one rank runs in the driver)
    colocated: bool = True  # generation shares the trainer's devices
    # When not colocated on GPUs of one node with a local Ray instance: the devices left to generation
    # (as CUDA_VISIBLE_DEVICES names them); the trainer's actors hold the others. Empty otherwise.
    generator_gpus: tuple[str, ...] = ()
    # The run's memory plan (rlcore.planning.run_memory), for recipes that leave these keys auto: the
    # engine's share of a GPU (None: the generator's own choice, or no plan), and whether the trainer's
    # gradients and optimizer state leave the GPU while a colocated engine is awake.
    engine_memory_fraction: float | None = None
    offload_trainer_state: bool = False


@attrs.frozen
class WorldInfo:
    """The process a backend is built in. torch.distributed is initialized before the factory runs."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: Literal["cpu", "cuda"] = "cpu"
    placement: Placement = attrs.field(factory=Placement)


class PackedMicroBatch(Protocol):
    """What a loss reads of one micro-batch in the flat packed layout (``T`` tokens, ``n`` real
    sequences); :class:`rlcore.packing.MicroBatch` is the one backends build and documents each field.
    Declared here so that this module needs nothing of :mod:`rlcore.packing`, which imports it."""

    input_ids_T: torch.Tensor  # int64 [T]
    position_ids_T: torch.Tensor  # int64 [T]
    cu_seqlens: torch.Tensor  # int32 [n+1], host side
    max_seqlen: int
    seq_ids: list[int]  # indices of the n sequences in the SequenceBatch
    seq_index_T: torch.Tensor  # int64 [T], -1 on padding
    loss_mask_T: torch.Tensor  # float [T]
    token_fields: dict[str, torch.Tensor]  # each float [T]
    seq_fields: dict[str, torch.Tensor]  # each [n]
    num_padding: int

    @property
    def num_seqs(self) -> int: ...

    @property
    def num_tokens(self) -> int: ...


# ---- protocols -------------------------------------------------------------------------------
@runtime_checkable
class Named(Protocol):
    """A plugin object with a name of its own for messages: :class:`Algorithm` and
    :class:`WeightTransport` declare one; an :class:`Environment` may (see :func:`plugin_name`)."""

    name: str


def plugin_name(obj: Any) -> str:
    """The name ``obj`` goes by in the run's messages: its ``name`` (:class:`Named`) when that is a
    non-empty string, else its class's name."""
    name = obj.name if isinstance(obj, Named) else None
    return name if isinstance(name, str) and name else type(obj).__name__


@runtime_checkable
class Algorithm(Protocol):
    """Advantage estimation and loss of one RL (or SFT) algorithm.

    Optional members, each declared by its own protocol, with defaults in
    :class:`rlcore.algorithms.base.AlgorithmBase` (which the built-in algorithms subclass):
    ``max_refill_rounds`` (:class:`RefillRounds`; an algorithm without it gets no refill rounds),
    ``capturable_loss`` (:class:`CapturableLoss`; without it no backend captures the loss),
    ``choose_old_logprobs`` (:class:`OldLogprobsChoice`; without it ``uses_old_logprobs`` stands)."""

    name: str
    uses_reference: bool  # the step must compute ref_logprobs
    uses_old_logprobs: bool  # the step must compute old_logprobs (importance ratio)
    loss_level: Literal["token", "sequence"]  # which StepTotals count normalizes the loss

    def shape_rewards(self, rewards_N: torch.Tensor, response_lengths_N: torch.Tensor, truncated_N: torch.Tensor) -> torch.Tensor:
        """Reward shaping before advantages (identity for most; DAPO's overlong penalty)."""

    def keep_trajectories(self, rewards_N: torch.Tensor, group_ids_N: torch.Tensor, truncated_N: torch.Tensor) -> torch.Tensor:
        """Bool [N]: which trajectories to train on (DAPO dynamic sampling/overlong filter)."""

    def advantages(self, rewards_N: torch.Tensor, group_ids_N: torch.Tensor) -> torch.Tensor:
        """Per-sequence advantages [N] from rewards and group ids."""

    def loss(self, logprobs_T: torch.Tensor, mb: PackedMicroBatch,
             totals: StepTotals) -> tuple[torch.Tensor, dict[str, float | torch.Tensor]]:
        """This micro-batch's share of the step loss (see module docstring) and its metrics:
        floats or detached 0-d tensors. Tensors let a backend read all metrics of a step with
        one device sync instead of one per micro-batch (the built-in algorithms return them)."""


@runtime_checkable
class RefillRounds(Protocol):
    """An :class:`Algorithm` that may ask for more rounds of rollouts when it drops whole groups
    (DAPO's dynamic sampling): after a step's first round keeps fewer than P*G trajectories, the
    run generates up to ``max_refill_rounds`` more rounds of P prompts (0: none, the default of
    :class:`rlcore.algorithms.base.AlgorithmBase`; an algorithm without the attribute gets none)."""

    max_refill_rounds: int


@runtime_checkable
class OldLogprobsChoice(Protocol):
    """An :class:`Algorithm` whose old-logprob pass may be skipped: it can take the current
    policy's logprobs, detached, as its importance ratio's denominator, which equals the old
    policy's when each batch trains exactly one optimizer step: the run loop takes the old
    logprobs right before that step, from the weights the step starts at, whichever policy version
    generated the batch (sync or async). ``rlcore.run`` calls :meth:`choose_old_logprobs` once before the run on the algorithm it
    uses, built from the recipe or passed as an object (an algorithm without the method keeps the
    ``uses_old_logprobs`` it declares). The built-in policy-gradient algorithms have it
    (``algorithm.use_old_logprobs: auto``)."""

    def choose_old_logprobs(self, one_update_per_batch: bool) -> bool:
        """Settle ``uses_old_logprobs`` for this run and return it: ``one_update_per_batch`` says
        whether each generated batch trains exactly one optimizer step.
        An algorithm asked explicitly (a config key) keeps its setting."""


@runtime_checkable
class CapturableLoss(Protocol):
    """An :class:`Algorithm` whose ``loss`` a backend may capture once in a CUDA graph and replay
    for other micro-batches of the same shapes (``policy.megatron_cfg.cuda_graph: micro_batch``).
    With ``capturable_loss`` true the loss promises: no host reads of tensor values (``.item()``,
    ``float(t)``, ``bool(t)``, ``.tolist()``, ``nonzero``, boolean-mask indexing or other
    data-dependent shapes) except in checks skipped while :func:`rlcore.algorithms.base.capturing`
    (``core/tests/test_capturable_loss.py`` checks the built-in ones); :class:`StepTotals` used in arithmetic only (it may hold 0-d device tensors); no reads of
    the micro-batch's host-side fields (``cu_seqlens``, ``seq_ids``, ``num_padding``, ``max_seqlen``:
    a graph would keep the captured micro-batch's); the same Python branches for every micro-batch
    with the same fields; metrics as 0-d tensors; and padding
    ignored: tokens with ``loss_mask_T == 0`` and sequences with no tokens (``seq_index_T`` never
    points at them) change neither the loss nor its gradient. The built-in policy-gradient
    algorithms and ``sft`` declare it; DPO and the reward model (pairs found on the host) do not."""

    capturable_loss: bool


@runtime_checkable
class TrainingBackend(Protocol):
    """Trains the policy. Built once per trainer rank; every rank gets the same calls.

    Optional: ``offload`` and ``onload`` (:class:`OffloadingBackend`), for
    ``policy.generation.colocated.offload_trainer_state`` (a run with the key on and a backend
    without them fails naming the key).
    """

    def logprobs(self, batch: SequenceBatch, *, reference: bool = False) -> list[torch.Tensor] | None:
        """Token-aligned float32 logprobs [L_i] of each sequence (CPU). Rank 0 returns all N;
        other ranks may return None. ``reference=True`` uses the frozen initial policy. Values
        are required where ``loss_mask > 0`` (the tokens a loss, KL term or refit probe reads);
        elsewhere a backend may return 0 (it need not compute prompt tokens' logits)."""

    def train(self, batch: SequenceBatch, algorithm: Algorithm) -> dict[str, float]:
        """Optimizer step(s) on ``batch`` with ``algorithm.loss`` (one per
        ``policy.train_global_batch_size`` sequences: :func:`rlcore.training.train_in_optimizer_steps`);
        returns summed metrics plus ``loss``, ``grad_norm``, ``lr``, ``num_micro_batches``,
        ``num_optimizer_steps``. A non-finite loss skips that update and counts it in
        ``skipped_nonfinite``."""

    def export_weights(self, dtype: Any = None, chunk_bytes: int = 1 << 30) -> Iterator[NamedTensors]:
        """Chunks of (Hugging Face name, tensor) covering the whole model, each at most
        ``chunk_bytes`` (one tensor larger than that forms its own chunk). Rank 0 yields; other
        ranks iterate too (collectives) and yield nothing."""

    def save_checkpoint(self, path: str) -> None: ...

    def load_checkpoint(self, path: str) -> None: ...

    def export_hf(self, path: str) -> None:
        """Write the trained policy as a Hugging Face checkpoint (safetensors + config)."""

    def shutdown(self) -> None: ...


@runtime_checkable
class OffloadingBackend(Protocol):
    """A :class:`TrainingBackend` that can free its GPU memory while a colocated generator works
    (``policy.generation.colocated.offload_trainer_state``)."""

    def offload(self, *, keep_weights: bool = False) -> None:
        """Move the optimizer state and gradients, and the weights unless ``keep_weights``, to host
        memory, freeing their GPU memory (may be a no-op on CPU; a no-op when already offloaded;
        gradients need not survive, the next step zeroes them)."""

    def onload(self) -> None:
        """Undo :meth:`offload`, before the next ``logprobs`` or ``train``."""


@runtime_checkable
class TrainerHandle(Protocol):
    """The trainer ranks as the run loop and weight transports see them, wherever they run.

    Every method runs the same call on every rank (SPMD backends need that) and returns rank 0's
    result. Implemented by :class:`rlcore.controller.workers.LocalTrainer` (the backend in this
    process) and :class:`rlcore.controller.workers.RayTrainerGroup` (one Ray actor per rank,
    every wait bounded by ``cluster.timeout_s`` and a dead rank named at once). ``what``
    describes the call in those errors.
    """

    loop_step: int  # the run loop's step (not the backend's optimizer step): named in errors

    @property
    def in_process(self) -> bool:
        """Whether rank 0's backend lives in this process (one rank, no Ray): a transport may then
        hand this process's tensors to the generator directly."""

    def logprobs(self, batch: SequenceBatch, *, reference: bool = False, what: str = "") -> list[torch.Tensor]:
        """:meth:`TrainingBackend.logprobs` on every rank; rank 0's (all N sequences)."""

    def train(self, batch: SequenceBatch, algorithm: Algorithm) -> dict[str, float]:
        """:meth:`TrainingBackend.train` on every rank; rank 0's metrics."""

    def save_checkpoint(self, path: str) -> None: ...

    def load_checkpoint(self, path: str) -> None: ...

    def offload(self, *, keep_weights: bool = False) -> None:
        """The backend's optional ``offload`` (:class:`OffloadingBackend`) on every rank; a backend
        without it: an error naming the key."""

    def onload(self) -> None:
        """The backend's optional ``onload`` on every rank."""

    def export_chunks(self, dtype: Any = None, chunk_bytes: int = 1 << 30) -> Iterator[NamedTensors]:
        """Rank 0's :meth:`TrainingBackend.export_weights` chunks, in this process."""

    def run_on_ranks(self, fn: str, *args: Any, what: str = "") -> list[Any]:
        """``fn(backend, rank, world_size, *args)`` next to every rank's backend; all ranks' results
        in rank order. ``fn`` is a ``"module:attr"`` string imported in each rank's process, so a
        plugin's code (e.g. a weight sender) runs in the trainer processes."""

    def shutdown(self) -> None: ...


@runtime_checkable
class CriticHandle(Protocol):
    """A value model trained beside the policy (PPO's critic), wherever its ranks run.

    A training backend provides one through its registration's ``critic`` capability, a
    ``"module:attr"`` factory ``(config, section_config, world) -> critic`` called in every trainer
    rank's process with a :class:`~rlcore.config.RunConfig` whose ``policy`` keys are the critic's
    (:func:`rlcore.controller.critic_step.critic_run_config`); the run reaches it through this
    protocol (:class:`rlcore.controller.critic_step.RankCritic`). Every method runs on every rank
    and returns rank 0's result, as :class:`TrainerHandle`'s do.

    Values are token-aligned like logprobs: ``values(batch)[i][t]`` is the critic's estimate of
    the return from token t of sequence i on, read from the prefix ``ids[:t]`` (the hidden state
    of token t-1); index 0 is 0. They are required where ``loss_mask > 0``."""

    def values(self, batch: SequenceBatch) -> list[torch.Tensor]:
        """Token-aligned float32 values [L_i] of each sequence (CPU), in batch order."""

    def train(self, batch: SequenceBatch, loss: Any) -> dict[str, float]:
        """Optimizer step(s) of the critic on ``loss.loss(values_T, mb, totals)`` (global
        normalization, as :meth:`Algorithm.loss`); metrics as :meth:`TrainingBackend.train`."""

    def save_checkpoint(self, path: str) -> None:
        """Model, optimizer, scheduler and RNG into the new directory ``path`` (resumable)."""

    def load_checkpoint(self, path: str) -> None: ...

    def export_hf(self, path: str) -> None:
        """The critic as a Hugging Face ``*ForTokenClassification`` checkpoint with one label."""

    def offload(self) -> None:
        """Optimizer state, gradients and weights to host memory (a no-op on CPU)."""

    def onload(self) -> None: ...

    def shutdown(self) -> None: ...


@runtime_checkable
class CriticAlgorithm(Protocol):
    """An :class:`Algorithm` that trains with a critic (``ppo``): the run builds a
    :class:`CriticHandle` for it and :mod:`rlcore.controller.critic_step` calls these."""

    uses_critic: bool
    value_loss: Any  # what CriticHandle.train gets: loss(values_T, mb, totals) -> (loss, metrics)

    def token_targets(self, batch: SequenceBatch, values: list[torch.Tensor],
                      rewards_N: torch.Tensor) -> tuple[dict[str, list[torch.Tensor]], dict[str, float]]:
        """Token fields (``advantages``, ``returns``, ``values``) from the critic's values and the
        shaped rewards, and their metrics."""

    def trains_policy(self, step: int) -> bool:
        """Whether run-loop step ``step`` (from 1) trains the policy (not during a critic warm-up)."""


@runtime_checkable
class Generator(Protocol):
    """Samples responses. ``weights_version`` counts refits.

    Optional: ``metrics()`` (:class:`GeneratorMetrics`); without it the run logs no generator metrics."""

    weights_version: int

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[GenerationResult]]:
        """``params.n`` results per prompt, in prompt order."""

    async def agenerate(self, prompt_ids: list[int], params: SamplingParams) -> GenerationResult:
        """One response, for streaming and multi-turn rollouts (many may be in flight)."""

    def score(self, sequences: list[list[int]]) -> list[list[float]]:
        """Token-aligned logprobs of given sequences (refit probes); index 0 is 0."""

    def update_weights(self, chunks: Iterable[NamedTensors]) -> None:
        """Load Hugging Face-named tensors in place; bumps ``weights_version``."""

    def sleep(self) -> None: ...

    def wake_up(self) -> None: ...

    def shutdown(self) -> None: ...


@runtime_checkable
class GeneratorMetrics(Protocol):
    """A :class:`Generator` that reports its own figures (cache use, preemptions): the run adds them
    to each step's metrics."""

    def metrics(self) -> dict[str, float]:
        """Numbers by metric name, read once a step after the rollouts."""


@runtime_checkable
class ImageGenerator(Protocol):
    """A :class:`Generator` that takes prompts with images (vision-language models). The run loop
    calls these methods for a batch whose samples carry :attr:`Sample.images`, and fails naming
    the generator when it lacks them."""

    def generate_with_images(self, prompts: list[list[int]], images: list[ImageInputs | None],
                             params: SamplingParams) -> list[list[GenerationResult]]:
        """As :meth:`Generator.generate`; ``images[i]`` are prompt i's (None: none)."""

    def score_with_images(self, sequences: list[list[int]], images: list[ImageInputs | None]) -> list[list[float]]:
        """As :meth:`Generator.score`, with each sequence's prompt images."""


@runtime_checkable
class AsyncTokenGenerator(Protocol):
    """What the agents' endpoint (:mod:`rlcore.agents`) needs of a generator: token ids in, token ids
    and their sampling logprobs out, many requests in flight. Every :class:`Generator` is one (vLLM's
    async engine; the ``hf`` generator through a thread)."""

    async def agenerate(self, prompt_ids: list[int], params: SamplingParams) -> GenerationResult:
        """One response to ``prompt_ids`` (``params.n`` is 1), with ``response_logprobs`` of the sampled tokens."""


@runtime_checkable
class Environment(Protocol):
    """Scores trajectories. Pure: never raises on model output; errors become reward 0.

    Optional: ``name`` (:class:`Named`; without it messages name the class), ``close()``
    (:class:`ClosableEnvironment`; without it nothing is released as the run ends)."""

    def step(self, samples: list[Sample], histories: list[list[str]]) -> list[EnvStep]:
        """``histories[i]`` is every model turn of trajectory i so far (newest last)."""


@runtime_checkable
class ClosableEnvironment(Protocol):
    """An :class:`Environment` holding something to release (a sandbox pool, a server's connection)."""

    def close(self) -> None:
        """Release it; called once as the run ends (bounded by ``cluster.timeout_s``)."""


@runtime_checkable
class TrajectoryTurns(Protocol):
    """A multi-turn environment that knows which trajectory of a sample it answers, and may set each
    model turn's token budget (budget forcing; a benchmark's seeded workload). :class:`rlcore.rollout.MultiTurnRunner`
    then calls these instead of :meth:`Environment.step`; ``trajectory`` is 0..n-1 among a sample's ``n``,
    ``turn`` counts model turns from 0."""

    def turn_max_new_tokens(self, sample: Sample, trajectory: int, turn: int) -> int | None:
        """The budget of model turn ``turn`` (capped by ``max_new_tokens`` and the room left); None: no budget of its own."""

    def step_trajectory(self, sample: Sample, trajectory: int, history: list[str]) -> EnvStep:
        """As :meth:`Environment.step` for one trajectory: ``history`` is its model turns so far (newest last)."""


@runtime_checkable
class EnvironmentSession(Protocol):
    """One trajectory's episode in an environment that keeps state between turns (a game, a remote
    environment server's session): opened before the first model turn, closed after the last."""

    def step(self, turn: str) -> EnvStep:
        """The environment's answer to the model's newest turn."""

    def close(self) -> None:
        """Release the episode (called once, also after an error)."""


@runtime_checkable
class SessionEnvironment(Protocol):
    """An :class:`Environment` whose multi-turn rollouts run one :class:`EnvironmentSession` per
    trajectory (:class:`rlcore.rollout.MultiTurnRunner` opens it), so that state that the model's
    turns alone do not determine (a server's episode, sampled observations) stays with its trajectory.
    Its ``step(samples, histories)`` still answers whole histories (single-turn loops, conformance)."""

    def open_session(self, sample: Sample) -> EnvironmentSession:
        """A new episode for one trajectory of ``sample``."""


@runtime_checkable
class PromptDataset(Protocol):
    train: Sequence[Sample]
    validation: Sequence[Sample] | None


@runtime_checkable
class MetricLogger(Protocol):
    """Records each step's metrics. Optional: ``resume_at`` (:class:`ResumableLogger`); without it a
    resumed run's logger keeps whatever it recorded after the checkpoint."""

    def log(self, metrics: dict[str, float], step: int) -> None: ...

    def close(self) -> None: ...


@runtime_checkable
class ResumableLogger(Protocol):
    """A :class:`MetricLogger` that takes back what it recorded after the checkpoint a run resumes from."""

    def resume_at(self, step: int, records: list[dict] | None = None) -> None:
        """Drop the records of steps after ``step`` (they are redone). ``records``, the checkpoint's
        own (one dict a step), let it put back those it lacks; a logger may take ``step`` alone."""


@runtime_checkable
class RolloutTableLogger(Protocol):
    """A logger that also shows a few of each step's rollout traces as a table (:mod:`rlcore.traces`)."""

    def log_rollouts(self, rows: list[list], step: int) -> None:
        """``rows`` of :data:`rlcore.traces.TABLE_COLUMNS` (sample, reward, advantage, prompt, completion)."""


@runtime_checkable
class WeightTransport(Protocol):
    """Moves weights from the trainer to the generator (a plugin's ``rlcore_weight_transport`` hook)."""

    name: str  # named in the refit's messages

    def transfer(self, trainer: TrainerHandle, generator: Generator) -> dict[str, float]:
        """Move the trainer's current weights into the generator; return ``{"bytes": .., "seconds": ..}``."""


# ---- preference pairs (DPO, reward models) ---------------------------------------------------
@attrs.define
class PreferencePair:
    """One preference: the same prompt answered twice, ``chosen`` preferred over ``rejected``.
    Token ids; ``source`` names where the pair came from (``file:row``) for errors."""

    prompt_ids: list[int]
    chosen_ids: list[int]  # response tokens only (EOS or the template's end-of-turn included)
    rejected_ids: list[int]
    source: str = ""


@runtime_checkable
class PreferenceDataset(Protocol):
    train: Sequence[PreferencePair]
    validation: Sequence[PreferencePair] | None


@runtime_checkable
class PairTrainer(Protocol):
    """What the pairwise loop (:mod:`rlcore.controller.pairs`) trains: DPO through a training
    backend, or a reward model."""

    def train_pairs(self, pairs: Sequence[PreferencePair]) -> dict[str, float]:
        """One step on these pairs; metrics under ``train/``."""

    def evaluate(self, pairs: Sequence[PreferencePair]) -> dict[str, float]:
        """Held-out metrics under ``val/`` (``val/accuracy``: fraction of pairs ranked right)."""

    def save(self, path: str) -> None:
        """Write the trained model as a Hugging Face checkpoint."""

    def save_checkpoint(self, path: str) -> None:
        """Write what resuming needs (model, optimizer, RNG) into the new directory ``path``
        (called when ``checkpointing.enabled``)."""

    def load_checkpoint(self, path: str) -> None:
        """Restore what :meth:`save_checkpoint` wrote."""

    def shutdown(self) -> None: ...


@runtime_checkable
class Teacher(Protocol):
    """A frozen model that scores the policy's rollouts (on-policy distillation, :mod:`rlcore.teacher`)."""

    def logprobs(self, batch: SequenceBatch) -> list[torch.Tensor]:
        """Token-aligned float32 logprobs [L_i] of each sequence of ``batch`` (CPU); index 0 is 0."""
