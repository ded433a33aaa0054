"""The ``agent`` environment's section (``env.agent``). Imports neither torch nor FastAPI."""

from __future__ import annotations

from typing import Literal

import attrs
from attrs import field, frozen

from rlcore.config.environment import MultiTurnEnvConfig
from rlcore.config.structure import doc

_positive = attrs.validators.gt(0)
_non_negative = attrs.validators.ge(0)


def _function_path(instance, attribute, value: str) -> None:
    if value and ":" not in value:  # empty: an error when the runner is built (a section may be written before its function)
        raise ValueError(f"env.agent.function: {value!r} is not 'module:function' (or 'path/to/file.py:function')")


@frozen(slots=False)
class AgentEnvConfig(MultiTurnEnvConfig):
    """An agent written against the OpenAI API, rolled out through rlcore's endpoint (:mod:`rlcore.agents`).

    ``max_turns`` bounds the model requests of one trajectory; ``max_env_concurrency`` the agents
    running at once. ``observation_role`` and ``turn_stop_strings`` are not read: the agent sends
    its own messages and stop strings; ``turn_barrier`` must stay false."""

    max_turns: int = field(default=3, validator=_positive, metadata=doc("model requests per trajectory; more are refused (HTTP 429)"))
    max_env_concurrency: int = field(default=256, validator=_positive, metadata=doc("agents (trajectories) running at once"))
    function: str = field(default="", validator=_function_path,
                          metadata=doc("the agent: an async (or plain) callable agent(client, sample) -> reward | EnvStep | "
                                       "{'reward': r, 'metrics': {...}}, as 'module:function' or 'path/file.py:function'"))
    max_retries: int = field(default=2, validator=_non_negative,
                             metadata=doc("attempts of a failed trajectory (exception, timeout, bad reward, endpoint error) after the first"))
    on_group_failure: Literal["drop", "resample"] = field(
        default="drop", validator=attrs.validators.in_(("drop", "resample")),
        metadata=doc("a group with a trajectory that failed every attempt: dropped from the step, or rolled out "
                     "again whole (max_group_resamples times, then dropped)"))
    max_group_resamples: int = field(default=1, validator=_non_negative, metadata=doc("whole-group re-rollouts of on_group_failure: resample"))
    attempt_timeout_s: float | None = field(
        default=None, validator=attrs.validators.optional(_positive),
        metadata=doc("one attempt of one trajectory over this fails (cause 'timeout') and is retried; None: only "
                     "cluster.timeout_s bounds the batch, and a hung agent stops the run naming its trajectory"))
    max_request_bytes: int = field(default=1 << 20, validator=_positive, metadata=doc("largest request body the endpoint accepts"))
    max_concurrent_requests: int = field(
        default=1, validator=_positive,
        metadata=doc("requests of one trajectory in flight or waiting at once (they are served one after another); more are refused"))
    request_timeout_s: float = field(default=600.0, validator=_positive, metadata=doc("the agent's client gives up on one request after this"))
