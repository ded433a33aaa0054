"""From prompts to a training batch: data order, rollouts, rewards, advantages, SequenceBatch."""

from __future__ import annotations

import math
from typing import Any

import attrs
import numpy as np
import torch

from rlcore.config.generation import GenerationConfig
from rlcore.deadlines import EnvironmentExit, EnvironmentTimeout
from rlcore.errors import RunStopped
from rlcore.interfaces import EnvStep, GenerationResult, Sample, SamplingParams, SequenceBatch, plugin_name


class DataCursor:
    """Seeded epoch-wise shuffled order over a dataset; ``position`` is all its state."""

    def __init__(self, size: int, seed: int, position: int = 0):
        if size == 0:
            raise ValueError("the training dataset is empty")
        self.size, self.seed, self.position = size, seed, position

    def _order(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(self.size)

    def take(self, count: int) -> list[int]:
        out = []
        for _ in range(count):
            epoch, offset = divmod(self.position, self.size)
            out.append(int(self._order(epoch)[offset]))
            self.position += 1
        return out


@attrs.define
class Trajectory:
    sample: Sample
    group: int
    result: GenerationResult
    reward: float = 0.0
    env_metrics: dict[str, float] = attrs.field(factory=dict)

    @property
    def truncated(self) -> bool:
        return self.result.finish_reason == "length"


def sampling_params(generation: GenerationConfig, n: int, seed: int | None, greedy: bool = False) -> SamplingParams:
    """SamplingParams from the generation section's contract (greedy: temperature 0, no top-p/k)."""
    return SamplingParams(
        temperature=0.0 if greedy else generation.temperature,
        top_p=1.0 if greedy else generation.top_p,
        top_k=-1 if greedy else generation.top_k,
        max_new_tokens=generation.max_new_tokens,
        n=n,
        stop=tuple(generation.stop_strings),
        stop_token_ids=tuple(generation.stop_token_ids),
        seed=seed,
        ignore_eos=generation.ignore_eos,
    )


def score(environment, trajectories: list[Trajectory]) -> dict[str, float]:
    """Rewards from the environment; an environment that raises costs reward 0, counted. One that
    returns something other than one EnvStep per trajectory stops the run (a bug in it: scoring
    such a batch 0 would make a run that learns nothing exit 0)."""
    metrics: dict[str, float] = {"env/errors": 0.0}
    try:
        steps = environment.step([t.sample for t in trajectories], [[t.result.text] for t in trajectories])
    except (EnvironmentTimeout, EnvironmentExit, EnvironmentContractError):
        raise
    except Exception as exc:  # noqa: BLE001 - the run goes on; the failure is counted and shown
        steps = [EnvStep(reward=0.0, metrics={"error": 1.0}) for _ in trajectories]
        metrics["env/errors"] = float(len(trajectories))
        print(f"warning: environment failed on a batch of {len(trajectories)}: {exc!r}; rewards set to 0")
    if not isinstance(steps, (list, tuple)) or len(steps) != len(trajectories):
        name = plugin_name(environment)
        got = f"{len(steps)} results" if isinstance(steps, (list, tuple)) else f"{type(steps).__name__} {_shown(steps)}"
        raise EnvironmentContractError(f"environment '{name}' returned {got} from step() for {len(trajectories)} "
                                       "trajectories; it must return a list of one EnvStep per trajectory")
    return apply_env_steps(trajectories, steps, metrics)


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


class EnvironmentContractError(TypeError, RunStopped):
    """An environment returned something that is not a reward or a metric (a bug in it, not in the
    model's output): the run stops, naming the environment's result at fault."""


_REWARD_LIMIT = float(np.finfo(np.float32).max)  # rewards travel as float32: beyond this they become inf


def _number(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)) and not (
            isinstance(value, torch.Tensor) and value.numel() == 1):
        raise EnvironmentContractError(f"{what} is {type(value).__name__} {_shown(value)}; it must be a real number "
                                       "(rlcore.interfaces.EnvStep)")
    return float(value)


def apply_env_steps(trajectories: list[Trajectory], steps: list, metrics: dict[str, float] | None = None) -> dict[str, float]:
    """Store each EnvStep's reward and metrics on its trajectory; return batch means of the metrics.
    A reward that is not finite in float32 (NaN, 1e300) scores 0 and counts in ``env/errors``; a
    non-finite metric is left out of its mean; a reward or metric that is no number at all is an error."""
    metrics = {"env/errors": 0.0} if metrics is None else metrics
    for i, (traj, step) in enumerate(zip(trajectories, steps)):
        if not hasattr(step, "reward") or not hasattr(step, "metrics"):
            raise EnvironmentContractError(f"the environment's result for trajectory {i} is {type(step).__name__} "
                                           f"{_shown(step)}; it must be an EnvStep (rlcore.interfaces.EnvStep)")
        reward = _number(step.reward, f"the environment's reward for trajectory {i}")
        if not math.isfinite(reward) or abs(reward) > _REWARD_LIMIT:
            if metrics["env/errors"] == 0:
                print(f"warning: the environment's reward for trajectory {i} is {reward!r} (not a finite float32); "
                      "scored 0 and counted in env/errors", flush=True)
            metrics["env/errors"] += 1
            reward = 0.0
        traj.reward = reward
        traj.env_metrics = {str(k): _number(v, f"the environment's metric {k!r} of trajectory {i}")
                            for k, v in dict(step.metrics).items()}
    for key in sorted({k for t in trajectories for k in t.env_metrics}):
        values = [t.env_metrics.get(key, 0.0) for t in trajectories]
        finite = [v for v in values if math.isfinite(v)]
        metrics[f"env/{key}" if not key.startswith("env/") else key] = float(np.mean(finite)) if finite else float("nan")
    return metrics


