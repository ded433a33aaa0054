"""A weight broadcast group between a trainer and generation engines that live elsewhere.

The trainer's sending rank is rank 0; each engine worker joins as ranks 1..N. The group is a
plain torch ``ProcessGroupGloo`` (CPU) or ``ProcessGroupNCCL`` (GPU) built on its own
``TCPStore``, so it never touches either side's default process group (vLLM's workers and the
trainer's FSDP/Megatron ranks keep theirs).

Wire protocol, one refit: for each chunk the sender broadcasts a header (a JSON list of
name/dtype/shape, as a length tensor and a byte tensor) and then one packed buffer per
chunk; an empty header ends the refit. Only torch is needed on the trainer side (no vLLM).

Trainer side in a run: :func:`send_from_trainer` runs in every trainer rank (through the trainer
group's ``run_on_ranks`` when the ranks are Ray actors, or directly when the backend is in the
driver). Every rank iterates ``backend.export_weights()`` (FSDP/Megatron gathers are
collectives); rank 0 joins the group once per process and sends, so the weights go from the
trainer's process to the engine workers without passing through the driver.
"""

from __future__ import annotations

import datetime
import json
import socket
import sys
from collections.abc import Iterable, Iterator
from typing import Any

from rlcore_vllm.codecs import buffer_size, layout, pack_into, unpack

END = "__rlcore_end__"


