"""The ``reward_model`` environment: a trained reward model scores GRPO trajectories.

reward = ``scale * (score - shift)`` of prompt + response, where the prompt is the sample's own
``prompt_ids`` (the tokens the policy saw) and the response is the trajectory's final text,
tokenized with the reward model's tokenizer, plus EOS: the environment protocol passes text, so
this is the one place a response is re-tokenized (a tokenizer the policy shares gives back the
generated ids). Scored in batches of ``batch_size`` without gradients, on the GPU when there is
one. A trajectory that cannot be scored (longer than ``max_tokens``, by default the model's
positions, or failing in the forward pass) gets reward 0 and the metric ``error``; this
environment never raises on model output.
"""

from __future__ import annotations

from typing import Any

import torch

from rlcore.interfaces import EnvStep, Sample
from rlcore.reward_model.config import RewardModelEnvConfig
from rlcore.reward_model.scorer import RewardScorer


class RewardModelEnvironment:
    def __init__(self, config: RewardModelEnvConfig):
        from transformers import AutoTokenizer

        self.config = config
        self.tokenizer = AutoTokenizer.from_pretrained(config.model)
        self.scorer = RewardScorer(config.model, config.device, config.dtype, self.tokenizer.pad_token_id)
        self.scorer.model.eval()
        # longer trajectories are not scored (reward 0, metric "error"): the model has no positions for them
        self.max_tokens = config.max_tokens or int(getattr(self.scorer.model.config, "max_position_embeddings", 0) or 0) or None

    def _ids(self, sample: Sample, response: str) -> list[int] | None:
        prompt = sample.prompt_ids
        if prompt is None:
            prompt = (self.tokenizer.apply_chat_template(sample.prompt, add_generation_prompt=True, tokenize=True)["input_ids"]
                      if isinstance(sample.prompt, list) else self.tokenizer(sample.prompt)["input_ids"])
        try:
            response_ids = self.tokenizer(response, add_special_tokens=False)["input_ids"]
        except Exception:  # noqa: BLE001 - text the tokenizer rejects (lone surrogates) is not scored
            return None
        return list(prompt) + list(response_ids) + [self.tokenizer.eos_token_id]

    @torch.no_grad()
    def _score_batch(self, sequences: list[list[int]]) -> list[float | None]:
        try:
            return self.scorer.scores(sequences).cpu().tolist()
        except Exception:  # noqa: BLE001 - one bad trajectory costs its own reward, not the batch's
            if len(sequences) == 1:
                return [None]
            return [s for seq in sequences for s in self._score_batch([seq])]

    def step(self, samples: list[Sample], histories: list[list[str]]) -> list[EnvStep]:
        cfg = self.config
        sequences = [self._ids(s, h[-1] if h else "") for s, h in zip(samples, histories)]
        fits = [i for i, seq in enumerate(sequences)
                if seq is not None and (self.max_tokens is None or len(seq) <= self.max_tokens)]
        scores: list[float | None] = [None] * len(sequences)
        for start in range(0, len(fits), cfg.batch_size):
            chunk = fits[start : start + cfg.batch_size]
            for i, score in zip(chunk, self._score_batch([sequences[i] for i in chunk])):
                scores[i] = score
        steps = []
        for score in scores:
            if score is None:
                steps.append(EnvStep(reward=0.0, metrics={"error": 1.0}))
                continue
            reward = cfg.scale * (score - cfg.shift)
            metrics = {"rm_score": score}
            if cfg.correct_above is not None:
                metrics["correct"] = float(reward > cfg.correct_above)
            steps.append(EnvStep(reward=reward, metrics=metrics))
        return steps


def build(config: RewardModelEnvConfig) -> RewardModelEnvironment:
    return RewardModelEnvironment(config)
