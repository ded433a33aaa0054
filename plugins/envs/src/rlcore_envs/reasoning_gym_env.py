"""reasoning-gym adapter: its procedural generators as a seeded dataset, its scorers as the reward.

Dataset (``data.name: reasoning_gym``): for each task of ``data.tasks`` a generator is made with
``reasoning_gym.create_dataset(task, seed=..., size=..., **data.task_configs[task])``; samples are
drawn from the tasks by ``data.weights``. Train and validation come from different seeds, and a
validation question never appears in train. Each sample keeps the generator's whole entry
(``question``, ``answer``, ``metadata``) as its answer and names its task in ``metadata["task"]``
(rlcore logs accuracy per task from it: ``train/accuracy/<task>``, ``val/accuracy/<task>``).

Environment (``env.reasoning_gym``): the task's own ``score_answer(answer, entry)`` (found with
``reasoning_gym.get_score_answer_fn``, the function reasoning-gym's dataset uses) scores the
response; the score (0..1, partial credit where the task gives it) is the reward, and ``correct``
is ``score >= correct_threshold``. Single turn.

Not supported: reasoning-gym's curricula (difficulty that moves with accuracy; set a fixed
difficulty through ``data.task_configs``), and its ``composite`` dataset's own weighting (rlcore
mixes tasks itself, so that each sample knows its task).
"""

from __future__ import annotations

import random
from typing import Any

from rlcore.interfaces import EnvStep, Sample
from rlcore.data.prompts import PromptSplits, messages_for
from rlcore_envs.common import build_splits, require
from rlcore_envs.config import ReasoningGymDatasetConfig, ReasoningGymEnvConfig

_ANSWER_TAGS = ("<answer>", "</answer>")


def _draws(config: ReasoningGymDatasetConfig, count: int, rng: random.Random) -> dict[str, int]:
    weights = list(config.weights) or [1.0] * len(config.tasks)
    picks = rng.choices(range(len(config.tasks)), weights=weights, k=count)
    return {task: picks.count(i) for i, task in enumerate(config.tasks)}


def _entries(task: str, size: int, seed: int, config: ReasoningGymDatasetConfig) -> list[dict]:
    if size == 0:
        return []
    rg = require("reasoning_gym", "reasoning-gym")
    try:
        dataset = rg.create_dataset(task, seed=seed, size=size, **config.task_configs.get(task, {}))
    except (KeyError, ValueError, TypeError) as exc:
        raise ValueError(f"data.tasks: reasoning-gym cannot make {task!r} with data.task_configs.{task}="
                         f"{config.task_configs.get(task, {})}: {exc}") from exc
    return [dataset[i] for i in range(size)]


def _sample(task: str, entry: dict, config: ReasoningGymDatasetConfig, split: str) -> Sample:
    user = config.prompt_template.replace("{question}", entry["question"])
    return Sample(prompt=messages_for(user, config.system_prompt), answer=entry,
                  metadata={"task": task, "split": split}, response=str(entry["answer"]))


def generate(config: ReasoningGymDatasetConfig) -> tuple[list[Sample], list[Sample]]:
    rng = random.Random(f"rlcore-reasoning-gym-{config.seed}")
    validation: list[Sample] = []
    for task, count in _draws(config, config.num_validation, rng).items():
        validation += [_sample(task, e, config, "validation") for e in _entries(task, count, config.seed * 2 + 1, config)]
    held_out = {(s.metadata["task"], s.answer["question"]) for s in validation}
    train: list[Sample] = []
    for task, count in _draws(config, config.num_train, rng).items():
        # draw extra, since questions shared with validation are dropped
        entries = [e for e in _entries(task, 2 * count + 16, config.seed * 2, config) if (task, e["question"]) not in held_out]
        if len(entries) < count:
            raise ValueError(f"data: reasoning-gym task {task!r} has too few questions apart from the held-out ones; "
                             f"lower data.num_validation or widen its data.task_configs")
        train += [_sample(task, e, config, "train") for e in entries[:count]]
    random.Random(config.seed).shuffle(train)
    # mixed too: a run that validates on the first train.max_val_samples sees every task, not the first one's block
    random.Random(config.seed + 1).shuffle(validation)
    return train, validation


def build_dataset(config: ReasoningGymDatasetConfig, tokenizer: Any) -> PromptSplits:
    train, validation = generate(config or ReasoningGymDatasetConfig())
    return build_splits(train, validation, tokenizer, config)


class ReasoningGymEnvironment:
    def __init__(self, config: ReasoningGymEnvConfig | None = None):
        self.config = config or ReasoningGymEnvConfig()
        self.rg = require("reasoning_gym", "reasoning-gym")
        self._scorers: dict[str, Any] = {}

    def _answer(self, response: str) -> str:
        if self.config.answer_from == "answer_tag":
            start, end = response.rfind(_ANSWER_TAGS[0]), response.rfind(_ANSWER_TAGS[1])
            return response[start + len(_ANSWER_TAGS[0]) : end].strip() if 0 <= start < end else ""
        if self.config.answer_from == "last_line":
            lines = [line for line in response.strip().splitlines() if line.strip()]
            return lines[-1].strip() if lines else ""
        return response.strip()

    def score(self, sample: Sample, response: object) -> float:
        task = sample.metadata.get("task") or sample.answer["metadata"]["source_dataset"]
        if task not in self._scorers:
            self._scorers[task] = self.rg.get_score_answer_fn(task)
        if not isinstance(response, str) or len(response) > self.config.max_response_chars:
            return 0.0
        try:
            score = float(self._scorers[task](self._answer(response), sample.answer))
        except Exception:  # noqa: BLE001 - a scorer that fails on model output scores 0
            return 0.0
        return score if 0.0 <= score <= 1.0 else 0.0

    def step(self, samples: list[Sample], histories: list[list[str]]) -> list[EnvStep]:
        if len(samples) != len(histories):
            raise ValueError(f"step() got {len(samples)} samples but {len(histories)} histories")
        steps = []
        for sample, history in zip(samples, histories):
            score = self.score(sample, history[-1] if isinstance(history, (list, tuple)) and history else "")
            steps.append(EnvStep(reward=score, done=True,
                                 metrics={"correct": float(score >= self.config.correct_threshold), "rg/score": score}))
        return steps


def build_env(section_config: ReasoningGymEnvConfig | None) -> ReasoningGymEnvironment:
    return ReasoningGymEnvironment(section_config)
