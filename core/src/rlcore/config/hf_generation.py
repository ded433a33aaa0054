"""Schema of the built-in ``hf`` generator's section (``policy.generation`` with backend: hf)."""

from __future__ import annotations

import attrs
from attrs import field, frozen

from rlcore.config.structure import doc

_positive = attrs.validators.gt(0)
_non_negative = attrs.validators.ge(0)


@frozen
class HFRefitConfig:
    """Refit settings the run loop reads from any generator's section."""

    chunk_bytes: int = field(default=256 << 20, metadata=doc("bytes per streamed chunk of weights"))
    probe_threshold: float = field(default=0.05, metadata=doc("fail when the probe's mean |logprob gap| exceeds this"))
    probe_num_sequences: int = field(default=4, metadata=doc("sequences scored by both sides after each refit; 0 disables"))


@frozen
class HFGenerationConfig:
    backend: str = field(default="hf", metadata=doc("generator name"))
    temperature: float = field(default=1.0, validator=_non_negative, metadata=doc("sampling temperature; 0 = greedy"))
    top_p: float = field(default=1.0, validator=[attrs.validators.gt(0), attrs.validators.le(1)], metadata=doc("nucleus sampling"))
    top_k: int = field(default=-1, metadata=doc("top-k; -1 disables"))
    max_new_tokens: int = field(default=64, validator=_positive, metadata=doc("response length limit"))
    stop_strings: tuple[str, ...] = field(default=(), metadata=doc("stop when the text ends with one of these"))
    stop_token_ids: tuple[int, ...] = field(default=(), metadata=doc("extra stop tokens besides EOS"))
    dtype: str = field(default="float32", metadata=doc("weights dtype"))
    refit: HFRefitConfig = field(factory=HFRefitConfig, metadata=doc("refit chunking and verification"))

    def __attrs_post_init__(self):
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"top_k must be -1 (off) or positive, got {self.top_k}")
