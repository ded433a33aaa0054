"""Rollouts: draw prompts, generate each G times, score, keep or refill whole groups.

Generation holds :attr:`Rollouts.generator_lock` for its whole length: the refit and a validation
pass take the same lock, so the generator is never asked to generate while its weights change.
Scoring holds :attr:`Rollouts.score_lock`: environments are not assumed thread-safe, and async
scoring runs beside the trainer's validation.
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING, Protocol

import attrs
import torch

from rlcore.generation.batching import DataCursor, Trajectory, apply_env_steps, rollout_metrics, sampling_params, score
from rlcore.deadlines import (
    EnvironmentTimeout,
    GenerationTimeout,
    TimedEnvironment,
    batch_deadline,
    batch_margin_s,
    call_with_timeout,
)
from rlcore.controller.timing import StepTimer
from rlcore.controller.context import RunContext
from rlcore.interfaces import (
    Algorithm,
    Environment,
    EnvStep,
    Generator,
    GeneratorMetrics,
    ImageGenerator,
    PromptDataset,
    RefillRounds,
    Sample,
)

if TYPE_CHECKING:
    from rlcore.config import RunConfig
    from rlcore.generation.rollout import MultiTurnRunner


@attrs.define
class GeneratedRound:
    """One round of rollouts, generated and not yet scored."""

    trajectories: list[Trajectory]
    version: int  # the generator's weights version they were sampled with
    final_steps: list | None  # multi-turn: the EnvSteps each rollout ended with (scored already)
    began: float  # time.perf_counter() when the generation took the generator
    step: int  # the step the round was generated for (named by an environment's timeout)
    env_metrics: dict = attrs.field(factory=dict)  # the environment's, once scored


class GenerationObserver(Protocol):
    """Told when a generation takes the generator and when it lets go (with the lock held)."""

    def generation_began(self) -> None: ...

    def generation_ended(self) -> None: ...


class RolloutSource(Protocol):
    """What the async driver's rollout thread asks of the rollouts."""

    def refill_rounds(self) -> int: ...

    def collect(self, step: int, timer: StepTimer,
                observer: GenerationObserver | None = None) -> tuple[list[Trajectory], dict, int]: ...

    def generate_round(self, step: int, round_: int, timer: StepTimer,
                       observer: GenerationObserver | None = None) -> GeneratedRound: ...

    def finish_collect(self, rounds: list[GeneratedRound], timer: StepTimer,
                       score_last_only: bool = False) -> tuple[list[Trajectory], dict, int]: ...

    def generator_metrics(self) -> dict[str, float]: ...

    def data_position(self) -> int: ...


def image_generator(generator: Generator) -> ImageGenerator:
    """``generator`` as an :class:`ImageGenerator`, or an error naming it: prompts with images need one."""
    if not isinstance(generator, ImageGenerator):
        raise TypeError(f"the dataset's prompts carry images but the generator {type(generator).__name__} takes none "
                        "(it has no generate_with_images); use the hf generator, or a text-only dataset")
    return generator


def no_images_in_multi_turn(samples: list[Sample]) -> None:
    """Multi-turn rollouts take token ids only: prompts with images are an error, not images dropped."""
    with_images = [s.index for s in samples if s.images is not None]
    if with_images:
        raise ValueError(f"samples {with_images[:5]} carry images, but multi-turn rollouts take text prompts only; "
                         "use a single-turn environment with image datasets")


