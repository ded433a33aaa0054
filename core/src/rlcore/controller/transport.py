"""The refit's transport between the trainer and the generator: a plugin's (hook ``rlcore_weight_transport``)
when one claims the pair, else :class:`StreamTransport`, which streams the weights through this process."""

from __future__ import annotations

from typing import Any

from rlcore.config import RefitConfig, RunConfig
from rlcore.interfaces import Generator, TrainerHandle, WeightTransport
from rlcore.training.weights import stream_into


class StreamTransport:
    """Fallback refit: stream the trainer's HF-named chunks into ``generator.update_weights``."""

    name = "stream"

    def __init__(self, chunk_bytes: int | None = None, dtype: Any = None):
        self.chunk_bytes = chunk_bytes or RefitConfig().chunk_bytes  # the one default, policy.generation.refit's
        self.dtype = dtype

    def transfer(self, trainer: TrainerHandle, generator: Generator) -> dict[str, float]:
        return stream_into(generator, trainer.export_chunks(dtype=self.dtype, chunk_bytes=self.chunk_bytes))


def pick_transport(manager, trainer: TrainerHandle, generator: Generator, config: RunConfig) -> WeightTransport:
    """A plugin's transport when one claims the pair, else :class:`StreamTransport`.

    The hook gets the trainer handle: a plugin that can send from inside the ranks uses its
    ``run_on_ranks``; one that cannot returns None and weights stream through this process."""
    found = manager.weight_transport(trainer=trainer, generator=generator)
    if found is not None and not isinstance(found, WeightTransport):
        raise TypeError(f"the rlcore_weight_transport hook returned a {type(found).__name__}, which lacks a name or "
                        "transfer() (rlcore.interfaces.WeightTransport)")
    if found is not None:
        return found
    return StreamTransport(chunk_bytes=config.generation.refit.chunk_bytes)
