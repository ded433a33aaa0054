"""Rollouts of a user's agent through the endpoint, failure-aware; callable like ``generator.generate``.

``AgentRunner(samples, params)`` starts the endpoint (:mod:`rlcore.agents.server`), runs
``agent(client, sample)`` for each of the ``params.n`` trajectories of every sample concurrently
(at most ``max_env_concurrency`` at once), each with an ``openai`` client whose key is that
trajectory's, and returns ``params.n`` results per sample: the tokens the endpoint recorded
(:mod:`rlcore.agents.recorder`), the agent's return value as the reward. It stands where
:class:`rlcore.generation.rollout.MultiTurnRunner` stands in the run loop (``Components.multi_turn``);
:func:`build_multi_turn_runner` picks one of the two for a run's multi-turn environment.

Failures are infrastructure, not model output, and never become rewards: an agent that raises,
times out (``attempt_timeout_s``), returns something that is not a finite reward, never reaches
the model, or whose requests the endpoint refused or failed, is run again (``max_retries``); a
group with a trajectory that failed every attempt is rolled out again whole
(``on_group_failure: resample``) or dropped from the step (``drop``, and after the resamples):
the sample's group then has no trajectories, so it takes no part in any advantage. Each failed
attempt is counted in ``rollout/infra_failures/<cause>``; a dropped group is logged with its
sample's index and causes. A batch where every group failed stops the run.

A hung agent: the batch is bounded by ``cluster.timeout_s`` (less a margin, so that this error,
naming the trajectories still open and their last requests, comes before the run loop's own bound).
"""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
import inspect
import math
import secrets
import sys
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Callable

import attrs

from rlcore.config.agents import AgentEnvConfig
from rlcore.agents.server import Endpoint
from rlcore.config import ConfigError
from rlcore.deadlines import DaemonThreads, GenerationTimeout, batch_margin_s
from rlcore.errors import RolloutError
from rlcore.interfaces import GenerationResult, Sample, SamplingParams
from rlcore.generation.rollout import critical_path_metrics, make_multi_turn_runner


class AgentTimeout(GenerationTimeout, RolloutError):
    """Agent trajectories still open when their batch's time (``cluster.timeout_s``) ran out; the
    message names them. The CLI prints it as one line."""


class AgentFailure(Exception):
    """One attempt of one trajectory failed; ``cause`` is the counter's name."""

    def __init__(self, cause: str, message: str):
        super().__init__(message)
        self.cause = cause


@attrs.define
class AgentTrajectory:
    sample: Sample
    result: GenerationResult
    reward: float
    env_metrics: dict[str, float]
    key: str
    attempts: int
    env_s: float = 0.0  # the agent's own seconds (its tools and logic): the attempt's wall time less its model requests'


def resolve_agent(spec: str) -> Callable:
    """``module:function`` or ``path/to/file.py:function`` -> the callable."""
    if not spec:
        raise ConfigError("env.agent.function", "name the agent: 'package.module:function' or 'path/to/file.py:function'")
    where, _, name = spec.rpartition(":")
    try:
        if where.endswith(".py"):
            path = Path(where).resolve()
            module_name = f"rlcore_agent_{path.stem}"
            module = sys.modules.get(module_name)
            if module is None:
                loader = importlib.util.spec_from_file_location(module_name, path)
                if loader is None or not path.is_file():
                    raise FileNotFoundError(f"no file {path}")
                module = importlib.util.module_from_spec(loader)
                sys.modules[module_name] = module
                loader.loader.exec_module(module)
        else:
            module = importlib.import_module(where)
        agent = getattr(module, name)
    except Exception as exc:  # noqa: BLE001 - any import failure is a config error naming the key
        raise ConfigError("env.agent.function", f"cannot load the agent {spec!r}: {exc!r}") from exc
    if not callable(agent):
        raise ConfigError("env.agent.function", f"{spec!r} is a {type(agent).__name__}, not a callable agent(client, sample)")
    return agent


