"""torch's CUDA allocator for a run: expandable segments, unless the user chose settings of their own.

A training step's tensors come in many sizes and lifetimes (micro-batches of other lengths, logits
chunks, FSDP2's gradient buffers). torch's default caching allocator carves them out of fixed segments
and keeps the pieces they leave, so the device holds more than the tensors need: 6.4 GiB of the 1.2B
FSDP2 step's 48 GiB (``docs/performance.md``, the memory section), memory the run's plan cannot give to
the colocated engine. With expandable segments each stream maps one segment that grows as needed and
freed blocks coalesce. vLLM's sleep-mode pool turns the setting off around its own allocations and back
on after them.

torch reads its allocator settings from ``PYTORCH_CUDA_ALLOC_CONF`` once, when the process first
initializes CUDA, and there is no public call to change them later: :func:`use_expandable_segments` sets
the variable before that, for this process and the processes it starts (trainer ranks, engines). A value
the user set, even an empty one, is left as it is; so is a process that initialized CUDA already (a line
says the run keeps torch's settings).
"""

from __future__ import annotations

import os
import sys

ALLOCATOR_ENV = "PYTORCH_CUDA_ALLOC_CONF"
DEFAULT_ALLOCATOR_CONF = "expandable_segments:True"


def cuda_initialized() -> bool:
    """Whether this process has started CUDA (only possible once torch is imported)."""
    torch = sys.modules.get("torch")
    return torch is not None and torch.cuda.is_initialized()


def use_expandable_segments() -> str | None:
    """Set ``PYTORCH_CUDA_ALLOC_CONF`` to rlcore's default where nothing decided it yet; returns the
    settings the process's allocator runs with (None: torch's own defaults)."""
    if ALLOCATOR_ENV in os.environ:
        return os.environ[ALLOCATOR_ENV] or None
    if cuda_initialized():
        print(f"allocator: CUDA started before the run; torch's allocator keeps its settings "
              f"(set {ALLOCATOR_ENV}={DEFAULT_ALLOCATOR_CONF} before it starts for rlcore's)", flush=True)
        return None
    os.environ[ALLOCATOR_ENV] = DEFAULT_ALLOCATOR_CONF
    return DEFAULT_ALLOCATOR_CONF
