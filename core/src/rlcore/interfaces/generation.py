"""What the run calls on a generator, an environment (turns, sessions), a weight transport and a teacher."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol, runtime_checkable, TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from rlcore.interfaces.data import EnvStep, GenerationResult, Named, NamedTensors, Sample, SamplingParams, SequenceBatch
    from rlcore.interfaces.training import TrainerHandle


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
    model turn's token budget (budget forcing; a benchmark's seeded workload). :class:`rlcore.generation.rollout.MultiTurnRunner`
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
    trajectory (:class:`rlcore.generation.rollout.MultiTurnRunner` opens it), so that state that the model's
    turns alone do not determine (a server's episode, sampled observations) stays with its trajectory.
    Its ``step(samples, histories)`` still answers whole histories (single-turn loops, conformance)."""

    def open_session(self, sample: Sample) -> EnvironmentSession:
        """A new episode for one trajectory of ``sample``."""


@runtime_checkable
class WeightTransport(Protocol):
    """Moves weights from the trainer to the generator (a plugin's ``rlcore_weight_transport`` hook)."""

    name: str  # named in the refit's messages

    def transfer(self, trainer: TrainerHandle, generator: Generator) -> dict[str, float]:
        """Move the trainer's current weights into the generator; return ``{"bytes": .., "seconds": ..}``."""


@runtime_checkable
class Teacher(Protocol):
    """A frozen model that scores the policy's rollouts (on-policy distillation, :mod:`rlcore.generation.teacher`)."""

    def logprobs(self, batch: SequenceBatch) -> list[torch.Tensor]:
        """Token-aligned float32 logprobs [L_i] of each sequence of ``batch`` (CPU); index 0 is 0."""
