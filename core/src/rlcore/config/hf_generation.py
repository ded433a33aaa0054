"""Schema of the built-in ``hf`` generator's section (``policy.generation`` with backend: hf)."""

from __future__ import annotations

import attrs
from attrs import field, frozen

from rlcore.config.generation import GenerationConfig
from rlcore.config.structure import doc


@frozen
class HFGenerationConfig(GenerationConfig):
    backend: str = field(default="hf", metadata=doc("generator name"))
    max_new_tokens: int = field(default=64, validator=attrs.validators.gt(0), metadata=doc("response length limit"))
    dtype: str = field(default="float32", metadata=doc("weights dtype"))
