"""Helpers every backend and transport shares: byte-bounded chunks of named tensors, and the
gather of per-sequence results from data-parallel ranks to rank 0."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

NamedTensor = tuple[str, torch.Tensor]


def chunked(named: Iterable[NamedTensor], chunk_bytes: int) -> Iterator[list[NamedTensor]]:
    """Group tensors into chunks of at most ``chunk_bytes`` (a larger tensor is a chunk of its own)."""
    chunk: list[NamedTensor] = []
    size = 0
    for name, tensor in named:
        nbytes = tensor.numel() * tensor.element_size()
        if chunk and size + nbytes > chunk_bytes:
            yield chunk
            chunk, size = [], 0
        chunk.append((name, tensor))
        size += nbytes
    if chunk:
        yield chunk


def gather_sequences_to_rank0(local: dict[int, torch.Tensor], num_sequences: int, who: str) -> list[torch.Tensor] | None:
    """Merge ``{sequence index: values}`` from every rank on rank 0, in sequence order; None elsewhere.

    Raises naming ``who`` when a sequence is missing (a packing plan that differed between ranks).
    """
    import torch.distributed as dist

    gathered = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(local, gathered, dst=0)
    if dist.get_rank() != 0:
        return None
    merged: dict[int, torch.Tensor] = {}
    for part in gathered:
        merged.update(part)
    missing = [i for i in range(num_sequences) if i not in merged]
    if missing:
        raise RuntimeError(f"{who}: no logprobs came back for sequences {missing[:10]} (packing plan mismatch between ranks)")
    return [merged[i] for i in range(num_sequences)]


def stream_into(generator, chunks: Iterable[list[NamedTensor]]) -> dict[str, float]:
    """Feed ``chunks`` to ``generator.update_weights``; return ``{"bytes", "seconds"}`` moved."""
    import time

    moved = {"bytes": 0}
    start = time.perf_counter()

    def counted():
        for chunk in chunks:
            moved["bytes"] += sum(t.numel() * t.element_size() for _, t in chunk)
            yield chunk

    generator.update_weights(counted())
    return {"bytes": float(moved["bytes"]), "seconds": time.perf_counter() - start}
