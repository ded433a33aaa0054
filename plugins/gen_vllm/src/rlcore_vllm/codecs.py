"""How a chunk of (Hugging Face name, tensor) pairs crosses into the engine's worker.

Three encodings, picked by where the worker lives and where the tensors are:

- ``direct``: the worker runs in this process (vLLM's in-process engine core); the tensors
  themselves are handed over, nothing is copied.
- ``shm`` (CPU, worker in another process): the chunk is packed into one file in
  ``/dev/shm`` that the worker maps; only names, dtypes, shapes and offsets are serialized.
- ``cuda_ipc`` (GPU, worker in another process): the chunk is packed into one CUDA buffer and
  its IPC handle is sent; the worker opens it without a copy through host memory.

``encode`` runs in the trainer/driver process, ``decode`` in the worker. The payload is plain
data (msgpack-friendly: str, int, list, bytes) so vLLM's RPC can carry it without pickling
functions. The sender must keep ``Encoded.keepalive`` until the whole update has finished:
vLLM's layer-wise reload keeps references to loaded tensors until each layer is complete.

Imports torch lazily (this module is imported by the plugin's config-free parts).
"""

from __future__ import annotations

import os
import pickle
import tempfile
import uuid
from typing import Any

import attrs

ALIGN = 64  # bytes; keeps every tensor view aligned for vectorized loads


@attrs.define
class Encoded:
    payload: dict[str, Any]
    nbytes: int
    keepalive: list[Any] = attrs.field(factory=list)
    cleanup_path: str | None = None

    def release(self) -> None:
        self.keepalive.clear()
        if self.cleanup_path is not None:
            try:
                os.unlink(self.cleanup_path)
            except FileNotFoundError:
                pass
            self.cleanup_path = None


def aligned(nbytes: int) -> int:
    """``nbytes`` rounded up to :data:`ALIGN`."""
    return (nbytes + ALIGN - 1) // ALIGN * ALIGN


def buffer_size(entries: list[dict[str, Any]]) -> int:
    """Bytes of the packed buffer that holds ``entries`` (at least one aligned block)."""
    return max(sum(aligned(e["nbytes"]) for e in entries), ALIGN)


def layout(chunk) -> tuple[list[dict[str, Any]], int]:
    """Metadata of each tensor in a packed byte buffer, and the buffer size."""
    entries, offset = [], 0
    for name, tensor in chunk:
        nbytes = tensor.numel() * tensor.element_size()
        entries.append({"name": name, "dtype": str(tensor.dtype).removeprefix("torch."),
                        "shape": list(tensor.shape), "offset": offset, "nbytes": nbytes})
        offset += aligned(nbytes)
    return entries, buffer_size(entries)


def pack_into(buffer_U8, chunk, entries) -> None:
    for (_, tensor), entry in zip(chunk, entries):
        view = buffer_U8[entry["offset"] : entry["offset"] + entry["nbytes"]]
        view.copy_(tensor.detach().contiguous().reshape(-1).view(_torch().uint8))


def unpack(buffer_U8, entries) -> list[tuple[str, Any]]:
    torch = _torch()
    out = []
    for entry in entries:
        raw = buffer_U8[entry["offset"] : entry["offset"] + entry["nbytes"]]
        out.append((entry["name"], raw.view(getattr(torch, entry["dtype"])).view(entry["shape"])))
    return out


def _torch():
    import torch

    return torch


def chunk_nbytes(chunk) -> int:
    return sum(t.numel() * t.element_size() for _, t in chunk)


def encode(chunk, mode: str, shm_dir: str | None = None) -> Encoded:
    """Turn a chunk into an RPC payload for ``mode`` (``direct``, ``shm`` or ``cuda_ipc``)."""
    nbytes = chunk_nbytes(chunk)
    if mode == "direct":
        return Encoded({"mode": "direct", "tensors": list(chunk)}, nbytes)
    torch = _torch()
    entries, size = layout(chunk)
    if mode == "shm":
        directory = shm_dir or ("/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir())
        path = os.path.join(directory, f"rlcore-refit-{os.getpid()}-{uuid.uuid4().hex}")
        storage = torch.UntypedStorage.from_file(path, True, size)
        buffer_U8 = torch.empty(0, dtype=torch.uint8).set_(storage)
        pack_into(buffer_U8, chunk, entries)
        return Encoded({"mode": "shm", "path": path, "size": size, "entries": entries}, nbytes,
                       keepalive=[buffer_U8], cleanup_path=path)
    if mode == "cuda_ipc":
        from torch.multiprocessing.reductions import reduce_tensor

        device = chunk[0][1].device
        buffer_U8 = torch.empty(size, dtype=torch.uint8, device=device)
        pack_into(buffer_U8, chunk, entries)
        torch.cuda.current_stream(device).synchronize()
        rebuild, args = reduce_tensor(buffer_U8)
        handle = pickle.dumps((rebuild, args))
        uuid_ = str(torch.cuda.get_device_properties(device).uuid)
        return Encoded({"mode": "cuda_ipc", "handle": handle, "entries": entries, "device_uuid": uuid_}, nbytes,
                       keepalive=[buffer_U8])
    raise ValueError(f"unknown weight encoding {mode!r}; expected 'direct', 'shm' or 'cuda_ipc'")


def decode(payload: dict[str, Any]) -> list[tuple[str, Any]]:
    """The worker's side of :func:`encode`: (name, tensor) pairs, without copying."""
    mode = payload["mode"]
    if mode == "direct":
        return list(payload["tensors"])
    torch = _torch()
    if mode == "shm":
        storage = torch.UntypedStorage.from_file(payload["path"], True, payload["size"])
        return unpack(torch.empty(0, dtype=torch.uint8).set_(storage), payload["entries"])
    if mode == "cuda_ipc":
        rebuild, args = pickle.loads(payload["handle"])  # noqa: S301 - produced by our own trainer
        args = list(args)
        args[6] = local_device_index(payload.get("device_uuid"))  # the sender's index means nothing here
        return unpack(rebuild(*args), payload["entries"])
    raise ValueError(f"unknown weight payload mode {mode!r}")


def local_device_index(device_uuid: str | None) -> int:
    """This process's index of the GPU that holds an IPC buffer (matched by UUID: processes see
    different ``CUDA_VISIBLE_DEVICES``). A tensor-parallel engine's workers on other GPUs open the
    buffer where it lives and copy across (peer access); without a UUID, the current device."""
    torch = _torch()
    if device_uuid is None:
        return torch.cuda.current_device()
    for index in range(torch.cuda.device_count()):
        if str(torch.cuda.get_device_properties(index).uuid) == device_uuid:
            return index
    raise RuntimeError(f"refit: the weights' GPU ({device_uuid}) is not visible to this engine worker "
                       f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r}); colocated engines "
                       "must see the trainer's GPUs")