def reward_tensors(trajs: list[Trajectory]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rewards, group ids and truncation flags of ``trajs``, one entry per trajectory."""
    rewards_N = torch.tensor([t.reward for t in trajs], dtype=torch.float32)
    groups_N = torch.tensor([t.group for t in trajs], dtype=torch.long)
    truncated_N = torch.tensor([t.truncated for t in trajs], dtype=torch.bool)
    return rewards_N, groups_N, truncated_N


class Rollouts:
    """The step's trajectories from the prompt cursor, the generator and the environment."""

    def __init__(self, config: RunConfig, context: RunContext, generator: Generator, environment: Environment,
                 algorithm: Algorithm, dataset: PromptDataset, multi_turn: MultiTurnRunner | None = None):
        self.train_cfg, self.grpo, self.generation_cfg = config.train, config.grpo, config.generation
        self.timeout_s = context.timeout_s
        self.generator, self.environment, self.algorithm = generator, environment, algorithm
        self.dataset, self.multi_turn = dataset, multi_turn
        self.cursor = DataCursor(len(dataset.train), config.train.seed)
        self.generator_lock = context.generator_lock
        self.score_lock = threading.Lock()
        self._failures: dict[int, list[dict]] = {}  # failed agent attempts by the step generated for, until traced
        self._failures_lock = threading.Lock()

    # ---- generation -------------------------------------------------------------------------
    def generate(self, samples: list[Sample], n: int, seed: int | None, step: int, greedy: bool = False,
                 observer: GenerationObserver | None = None, failures: list[dict] | None = None):
        """Results per sample, the weights version, for multi-turn environments the EnvSteps the rollouts
        ended with (else None), and the ``time.perf_counter()`` at which the generation took the generator.
        ``failures``, when given, gets the agent attempts that failed (for the rollout traces)."""
        params = sampling_params(self.generation_cfg, n, seed, greedy)
        final_steps = None
        with self.generator_lock:
            began = time.perf_counter()
            version = self.generator.weights_version
            if observer is not None:
                observer.generation_began()
            if self.multi_turn is not None:
                no_images_in_multi_turn(samples)
                self._tell_environment(step)
                results = self._bounded(lambda: self.multi_turn(samples, params), "multi-turn rollouts", step)
                final_steps = [[EnvStep(reward=t.reward, metrics=t.env_metrics) for t in group]
                               for group in self.multi_turn.last_trajectories]
                if failures is not None:
                    failures.extend(self.multi_turn.last_failures)
            elif any(s.images is not None for s in samples):
                generator = image_generator(self.generator)
                results = self._bounded(lambda: generator.generate_with_images(
                    [s.prompt_ids for s in samples], [s.images for s in samples], params), "generate", step)
            else:
                results = self._bounded(lambda: self.generator.generate([s.prompt_ids for s in samples], params),
                                        "generate", step)
            if observer is not None:
                observer.generation_ended()
        return results, version, final_steps, began

    def _bounded(self, fn, what: str, step: int):
        limit = self.timeout_s
        inner = limit - batch_margin_s(limit)  # an environment call inside times out first, with its own message

        def within_deadline():
            with batch_deadline(inner):
                return fn()

        try:
            return call_with_timeout(within_deadline, limit, lambda: f"timeout: the generator's '{what}' did not finish "
                                                                     f"within {limit:g}s (cluster.timeout_s) at step {step}",
                                     GenerationTimeout)
        except GenerationTimeout as exc:
            if isinstance(exc.__context__, EnvironmentTimeout):  # the batch's end came as its environment's error left
                raise exc.__context__ from None
            raise

    def score(self, trajs: list[Trajectory], final_steps, step: int) -> dict[str, float]:
        """Multi-turn rollouts were scored turn by turn already; single-turn ones are scored now."""
        if final_steps is None:
            with self.score_lock:
                self._tell_environment(step)
                return score(self.environment, trajs)
        return apply_env_steps(trajs, [env_step for group in final_steps for env_step in group])

    def _tell_environment(self, step: int) -> None:
        """The step whose batch the environment is called for, named if a call hangs
        (:class:`rlcore.deadlines.TimedEnvironment`). Set here, where the calls are made: the
        async rollout thread works one or two steps ahead of the trainer's."""
        if isinstance(self.environment, TimedEnvironment):
            self.environment.current_step = step

    def _rollout_group(self, step: int, round_: int, observer: GenerationObserver | None = None) -> GeneratedRound:
        G = self.grpo.num_generations_per_prompt
        samples = [self.dataset.train[i] for i in self.cursor.take(self.train_cfg.num_prompts_per_step)]
        seed = (self.train_cfg.seed * 1_000_003 + step * 101 + round_) if self.train_cfg.deterministic else None
        failures: list[dict] = []
        results, version, final_steps, began = self.generate(samples, G, seed, step, observer=observer, failures=failures)
        if failures:
            with self._failures_lock:
                self._failures.setdefault(step, []).extend(failures)
        first_group = round_ * len(samples)  # unique group ids across refill rounds
        trajectories = [Trajectory(s, first_group + g, r) for g, (s, rs) in enumerate(zip(samples, results)) for r in rs]
        return GeneratedRound(trajectories, version, final_steps, began, step)

    def generate_round(self, step: int, round_: int, timer: StepTimer,
                       observer: GenerationObserver | None = None) -> GeneratedRound:
        with timer.phase("generation"):
            return self._rollout_group(step, round_, observer)

    def take_failures(self, step: int) -> list[dict]:
        """The failed agent attempts of the rounds generated for steps up to ``step``, handed over once."""
        with self._failures_lock:
            done = sorted(k for k in self._failures if k <= step)
            return [failure for k in done for failure in self._failures.pop(k)]

    def data_position(self) -> int:
        """Prompts drawn so far (the cursor's position): a checkpoint's place in the data."""
        return self.cursor.position

    def generator_metrics(self) -> dict[str, float]:
        metrics = ({k: float(v) for k, v in self.generator.metrics().items()}
                   if isinstance(self.generator, GeneratorMetrics) else {})
        if self.multi_turn is not None:  # the agent runner's failures, by cause
            metrics.update(self.multi_turn.metrics())
        return metrics

    # ---- keeping whole groups ---------------------------------------------------------------
    def refill_rounds(self) -> int:
        """DAPO-style refill rounds the algorithm may ask for after dropping groups (0: none)."""
        return int(self.algorithm.max_refill_rounds or 0) if isinstance(self.algorithm, RefillRounds) else 0

    def collect(self, step: int, timer: StepTimer,
                observer: GenerationObserver | None = None) -> tuple[list[Trajectory], dict, int]:
        """Trajectories for one step, with DAPO-style refill when the algorithm drops groups."""
        rounds = self.refill_rounds()
        target = self.train_cfg.num_prompts_per_step * self.grpo.num_generations_per_prompt
        generated: list[GeneratedRound] = []
        for round_ in range(rounds + 1):
            generated.append(self.generate_round(step, round_, timer, observer))
            kept, metrics, version = self.finish_collect(generated, timer, score_last_only=True)
            if len(kept) >= target or rounds == 0:
                break
        metrics.update(self.generator_metrics())
        return kept, metrics, version

    def finish_collect(self, rounds: list[GeneratedRound], timer: StepTimer,
                       score_last_only: bool = False) -> tuple[list[Trajectory], dict, int]:
        """Score ``rounds`` (only the last when the earlier ones were scored already) and keep whole
        groups: the step's trajectories, its rollout metrics (from the first round) and weights version."""
        for generated in rounds[-1:] if score_last_only else rounds:
            with timer.phase("reward"):
                generated.env_metrics = self.score(generated.trajectories, generated.final_steps, generated.step)
        metrics: dict[str, float] = {**rounds[0].env_metrics, **rollout_metrics(rounds[0].trajectories)}
        kept: list[Trajectory] = []
        for generated in rounds:
            trajs = generated.trajectories
            rewards_N, groups_N, truncated_N = reward_tensors(trajs)
            # Whole groups are kept or dropped here (dynamic sampling); single trajectories the
            # algorithm filters (overlong) stay in their group's baseline and are masked by the learner.
            keep_N = self.algorithm.keep_trajectories(rewards_N, groups_N, truncated_N)
            kept_groups = set(groups_N[keep_N].tolist())
            kept.extend(t for t in trajs if t.group in kept_groups)
        metrics["rollout/refill_rounds"] = float(len(rounds) - 1)
        kept = kept[: self.train_cfg.num_prompts_per_step * self.grpo.num_generations_per_prompt]
        metrics["rollout/kept_trajectories"] = float(len(kept))
        return kept, metrics, rounds[-1].version