def is_correct(reward: float, env_metrics: dict[str, float]) -> bool:
    for key in ("correct", "env/correct", "accuracy"):
        if key in env_metrics:
            return env_metrics[key] >= 0.5
    return reward >= 1.0


def accuracy_by_task(trajectories: list[Trajectory], prefix: str) -> dict[str, float]:
    """``<prefix>/accuracy/<task>`` for each task named by the samples' ``metadata["task"]`` (a mix of
    tasks, e.g. reasoning-gym's): the accuracy over that task's trajectories only."""
    by_task: dict[str, list[bool]] = {}
    for t in trajectories:
        task = t.sample.metadata.get("task") if isinstance(t.sample.metadata, dict) else None
        if isinstance(task, str) and task:
            by_task.setdefault(task, []).append(is_correct(t.reward, t.env_metrics))
    return {f"{prefix}/accuracy/{task}": float(np.mean(marks)) for task, marks in sorted(by_task.items())}


def to_sequence_batch(trajectories: list[Trajectory], advantages_N: torch.Tensor, max_len: int) -> SequenceBatch:
    """Prompt + response ids with a token-aligned loss mask and per-token fields."""
    input_ids, loss_mask, gen_lp, adv_tok = [], [], [], []
    routed = [] if any(t.result.routed_experts is not None for t in trajectories) else None
    for i, traj in enumerate(trajectories):
        prompt, response = traj.result.prompt_ids, traj.result.response_ids
        mask = traj.result.response_mask or [1] * len(response)
        ids = (list(prompt) + list(response))[:max_len]
        keep = len(ids) - len(prompt)
        input_ids.append(torch.tensor(ids, dtype=torch.long))
        loss_mask.append(torch.tensor([0] * len(prompt) + list(mask[:keep]), dtype=torch.float32))
        gen_lp.append(torch.tensor([0.0] * len(prompt) + list(traj.result.response_logprobs[:keep]), dtype=torch.float32))
        adv_tok.append(torch.full((len(ids),), float(advantages_N[i]), dtype=torch.float32))
        if routed is not None:
            routed.append(routed_experts_for(traj.result.routed_experts, len(ids)))
    images = [t.sample.images for t in trajectories]
    return SequenceBatch(
        input_ids=input_ids,
        loss_mask=loss_mask,
        routed_experts=routed,
        images=images if any(i is not None for i in images) else None,
        token_fields={"gen_logprobs": gen_lp, "advantages": adv_tok},
        seq_fields={
            "rewards": torch.tensor([t.reward for t in trajectories], dtype=torch.float32),
            "advantages": advantages_N.to(torch.float32),
        },
    )


def routed_experts_for(reported: Any, length: int) -> torch.Tensor:
    """int16 [length, MoE layers, top-k]: the generator's routing of a sequence of ``length`` tokens,
    cut where the sequence was cut, -1 on rows it did not report (the last token, which the generator
    never fed to the model). An empty [length, 0, 0] tensor when it reported none for this sequence."""
    if reported is None:
        return torch.full((length, 0, 0), -1, dtype=torch.int16)
    experts = torch.as_tensor(np.asarray(reported), dtype=torch.int16)
    if experts.ndim != 3:
        raise ValueError(f"routed experts must be [tokens, MoE layers, top-k], got shape {tuple(experts.shape)}")
    out = torch.full((length, *experts.shape[1:]), -1, dtype=torch.int16)
    n = min(length, experts.shape[0])
    out[:n] = experts[:n]
    return out


def rollout_metrics(trajectories: list[Trajectory]) -> dict[str, float]:
    """Per-step rollout statistics. ``rollout/entropy_estimate`` is the mean of ``-log p_gen`` over
    the tokens the model sampled: an unbiased Monte-Carlo estimate of the per-token entropy of the
    sampling distribution (the policy itself at temperature 1), needing no full-vocabulary pass."""
    lengths = [len(t.result.response_ids) for t in trajectories]
    rewards = [t.reward for t in trajectories]
    sampled = [-lp for t in trajectories
               for lp, m in zip(t.result.response_logprobs, t.result.response_mask or [1] * len(t.result.response_logprobs)) if m]
    return {
        "rollout/entropy_estimate": float(np.mean(sampled)) if sampled else 0.0,
        "train/reward_mean": float(np.mean(rewards)),
        "train/accuracy": float(np.mean([is_correct(t.reward, t.env_metrics) for t in trajectories])),
        "rollout/mean_response_tokens": float(np.mean(lengths)),
        "rollout/mean_prompt_tokens": float(np.mean([len(t.result.prompt_ids) for t in trajectories])),
        "rollout/max_response_tokens": float(np.max(lengths)),
        # the lengths' distribution, for sizing a run from this one (rlcore plan --lengths-from)
        "rollout/min_response_tokens": float(np.min(lengths)),
        **{f"rollout/p{q}_response_tokens": float(np.percentile(lengths, q)) for q in (50, 90, 99)},
        "rollout/truncated_fraction": float(np.mean([t.truncated for t in trajectories])),
        "rollout/num_trajectories": float(len(trajectories)),
        **accuracy_by_task(trajectories, "train"),
    }