def reward_of(value: Any) -> tuple[float, dict[str, float]]:
    """The agent's return value as (reward, metrics): a number, an EnvStep-like object or a
    ``{"reward": r, "metrics": {...}}`` dict; anything else fails as ``malformed``."""
    metrics: Any = {}
    if isinstance(value, dict) and "reward" in value:
        reward, metrics = value["reward"], value.get("metrics") or {}
    elif hasattr(value, "reward") and not isinstance(value, (int, float)):
        reward, metrics = value.reward, getattr(value, "metrics", None) or {}
    else:
        reward = value
    if isinstance(reward, bool):
        reward = float(reward)
    if not isinstance(reward, (int, float)) or not math.isfinite(float(reward)):
        raise AgentFailure("malformed", f"the agent returned {str(value)[:120]!r}, not a finite reward")
    try:
        return float(reward), {str(k): float(v) for k, v in dict(metrics).items()}
    except (TypeError, ValueError) as exc:
        raise AgentFailure("malformed", f"the agent's metrics must map names to numbers: {exc}") from exc


class AgentRunner:
    def __init__(self, generator, tokenizer, agent: Callable, config: AgentEnvConfig, *, max_total_tokens: int, timeout_s: float,
                 served_models: tuple[str, ...] = ("policy",)):
        self.agent, self.cfg, self.timeout_s = agent, config, timeout_s
        self.endpoint = Endpoint(generator, tokenizer, max_total_tokens=max_total_tokens, max_turns=config.max_turns,
                                 max_request_bytes=config.max_request_bytes, max_concurrent_requests=config.max_concurrent_requests,
                                 served_models=served_models)
        self.is_async = inspect.iscoroutinefunction(agent) or inspect.iscoroutinefunction(agent.__call__)
        # Daemon threads: a hung plain-function agent, abandoned at its timeout, is not joined at exit.
        self._threads = None if self.is_async else DaemonThreads("rlcore-agent")
        self.last_trajectories: list[list[AgentTrajectory]] = []
        self.counts: Counter = Counter()
        self.last_failures: list[dict] = []  # the last call's failed attempts: sample, trajectory, cause, error (traces)
        self._slots: asyncio.Semaphore | None = None
        self._idle_clients: list = []  # HTTP clients of finished agents, lent to the next (during a call)
        self._tls = None  # one TLS context for every client: each would load the CA bundle (~20 ms)
        self._open: dict[str, str] = {}  # key -> "sample i, trajectory k, attempt a" of every agent running now

    # ---- one attempt --------------------------------------------------------------------------
    def _lend_client(self):
        """An HTTP client for one running agent: each running agent has its own (at most
        ``max_env_concurrency``, reused by the agents that follow), because httpcore's connection pool
        scans all its connections on every request: one pool shared by hundreds of agents made the
        endpoint's requests quadratic in their number (most of the event loop's time at 256)."""
        if self._idle_clients:
            return self._idle_clients.pop()
        import ssl

        import httpx

        if self._tls is None:
            self._tls = ssl.create_default_context()
        # no cap on connections: requests past env.agent.max_concurrent_requests reach the endpoint, which refuses them
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=self.cfg.max_concurrent_requests)
        return httpx.AsyncClient(limits=limits, timeout=self.cfg.request_timeout_s, trust_env=False, verify=self._tls)

    async def _call_agent(self, key: str, sample: Sample, http):
        import openai

        options = dict(base_url=self.endpoint.base_url(), api_key=key, max_retries=0, timeout=self.cfg.request_timeout_s)
        if self.is_async:
            return await self.agent(openai.AsyncOpenAI(**options, http_client=http), sample)
        with openai.OpenAI(**options) as client:
            return await asyncio.get_running_loop().run_in_executor(self._threads, self.agent, client, sample)

    async def _attempt(self, sample: Sample, seed: int | None, name: str, http) -> AgentTrajectory:
        key = f"{name.replace(' ', '').replace(',', '-')}-{secrets.token_hex(6)}"
        traj = self.endpoint.open(key, seed)
        self._open[key] = name
        began = time.perf_counter()
        try:
            try:
                value = await asyncio.wait_for(self._call_agent(key, sample, http), self.cfg.attempt_timeout_s)
            except asyncio.TimeoutError:
                raise AgentFailure("timeout", f"the agent did not finish within {self.cfg.attempt_timeout_s:g}s "
                                              "(env.agent.attempt_timeout_s)") from None
            except Exception as exc:  # noqa: BLE001 - the agent's (or its tools') failure, counted by cause
                cause = traj.causes[-1] if traj.causes else "agent_error"
                detail = f"; the endpoint: {traj.errors[-1]}" if traj.errors else ""
                raise AgentFailure(cause, f"{type(exc).__name__}: {exc}{detail}") from exc
            if traj.causes:  # the agent went on past a refused or failed request: its reward is of a broken exchange
                raise AgentFailure(traj.causes[0], f"the agent returned after the endpoint refused or failed a request: "
                                                   f"{traj.errors[0] if traj.errors else traj.causes[0]}")
            reward, metrics = reward_of(value)
            result = traj.recorder.result()
            if result is None:
                raise AgentFailure("no_request", "the agent returned without a model reply (it made no request, or none fit)")
        finally:
            self.endpoint.close(key)
            self._open.pop(key, None)
        calls = sum(len(turn.get("tool_calls") or ()) for seg in traj.recorder.segments for turn in seg.turns)
        metrics.update({"agent_requests": float(traj.recorder.requests), "agent_segments": float(1 + len(result.segments or ())),
                        "agent_tool_calls": float(calls)})
        env_s = max(0.0, time.perf_counter() - began - traj.serving_s)
        return AgentTrajectory(sample, result, reward, metrics, key, 1, env_s)

    async def _trajectory(self, sample: Sample, seed: int | None, name: str) -> AgentTrajectory | AgentFailure:
        failure = None
        for attempt in range(1 + self.cfg.max_retries):
            async with self._slots:
                http = self._lend_client() if self.is_async else None
                try:
                    done = await self._attempt(sample, None if seed is None else seed + 15485863 * attempt,
                                               f"{name}, attempt {attempt}", http)
                except AgentFailure as exc:
                    failure = exc
                    self.counts[f"rollout/infra_failures/{exc.cause}"] += 1
                    self.counts["rollout/infra_failures"] += 1
                    self.last_failures.append({"sample": sample.index, "trajectory": f"{name}, attempt {attempt}",
                                               "cause": exc.cause, "error": str(exc)[:2000]})
                    continue
                finally:
                    if http is not None:
                        self._idle_clients.append(http)
            done.attempts = attempt + 1
            self.counts["rollout/agent_retries"] += attempt
            return done
        return failure

    async def _group(self, i: int, sample: Sample, params: SamplingParams) -> list[AgentTrajectory]:
        rounds = 1 + (self.cfg.max_group_resamples if self.cfg.on_group_failure == "resample" else 0)
        for round_ in range(rounds):
            seeds = [None if params.seed is None else params.seed + 104729 * (i * params.n + k) + 7 * round_ for k in range(params.n)]
            outcomes = await asyncio.gather(*[self._trajectory(sample, seeds[k], f"sample {sample.index}, trajectory {k}")
                                              for k in range(params.n)])
            failures = [o for o in outcomes if isinstance(o, AgentFailure)]
            if not failures:
                return list(outcomes)
            causes = ", ".join(f"{f.cause}: {f}" for f in failures[:3])
            last = round_ == rounds - 1
            print(f"warning: agent group of sample {sample.index} (dataset index): {len(failures)} of {params.n} trajectories "
                  f"failed {1 + self.cfg.max_retries} attempts ({causes}); the group is "
                  f"{'dropped' if last else 'rolled out again'}", flush=True)
            self.counts["rollout/dropped_groups" if last else "rollout/resampled_groups"] += 1
        return []

    async def arun(self, samples: Sequence[Sample], params: SamplingParams) -> list[list[AgentTrajectory]]:
        self._slots = asyncio.Semaphore(self.cfg.max_env_concurrency)
        self.endpoint.params = params
        await self.endpoint.start()
        try:
            tasks = [asyncio.ensure_future(self._group(i, s, params)) for i, s in enumerate(samples)]
            limit = self.timeout_s - batch_margin_s(self.timeout_s)
            done, pending = await asyncio.wait(tasks, timeout=limit)
            if pending:
                open_now = [f"{key} ({name}; {self.endpoint.trajectories[key].recorder.requests} requests served)"
                            for key, name in self._open.items() if key in self.endpoint.trajectories]
                for task in pending:
                    task.cancel()
                await asyncio.gather(*pending, return_exceptions=True)
                raise AgentTimeout(f"timeout: agent trajectories did not finish within {limit:g}s (cluster.timeout_s less "
                                        f"a margin): {'; '.join(open_now[:8]) or 'none open'}")
            groups = [t.result() for t in tasks]
        finally:
            clients, self._idle_clients = self._idle_clients, []  # bound to this call's event loop
            await asyncio.gather(*(client.aclose() for client in clients), return_exceptions=True)
            await self.endpoint.stop()
        if samples and not any(groups):
            raise RolloutError(f"every one of the {len(samples)} agent groups of this batch failed (see the warnings above; "
                               f"counts {dict(self.counts)}): the agent, its tools or the endpoint are broken")
        return groups

    def __call__(self, samples: Sequence[Sample], params: SamplingParams) -> list[list[GenerationResult]]:
        """``params.n`` results per sample, none for a dropped group; trajectories with rewards in
        ``last_trajectories``."""
        self.counts, self.last_failures = Counter(), []
        self.last_trajectories = asyncio.run(self.arun(samples, params))
        return [[t.result for t in group] for group in self.last_trajectories]

    def metrics(self) -> dict[str, float]:
        """The last call's failure counters (``rollout/infra_failures[/<cause>]``, ``rollout/dropped_groups``, ...) and
        its model tokens and critical path (:func:`rlcore.generation.rollout.critical_path_metrics`, as a native
        multi-turn rollout reports them; an agent's tool seconds are its attempt's time outside its model requests)."""
        base = {"rollout/infra_failures": 0.0, "rollout/dropped_groups": 0.0}
        return {**base, **{k: float(v) for k, v in self.counts.items()},
                **critical_path_metrics(self.last_trajectories)}


def build_multi_turn_runner(generator, environment, tokenizer, config):
    """The rollouts of a multi-turn environment: the ``agent`` environment's agents through the endpoint
    (:func:`make_agent_runner`), any other turn by turn (:func:`rlcore.generation.rollout.make_multi_turn_runner`)."""
    section = config.section(f"env.{config.env.name}")
    if isinstance(section, AgentEnvConfig):
        return make_agent_runner(generator, tokenizer, config, section)
    return make_multi_turn_runner(generator, environment, tokenizer, config)


def make_agent_runner(generator, tokenizer, config, section: AgentEnvConfig) -> AgentRunner:
    if section.turn_barrier:
        raise ValueError("env.agent.turn_barrier: an agent sends its requests when it chooses, so its turns cannot wait for "
                         "the other trajectories'; set it false (or use a turn-by-turn multi-turn environment)")
    return AgentRunner(generator, tokenizer, resolve_agent(section.function), section,
                       max_total_tokens=config.policy.max_total_sequence_length, timeout_s=config.cluster.timeout_s,
                       served_models=("policy", config.policy.model_name))
