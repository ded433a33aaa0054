"""Refit for the ``hf_static`` generator, chosen through rlcore's ``rlcore_weight_transport`` hook.

The trainer's Hugging Face-named chunks (:meth:`rlcore.interfaces.TrainerHandle.export_chunks`:
rank 0's, in this process, wherever the ranks run) are asked for in the generator's own dtype, so
a bfloat16 generator on a float32 trainer receives half the bytes, and are copied into the
generation model in place by ``update_weights``.
"""

from __future__ import annotations

from rlcore.interfaces import Generator, TrainerHandle, WeightTransport
from rlcore.training.weights import stream_into


class InPlaceTransport:
    """Implements :class:`rlcore.interfaces.WeightTransport`."""

    name = "hf_static-in-place"

    def __init__(self, chunk_bytes: int, dtype: str):
        self.chunk_bytes, self.dtype = chunk_bytes, dtype

    def transfer(self, trainer: TrainerHandle, generator: Generator) -> dict[str, float]:
        return stream_into(generator, trainer.export_chunks(dtype=self.dtype, chunk_bytes=self.chunk_bytes))


def pick_transport(trainer: TrainerHandle, generator: Generator) -> WeightTransport | None:
    """Ours for an ``hf_static`` generator; None (another plugin decides) for any other."""
    from rlcore_hf_static.generator import StaticCacheGenerator

    if not isinstance(generator, StaticCacheGenerator):
        return None
    return InPlaceTransport(generator.config.refit.chunk_bytes, generator.config.dtype)
