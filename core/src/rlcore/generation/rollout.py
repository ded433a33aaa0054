"""Multi-turn rollouts over any generator's ``agenerate`` and an environment's ``step``.

A trajectory alternates model turns and environment observations::

    prompt | model turn 1 | [end of turn] observation 1 + next generation prompt | model turn 2 | ...

Tokens only ever get appended: each model turn's ids are taken as generated, and an observation
is tokenized on its own as the *suffix* the chat template adds for it (the text the template
renders for ``[..., assistant, observation]`` after ``[..., assistant]``, plus the generation
prompt), so earlier turns are never re-tokenized and the trainer sees exactly what was sampled.
Before an observation, the template's end-of-turn text is completed: all of it after a turn cut
by a stop string or the length limit, only what follows the EOS token after one that ended on it
(ChatML's ``\\n`` after ``<|im_end|>``). Observation and end-of-turn tokens get ``response_mask``
0 and logprob 0; model tokens (their EOS included) get mask 1 and the generator's logprobs. The
result's ``text`` is the final model turn (what an environment grades); every turn's text and
every observation are in the trajectory.

So a trajectory equals, token for token, the chat template applied to its message list (up to the
template's text after the final EOS), for Llama 3, Qwen2 and Qwen3 templates with ``user`` or
``tool`` observations (``plugins/env_math/tests/test_multiturn_tokens.py``), given the model's
turns tokenize as the template's text would. One exception is the template's own: Qwen3 renders
only the reasoning of turns after the last ``user`` message, so with ``observation_role: user``
its rendering lacks the earlier turns' ``<think>`` blocks, which the trajectory keeps (the model
saw them); with ``observation_role: tool`` (tool responses are not user queries) it keeps them too.

Every trajectory runs as its own coroutine (``asyncio.gather``), so with an async engine many
are in flight at once and each turn is scheduled as soon as its observation is ready. With
``turn_barrier`` (``env.<name>.turn_barrier``) no trajectory's turn k+1 is asked for before every
trajectory still going has its turn k generated and answered, as a batched synchronous rollout
does: the baseline against which continuous multi-turn scheduling is measured, and a rollout whose
batches are the same whatever the tool latencies. Each trajectory's tokens are the same either way
(for a generator whose samples do not depend on what else is in flight, such as ``hf`` with seeds).
An environment that implements :class:`rlcore.interfaces.TrajectoryTurns` is told which trajectory
and turn it answers, and may set each turn's token budget. An environment that keeps state per
trajectory (:class:`rlcore.interfaces.SessionEnvironment`) gets one session per trajectory, opened
before its first turn and closed after its last.
Limits: ``max_turns`` model turns, ``max_total_tokens`` prompt + response tokens.
Environment steps run in a thread pool of their own with one thread per trajectory (up to
``max_env_concurrency``): ``asyncio.to_thread``'s default pool has ``cpu_count + 4`` threads,
which would queue the tool calls of 256 trajectories behind each other (6 at a time on a 2-core
machine) while the engine sits idle.

This module imports no torch.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import time
from collections.abc import Sequence
from typing import Any

import attrs

from rlcore.deadlines import EnvironmentTimeout
from rlcore.interfaces import (
    EnvironmentSession, EnvStep, GenerationResult, Sample, SamplingParams, SessionEnvironment, TrajectoryTurns,
)

_MARK = "\u2063rlcore-turn\u2063"  # content no real turn contains, to cut template renderings


@attrs.define
class MultiTurnTrajectory:
    sample: Sample
    result: GenerationResult  # prompt_ids + every appended token, with response_mask
    reward: float = 0.0
    done: bool = False
    turns: list[str] = attrs.field(factory=list)  # each model turn's text
    observations: list[str] = attrs.field(factory=list)  # the environment's reply to each turn but the last
    env_metrics: dict[str, float] = attrs.field(factory=dict)
    env_s: float = 0.0  # seconds its environment steps took (tool calls), from the runner's side


class ChatSuffixes:
    """Token ids the chat template puts around an observation, computed once per role.

    Both renderings are cut at a marker inside the assistant turn, not at the length of the first:
    a template may render an assistant turn differently once something follows it (Qwen3 adds an
    empty ``<think></think>`` block to the last turn only), and its end-of-turn text may be longer
    than the token that ends generation (ChatML's ``<|im_end|>\\n`` after EOS ``<|im_end|>``).
    """

    def __init__(self, tokenizer, observation_role: str = "user"):
        self.tokenizer = tokenizer
        self.role = observation_role
        self._base = [{"role": "user", "content": "q"}, {"role": "assistant", "content": _MARK}]
        self.end_of_turn_text = self._after_mark(self._render(self._base, add_generation_prompt=False))
        self.end_of_turn_ids = self._encode(self.end_of_turn_text)
        self._special_ids = set(getattr(tokenizer, "all_special_ids", ()))
        self.observation_ids("probe")  # a template this cannot cut fails here, not mid-rollout

    def _render(self, messages, add_generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)

    @staticmethod
    def _after_mark(rendered: str) -> str:
        return rendered[rendered.rindex(_MARK) + len(_MARK) :]

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False)) if text else []

    def observation_ids(self, observation: str) -> list[int]:
        """The ids that follow a closed assistant turn: the observation turn and the generation prompt."""
        return self.messages_ids([{"role": self.role, "content": observation}])

    def messages_ids(self, messages: list[dict], **template_kwargs: Any) -> list[int]:
        """The ids the template renders for ``messages`` (any roles: tool results, user turns) after a
        closed assistant turn, and the generation prompt. ``template_kwargs`` go to the template
        (``tools``, ``enable_thinking``, ...)."""
        full = self.tokenizer.apply_chat_template(self._base + list(messages), tokenize=False, add_generation_prompt=True,
                                                  **template_kwargs)
        after = self._after_mark(full)
        if not after.startswith(self.end_of_turn_text):
            roles = ", ".join(repr(m.get("role")) for m in messages)
            raise ValueError(f"the chat template closes an assistant turn with {self.end_of_turn_text!r} when it is the last "
                             f"message but follows it with {after[:40]!r} before a {roles} message; "
                             "multi-turn rollouts need one end-of-turn text")
        return self._encode(after[len(self.end_of_turn_text) :])

    def closing_ids(self, response_ids: Sequence[int]) -> list[int]:
        """What the template's end-of-turn text adds after a turn: all of it after a stop string or the
        length limit, the rest of it after an EOS token that is its start (``\\n`` after ``<|im_end|>``)."""
        eot = self.end_of_turn_ids
        if eot and list(response_ids[-len(eot) :]) == eot:
            return []
        # A partial match counts only when it ends on a special token: content that happens to end
        # like the template's text (a newline) is not the end of the turn.
        for k in range(len(eot) - 1, 0, -1):
            if list(response_ids[-k:]) == eot[:k] and response_ids[-1] in self._special_ids:
                return eot[k:]
        return list(eot)


@attrs.define
class _State:
    prompt_ids: list[int]
    ids: list[int] = attrs.field(factory=list)
    logprobs: list[float] = attrs.field(factory=list)
    mask: list[int] = attrs.field(factory=list)
    finish_reason: str = "stop"
    version: int | None = None

    def append(self, ids: Sequence[int], logprobs: Sequence[float] | None, model: bool) -> None:
        self.ids.extend(ids)
        self.logprobs.extend(logprobs if logprobs is not None else [0.0] * len(ids))
        self.mask.extend([1 if model else 0] * len(ids))

    def total(self) -> int:
        return len(self.prompt_ids) + len(self.ids)


class TurnBarrier:
    """Holds each trajectory before its next turn until every trajectory still going has arrived;
    a trajectory that ends :meth:`leave` s instead. ``rounds`` counts the releases."""

    def __init__(self, parties: int):
        self.parties, self.arrived, self.rounds = parties, 0, 0
        self._gate = asyncio.Event()

    async def wait(self) -> None:
        gate = self._gate
        self.arrived += 1
        self._release_if_full()
        await gate.wait()

    def leave(self) -> None:
        self.parties -= 1
        self._release_if_full()

    def _release_if_full(self) -> None:
        if self.arrived and self.arrived >= self.parties:
            self._gate.set()
            self._gate, self.arrived = asyncio.Event(), 0
            self.rounds += 1


class MultiTurnRunner:
    """Runs ``n`` multi-turn trajectories per sample concurrently; callable like ``generator.generate``."""

    def __init__(self, generator, environment, tokenizer, *, max_turns: int = 3, max_total_tokens: int = 1024,
                 observation_role: str = "user", turn_stop_strings: Sequence[str] = (), max_env_concurrency: int = 256,
                 turn_barrier: bool = False):
        if max_turns < 1:
            raise ValueError(f"max_turns must be >= 1, got {max_turns}")
        if max_env_concurrency < 1:
            raise ValueError(f"max_env_concurrency must be >= 1, got {max_env_concurrency}")
        # Threads start on demand (one per trajectory in flight, up to the bound) and are reused.
        self._env_pool = concurrent.futures.ThreadPoolExecutor(max_env_concurrency, thread_name_prefix="rlcore-env")
        self.generator, self.environment = generator, environment
        self.max_turns, self.max_total_tokens = max_turns, max_total_tokens
        self.turn_stop = tuple(turn_stop_strings)
        self.turn_barrier = turn_barrier
        self._turns = environment if isinstance(environment, TrajectoryTurns) else None
        self.last_barrier_rounds = 0
        self.suffixes = ChatSuffixes(tokenizer, observation_role)
        self.last_trajectories: list[list[MultiTurnTrajectory]] = []
        self.last_failures: list[dict] = []  # never any: an environment's error is scored, not retried (the agent runner's have some)

    def _turn_params(self, params: SamplingParams, room: int, seed: int | None, budget: int | None = None) -> SamplingParams:
        limit = min(params.max_new_tokens, room) if budget is None else min(params.max_new_tokens, room, max(1, budget))
        return attrs.evolve(params, n=1, max_new_tokens=limit, seed=seed,
                            stop=tuple(dict.fromkeys(tuple(params.stop) + self.turn_stop)))

    def _in_env_thread(self, fn, *args):
        """``fn(*args)`` on the environment threads, in this context (a batch's deadline goes with it)."""
        return asyncio.get_running_loop().run_in_executor(self._env_pool, contextvars.copy_context().run, fn, *args)

    async def _env_step(self, sample: Sample, trajectory: int, history: list[str],
                        session: EnvironmentSession | None = None) -> EnvStep:
        try:
            if session is not None:
                return await self._in_env_thread(session.step, history[-1])
            if self._turns is not None:
                return await self._in_env_thread(self._turns.step_trajectory, sample, trajectory, list(history))
            (step,) = await self._in_env_thread(self.environment.step, [sample], [list(history)])
        except EnvironmentTimeout:
            raise
        except Exception:  # noqa: BLE001 - an environment failure ends the trajectory with reward 0, counted
            return EnvStep(reward=0.0, done=True, metrics={"error": 1.0})
        return step

    async def run_one(self, sample: Sample, params: SamplingParams, seed: int | None = None, trajectory: int = 0,
                      barrier: TurnBarrier | None = None) -> MultiTurnTrajectory:
        """Trajectory ``trajectory`` (0..n-1) of ``sample``; with a ``barrier``, each turn after the first waits at it."""
        if sample.prompt_ids is None:
            raise ValueError(f"sample {sample.index} has no prompt_ids (the dataset must tokenize prompts)")
        try:
            if not isinstance(self.environment, SessionEnvironment):
                return await self._turns_of(sample, params, seed, trajectory, barrier, None)
            session = await self._in_env_thread(self.environment.open_session, sample)
            try:
                return await self._turns_of(sample, params, seed, trajectory, barrier, session)
            finally:
                await self._in_env_thread(session.close)
        finally:
            if barrier is not None:
                barrier.leave()

    async def _turns_of(self, sample: Sample, params: SamplingParams, seed: int | None, trajectory: int,
                        barrier: TurnBarrier | None, session: EnvironmentSession | None) -> MultiTurnTrajectory:
        state = _State(list(sample.prompt_ids))
        traj = MultiTurnTrajectory(sample, result=None)  # type: ignore[arg-type]
        for turn in range(self.max_turns):
            room = self.max_total_tokens - state.total()
            if room <= 0:
                state.finish_reason = "length"
                break
            if barrier is not None and turn > 0:
                await barrier.wait()
            turn_seed = None if seed is None else seed + 7919 * turn
            budget = None if self._turns is None else self._turns.turn_max_new_tokens(sample, trajectory, turn)
            out = await self.generator.agenerate(state.prompt_ids + state.ids, self._turn_params(params, room, turn_seed, budget))
            state.version = out.policy_version if state.version is None else min(state.version, out.policy_version)
            state.append(out.response_ids, out.response_logprobs, model=True)
            state.finish_reason = out.finish_reason
            traj.turns.append(out.text)
            began = time.perf_counter()
            step = await self._env_step(sample, trajectory, traj.turns, session)
            traj.env_s += time.perf_counter() - began
            traj.reward, traj.done, traj.env_metrics = float(step.reward), bool(step.done), dict(step.metrics)
            if step.done or turn == self.max_turns - 1 or out.finish_reason in ("abort", "truncated_prompt"):
                break
            observation = self.suffixes.closing_ids(out.response_ids) + self.suffixes.observation_ids(step.observation or "")
            if state.total() + len(observation) >= self.max_total_tokens:
                state.finish_reason = "length"
                break
            state.append(observation, None, model=False)
            traj.observations.append(step.observation or "")
        traj.result = GenerationResult(
            prompt_ids=state.prompt_ids, response_ids=state.ids, response_logprobs=state.logprobs,
            finish_reason=state.finish_reason, text=traj.turns[-1] if traj.turns else "", response_mask=state.mask,
            policy_version=state.version or 0, num_turns=len(traj.turns),
        )
        return traj

    async def arun(self, samples: Sequence[Sample], params: SamplingParams) -> list[list[MultiTurnTrajectory]]:
        barrier = TurnBarrier(len(samples) * params.n) if self.turn_barrier else None
        jobs = [self.run_one(s, params, None if params.seed is None else params.seed + 104729 * (i * params.n + k), k, barrier)
                for i, s in enumerate(samples) for k in range(params.n)]
        flat = await asyncio.gather(*jobs)
        self.last_barrier_rounds = 0 if barrier is None else barrier.rounds
        return [list(flat[i * params.n : (i + 1) * params.n]) for i in range(len(samples))]

    def metrics(self) -> dict[str, float]:
        """Merged into the step's metrics: the last call's :func:`critical_path_metrics` and the turn barrier's rounds."""
        out = critical_path_metrics(self.last_trajectories)
        return {**out, "rollout/turn_barrier_rounds": float(self.last_barrier_rounds)} if out else {}

    def __call__(self, samples: Sequence[Sample], params: SamplingParams) -> list[list[GenerationResult]]:
        """``params.n`` results per sample (the loop's contract); trajectories with rewards are kept
        in ``last_trajectories``."""
        self.last_trajectories = asyncio.run(self.arun(samples, params))
        return [[t.result for t in group] for group in self.last_trajectories]


def critical_path_metrics(groups) -> dict[str, float]:
    """A multi-turn call's model tokens and its critical path, from its trajectories (each with a ``result`` and the
    ``env_s`` its tools took; a native multi-turn rollout's or an agent's): the model tokens and tool seconds of the
    trajectory with the most model tokens, and the most tool seconds of any trajectory. The planner bounds decode
    by the longest trajectory (``rlcore plan``'s response tail); the benchmark's multi-turn table reads them too."""
    flat = [t for group in groups for t in group if t.result is not None]
    if not flat:
        return {}
    tokens = [sum(t.result.response_mask or ()) for t in flat]
    longest = max(range(len(flat)), key=tokens.__getitem__)
    return {"rollout/generated_tokens": float(sum(tokens)),
            "rollout/longest_trajectory_model_tokens": float(tokens[longest]),
            "rollout/longest_trajectory_env_s": flat[longest].env_s,
            "rollout/max_trajectory_env_s": max(t.env_s for t in flat)}


def make_multi_turn_runner(generator, environment, tokenizer, config: Any) -> MultiTurnRunner:
    """Build a runner from a :class:`rlcore.config.RunConfig`: the turn settings are the
    environment section's (:class:`rlcore.config.environment.MultiTurnEnvConfig`). The ``agent``
    environment is rolled out by its agent instead (``rlcore.agents.runner.make_agent_runner``)."""
    from rlcore.config.agents import AgentEnvConfig
    from rlcore.config.environment import MultiTurnEnvConfig

    path = f"env.{config.env.name}"
    turns = config.section(path)
    if isinstance(turns, AgentEnvConfig):
        raise TypeError(f"{path}: the agent environment is rolled out through rlcore's endpoint by its agent, "
                        "not turn by turn: build its runner with rlcore.agents.runner.make_agent_runner")
    if turns is None:
        turns = MultiTurnEnvConfig()
    elif not isinstance(turns, MultiTurnEnvConfig):
        raise TypeError(f"{path}: a multi-turn environment's section must be a MultiTurnEnvConfig, got {type(turns).__name__}")
    return MultiTurnRunner(
        generator, environment, tokenizer, max_turns=turns.max_turns, max_total_tokens=config.policy.max_total_sequence_length,
        observation_role=turns.observation_role, turn_stop_strings=tuple(turns.turn_stop_strings),
        max_env_concurrency=turns.max_env_concurrency, turn_barrier=turns.turn_barrier,
    )
