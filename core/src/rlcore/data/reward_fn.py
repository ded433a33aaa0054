"""A plain Python function as the environment: ``rlcore.run(config, reward_fn=fn)`` or
``env.reward_fn: module:function`` in a recipe.

The function takes TRL's reward-function signature, so one written for TRL's ``reward_funcs``
works unchanged::

    def reward_fn(prompts, completions, **kwargs) -> list[float]:
        return [1.0 if c.strip() == str(a) else 0.0 for c, a in zip(completions, kwargs["answer"])]

It is called once per batch of single-turn trajectories with keyword arguments: ``prompts`` (the
dataset's prompts, text or chat messages), ``completions`` (the model's text), ``answer`` (each
sample's ground truth) and each key of the samples' ``metadata`` as a list, as TRL passes a
dataset's extra columns. It returns one number per completion; ``None`` (TRL: "does not apply")
scores 0. A value that is no finite number (NaN, a string such as ``"yes"``) scores 0 too, but is
counted in ``env/errors`` and printed once naming the function: it is a bug in the function.

Reward functions never raise on model output: an exception inside the function scores that batch
0, is counted in ``env/reward_fn_errors`` and printed once with its message, and the run goes on.
A function that returns the wrong number of rewards is a bug in the function, not in the model's
output, and stops the run with a message saying so. Every call is bounded by ``cluster.timeout_s``
like any environment's (:class:`rlcore.deadlines.TimedEnvironment`, ``env.on_timeout``):
a function that never returns, sleeping or spinning, stops the run naming it (the timeout is not one
of the exceptions that score 0).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from rlcore.config import ConfigError
from rlcore.errors import RunStopped
from rlcore.interfaces import Environment, EnvStep, Sample


class FunctionEnvironment:
    """:class:`rlcore.interfaces.Environment` around a TRL-style reward function."""

    def __init__(self, fn: Callable[..., Any], name: str | None = None):
        if not callable(fn):
            raise TypeError(f"a reward function must be callable, got {type(fn).__name__}")
        self.fn = fn
        self.name = name or getattr(fn, "__name__", type(fn).__name__)
        self._warned = False
        self._warned_value = False

    def step(self, samples: list[Sample], histories: list[list[str]]) -> list[EnvStep]:
        completions = [h[-1] if h else "" for h in histories]
        kwargs: dict[str, list[Any]] = {"answer": [s.answer for s in samples]}
        for key in sorted({k for s in samples for k in (s.metadata or {})} - {"prompts", "completions", "answer"}):
            kwargs[key] = [(s.metadata or {}).get(key) for s in samples]
        try:
            rewards = list(self.fn(prompts=[s.prompt for s in samples], completions=completions, **kwargs))
        except RunStopped:  # its deadline (cluster.timeout_s) expired inside it: env.on_timeout decides, not this
            raise
        except Exception as exc:  # noqa: BLE001 - the rule: a reward function never stops a run on model output
            if not self._warned:
                print(f"warning: reward function {self.name} raised {type(exc).__name__}: {exc}; that batch scores 0 "
                      "(counted in env/reward_fn_errors; shown once)", flush=True)
                self._warned = True
            return [EnvStep(reward=0.0, metrics={"reward_fn_errors": 1.0}) for _ in samples]
        if len(rewards) != len(samples):
            raise ValueError(f"reward function {self.name} returned {len(rewards)} rewards for {len(samples)} completions; "
                             "it must return one per completion")
        return [EnvStep(reward=self._score(r, i), metrics={"reward_fn_errors": 0.0}) for i, r in enumerate(rewards)]

    def _score(self, value: Any, index: int) -> float:
        """``value`` as a reward: None scores 0; a value that is no finite number becomes NaN, which the
        loop scores 0 and counts in ``env/errors`` (:func:`rlcore.generation.batching.apply_env_steps`)."""
        if value is None:
            return 0.0
        try:  # a string is no reward even when it reads as one ("1.0"): TRL's functions return floats
            number = math.nan if isinstance(value, (str, bytes)) else float(value)
        except (TypeError, ValueError, OverflowError):
            number = math.nan
        if math.isfinite(number):
            return number
        if not self._warned_value:
            shown = repr(value) if len(repr(value)) <= 60 else repr(value)[:57] + "..."
            print(f"warning: reward function {self.name} returned {type(value).__name__} {shown} for completion {index}, "
                  "not a finite number; scored 0 and counted in env/errors (shown once)", flush=True)
            self._warned_value = True
        return math.nan


def load_reward_fn(spec: str) -> Callable[..., Any]:
    """The function ``env.reward_fn`` names (``module:function``), or a ConfigError naming the key."""
    from rlcore.utils import resolve

    try:
        fn = resolve(spec)
    except ValueError:
        raise ConfigError("env.reward_fn", f"{spec!r}: expected 'module:function' (e.g. my_rewards:exact_match)") from None
    except (ImportError, AttributeError) as exc:
        raise ConfigError("env.reward_fn", f"{spec!r} cannot be imported: {type(exc).__name__}: {exc} "
                          "(is its module on PYTHONPATH?)") from None
    if not callable(fn):
        raise ConfigError("env.reward_fn", f"{spec!r} is a {type(fn).__name__}, not a function")
    return fn


def as_environment(given: dict[str, Any]) -> dict[str, Any]:
    """``rlcore.run``'s keywords with ``reward_fn=fn`` (or a plain function passed as ``environment``)
    turned into a :class:`FunctionEnvironment`."""
    given = dict(given)
    fn = given.pop("reward_fn", None)
    env = given.get("environment")
    if fn is not None and env is not None:
        raise TypeError("rlcore.run got both environment= and reward_fn=; pass one")
    if fn is None and env is not None and callable(env) and not isinstance(env, Environment):
        fn = env  # a function passed as the environment
    if fn is not None:
        given["environment"] = FunctionEnvironment(fn)
    return given

