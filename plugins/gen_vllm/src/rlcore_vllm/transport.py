"""Weight transports from a training backend into the vLLM generator (``rlcore_weight_transport``).

- :class:`ColocatedTransport`: trainer and engine share the devices. The backend's chunks go
  through ``generator.update_weights``, which hands them to the worker directly (engine core in
  this process), by CUDA IPC handle (GPU, engine in another process) or through shared memory
  (CPU, engine in another process); see :mod:`rlcore_vllm.codecs`.
- :class:`BroadcastTransport`: the engines have their own devices or hosts. The trainer's
  sending rank and every engine worker form a broadcast group (NCCL on GPU, gloo on CPU); the
  backend streams Hugging Face-named chunks into it (:mod:`rlcore_vllm.broadcast`).

Both return ``{"bytes", "seconds"}``. Verification (probe logprobs against the trainer's) is
done by the run loop after every transfer, with ``policy.generation.refit.probe_threshold``.
"""

from __future__ import annotations

import concurrent.futures
import time
from typing import Any



def _torch_dtype(name: str | None):
    import torch

    if name in (None, "auto"):
        return None
    return getattr(torch, name)


class ColocatedTransport:
    name = "vllm_colocated"

    def __init__(self, chunk_bytes: int = 1 << 30, dtype: Any = None):
        self.chunk_bytes, self.dtype = chunk_bytes, dtype

    def transfer(self, backend, generator) -> dict[str, float]:
        from rlcore.weights import stream_into

        return stream_into(generator, backend.export_weights(dtype=self.dtype, chunk_bytes=self.chunk_bytes))


class BroadcastTransport:
    """Rank 0 of the trainer sends; the generator's workers receive (ranks 1..N)."""

    name = "vllm_broadcast"

    def __init__(self, chunk_bytes: int = 1 << 30, dtype: Any = None, group_backend: str = "gloo",
                 host: str = "127.0.0.1", timeout_s: float = 600.0, device: str = "cpu"):
        self.chunk_bytes, self.dtype = chunk_bytes, dtype
        self.group_backend, self.host, self.timeout_s, self.device = group_backend, host, timeout_s, device
        self.group = None

    def connect(self, generator, port: int | None = None) -> None:
        """Form the group: the engines join in the background while this process joins as rank 0."""
        from rlcore_vllm.broadcast import WeightGroup, free_port

        port = port or free_port()
        world = 1 + generator.world_size()
        joining = generator.join_weight_group(self.host, port, world, self.group_backend, self.timeout_s)
        self.group = WeightGroup(self.host, port, world, 0, self.group_backend, self.timeout_s, self.device)
        joining.result(timeout=self.timeout_s)

    def transfer(self, backend, generator) -> dict[str, float]:
        if self.group is None:
            self.connect(generator)
        start = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="rlcore-refit-recv") as pool:
            receiving = pool.submit(generator.receive_weights)
            try:
                sent = self.group.send(backend.export_weights(dtype=self.dtype, chunk_bytes=self.chunk_bytes))
            except BaseException:
                receiving.cancel()
                raise
            received = receiving.result(timeout=self.timeout_s)
        if int(received) != int(sent["bytes"]):
            raise RuntimeError(f"broadcast refit: sent {int(sent['bytes'])} bytes but the engine loaded {received}")
        return {"bytes": sent["bytes"], "seconds": time.perf_counter() - start}


def pick_transport(backend, generator):
    """The transport for this (backend, generator) pair, or None when the generator is not ours."""
    from rlcore_vllm.generator import VllmGenerator

    if not isinstance(generator, VllmGenerator) or not hasattr(backend, "export_weights"):
        return None
    cfg = generator.config
    dtype = _torch_dtype(generator.dtype)
    if cfg.colocated.enabled:
        return ColocatedTransport(cfg.refit.chunk_bytes, dtype)
    group_backend = cfg.refit.group_backend
    if group_backend == "auto":
        group_backend = "nccl" if generator.device == "cuda" else "gloo"
    device = "cuda" if group_backend == "nccl" else "cpu"
    return BroadcastTransport(cfg.refit.chunk_bytes, dtype, group_backend, cfg.refit.group_host, cfg.refit.timeout_s, device)
