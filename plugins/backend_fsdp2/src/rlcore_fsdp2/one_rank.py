"""FSDP2 with one data-parallel rank: copy the gradients into the reduce buffer with ``torch.cat``.

Before each reduce-scatter FSDP2 copies a module's gradients into one flat buffer with
``torch._chunk_cat``. Its CUDA kernel builds its launch metadata on the host, one entry per
block of the copy: for the 1.2B Llama of ``benchmarks/bench_train_fsdp2.py`` that is 31-38 ms of
host time per optimizer step (one call, all parameters at the root), during which the H200 sat
idle (a 36 ms gap in a profiled step of 290 ms; ``benchmarks/RESULTS.md``, seventh session). With
one rank there is one chunk, and ``_chunk_cat`` with one chunk is ``torch.cat`` of the flattened
gradients (same values, same dtype cast into the buffer), whose launch costs microseconds.

:func:`install` wraps FSDP2's copy-in function (a module-level function that ``foreach_reduce``
looks up at each call): one chunk goes through ``torch.cat``, several through FSDP2's own code.
It is written here because no FSDP2 option skips the copy; torch versions without that function
are left alone.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

log = logging.getLogger(__name__)

_ORIGINAL_ATTR = "_rlcore_original"


def copy_in(unsharded_grads: list[torch.Tensor], reduce_scatter_input: torch.Tensor, world_size: int,
            original: Any = None) -> None:
    """``foreach_reduce_scatter_copy_in`` with a ``torch.cat`` path for one chunk."""
    if world_size == 1:
        torch.cat([grad.reshape(-1) for grad in unsharded_grads], out=reduce_scatter_input.view(-1))
        return
    original(unsharded_grads, reduce_scatter_input, world_size)


def install() -> bool:
    """Wrap FSDP2's copy-in (once per process); False where this torch has no such function."""
    try:
        from torch.distributed.fsdp._fully_shard import _fsdp_collectives as collectives
    except ImportError:
        return False
    current = getattr(collectives, "foreach_reduce_scatter_copy_in", None)
    if current is None:
        log.debug("fsdp2 backend: this torch has no foreach_reduce_scatter_copy_in; FSDP2's copy-in is left as is")
        return False
    if hasattr(current, _ORIGINAL_ATTR):
        return True

    def wrapped(unsharded_grads, reduce_scatter_input, world_size):
        copy_in(unsharded_grads, reduce_scatter_input, world_size, current)

    setattr(wrapped, _ORIGINAL_ATTR, current)
    collectives.foreach_reduce_scatter_copy_in = wrapped
    return True
