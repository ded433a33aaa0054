"""verifiers adapter (``verifiers`` 0.4, ``import verifiers.v1 as vf``): tasksets as datasets, a task's
weighted ``@vf.reward`` functions and ``@vf.metric`` functions as the reward and metrics, and a
``vf.Env``'s ``run()`` (the environment plays the user) as a multi-turn rollout.

Dataset (``data.name: verifiers``): ``vf.load_taskset`` of the installed taskset package
``data.taskset``; the first ``num_train + num_validation`` tasks, shuffled with ``seed``, validation
first. A sample's prompt is the task's system prompt and prompt (text or messages); its answer is the
task's whole wire data (``TaskData.model_dump``), from which the environment rebuilds the task, so
nothing of the task is lost; ``metadata`` names the task (``task``: its ``name`` when it has one).

Scoring: the conversation becomes a real ``vf.Trace`` (the prompt, then each model turn as a sampled
assistant message and each environment turn as a user message) and the task's own
``Task.score(trace)`` runs: every reward is recorded with its weight and the trajectory's reward is
``trace.reward`` (the weighted sum, as verifiers computes it). Metrics: ``vf/reward/<name>`` (each
reward's unweighted score) and ``vf/metric/<name>`` (each metric).

Multi-turn (``env.verifiers.env_class``): the ``vf.Env``'s ``run(task, agents)`` runs in a session of its
own per trajectory; the policy plays the seat ``env.verifiers.seat``: each ``interaction.turn(message)``
of that seat is one model turn (``message`` shown to the model as the next user turn), and when
``run()`` returns, ``finalize()`` and the task's scoring run on the seat's trace.

Not supported (the adapter fails naming them, or they are skipped): harness programs, tools and
toolsets (MCP), sandboxed runtimes and runtime-dependent rewards (scored without a runtime, as
verifiers does offline), judges that call a model, ``@vf.stop`` conditions, other seats played by a
model (only the policy's seat exists), and a first ``turn(message)`` that supplies the prompt (the
task's own prompt must open the conversation: rlcore tokenizes prompts before the rollout).
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import threading
from queue import Empty, Queue
from typing import Any

from rlcore.interfaces import EnvStep, Sample
from rlcore.data.prompts import PromptSplits
from rlcore_envs.common import build_splits, replay_in_sessions, require
from rlcore_envs.config import VerifiersDatasetConfig, VerifiersEnvConfig


def _vf():
    return require("verifiers.v1", "verifiers")


def load_taskset(taskset: str, args: dict):
    """``vf.load_taskset`` of an installed taskset package id, or the ``vf.Taskset`` class ``module:Class`` names."""
    vf = _vf()
    from verifiers.v1.configs.taskset import TasksetConfig
    from verifiers.v1.taskset import Taskset
    from verifiers.v1.utils.generic import concrete_type
    from verifiers.v1.utils.loaders import taskset_config_type

    if ":" not in taskset:
        return vf.load_taskset(taskset_config_type(taskset).model_validate({"id": taskset, **args}))
    cls = _import_attr(taskset, "taskset")
    config_cls = concrete_type(cls, TasksetConfig, origin=Taskset) or TasksetConfig
    return cls(config_cls.model_validate({"id": taskset.partition(":")[0], **args}))


def _import_attr(path: str, what: str):
    import importlib

    module, _, name = path.partition(":")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"{what} {path!r} cannot be imported: {exc}") from exc


def _messages(data) -> list[dict[str, str]]:
    out = [{"role": "system", "content": data.system_prompt}] if data.system_prompt else []
    if isinstance(data.prompt, str):
        out.append({"role": "user", "content": data.prompt})
    else:
        from verifiers.v1.types import content_text

        out += [{"role": m.role, "content": content_text(m.content) or ""} for m in data.prompt or []]
    return out


def build_dataset(config: VerifiersDatasetConfig, tokenizer: Any) -> PromptSplits:
    taskset = load_taskset(config.taskset, config.taskset_args)
    tasks = list(taskset.take(config.num_train + config.num_validation))
    random.Random(config.seed).shuffle(tasks)
    samples = []
    for task in tasks:
        if not task.data.prompt:
            raise ValueError(f"data.taskset {config.taskset!r}: task {task.data.idx} has no prompt; rlcore needs the task's "
                             "prompt to open the conversation")
        samples.append(Sample(prompt=_messages(task.data), answer=task.data.model_dump(mode="json"),
                              metadata={"task": task.data.name or config.taskset, "vf_task_type": type(task).__name__}))
    val, train = samples[: config.num_validation], samples[config.num_validation :]
    return build_splits(train, val, tokenizer, config)


def new_trace(vf, task, messages: list[dict[str, str]]):
    from verifiers.v1.graph import MessageNode
    from verifiers.v1.trace import AgentInfo, TraceTask

    trace = vf.Trace(task=TraceTask(type=type(task).__name__, data=task.data, key=task.key, hash=task.hash),
                     agent=AgentInfo(config=vf.AgentConfig()))
    kinds = {"system": vf.SystemMessage, "user": vf.UserMessage, "assistant": vf.AssistantMessage}
    for m in messages:
        trace.nodes.append(MessageNode(parent=len(trace.nodes) - 1 if trace.nodes else None, message=kinds[m["role"]](content=m["content"])))
    return trace


def add_turn(vf, trace, text: str, sampled: bool) -> None:
    from verifiers.v1.graph import MessageNode

    message = vf.AssistantMessage(content=text) if sampled else vf.UserMessage(content=text)
    trace.nodes.append(MessageNode(parent=len(trace.nodes) - 1 if trace.nodes else None, message=message, sampled=sampled))


def scored_step(trace) -> EnvStep:
    metrics = {f"vf/reward/{k}": float(r.score) for k, r in trace.rewards.items() if r is not None}
    metrics |= {f"vf/metric/{k}": float(v) for k, v in trace.metrics.items() if v is not None}
    return EnvStep(reward=float(trace.reward), done=True, metrics=metrics)


class VerifiersEnvironment:
    def __init__(self, config: VerifiersEnvConfig):
        self.config, self.vf = config, _vf()
        taskset = load_taskset(config.taskset, config.taskset_args)
        self.task_cls, self.taskset_config = type(taskset).task_type(), taskset.config
        self.env_cls = None
        if config.env_class:
            self.env_cls = _import_attr(config.env_class, "env.verifiers.env_class")

    def task(self, sample: Sample):
        return self.task_cls(self.task_cls.data_type().model_validate(sample.answer))

    def score(self, sample: Sample, history: list[str]) -> EnvStep:
        task = self.task(sample)
        trace = new_trace(self.vf, task, sample.prompt if isinstance(sample.prompt, list) else [{"role": "user", "content": sample.prompt}])
        for turn in history:
            add_turn(self.vf, trace, turn if isinstance(turn, str) else "", sampled=True)
        try:
            asyncio.run(task.score(trace))
        except Exception:  # noqa: BLE001 - a reward function that fails on model output scores 0, counted
            return EnvStep(reward=0.0, done=True, metrics={"vf/scoring_error": 1.0})
        return scored_step(trace)

    def open_session(self, sample: Sample):
        if self.env_cls is None:
            return _ScoreAtEnd(self, sample)
        return VerifiersSession(self, sample)

    def step(self, samples: list[Sample], histories: list[list[str]]) -> list[EnvStep]:
        if len(samples) != len(histories):
            raise ValueError(f"step() got {len(samples)} samples but {len(histories)} histories")
        if self.env_cls is None:
            return [self.score(s, list(h) if isinstance(h, (list, tuple)) else []) for s, h in zip(samples, histories)]
        return replay_in_sessions(self, samples, histories)


class _ScoreAtEnd:
    """Single turn: the first model turn is scored."""

    def __init__(self, env: VerifiersEnvironment, sample: Sample):
        self.env, self.sample = env, sample

    def step(self, turn: str) -> EnvStep:
        return self.env.score(self.sample, [turn])

    def close(self) -> None:
        pass


# ---- multi-turn: a vf.Env's run() as one session per trajectory -------------------------------
_FIRST, _CLOSED = object(), object()


class _Segment:
    def __init__(self, last_reply: str, terminated: bool):
        self.last_reply, self.terminated = last_reply, terminated


class _Interaction:
    """What ``agents.<seat>.interaction(task)`` yields: ``turn(message)`` hands ``message`` to the model
    as the next user turn and returns the model's reply."""

    def __init__(self, session: VerifiersSession, trace):
        self.session, self.trace, self.opened = session, trace, False

    async def turn(self, message: str | None = None) -> _Segment:
        if not self.opened and message is not None:
            raise NotImplementedError("a first turn(message) that supplies the prompt: rlcore opens with the task's prompt")
        self.opened = True
        if message is not None:
            add_turn(self.session.vf, self.trace, message, sampled=False)
        self.session.events.put(("turn", message))
        reply = await asyncio.to_thread(self.session.replies.get)
        if reply is _CLOSED:
            return _Segment("", True)
        add_turn(self.session.vf, self.trace, reply, sampled=True)
        return _Segment(reply, False)


