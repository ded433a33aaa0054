"""Trainer placement: in this process, or one Ray actor per rank.

Both forms expose ``call(method, *args, what=..., **kwargs)``, which runs the backend method on
every rank (the same call everywhere, as SPMD backends need) and returns rank 0's result. In the
Ray form every wait has a timeout; on expiry the error says which ranks the driver was waiting
for and what they were doing, and a dead actor is named with the method it was running.

Fault injection for tests: ``RLCORE_FAULT=<crash|hang>:<method>:<step>[:<rank>]`` makes that
rank (default: the last) exit or sleep when it starts ``method`` at ``step``.
"""

from __future__ import annotations

import os
import socket
import time
from typing import Any

from rlcore.interfaces import WorldInfo


class WorkerError(RuntimeError):
    """A trainer or generator worker died or did not answer in time."""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def maybe_inject_fault(method: str, step: int, rank: int, world_size: int) -> None:
    spec = os.environ.get("RLCORE_FAULT")
    if not spec:
        return
    parts = spec.split(":")
    kind, target, at_step = parts[0], parts[1], int(parts[2])
    at_rank = int(parts[3]) if len(parts) > 3 else world_size - 1
    if target == method and at_step == step and at_rank == rank:
        if kind == "crash":
            os._exit(17)
        if kind == "hang":
            time.sleep(10**6)


def init_distributed(rank: int, world_size: int, master_port: int, device: str, master_addr: str = "127.0.0.1") -> None:
    import torch
    import torch.distributed as dist

    if dist.is_initialized():
        return
    os.environ.update(MASTER_ADDR=master_addr, MASTER_PORT=str(master_port), RANK=str(rank), WORLD_SIZE=str(world_size))
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if device == "cuda" else "gloo", rank=rank, world_size=world_size)


class LocalTrainer:
    """The backend in the driver process (single-process runs, debugging, the CPU demo)."""

    def __init__(self, registration, config, section_config, device: str):
        init_distributed(0, 1, free_port(), device)
        self.world = WorldInfo(rank=0, world_size=1, local_rank=0, device=device)
        self.backend = registration.build(config, section_config, self.world)
        self.step = 0

    def call(self, method: str, *args, what: str = "", **kwargs) -> Any:
        maybe_inject_fault(method, self.step, 0, 1)
        return getattr(self.backend, method)(*args, **kwargs)

    def export_chunks(self, dtype=None, chunk_bytes: int = 1 << 30):
        yield from self.backend.export_weights(dtype=dtype, chunk_bytes=chunk_bytes)

    def shutdown(self) -> None:
        self.backend.shutdown()


class _TrainerActor:
    """Body of the Ray actor; one per rank."""

    def __init__(self, registration, config, section_config, rank: int, world_size: int, port: int, device: str):
        import torch

        torch.set_num_threads(max(1, int(os.environ.get("RLCORE_THREADS_PER_RANK", "1"))))
        init_distributed(rank, world_size, port, device)
        self.rank, self.world_size = rank, world_size
        self.backend = registration.build(config, section_config, WorldInfo(rank, world_size, 0, device))

    def call(self, method: str, step: int, args, kwargs):
        maybe_inject_fault(method, step, self.rank, self.world_size)
        return getattr(self.backend, method)(*args, **kwargs)

    def export_all(self, step: int, dtype, chunk_bytes: int):
        maybe_inject_fault("export_weights", step, self.rank, self.world_size)
        return list(self.backend.export_weights(dtype=dtype, chunk_bytes=chunk_bytes))

    def pid(self) -> int:
        return os.getpid()


class RayTrainerGroup:
    """``world_size`` trainer ranks as Ray actors (gloo on CPU, NCCL on GPU)."""

    def __init__(self, registration, config, section_config, world_size: int, device: str, timeout_s: float):
        import ray

        self.ray = ray
        self.timeout_s = timeout_s
        self.step = 0
        port = free_port()
        actor_cls = ray.remote(num_cpus=1, num_gpus=1 if device == "cuda" else 0)(_TrainerActor)
        self.actors = [
            actor_cls.remote(registration, config, section_config, rank, world_size, port, device)
            for rank in range(world_size)
        ]
        # Start-up imports torch and builds the model in every rank: allow more than one step's wait.
        self.pids = self._gather([a.pid.remote() for a in self.actors], "start-up (building the backend)", max(timeout_s, 600.0))

    def _gather(self, refs: list, what: str, timeout_s: float | None = None) -> list:
        timeout_s = timeout_s or self.timeout_s
        ready, pending = self.ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        results = [None] * len(refs)
        for rank, ref in enumerate(refs):
            if ref in pending:
                continue
            try:
                results[rank] = self.ray.get(ref)
            except self.ray.exceptions.RayActorError as exc:
                pid = self.pids[rank] if hasattr(self, "pids") else "?"
                raise WorkerError(f"trainer rank {rank} (pid {pid}) died during {what} at step {self.step}: {exc.__class__.__name__}") from exc
        if pending:
            late = [rank for rank, ref in enumerate(refs) if ref in pending]
            done = [rank for rank in range(len(refs)) if rank not in late]
            raise WorkerError(
                f"timeout: the driver waited {timeout_s:.0f}s (cluster.timeout_s) for trainer ranks {late} "
                f"running {what} at step {self.step}; ranks {done} had finished"
            )
        return results

    def call(self, method: str, *args, what: str = "", **kwargs) -> Any:
        refs = [a.call.remote(method, self.step, args, kwargs) for a in self.actors]
        return self._gather(refs, what or f"'{method}'")[0]

    def export_chunks(self, dtype=None, chunk_bytes: int = 1 << 30):
        refs = [a.export_all.remote(self.step, dtype, chunk_bytes) for a in self.actors]
        yield from self._gather(refs, "'export_weights' (refit)")[0]

    def shutdown(self) -> None:
        for actor in self.actors:
            try:
                self.ray.kill(actor)
            except Exception:  # noqa: BLE001 - best effort at teardown
                pass
