"""OpenEnv adapter: a client of an OpenEnv environment server (``openenv-core``), reset/step per turn.

The server is given by URL (``base_url``) or started by the run as a local process
(``server_command``, ``{port}`` replaced by a free port and ``{python}`` by the run's interpreter; stopped
when the run ends), and reached with
OpenEnv's own ``GenericEnvClient``: one WebSocket session per trajectory, so every trajectory has its
own episode on the server (the server must allow concurrent sessions for more than one at a time).

Mapping. A sample is one ``reset`` (``data.reset_args``, plus ``seed_key`` = the sample's seed); its
prompt is the observation that reset returns (read when the dataset is built). A trajectory's session
resets with the same arguments, and each model turn is one ``step``: the turn fills the action's
``action_field`` (or, with ``action_json``, is parsed as the whole action). The next observation
(``observation_field`` of it, or all of it as JSON) is the next user turn; ``done`` ends the trajectory.
The reward is the sum of the steps' rewards; metrics: ``correct`` (total >= ``success_threshold``),
``openenv/steps``, ``openenv/last_reward``, ``openenv/invalid_action`` (an action the server refused
ends the trajectory with what it earned so far), ``openenv/reset_mismatch`` (the session's reset
observation differed from the sample's prompt: a server that does not reset deterministically).

Not supported: rewards per step in the loss (rlcore's algorithms take one reward per trajectory:
the sum), MCP tool-calling environments (``CallToolAction``), OpenEnv's Docker and Hugging Face Hub
providers (start the server yourself and give ``base_url``), and the server's ``state`` endpoint.
"""

from __future__ import annotations

import atexit
import json
import socket
import subprocess
import sys
import time
import urllib.request
from typing import Any

from rlcore.interfaces import EnvStep, Sample
from rlcore.data.prompts import PromptSplits, messages_for
from rlcore_envs.common import build_splits, replay_in_sessions, require
from rlcore_envs.config import OpenEnvDatasetConfig, OpenEnvEnvConfig, OpenEnvServerKeys


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


PORT_ATTEMPTS = 3


class PortTaken(RuntimeError):
    """The server could not bind the port it was given (taken since it was found free)."""


