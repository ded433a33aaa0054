"""Refit for the ``sglang`` generator, chosen through rlcore's ``rlcore_weight_transport`` hook.

The trainer's Hugging Face-named chunks (:meth:`rlcore.interfaces.TrainerHandle.export_chunks`: rank
0's, in this process, wherever the ranks run) are asked for in the engine's dtype, so a bfloat16
engine beside a float32 trainer receives half the bytes, and go into ``update_weights`` (SGLang's
``update_weights_from_tensor``, :mod:`rlcore_sglang.weights`).
"""

from __future__ import annotations

from rlcore.interfaces import Generator, TrainerHandle, WeightTransport
from rlcore.training.weights import stream_into


class SglangTensorTransport:
    """Implements :class:`rlcore.interfaces.WeightTransport`."""

    name = "sglang_tensor"

    def __init__(self, chunk_bytes: int, dtype: str):
        self.chunk_bytes, self.dtype = chunk_bytes, dtype

    def transfer(self, trainer: TrainerHandle, generator: Generator) -> dict[str, float]:
        return stream_into(generator, trainer.export_chunks(dtype=self.dtype, chunk_bytes=self.chunk_bytes))


def pick_transport(trainer: TrainerHandle, generator: Generator) -> WeightTransport | None:
    """Ours for an ``sglang`` generator; None (another plugin decides) for any other."""
    from rlcore_sglang.generator import SglangGenerator

    if not isinstance(generator, SglangGenerator):
        return None
    return SglangTensorTransport(generator.config.refit.chunk_bytes, generator.dtype)