class WeightGroup:
    """One member of the broadcast group (rank 0 sends, the others receive)."""

    def __init__(self, host: str, port: int, world_size: int, rank: int, backend: str = "gloo",
                 timeout_s: float = 600.0, device: str = "cpu"):
        import torch
        import torch.distributed as dist

        if backend not in ("gloo", "nccl"):
            raise ValueError(f"weight group backend must be 'gloo' or 'nccl', got {backend!r}")
        self.rank, self.world_size, self.backend = rank, world_size, backend
        self.device = torch.device(device)
        timeout = datetime.timedelta(seconds=timeout_s)
        listen_fd = None
        if rank == 0:  # torch's own store server would listen on every interface; this one only at ``host``
            listener = _LISTENERS.pop((host, port), None)
            if listener is None:
                listener = _listen(host, port, world_size)
            else:  # reserved before the group's size was known: every rank may connect at once
                listener.listen(max(128, world_size))
            listen_fd = listener.detach()
        self._store = dist.TCPStore(host, port, world_size, rank == 0, timeout=timeout, wait_for_workers=False,
                                    master_listen_fd=listen_fd)
        store = dist.PrefixStore("rlcore-weights", self._store)
        if backend == "gloo":
            self.pg = dist.ProcessGroupGloo(store, rank, world_size, timeout)
        else:
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            self.pg = dist.ProcessGroupNCCL(store, rank, world_size, options)

    def _broadcast(self, tensor) -> None:
        import torch.distributed as dist

        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        self.pg.broadcast([tensor], opts).wait()

    def _header(self, entries: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
        """Broadcast (rank 0) or receive (others) a chunk header; None ends the refit."""
        import torch

        if self.rank == 0:
            raw = json.dumps(entries if entries is not None else END).encode()
            length = torch.tensor([len(raw)], dtype=torch.int64, device=self.device)
        else:
            length = torch.zeros(1, dtype=torch.int64, device=self.device)
        self._broadcast(length)
        if self.rank == 0:
            data = torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(self.device)
        else:
            data = torch.empty(int(length.item()), dtype=torch.uint8, device=self.device)
        self._broadcast(data)
        decoded = json.loads(bytes(data.cpu().tolist()))
        return None if decoded == END else decoded

    def send(self, chunks: Iterable[list[tuple[str, Any]]]) -> dict[str, float]:
        """Rank 0: stream every chunk to the engines; returns ``{"bytes": .., "chunks": ..}``."""
        import torch

        assert self.rank == 0, "only rank 0 sends"
        total, count = 0, 0
        for chunk in chunks:
            if not chunk:
                continue
            entries, size = layout(chunk)
            self._header(entries)
            buffer_U8 = torch.empty(size, dtype=torch.uint8, device=self.device)
            pack_into(buffer_U8, [(n, t.to(self.device)) for n, t in chunk], entries)
            self._broadcast(buffer_U8)
            total += sum(e["nbytes"] for e in entries)
            count += 1
        self._header(None)
        return {"bytes": float(total), "chunks": float(count)}

    def receive(self) -> Iterator[list[tuple[str, Any]]]:
        """Ranks > 0: yield each received chunk until the sender ends the refit."""
        import torch

        assert self.rank > 0, "rank 0 sends"
        while True:
            entries = self._header(None)
            if entries is None:
                return
            size = buffer_size(entries)
            buffer_U8 = torch.empty(size, dtype=torch.uint8, device=self.device)
            self._broadcast(buffer_U8)
            yield unpack(buffer_U8, entries)

    def close(self) -> None:
        self.pg = None
        self._store = None


# Sending groups this process has joined, by (host, port): a trainer rank keeps its group between refits.
_SENDERS: dict[tuple[str, int], WeightGroup] = {}
# Listening sockets for stores this process will host, by (host, port). The port is held from the
# moment it is handed out: the engines start connecting before the sender builds its group, and a
# port that is merely free then can be taken meanwhile (by another process, or by an engine's own
# connection attempt, which on loopback can connect to itself).
_LISTENERS: dict[tuple[str, int], socket.socket] = {}


def _listen(host: str, port: int = 0, world_size: int = 1) -> socket.socket:
    return socket.create_server((host, port), backlog=max(128, world_size))


def reserve_listener(host: str) -> int:
    """Bind and listen on a free port at ``host`` for a store this process will host as rank 0;
    the next :class:`WeightGroup` of rank 0 at that address serves on this very socket."""
    listener = _listen(host)
    port = listener.getsockname()[1]
    _LISTENERS[(host, port)] = listener
    return port


def sender_port(backend, rank: int, world_size: int) -> int | None:
    """A port held on loopback for the group's store (rank 0 hosts it); None on other ranks."""
    return reserve_listener("127.0.0.1") if rank == 0 else None


def sender_address(backend, rank: int, world_size: int, host: str | None = None) -> tuple[str, int] | None:
    """Where rank 0 hosts the group's store: ``host`` (``refit.group_host``) or, when None, the
    address of the Ray node this rank runs on (so engines on other nodes reach it; loopback on a
    local instance and for a trainer outside Ray), and a port held there for the group's store
    (:func:`reserve_listener`). None on other ranks."""
    if rank != 0:
        return None
    if host is None:
        ray = sys.modules.get("ray")  # imported by any Ray worker; a trainer outside Ray never needs it
        host = ray.util.get_node_ip_address() if ray is not None and ray.is_initialized() else "127.0.0.1"
    return host, reserve_listener(host)


def send_from_trainer(backend, rank: int, world_size: int, host: str, port: int, group_size: int,
                      group_backend: str, timeout_s: float, device: str, dtype: Any, chunk_bytes: int):
    """One refit from a trainer rank; every rank must call it (``run_on_ranks``).

    All ranks iterate ``backend.export_weights(dtype, chunk_bytes)``; rank 0 also joins the group
    at ``host:port`` as its rank 0 (first call only, the group is kept in this process) and
    broadcasts each chunk to the ``group_size - 1`` engine workers. Returns rank 0's
    ``{"bytes", "chunks"}`` and None on the other ranks."""
    chunks = backend.export_weights(dtype=dtype, chunk_bytes=chunk_bytes)
    if rank != 0:
        for _ in chunks:  # the gathers inside are collectives with rank 0
            pass
        return None
    group = _SENDERS.get((host, port))
    if group is None:
        group = WeightGroup(host, port, group_size, 0, group_backend, timeout_s, device)
        _SENDERS[(host, port)] = group
    return group.send(chunks)