class OpenEnvServer:
    """The server a config names: its URL, and the process when this run started it."""

    def __init__(self, keys: OpenEnvServerKeys):
        self.process: subprocess.Popen | None = None
        if keys.base_url:
            self.url = keys.base_url.rstrip("/")
            return
        atexit.register(self.stop)
        for attempt in range(PORT_ATTEMPTS):
            # A free port is free when asked, not when the server binds it: another process can take it between
            # the two, and then the server exits at once saying so; a new port is asked for then.
            port = _free_port()
            cmd = [part.replace("{port}", str(port)).replace("{python}", sys.executable) for part in keys.server_command]
            self.url = f"http://127.0.0.1:{port}"
            self.process = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
            try:
                self._wait(keys.startup_timeout_s, cmd)
                return
            except PortTaken:
                if attempt == PORT_ATTEMPTS - 1:
                    raise

    def _wait(self, timeout_s: float, cmd: list[str]) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                err = self.process.stderr.read().decode(errors="replace")[-2000:]
                error = PortTaken if "address already in use" in err.lower() else RuntimeError
                raise error(f"the OpenEnv server {cmd} exited with {self.process.returncode} before answering:\n{err}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as response:
                    if response.status == 200:
                        return
            except OSError:
                time.sleep(0.3)
        self.stop()
        raise TimeoutError(f"the OpenEnv server {cmd} did not answer {self.url}/health within {timeout_s:g}s")

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()


def _client(url: str, timeout_s: float):
    openenv = require("openenv", "openenv")
    client = openenv.GenericEnvClient(base_url=url, message_timeout_s=timeout_s).sync()
    client.connect()
    return client


def render(observation: Any, field: str | None) -> str:
    if field is not None and isinstance(observation, dict) and field in observation:
        value = observation[field]
        return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
    return json.dumps(observation, ensure_ascii=False, sort_keys=True)


def _reset_args(sample: Sample) -> dict:
    return dict(sample.answer["reset_args"])


# ---- dataset ---------------------------------------------------------------------------------
def build_dataset(config: OpenEnvDatasetConfig, tokenizer: Any) -> PromptSplits:
    server = OpenEnvServer(config)
    try:
        client = _client(server.url, config.request_timeout_s)
        try:
            splits = []
            for split, count, first in (("train", config.num_train, 0), ("validation", config.num_validation, config.num_train)):
                samples = []
                for i in range(count):
                    args = dict(config.reset_args)
                    if config.seed_key:
                        args[config.seed_key] = config.seed * 1_000_003 + first + i
                    observation = client.reset(**args).observation
                    prompt = config.prompt_template.replace("{observation}", render(observation, config.observation_field))
                    samples.append(Sample(prompt=messages_for(prompt, config.system_prompt),
                                          answer={"reset_args": args, "observation": observation},
                                          metadata={"split": split}))
                splits.append(samples)
        finally:
            client.close()
    finally:
        server.stop()
    return build_splits(splits[0], splits[1], tokenizer, config)


# ---- environment -----------------------------------------------------------------------------
class OpenEnvSession:
    """One trajectory's episode: a WebSocket session of its own on the server."""

    def __init__(self, env: OpenEnvEnvironment, sample: Sample):
        self.config = env.config
        self.client = _client(env.server.url, self.config.request_timeout_s)
        self.total, self.steps, self.mismatch = 0.0, 0, 0.0
        result = self.client.reset(**_reset_args(sample))
        if "observation" in sample.answer and result.observation != sample.answer["observation"]:
            self.mismatch = 1.0

    def _action(self, turn: str) -> dict | None:
        if not self.config.action_json:
            return {self.config.action_field: turn}
        try:
            action = json.loads(turn.strip().removeprefix("```json").removesuffix("```"))
        except ValueError:
            return None
        return action if isinstance(action, dict) else None

    def _end(self, last: float, invalid: float) -> EnvStep:
        return EnvStep(reward=self.total, done=True, metrics={
            "correct": float(self.total >= self.config.success_threshold), "openenv/steps": float(self.steps),
            "openenv/last_reward": last, "openenv/invalid_action": invalid, "openenv/reset_mismatch": self.mismatch})

    def step(self, turn: str) -> EnvStep:
        action = self._action(turn if isinstance(turn, str) else "")
        if action is None:
            return self._end(0.0, 1.0)
        try:
            result = self.client.step(action)
        except Exception:  # noqa: BLE001 - the server refused the model's action (validation error)
            return self._end(0.0, 1.0)
        reward = float(result.reward or 0.0)
        self.total += reward
        self.steps += 1
        if result.done:
            return self._end(reward, 0.0)
        return EnvStep(reward=self.total, done=False, observation=render(result.observation, self.config.observation_field),
                       metrics={"openenv/steps": float(self.steps)})

    def close(self) -> None:
        self.client.close()


class OpenEnvEnvironment:
    """Implements :class:`rlcore.interfaces.SessionEnvironment`; ``step`` replays whole histories in a fresh session."""

    def __init__(self, config: OpenEnvEnvConfig | None = None):
        self.config = config or OpenEnvEnvConfig(base_url="http://127.0.0.1:8000")
        self.server = OpenEnvServer(self.config)

    def open_session(self, sample: Sample) -> OpenEnvSession:
        return OpenEnvSession(self, sample)

    def step(self, samples: list[Sample], histories: list[list[str]]) -> list[EnvStep]:
        if len(samples) != len(histories):
            raise ValueError(f"step() got {len(samples)} samples but {len(histories)} histories")
        return replay_in_sessions(self, samples, histories)

    def close(self) -> None:
        self.server.stop()


def build_env(section_config: OpenEnvEnvConfig | None) -> OpenEnvEnvironment:
    return OpenEnvEnvironment(section_config)
