"""Schema of the ``env.toy_echo`` section. Plain attrs, no torch: ``rlcore plugins`` imports it."""

from __future__ import annotations

import math

import attrs
from attrs import field, frozen

from rlcore.config import doc


def _finite(instance, attribute, value):
    if not math.isfinite(value):
        raise ValueError(f"{attribute.name} must be a finite number, got {value}")


@frozen
class ToyEchoConfig:
    """Reward the model for repeating the sample's answer."""

    case_sensitive: bool = field(default=False, metadata=doc("compare answers case-sensitively"))
    reward_correct: float = field(default=1.0, validator=_finite, metadata=doc("reward when the last turn equals the answer"))
    reward_wrong: float = field(default=0.0, validator=_finite, metadata=doc("reward otherwise"))
    max_chars: int = field(default=1000, validator=attrs.validators.gt(0), metadata=doc("longer responses are wrong without comparing"))
