"""Schema of the ``policy.ddp_cfg`` section. Plain attrs, no torch: ``rlcore plugins`` imports it.

The keys every backend shares (precision, optimizer, scheduler, packing, clipping) are core's
``policy`` keys; this section holds only what is DistributedDataParallel's own.
"""

from __future__ import annotations

import attrs
from attrs import field, frozen

from rlcore.config import doc

SECTION = "policy.ddp_cfg"
_positive = attrs.validators.gt(0)


@frozen
class DDPConfig:
    """Every trainer rank holds the whole model; gradients are summed over ranks by DDP's buckets."""

    enabled: bool = field(default=False, metadata=doc("use this backend (it takes precedence over policy.dtensor_cfg)"))
    bucket_cap_mb: float = field(default=25.0, validator=_positive, metadata=doc("gradient bucket size of DDP's all-reduce, in MiB"))
    find_unused_parameters: bool = field(default=False, metadata=doc("let DDP look for parameters no forward used (slower; needed only for models that skip some)"))
    logprob_chunk_tokens: int = field(default=1024, validator=_positive, metadata=doc("rows of the logits turned into float32 log-softmax at a time"))