class _Seat:
    trainable = True

    def __init__(self, interaction: _Interaction):
        self._interaction = interaction

    @contextlib.asynccontextmanager
    async def interaction(self, task):
        yield self._interaction


class _Agents:
    def __init__(self, seat: str | None, interaction: _Interaction):
        self._seat, self._player = seat, _Seat(interaction)

    def __getattr__(self, name: str) -> _Seat:
        if name.startswith("_"):
            raise AttributeError(name)
        if self._seat is None or name == self._seat:
            return self._player
        raise NotImplementedError(f"seat {name!r}: only the policy's seat ({self._seat!r}) is played; other model seats are not supported")


class VerifiersSession:
    """``vf.Env.run(task, agents)`` on a thread of its own; :meth:`step` trades one model turn for the
    environment's next user turn, or for the scored end of the episode."""

    def __init__(self, env: VerifiersEnvironment, sample: Sample):
        from verifiers.v1.configs.env import EnvConfig
        from verifiers.v1.env import Env
        from verifiers.v1.utils.generic import concrete_type

        self.vf, self.config = env.vf, env.config
        self.events: Queue = Queue()
        self.replies: Queue = Queue()
        config_cls = concrete_type(env.env_cls, EnvConfig, origin=Env) or EnvConfig
        # the taskset's own config goes in as it was loaded ('module:Class' ids are this adapter's, not verifiers')
        env_config = config_cls.model_validate(dict(env.config.env_args)).model_copy(update={"taskset": env.taskset_config})
        # Harness loading is skipped (Env.__init__ would provision agent programs): the policy is the agent.
        self.episode_env = env.env_cls.__new__(env.env_cls)
        self.episode_env.config = env_config
        self.task = env.task(sample)
        self.trace = new_trace(self.vf, self.task, sample.prompt if isinstance(sample.prompt, list) else [{"role": "user", "content": sample.prompt}])
        self.started = False
        self.thread = threading.Thread(target=lambda: asyncio.run(self._drive()), name="rlcore-verifiers-env", daemon=True)
        self.thread.start()

    async def _drive(self) -> None:
        interaction = _Interaction(self, self.trace)
        agents = _Agents(self.config.seat, interaction)
        try:
            await self.episode_env.setup(agents)
            await self.episode_env.run(self.task, agents)
            await self._finalize()
            await self.task.score(self.trace)
            self.events.put(("done", scored_step(self.trace)))
        except Exception as exc:  # noqa: BLE001 - an environment failure ends the trajectory with reward 0, counted
            self.events.put(("done", EnvStep(reward=0.0, done=True, metrics={"vf/env_error": 1.0, "error": 1.0})))
            self.error = exc

    async def _finalize(self) -> None:
        from verifiers.v1.episode import EnvInfo, Episode

        episode = Episode(env=EnvInfo(id=self.episode_env.config.env_id), task=self.trace.task)
        episode.traces.append(self.trace)
        await self.episode_env.finalize(self.task, episode)

    def _next(self) -> tuple[str, Any]:
        try:
            return self.events.get(timeout=self.config.turn_timeout_s)
        except Empty:
            return "done", EnvStep(reward=0.0, done=True, metrics={"vf/timeout": 1.0})

    def step(self, turn: str) -> EnvStep:
        if not self.started:  # the environment's first turn() asks for the opening model turn
            self.started = True
            kind, value = self._next()
            if kind == "done":
                return value
        self.replies.put(turn if isinstance(turn, str) else "")
        kind, value = self._next()
        if kind == "done":
            return value
        return EnvStep(reward=0.0, done=False, observation=value or "")

    def close(self) -> None:
        self.replies.put(_CLOSED)
        self.thread.join(timeout=5)


def build_env(section_config: VerifiersEnvConfig) -> VerifiersEnvironment:
    return VerifiersEnvironment(section_config)
