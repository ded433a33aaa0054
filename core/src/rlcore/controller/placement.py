"""Where the trainer ranks and the generator go: one :class:`rlcore.interfaces.Placement` per run.

A CPU run with one trainer process, or any run with ``cluster.use_ray: false``, keeps everything
in the driver. Otherwise the trainer ranks are Ray actors. Without colocation on GPUs, generation
takes ``policy.generation.colocated.resources`` GPUs and the trainer the rest; on one node with a
local Ray instance the trainer's actors hold the first GPUs and generation the others
(``Placement.generator_gpus``). Everything is checked here, before any process or GPU is used.
"""

from __future__ import annotations

import os

from rlcore.config import ConfigError, RunConfig
from rlcore.interfaces import Placement

_GEN_GPUS_KEY = "policy.generation.colocated.resources.gpus_per_node"
_OFFLOAD_KEY = "policy.generation.colocated.offload_trainer_state"


def plan_placement(config: RunConfig) -> Placement:
    cluster, generation = config.cluster, config.generation
    device = "cuda" if cluster.gpus_per_node > 0 else "cpu"
    world = cluster.gpus_per_node * cluster.num_nodes if device == "cuda" else cluster.cpu_workers
    colocated = generation.colocated.enabled
    if generation.colocated.offload_trainer_state is True:
        if not colocated:
            raise ConfigError(_OFFLOAD_KEY, "moves the trainer's state out of the engines' way, but "
                                            "policy.generation.colocated.enabled is false: they have devices of their own")
        if config.grpo.async_grpo.enabled:
            raise ConfigError(_OFFLOAD_KEY, "needs the synchronous loop (training and generation take turns); "
                                            "grpo.async_grpo.enabled is true")
    separate_gpus = device == "cuda" and not colocated
    if separate_gpus:
        resources = generation.colocated.resources
        gen_gpus = resources.gpus_per_node * resources.num_nodes
        world -= gen_gpus
        if world < 1:
            raise ConfigError(_GEN_GPUS_KEY, f"takes {gen_gpus} of the {world + gen_gpus} GPUs in cluster.gpus_per_node x "
                                             "num_nodes, leaving none for the trainer")
    use_ray = cluster.use_ray if cluster.use_ray is not None else (world > 1 or separate_gpus)
    if not use_ray and world > 1:
        raise ConfigError("cluster.use_ray", f"{world} trainer processes need Ray; set cluster.use_ray=true")
    if not use_ray and separate_gpus:
        raise ConfigError("cluster.use_ray", "non-colocated generation on GPUs needs the trainer in its own "
                                             "process (Ray actors) so each side sees only its GPUs; set cluster.use_ray=true")
    generator_gpus: tuple[str, ...] = ()
    local_ray = not (cluster.ray_address or os.environ.get("RAY_ADDRESS"))
    if separate_gpus and local_ray and cluster.num_nodes == 1:
        generator_gpus = tuple(driver_gpu_ids(os.environ.get("CUDA_VISIBLE_DEVICES"), cluster.gpus_per_node, world))
    return Placement(device=device, trainer_ranks=world, use_ray=use_ray, colocated=colocated, generator_gpus=generator_gpus,
                     offload_trainer_state=generation.colocated.offload_trainer_state is True)


def driver_gpu_ids(visible: str | None, gpus_per_node: int, trainer_gpus: int) -> list[str]:
    """GPUs left to the driver's generator when the trainer's Ray actors hold the first
    ``trainer_gpus`` of the node (a local Ray instance started with ``num_gpus=trainer_gpus`` hands
    out exactly those). Only processes that start CUDA after the generator narrows
    ``CUDA_VISIBLE_DEVICES`` to these see them: a CUDA context already created in this process is
    refused here, but a bare ``torch.cuda.is_available()`` also fixes the device list and leaves no
    trace, so a generator does its device work in freshly started processes (the vllm plugin
    spawns its engine core when not colocated)."""
    import torch

    if torch.cuda.is_initialized():
        raise RuntimeError("non-colocated generation: CUDA was initialised in the driver before its GPUs were chosen")
    ids = [i.strip() for i in visible.split(",") if i.strip()] if visible else [str(i) for i in range(gpus_per_node)]
    left = ids[trainer_gpus:gpus_per_node]
    if not left:
        raise ConfigError(_GEN_GPUS_KEY, f"no GPU left for generation: {len(ids)} visible, {trainer_gpus} taken by the trainer")
    return left
