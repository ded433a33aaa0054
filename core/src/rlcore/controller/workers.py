"""The trainer ranks behind :class:`rlcore.interfaces.TrainerHandle`: in this process, or one Ray
actor per rank.

Both run every call on every rank (the same call everywhere, as SPMD backends need) and return
rank 0's result; ``run_on_ranks`` runs a plugin's function ``fn(backend, rank, world_size,
*args)`` (given as ``"module:attr"``, imported in each rank's process) next to every rank's
backend and returns all ranks' results: how a transport sends weights straight from the trainer
processes. In the Ray form every wait has a timeout; on expiry the error says which ranks the
driver was waiting for and what they were doing. A dead actor is named with what it was running
as soon as it is seen, before any error of its peers (which may be blocked in a collective with
it, or have failed because of it). Test fault injection wraps a handle
(:mod:`rlcore.testing.faults`).
"""

from __future__ import annotations

import datetime
import os
import socket
import time

from rlcore.controller.allocator import use_expandable_segments
from rlcore.interfaces import OffloadingBackend, Placement, WorldInfo
from rlcore.utils import free_port, resolve

_PEER_GRACE_S = 5.0  # how long a rank's error waits for news of a dead peer (see _gather)


class WorkerError(RuntimeError):
    """A trainer or generator worker died or did not answer in time."""


def init_distributed(rank: int, world_size: int, master_port: int, device: str, master_addr: str = "127.0.0.1",
                     local_addr: str | None = None) -> None:
    """The trainer's process group, listening only where it must: the TCP store serves on a socket
    bound to the master address (torch's own server binds every interface), and gloo's and NCCL's
    bootstrap sockets use the interface holding this rank's node address ``local_addr`` (default:
    the master address), which is loopback on one machine. ``GLOO_SOCKET_IFNAME`` and
    ``NCCL_SOCKET_IFNAME`` set by the user win."""
    import torch
    import torch.distributed as dist

    if dist.is_initialized():
        return
    os.environ.update(MASTER_ADDR=master_addr, MASTER_PORT=str(master_port), RANK=str(rank), WORLD_SIZE=str(world_size))
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    backend = "nccl" if device == "cuda" else "gloo"
    interface = interface_of(local_addr or master_addr)
    if interface is not None:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", interface)
        os.environ.setdefault("NCCL_SOCKET_IFNAME", interface)
    timeout = datetime.timedelta(seconds=1800)
    listen_fd = None
    if rank == 0:
        server = socket.create_server((master_addr, master_port), backlog=max(128, world_size))
        listen_fd = server.detach()
    store = dist.TCPStore(master_addr, master_port, world_size, rank == 0, timeout=timeout, master_listen_fd=listen_fd)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)


def move_training_state(backend, rank: int, world_size: int, out: bool, keep_weights: bool = False) -> None:
    """One rank's ``offload`` (``out``) or ``onload``, for ``policy.generation.colocated.offload_trainer_state``."""
    if not isinstance(backend, OffloadingBackend):
        raise TypeError(f"policy.generation.colocated.offload_trainer_state: the training backend "
                        f"{type(backend).__name__} has no offload()/onload() (rlcore.interfaces.OffloadingBackend); "
                        "set the key to false")
    if out:
        backend.offload(keep_weights=keep_weights)
    else:
        backend.onload()


def interface_of(address: str) -> str | None:
    """The name of the network interface whose (primary IPv4) address is ``address``; None when
    none is (then gloo and NCCL pick their own)."""
    import fcntl
    import struct

    if address.startswith("127."):
        return "lo"  # Linux's loopback interface
    siocgifaddr = 0x8915
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        for _, name in socket.if_nameindex():
            try:
                packed = fcntl.ioctl(probe.fileno(), siocgifaddr, struct.pack("256s", name[:15].encode()))
            except OSError:  # no IPv4 address on this interface
                continue
            if socket.inet_ntoa(packed[20:24]) == address:
                return name
    return None


