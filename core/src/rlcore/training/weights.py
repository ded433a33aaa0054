"""Helpers every backend and transport shares: byte-bounded chunks of named tensors, the gather
of per-sequence results from data-parallel ranks to rank 0, and the one Hugging Face checkpoint
writer."""

from __future__ import annotations

import copy
import json
import shutil
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

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


def write_hf_checkpoint(chunks: Iterable[list[NamedTensor]], path: str | Path, hf_config: Any, dtype: torch.dtype,
                        tokenizer_dir: str | None, *, model_dir: str | None = None, rank: int = 0) -> None:
    """A Hugging Face checkpoint from a backend's exported chunks (every rank passes its
    ``export_weights``; rank 0 writes, the others only iterate, for the collectives inside).

    One safetensors file per chunk (``model.safetensors`` alone, else
    ``model-0000i-of-0000n.safetensors`` and an index), ``config.json`` with ``dtype``, the
    tokenizer of ``tokenizer_dir`` (skipped when None or a directory without a tokenizer) and
    ``generation_config.json`` (and a vision model's ``preprocessor_config.json`` or ``processor_config.json``) from
    ``model_dir`` (default: the tokenizer directory) if it has one."""
    if rank != 0:
        for _ in chunks:
            pass
        return
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    files: list[tuple[str, list[str]]] = []
    total = 0
    for i, chunk in enumerate(chunks):
        tmp = f"model-part-{i:05d}.safetensors"
        # Clone: reverse weight conversion returns views of one fused tensor, which safetensors refuses.
        tensors = {n: t.detach().to("cpu").contiguous().clone() for n, t in chunk}
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        save_file(tensors, str(path / tmp), metadata={"format": "pt"})
        files.append((tmp, list(tensors)))
    if len(files) == 1:
        (path / files[0][0]).rename(path / "model.safetensors")
    else:
        weight_map = {}
        for i, (tmp, names) in enumerate(files):
            final = f"model-{i + 1:05d}-of-{len(files):05d}.safetensors"
            (path / tmp).rename(path / final)
            weight_map.update({n: final for n in names})
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    _write_config(hf_config, path, dtype)
    from rlcore.utils import local_model_dir

    # Hub ids (policy.model_name as transformers takes it) name their snapshot in the local cache.
    tokenizer_dir = local_model_dir(tokenizer_dir) if tokenizer_dir else None
    model_dir = local_model_dir(model_dir) if model_dir else None
    if tokenizer_dir and any((Path(tokenizer_dir) / f).is_file() for f in ("tokenizer_config.json", "tokenizer.json")):
        from transformers import AutoTokenizer

        AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(path)
    # the last two: a vision model's image processor, or its whole processor (LLaVA's)
    for name in ("generation_config.json", "preprocessor_config.json", "processor_config.json"):
        kept = Path(model_dir or tokenizer_dir or "") / name
        if (model_dir or tokenizer_dir) and kept.is_file():
            shutil.copy(kept, path / name)


def _write_config(hf_config: Any, path: Path, dtype: torch.dtype) -> None:
    config = copy.deepcopy(hf_config)
    config.dtype = dtype
    # A backend's own attention implementation name must not leak: a plain transformers/vLLM load
    # would not know it.
    config._attn_implementation = None
    config.use_cache = True
    config.save_pretrained(path)
