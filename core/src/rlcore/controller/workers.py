"""Trainer placement: in this process, or one Ray actor per rank.

Both forms expose ``call(method, *args, what=..., **kwargs)``, which runs the backend method on
every rank (the same call everywhere, as SPMD backends need) and returns rank 0's result, and
``run_on_ranks(fn, *args, what=..., fault_point=...)``, which runs a plugin's function
``fn(backend, rank, world_size, *args)`` (given as ``"module:attr"``, imported in each rank's
process) next to every rank's backend and returns all ranks' results: how a transport sends
weights straight from the trainer processes. In the Ray form every wait has a timeout; on expiry
the error says which ranks the driver was waiting for and what they were doing. A dead actor is
named with what it was running as soon as it is seen, before any error of its peers (which may
be blocked in a collective with it, or have failed because of it).

Fault injection for tests: ``RLCORE_FAULT=<crash|hang>:<method>:<step>[:<rank>]`` makes that
rank (default: the last) exit or sleep when it starts ``method`` at ``step``.
"""

from __future__ import annotations

import datetime
import os
import socket
import time
from typing import Any

from rlcore.interfaces import WorldInfo
from rlcore.plugins import resolve

_PEER_GRACE_S = 5.0  # how long a rank's error waits for news of a dead peer (see _gather)


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
    """The trainer's process group. With a loopback master (one machine) nothing listens beyond
    loopback: the TCP store serves on a socket bound to the master address (torch's own server
    binds every interface), and gloo's and NCCL's bootstrap sockets use the loopback interface."""
    import torch
    import torch.distributed as dist

    if dist.is_initialized():
        return
    os.environ.update(MASTER_ADDR=master_addr, MASTER_PORT=str(master_port), RANK=str(rank), WORLD_SIZE=str(world_size))
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    backend = "nccl" if device == "cuda" else "gloo"
    if not master_addr.startswith("127."):
        print(f"torch.distributed: rank {rank} rendezvous at {master_addr}:{master_port}; the store listens on every interface",
              flush=True)
        dist.init_process_group(backend, rank=rank, world_size=world_size)
        return
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # Linux's loopback interface
    os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
    timeout = datetime.timedelta(seconds=1800)
    listen_fd = None
    if rank == 0:
        server = socket.create_server((master_addr, master_port), backlog=max(128, world_size))
        listen_fd = server.detach()
    store = dist.TCPStore(master_addr, master_port, world_size, rank == 0, timeout=timeout, master_listen_fd=listen_fd)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)


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

    def run_on_ranks(self, fn: str, *args, what: str = "", fault_point: str | None = None) -> list:
        """``[fn(backend, 0, 1, *args)]``: this process is rank 0 of 1 (see :meth:`RayTrainerGroup.run_on_ranks`)."""
        if fault_point:
            maybe_inject_fault(fault_point, self.step, 0, 1)
        return [resolve(fn)(self.backend, 0, 1, *args)]

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

    def run(self, fn: str, step: int, args, fault_point: str | None):
        if fault_point:
            maybe_inject_fault(fault_point, step, self.rank, self.world_size)
        return resolve(fn)(self.backend, self.rank, self.world_size, *args)

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
        """Every rank's result, in rank order.

        Waits for one rank at a time so that a dead actor is reported at once, not after the
        timeout its peers (blocked in a collective with it) would take. When a rank's task raises,
        the others get a few seconds to show whether one of them died first: that death is the
        cause and is what the error names; otherwise the task's own error is raised."""
        timeout_s = timeout_s or self.timeout_s
        deadline = time.monotonic() + timeout_s
        rank_of = {ref: rank for rank, ref in enumerate(refs)}
        results: list = [None] * len(refs)
        pending, failure = list(refs), None
        while pending:
            left = deadline - time.monotonic()
            if failure is not None:
                left = min(left, failure[1] - time.monotonic())
            if left <= 0:
                break
            ready, pending = self.ray.wait(pending, num_returns=1, timeout=left)
            for ref in ready:
                rank = rank_of[ref]
                try:
                    results[rank] = self.ray.get(ref)
                except self.ray.exceptions.RayActorError as exc:
                    pid = self.pids[rank] if hasattr(self, "pids") else "?"
                    raise WorkerError(f"trainer rank {rank} (pid {pid}) died during {what} at step {self.step}: {exc.__class__.__name__}") from exc
                except Exception as exc:  # noqa: BLE001 - re-raised below unless a dead rank explains it
                    if failure is None:
                        failure = (exc, time.monotonic() + _PEER_GRACE_S)
        if failure is not None:
            raise failure[0]
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

    def run_on_ranks(self, fn: str, *args, what: str = "", fault_point: str | None = None) -> list:
        """Run ``fn(backend, rank, world_size, *args)`` in every rank's process; all ranks' results.

        ``fn`` is a ``"module:attr"`` string, imported inside each actor (so a plugin's code runs
        next to the backend without the driver importing it there). Every rank runs it, as SPMD
        backends need (e.g. ``export_weights`` gathers are collectives). ``fault_point`` names the
        call for ``RLCORE_FAULT``; ``what`` describes it in errors. Waits at most ``cluster.timeout_s``."""
        refs = [a.run.remote(fn, self.step, args, fault_point) for a in self.actors]
        return self._gather(refs, what or f"'{fn}'")

    def export_chunks(self, dtype=None, chunk_bytes: int = 1 << 30):
        refs = [a.export_all.remote(self.step, dtype, chunk_bytes) for a in self.actors]
        yield from self._gather(refs, "'export_weights' (refit)")[0]

    def shutdown(self) -> None:
        for actor in self.actors:
            try:
                self.ray.kill(actor)
            except Exception:  # noqa: BLE001 - best effort at teardown
                pass
