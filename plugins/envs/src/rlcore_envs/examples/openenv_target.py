"""A real OpenEnv environment server for the tests and the recipe: "say the target number" in up to two tries.

Served with OpenEnv's own ``create_app`` (``python -m uvicorn rlcore_envs.examples.openenv_target:app``); each WebSocket
session gets its own environment, so concurrent trajectories have separate episodes.
"""

from __future__ import annotations

import random

from openenv.core.env_server import create_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State


class SayAction(Action):
    message: str


class TargetObservation(Observation):
    text: str = ""
    tries: int = 0


class TargetEnvironment(Environment):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self):
        super().__init__()
        self.target, self.tries = 0, 0
        self._state = State()

    def reset(self, seed=None, episode_id=None, **kwargs):
        self.target, self.tries = random.Random(seed).randint(1, 9), 0
        self._state = State(episode_id=episode_id)
        return TargetObservation(text=f"Say {self.target}.", tries=0)

    def step(self, action, timeout_s=None, **kwargs):
        self.tries += 1
        hit = action.message.strip() == str(self.target)
        done = hit or self.tries >= 2
        text = "Right." if hit else f"No. Say {self.target}."
        return TargetObservation(text=text, tries=self.tries, reward=1.0 if hit else 0.0, done=done)

    @property
    def state(self):
        return self._state


app = create_app(TargetEnvironment, SayAction, TargetObservation, env_name="target", max_concurrent_envs=16)
