"""The engines of a run: the parts that hold the policy's weights (the training backend's ranks, a
critic, the generator) and the transport between them, from the recipe (through the plugin
registry) or from the objects a user passes to ``rlcore.run``; the run's seeds.

What the run learns and from what (algorithm, tokenizer, data, environment) is built in
:mod:`rlcore.controller.task`. Every loop (GRPO, SFT, pairs) builds its parts there and here only,
so a part is built the same way whatever the algorithm trains on.
"""

from __future__ import annotations

import os
import random
from typing import Any

import numpy as np
import torch

from rlcore.config import ConfigError, RefitConfig, RunConfig
from rlcore.controller import critic_step
from rlcore.controller.mps_client import enter_mps_client
from rlcore.controller.ray_local import start_local_ray
from rlcore.controller.workers import LocalTrainer, RayTrainerGroup
from rlcore.interfaces import CriticHandle, Generator, Placement, TrainerHandle, WeightTransport
from rlcore.training.weights import stream_into


class StreamTransport:
    """Fallback refit: stream the trainer's HF-named chunks into ``generator.update_weights``."""

    name = "stream"

    def __init__(self, chunk_bytes: int | None = None, dtype: Any = None):
        self.chunk_bytes = chunk_bytes or RefitConfig().chunk_bytes  # the one default, policy.generation.refit's
        self.dtype = dtype

    def transfer(self, trainer: TrainerHandle, generator: Generator) -> dict[str, float]:
        return stream_into(generator, trainer.export_chunks(dtype=self.dtype, chunk_bytes=self.chunk_bytes))


def select_backend(config: RunConfig, manager, announce: bool = True):
    enabled = []
    for reg in manager.registry["training_backend"].values():
        section = config.section(reg.section)
        if section is not None and section.enabled:  # the field every backend schema has (checked at registration)
            enabled.append(reg)
    if not enabled:
        raise ConfigError("policy", "no training backend is enabled: set policy.dtensor_cfg.enabled=true or policy.megatron_cfg.enabled=true")
    enabled.sort(key=lambda r: r.capabilities.get("precedence", 0), reverse=True)
    top = enabled[0]
    ties = [r.name for r in enabled if r.capabilities.get("precedence", 0) == top.capabilities.get("precedence", 0)]
    if len(ties) > 1:
        raise ConfigError("policy", f"several training backends are enabled with equal precedence: {ties}; disable all but one")
    others = [f"{r.name} ({r.section})" for r in enabled[1:]]
    if announce:
        print(f"training backend: {top.name} ({top.section})" + (f"; also enabled but of lower precedence: {', '.join(others)}" if others else ""), flush=True)
    return top


def seed_everything(seed: int, deterministic: bool) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    if deterministic:
        torch.use_deterministic_algorithms(True, warn_only=True)


def build_trainer(config: RunConfig, manager, placement: Placement, backend=None) -> TrainerHandle:
    """The trainer ranks ``placement`` asks for (or ``backend``, a user's object, in this process)."""
    enter_mps_client(config.experimental.trainer_mps_priority, placement)  # before anything in the trainer uses CUDA
    if backend is not None:
        return LocalTrainer(backend)
    reg = select_backend(config, manager)
    section = config.section(reg.section)
    if not placement.use_ray:
        return LocalTrainer.build(reg, config, section, placement)
    import ray

    address = config.cluster.ray_address or os.environ.get("RAY_ADDRESS")
    if not ray.is_initialized():
        if address:
            ray.init(address=address, include_dashboard=False)
            print(f"ray: joined the cluster at {address}; its nodes listen where that cluster was started to", flush=True)
        else:  # a local instance with a CPU slot per trainer rank, even on a 2-core machine
            world = placement.trainer_ranks
            kwargs = {"num_gpus": world} if placement.device == "cuda" and not placement.colocated else {}
            start_local_ray(num_cpus=max(world + 1, os.cpu_count() or 1), **kwargs)
    return RayTrainerGroup(reg, config, section, placement, config.cluster.timeout_s)


def build_critic(config: RunConfig, manager, algorithm: Any, trainer: TrainerHandle, placement: Placement,
                 backend=None) -> CriticHandle | None:
    """The value model of an algorithm that trains one (ppo), on the trainer's ranks; else None.
    A backend passed as an object (``backend``) has no registration, hence no critic factory."""
    if not critic_step.trains_critic(algorithm):
        return None
    registration = None if backend is not None else select_backend(config, manager, announce=False)
    return critic_step.build_critic(config, algorithm, trainer, registration, placement)


def pick_transport(manager, trainer: TrainerHandle, generator: Generator, config: RunConfig) -> WeightTransport:
    """A plugin's transport when one claims the pair, else :class:`StreamTransport`.

    The hook gets the trainer handle: a plugin that can send from inside the ranks uses its
    ``run_on_ranks``; one that cannot returns None and weights stream through this process."""
    found = manager.weight_transport(trainer=trainer, generator=generator)
    if found is not None and not isinstance(found, WeightTransport):
        raise TypeError(f"the rlcore_weight_transport hook returned a {type(found).__name__}, which lacks a name or "
                        "transfer() (rlcore.interfaces.WeightTransport)")
    if found is not None:
        return found
    return StreamTransport(chunk_bytes=config.generation.refit.chunk_bytes)


def build_generator(config: RunConfig, manager, placement: Placement, given: dict) -> Generator:
    """The generator passed to ``rlcore.run``, else ``policy.generation.backend``'s plugin."""
    generator = given.get("generator")
    if generator is None:
        config.require_section("policy.generation")
        generator = manager.get("generator", config.generation.backend).build(config, config.generation, placement)
    return generator
