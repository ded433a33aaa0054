"""Colocated refit when the trainer ranks are Ray actors and the engine lives with the driver.

Trainer rank 0's process hands each exported chunk to the engine's worker directly: as a CUDA
IPC handle on GPU (the chunk stays in rank 0's GPU memory, on the device the colocated engine
shares) or as a ``/dev/shm`` file on CPU (:mod:`rlcore_vllm.codecs`). Only the handle crosses a
local socket (``multiprocessing.connection``) to the driver, which passes it to the engine and
answers ``loaded``; rank 0 keeps every chunk alive until the engine has finished the whole
layer-wise reload (``finished``). The weights never pass through Ray's object store nor the
driver's memory: core's generic stream transport returns all of rank 0's chunks as one Ray
result, which for an 8B model (16 GB) takes minutes.

Written by hand: vLLM and Ray have no API for "load these IPC handles from another process's
export loop"; NeMo-RL does the same handoff over ZMQ.
"""

from __future__ import annotations

import secrets
import time
from multiprocessing.connection import Client, Listener
from typing import Any


def send_from_rank(backend, rank: int, world_size: int, address, authkey: bytes, encoding: str, dtype,
                   chunk_bytes: int) -> dict[str, float]:
    """Every rank iterates ``export_weights`` (its gathers are collectives); rank 0 sends each chunk."""
    from rlcore_vllm.codecs import encode

    conn = Client(tuple(address), authkey=authkey) if rank == 0 else None
    sent, nbytes = [], 0
    try:
        for chunk in backend.export_weights(dtype=dtype, chunk_bytes=chunk_bytes):
            if conn is None or not chunk:
                continue
            encoded = encode(chunk, encoding)
            sent.append(encoded)
            nbytes += encoded.nbytes
            conn.send(encoded.payload)
            _expect(conn, "loaded")
        if conn is not None:
            conn.send(None)
            _expect(conn, "finished")
    finally:
        for encoded in sent:
            encoded.release()
        if conn is not None:
            conn.close()
    return {"bytes": float(nbytes)}


def _expect(conn, word: str) -> None:
    reply = conn.recv()
    if reply != word:
        raise RuntimeError(f"colocated refit: the engine answered {reply!r} instead of {word!r}")


class HandoffReceiver:
    """The driver's end: a one-connection listener on localhost, served in a thread by :meth:`serve`."""

    def __init__(self):
        self.authkey = secrets.token_bytes(16)
        self.listener = Listener(("127.0.0.1", 0), authkey=self.authkey)

    @property
    def address(self) -> tuple[str, int]:
        return self.listener.address

    def serve(self, generator) -> int:
        """Accept rank 0, load each handle into the engine, finish the reload; the bytes loaded."""
        conn = self.listener.accept()
        loaded = 0

        def payloads():
            nonlocal loaded
            while (payload := conn.recv()) is not None:
                yield payload
                loaded += sum(int(e["nbytes"]) for e in payload.get("entries", ()))
                conn.send("loaded")  # after the engine has taken this chunk

        try:
            generator.load_payloads(payloads())
            conn.send("finished")
        except BaseException:
            try:
                conn.send("failed")
            except OSError:
                pass
            raise
        finally:
            conn.close()
        return loaded

    def close(self) -> None:
        self.listener.close()


class RankHandoffTransport:
    name = "vllm_colocated_handoff"
    sender = "rlcore_vllm.handoff:send_from_rank"

    def __init__(self, chunk_bytes: int = 1 << 30, dtype: Any = None, timeout_s: float = 600.0):
        self.chunk_bytes, self.dtype, self.timeout_s = chunk_bytes, dtype, timeout_s

    def transfer(self, trainer, generator) -> dict[str, float]:
        from rlcore.utils import in_daemon_thread

        encoding = "cuda_ipc" if generator.device == "cuda" else "shm"
        start = time.perf_counter()
        receiver = HandoffReceiver()
        try:
            receiving = in_daemon_thread(lambda: receiver.serve(generator), "rlcore-refit-recv")
            sent = trainer.run_on_ranks(self.sender, receiver.address, receiver.authkey, encoding, self.dtype,
                                        self.chunk_bytes, what="'export_weights' (colocated refit)")[0]
            loaded = receiving.result(timeout=self.timeout_s)
        finally:
            receiver.close()
        if int(loaded) != int(sent["bytes"]):
            raise RuntimeError(f"colocated refit: rank 0 sent {int(sent['bytes'])} bytes but the engine loaded {loaded}")
        return {"bytes": sent["bytes"], "seconds": time.perf_counter() - start}