class LocalTrainer:
    """A backend in the driver process (single-process runs, debugging, the CPU demo)."""

    in_process = True

    def __init__(self, backend):
        self.backend = backend
        self.loop_step = 0

    @classmethod
    def build(cls, registration, config, section_config, placement: Placement | None = None) -> LocalTrainer:
        """Rank 0 of a one-process world (torch.distributed initialized here), then the backend."""
        placement = placement or Placement()
        init_distributed(0, 1, free_port(), placement.device)
        return cls(registration.build(config, section_config, WorldInfo(0, 1, 0, placement.device, placement)))

    def logprobs(self, batch, *, reference: bool = False, what: str = ""):
        return self.backend.logprobs(batch, reference=reference)

    def train(self, batch, algorithm) -> dict[str, float]:
        return self.backend.train(batch, algorithm)

    def save_checkpoint(self, path: str) -> None:
        self.backend.save_checkpoint(path)

    def load_checkpoint(self, path: str) -> None:
        self.backend.load_checkpoint(path)

    def offload(self, *, keep_weights: bool = False) -> None:
        move_training_state(self.backend, 0, 1, True, keep_weights)

    def onload(self) -> None:
        move_training_state(self.backend, 0, 1, False)

    def run_on_ranks(self, fn: str, *args, what: str = "") -> list:
        """``[fn(backend, 0, 1, *args)]``: this process is rank 0 of 1 (see :meth:`RayTrainerGroup.run_on_ranks`)."""
        return [resolve(fn)(self.backend, 0, 1, *args)]

    def export_chunks(self, dtype=None, chunk_bytes: int = 1 << 30):
        yield from self.backend.export_weights(dtype=dtype, chunk_bytes=chunk_bytes)

    def shutdown(self) -> None:
        self.backend.shutdown()


class _TrainerActor:
    """Body of the Ray actor; one per rank. Built in two calls: :meth:`where` (the node this rank
    landed on, and for rank 0 a free port there), then :meth:`start` with rank 0's address."""

    def __init__(self, registration, config, section_config, rank: int, placement: Placement):
        # the driver's allocator settings reach a rank of the local Ray instance through its environment; a rank on a
        # cluster the run joined has its node's, or rlcore's default where the node set none (before CUDA starts)
        use_expandable_segments()
        import torch

        torch.set_num_threads(max(1, int(os.environ.get("RLCORE_THREADS_PER_RANK", "1"))))
        self._build = (registration, config, section_config, placement)
        self.rank, self.world_size = rank, placement.trainer_ranks

    def where(self) -> tuple[str, int]:
        """The Ray node this rank runs on, and its pid."""
        import ray

        return ray.get_runtime_context().get_node_id(), os.getpid()

    def free_port(self, host: str) -> int:
        return free_port(host)

    def start(self, master_addr: str, master_port: int, local_addr: str) -> None:
        registration, config, section_config, placement = self._build
        init_distributed(self.rank, self.world_size, master_port, placement.device, master_addr, local_addr)
        self.backend = registration.build(config, section_config, WorldInfo(self.rank, self.world_size, 0, placement.device, placement))

    def logprobs(self, batch, reference: bool):
        return self.backend.logprobs(batch, reference=reference)

    def train(self, batch, algorithm):
        return self.backend.train(batch, algorithm)

    def save_checkpoint(self, path: str) -> None:
        self.backend.save_checkpoint(path)

    def load_checkpoint(self, path: str) -> None:
        self.backend.load_checkpoint(path)

    def run(self, fn: str, args):
        return resolve(fn)(self.backend, self.rank, self.world_size, *args)

    def export_all(self, dtype, chunk_bytes: int):
        return list(self.backend.export_weights(dtype=dtype, chunk_bytes=chunk_bytes))


