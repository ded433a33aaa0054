"""Weight transports from a training backend into the vLLM generator (``rlcore_weight_transport``).

- :class:`ColocatedTransport`: trainer and engine share the devices. The backend's chunks go
  through ``generator.update_weights``, which hands them to the worker directly (engine core in
  this process), by CUDA IPC handle (GPU, engine in another process) or through shared memory
  (CPU, engine in another process); see :mod:`rlcore_vllm.codecs`.
- :class:`BroadcastTransport`: the engines have their own devices or hosts. The trainer's rank 0
  and every engine worker form a broadcast group (NCCL on GPU, gloo on CPU); rank 0 streams
  Hugging Face-named chunks into it (:mod:`rlcore_vllm.broadcast`) from the trainer's own
  process, also when the trainer ranks are Ray actors (through their ``run_on_ranks``).

- :class:`rlcore_vllm.handoff.RankHandoffTransport`: colocated, trainer ranks in Ray actors (the
  engine lives with the driver): rank 0's process hands each chunk to the engine as a CUDA IPC
  handle or shared-memory file, over a local socket; nothing goes through Ray's object store.

All return ``{"bytes", "seconds"}``. Verification (probe logprobs against the trainer's) is
done by the run loop after every transfer, with ``policy.generation.refit.probe_threshold``.
"""

from __future__ import annotations

import time
from typing import Any

from rlcore.utils import free_port, in_daemon_thread, torch_dtype


class ColocatedTransport:
    name = "vllm_colocated"

    def __init__(self, chunk_bytes: int = 1 << 30, dtype: Any = None):
        self.chunk_bytes, self.dtype = chunk_bytes, dtype

    def transfer(self, trainer, generator) -> dict[str, float]:
        from rlcore.training.weights import stream_into

        return stream_into(generator, trainer.export_chunks(dtype=self.dtype, chunk_bytes=self.chunk_bytes))


class BroadcastTransport:
    """Trainer rank 0 sends; the generator's workers receive (ranks 1..N of the group).

    Through the trainer handle's ``run_on_ranks`` every trainer rank runs
    :func:`rlcore_vllm.broadcast.send_from_trainer` and rank 0 sends from its own process (this
    one, for an in-process trainer): weights go trainer process -> engine workers, never through
    this process's copy or Ray's object store. Either way this process receives on behalf of the engine
    (``generator.receive_weights``) in a thread while the sender runs; the group is formed on the
    first transfer (``generator.join_weight_group``) and kept. A trainer rank that dies or hangs
    mid-send surfaces as the trainer group's ``WorkerError`` (rank, step) within
    ``cluster.timeout_s``; the engines' half-received refit is then abandoned with the run.
    """

    name = "vllm_broadcast"
    sender = "rlcore_vllm.broadcast:send_from_trainer"

    def __init__(self, chunk_bytes: int = 1 << 30, dtype: Any = None, group_backend: str = "gloo",
                 host: str | None = None, timeout_s: float = 600.0, device: str = "cpu"):
        self.chunk_bytes, self.dtype = chunk_bytes, dtype
        self.group_backend, self.timeout_s, self.device = group_backend, timeout_s, device
        self.configured_host = host  # None: rank 0's node address, asked of rank 0 (cross-node runs)
        self.host: str | None = None
        self.port: int | None = None  # of the group's store, hosted by the sending rank; set on first use

    def transfer(self, trainer, generator) -> dict[str, float]:
        group_size = 1 + generator.world_size()
        joining = None
        start = time.perf_counter()
        if self.port is None:  # rank 0 hosts the group's store: its node's address and a port free there
            host, port = trainer.run_on_ranks("rlcore_vllm.broadcast:sender_address", self.configured_host,
                                              what="'sender_address' (broadcast refit)")[0]
            joining = generator.join_weight_group(host, port, group_size, self.group_backend, self.timeout_s)
            self.host, self.port = host, port
        receiving = in_daemon_thread(lambda: _receive(generator, joining, self.timeout_s), "rlcore-refit-recv")
        args = (self.host, self.port, group_size, self.group_backend, self.timeout_s, self.device, self.dtype, self.chunk_bytes)
        try:
            sent = trainer.run_on_ranks(self.sender, *args, what="'export_weights' (broadcast refit)")[0]
        except BaseException:
            self.port = None  # the group is broken (the engines may be blocked mid-receive); never reuse it
            raise
        received = receiving.result(timeout=self.timeout_s)
        if int(received) != int(sent["bytes"]):
            raise RuntimeError(f"broadcast refit: sent {int(sent['bytes'])} bytes but the engine loaded {received}")
        return {"bytes": sent["bytes"], "seconds": time.perf_counter() - start}


def _receive(generator, joining, timeout_s: float) -> int:
    if joining is not None:  # the engines' join completes once the sender has joined too
        joining.result(timeout=timeout_s)
    return generator.receive_weights()


def pick_transport(trainer, generator):
    """The transport for this (trainer handle, generator) pair, or None when it is not ours."""
    from rlcore_vllm.generator import VllmGenerator

    if not isinstance(generator, VllmGenerator):
        return None
    cfg = generator.config
    dtype = torch_dtype(generator.dtype)
    if cfg.colocated.enabled:
        if trainer.in_process:
            return ColocatedTransport(cfg.refit.chunk_bytes, dtype)
        from rlcore_vllm.handoff import RankHandoffTransport

        return RankHandoffTransport(cfg.refit.chunk_bytes, dtype, cfg.refit.timeout_s)
    group_backend = cfg.refit.group_backend
    if group_backend == "auto":
        group_backend = "nccl" if generator.device == "cuda" else "gloo"
    device = "cuda" if group_backend == "nccl" else "cpu"
    return BroadcastTransport(cfg.refit.chunk_bytes, dtype, group_backend, cfg.refit.group_host, cfg.refit.timeout_s, device)
