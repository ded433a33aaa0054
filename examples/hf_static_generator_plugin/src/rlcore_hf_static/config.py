"""Schema of ``policy.generation`` when ``backend: hf_static``. Plain attrs, no torch.

It extends :class:`rlcore.config.GenerationConfig`, the keys every generator shares (sampling,
``colocated``, ``refit``), as every generator's schema must.
"""

from __future__ import annotations

from typing import Literal

import attrs
from attrs import field, frozen

from rlcore.config import GenerationConfig, doc


@frozen
class HFStaticGenerationConfig(GenerationConfig):
    backend: str = field(default="hf_static", metadata=doc("generator name"))
    max_new_tokens: int = field(default=64, validator=attrs.validators.gt(0), metadata=doc("response length limit"))
    dtype: Literal["float32", "bfloat16", "float16"] = field(default="float32", metadata=doc("weights dtype of the generation model (refit sends this dtype)"))
    batch_rows: int = field(default=256, validator=attrs.validators.gt(0), metadata=doc("sequences decoded together by one generate() call"))
    cache_implementation: Literal["static", "dynamic"] = field(default="static", metadata=doc(
        "transformers' KV cache: 'static' preallocates it for the batch's longest prompt + max_new_tokens"))