class RayTrainerGroup:
    """``world_size`` trainer ranks as Ray actors (gloo on CPU, NCCL on GPU), one per bundle of
    ``placement_group`` (made ready by :func:`rlcore.controller.ray_placement.create_rank_placement_group`;
    ``cluster.placement_strategy``).

    The process group meets at the address rank 0's node reports and a port free there, so ranks
    on other nodes reach it; on a local Ray instance that address is loopback."""

    in_process = False

    def __init__(self, registration, config, section_config, placement: Placement, timeout_s: float, placement_group):
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self.ray = ray
        self.timeout_s = timeout_s
        self.loop_step = 0
        self.placement_group = placement_group  # bundle i is rank i's (ray_placement.create_rank_placement_group)
        actor_cls = ray.remote(num_cpus=1, num_gpus=1 if placement.device == "cuda" else 0)(_TrainerActor)
        self.actors = [
            actor_cls.options(scheduling_strategy=PlacementGroupSchedulingStrategy(self.placement_group, rank)).remote(
                registration, config, section_config, rank, placement)
            for rank in range(placement.trainer_ranks)
        ]
        start_s = max(timeout_s, 600.0)  # start-up imports torch and builds the model in every rank
        where = self._gather([a.where.remote() for a in self.actors], "start-up (reporting its node)", start_s)
        self.node_ids, self.pids = [node for node, _ in where], [pid for _, pid in where]
        address_of = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}
        self.node_ips = [address_of[node] for node in self.node_ids]
        master_addr = self.node_ips[0]
        (master_port,) = self._gather([self.actors[0].free_port.remote(master_addr)], "start-up (choosing a port)", start_s)
        print(f"trainer: {len(self.actors)} ranks on {len(set(self.node_ids))} node(s) ({config.cluster.placement_strategy}): "
              + ", ".join(f"rank {r} on {ip} (node {node[:8]})" for r, (ip, node) in enumerate(zip(self.node_ips, self.node_ids)))
              + f"; process group at {master_addr}:{master_port}", flush=True)
        self._gather([a.start.remote(master_addr, master_port, ip) for a, ip in zip(self.actors, self.node_ips)],
                     "start-up (building the backend)", start_s)

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
                    raise WorkerError(f"trainer rank {rank} ({self._whereabouts(rank)}) died during {what} at step "
                                      f"{self.loop_step}: {exc.__class__.__name__}") from exc
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
                f"running {what} at step {self.loop_step}; ranks {done} had finished"
            )
        return results

    def _whereabouts(self, rank: int) -> str:
        """``pid P on node <address> (<node id>)``, as far as known: a rank lost with its node reads
        differently from a process that crashed on a healthy one only through Ray's error class
        (``ActorUnavailableError``: the connection is gone; ``ActorDiedError``: the process exited)."""
        if not hasattr(self, "pids"):
            return "before it reported its node"
        text = f"pid {self.pids[rank]}"
        if hasattr(self, "node_ips"):
            text += f" on node {self.node_ips[rank]} ({self.node_ids[rank][:8]})"
        return text

    def _on_all(self, what: str, submit) -> list:
        """Every rank's result of ``submit(actor)`` (a Ray call); ``what`` names the call in errors."""
        return self._gather([submit(actor) for actor in self.actors], what)

    def logprobs(self, batch, *, reference: bool = False, what: str = ""):
        return self._on_all(what or "'logprobs'", lambda a: a.logprobs.remote(batch, reference))[0]

    def train(self, batch, algorithm) -> dict[str, float]:
        return self._on_all("'train'", lambda a: a.train.remote(batch, algorithm))[0]

    def save_checkpoint(self, path: str) -> None:
        self._on_all("'save_checkpoint'", lambda a: a.save_checkpoint.remote(path))

    def load_checkpoint(self, path: str) -> None:
        self._on_all("'load_checkpoint'", lambda a: a.load_checkpoint.remote(path))

    def offload(self, *, keep_weights: bool = False) -> None:
        self.run_on_ranks(f"{__name__}:move_training_state", True, keep_weights, what="'offload' (trainer state to host)")

    def onload(self) -> None:
        self.run_on_ranks(f"{__name__}:move_training_state", False, what="'onload' (trainer state back)")

    def run_on_ranks(self, fn: str, *args, what: str = "") -> list:
        """Run ``fn(backend, rank, world_size, *args)`` in every rank's process; all ranks' results.

        ``fn`` is a ``"module:attr"`` string, imported inside each actor (so a plugin's code runs
        next to the backend without the driver importing it there). Every rank runs it, as SPMD
        backends need (e.g. ``export_weights`` gathers are collectives). ``what`` describes the
        call in errors. Waits at most ``cluster.timeout_s``."""
        return self._on_all(what or f"'{fn}'", lambda a: a.run.remote(fn, args))

    def export_chunks(self, dtype=None, chunk_bytes: int = 1 << 30):
        yield from self._on_all("'export_weights' (refit)", lambda a: a.export_all.remote(dtype, chunk_bytes))[0]

    def shutdown(self) -> None:
        from ray.util.placement_group import remove_placement_group

        for actor in self.actors:
            try:
                self.ray.kill(actor)
            except Exception:  # noqa: BLE001 - best effort at teardown
                pass
        try:
            remove_placement_group(self.placement_group)  # a joined cluster outlives this run
        except Exception:  # noqa: BLE001 - best effort at teardown
            pass
