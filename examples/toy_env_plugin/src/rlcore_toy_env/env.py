"""The ``toy_echo`` environment: reward 1 when the model's last turn is the sample's answer.

Single turn. Pure: it never raises on model output (anything that is not a string, or is longer
than ``max_chars``, is simply wrong), keeps no state between calls and modifies no input.
"""

from __future__ import annotations

from rlcore.interfaces import EnvStep, Sample

from rlcore_toy_env.config import ToyEchoConfig


class ToyEchoEnvironment:
    def __init__(self, config: ToyEchoConfig | None = None):
        self.config = config or ToyEchoConfig()

    def _normalize(self, text: str) -> str:
        text = " ".join(text.split())
        return text if self.config.case_sensitive else text.casefold()

    def _correct(self, sample: Sample, history: list[str]) -> bool:
        response = history[-1] if history else ""
        if not isinstance(response, str) or len(response) > self.config.max_chars or sample.answer is None:
            return False
        return self._normalize(response) == self._normalize(str(sample.answer))

    def step(self, samples: list[Sample], histories: list[list[str]]) -> list[EnvStep]:
        if len(samples) != len(histories):
            raise ValueError(f"toy_echo: {len(samples)} samples but {len(histories)} histories")
        steps = []
        for sample, history in zip(samples, histories):
            correct = self._correct(sample, history)
            reward = self.config.reward_correct if correct else self.config.reward_wrong
            steps.append(EnvStep(reward=float(reward), done=True, metrics={"toy_echo/correct": float(correct)}))
        return steps


def build(section_config: ToyEchoConfig | None) -> ToyEchoEnvironment:
    """Factory registered as ``toy_echo``: ``factory(section_config) -> Environment``."""
    return ToyEchoEnvironment(section_config)
