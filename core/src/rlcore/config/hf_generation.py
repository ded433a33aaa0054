"""Schema of the built-in ``hf`` generator's section (``policy.generation`` with backend: hf)."""

from __future__ import annotations

from attrs import field, frozen

from rlcore.config.generation import GenerationConfig
from rlcore.config.structure import doc


@frozen
class HFGenerationConfig(GenerationConfig):
    backend: str = field(default="hf", metadata=doc("generator name"))
    dtype: str = field(default="float32", metadata=doc("weights dtype"))
