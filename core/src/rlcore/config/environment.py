"""What core reads of an environment's section: the turn settings of multi-turn environments.

An environment registered with ``multi_turn=True`` has a ``config_cls`` extending
:class:`MultiTurnEnvConfig` (checked when it registers); :func:`rlcore.generation.rollout.make_multi_turn_runner`
reads these keys and nothing else of the section. Imports no torch.
"""

from __future__ import annotations

import attrs
from attrs import field, frozen

from rlcore.config.structure import doc

_positive = attrs.validators.gt(0)


@frozen(slots=False)  # no slots: an environment's schema combines it with its own base class
class MultiTurnEnvConfig:
    """Turn settings of a multi-turn environment's section (``env.<name>``)."""

    max_turns: int = field(default=3, validator=_positive, metadata=doc("model turns per trajectory, the answering turn included"))
    observation_role: str = field(default="user", metadata=doc("chat role of the environment's observations"))
    turn_stop_strings: tuple[str, ...] = field(default=(), metadata=doc("end a model turn (besides EOS)"))
    max_env_concurrency: int = field(default=256, validator=_positive, metadata=doc("environment steps in flight at once"))
    turn_barrier: bool = field(default=False, metadata=doc(
        "every trajectory's next turn waits until all trajectories still going have their current turn generated and "
        "answered, as a batched synchronous rollout does (the baseline of continuous multi-turn scheduling, and the "
        "same batches whatever the tool latencies); false: each trajectory goes on as soon as its observation is ready"))
