"""Schema of the ``reward_model`` environment (section ``env.reward_model``). Imports no torch."""

from __future__ import annotations

from typing import Literal

import attrs
from attrs import field, frozen

from rlcore.config.structure import doc


@frozen(kw_only=True)
class RewardModelEnvConfig:
    """Score each trajectory with a trained reward model (a Hugging Face sequence-classification
    checkpoint with one label, e.g. what the ``reward_model`` algorithm writes to ``<log_dir>/model``)."""

    model: str = field(metadata=doc("the reward model's checkpoint directory (its tokenizer beside it)"))
    device: Literal["auto", "cpu", "cuda"] = field(default="auto", metadata=doc("where it scores; auto = cuda when available"))
    dtype: Literal["float32", "bfloat16", "float16"] = field(default="float32", metadata=doc("scoring dtype"))
    max_tokens: int | None = field(
        default=None, validator=attrs.validators.optional(attrs.validators.gt(0)),
        metadata=doc("longest prompt + response scored (longer ones get reward 0); None = the model's max positions"))
    batch_size: int = field(default=64, validator=attrs.validators.gt(0), metadata=doc("trajectories per forward pass"))
    scale: float = field(default=1.0, metadata=doc("reward = scale * (score - shift)"))
    shift: float = field(default=0.0, metadata=doc("subtracted from the score before scaling"))
    correct_above: float | None = field(
        default=None, metadata=doc("a reward above this counts as correct (val/accuracy); None = no accuracy"))
