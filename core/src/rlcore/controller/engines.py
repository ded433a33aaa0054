"""The engines of a run: the parts that hold the policy's weights (the training backend's ranks, a
critic, the generator), built in that order by :func:`build_engines` from the recipe (through the plugin
registry) or from the objects a user passes to ``rlcore.run``; the run's seeds. The transport between
trainer and generator is chosen in :mod:`rlcore.controller.transport`.

What the run learns and from what (algorithm, tokenizer, data) is built in :mod:`rlcore.controller.task`,
the environment in :mod:`rlcore.controller.environment`. Every loop (GRPO, SFT, pairs) builds its parts
there and here only, so a part is built the same way whatever the algorithm trains on.
"""

from __future__ import annotations

import os
import random
from typing import Any

import numpy as np
import torch

from attrs import frozen

from rlcore.config import ConfigError, RunConfig
from rlcore.controller import critic_step
from rlcore.controller.heartbeat import doing
from rlcore.controller.mps_client import enter_mps_client
from rlcore.controller.ray_local import start_local_ray
from rlcore.controller.ray_placement import create_rank_placement_group
from rlcore.controller.workers import LocalTrainer, RayTrainerGroup
from rlcore.interfaces import CriticHandle, Generator, Placement, TrainerHandle


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
    return start_trainer(config, None if backend is not None else select_backend(config, manager), placement, backend)


def start_trainer(config: RunConfig, registration, placement: Placement, backend=None) -> TrainerHandle:
    """The ranks of the backend ``registration`` (:func:`select_backend`), or ``backend`` in this process: Ray's
    first (the cluster joined or a local instance started, the ranks' placement group made), else local ranks."""
    enter_mps_client(config.experimental.trainer_mps_priority, placement)  # before anything in the trainer uses CUDA
    if backend is not None:
        return LocalTrainer(backend)
    section = config.section(registration.section)
    if placement.use_ray:
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
        group = create_rank_placement_group(ray, placement, config.cluster.placement_strategy, config.cluster.timeout_s)
        return RayTrainerGroup(registration, config, section, placement, config.cluster.timeout_s, group)
    return LocalTrainer.build(registration, config, section, placement)


@frozen
class Engines:
    """The parts that hold the policy's weights, as :func:`build_engines` built them."""

    trainer: TrainerHandle
    critic: CriticHandle | None  # ppo's value model, on the trainer's ranks
    generator: Generator | None  # None: a run that does not generate


def build_engines(config: RunConfig, manager, placement: Placement, given: dict, algorithm: Any, *,
                  generate: bool = True) -> Engines:
    """The trainer, the critic of an algorithm that trains one, and (``generate``) the generator passed to
    ``rlcore.run`` or ``policy.generation.backend``'s plugin: in this order, so that a colocated engine starts
    beside a loaded trainer. A backend passed as an object (``given["backend"]``) has no registration, hence
    no critic factory."""
    backend = given.get("backend")
    doing("loading the model into the training backend")
    registration = None if backend is not None else select_backend(config, manager)
    trainer = start_trainer(config, registration, placement, backend)
    critic = None
    if critic_step.trains_critic(algorithm):
        critic = critic_step.build_critic(config, algorithm, trainer, registration, placement)
    generator = given.get("generator")
    if generate:
        doing("starting the generator")
    if generate and generator is None:
        config.require_section("policy.generation")
        generator = manager.get("generator", config.generation.backend).build(config, config.generation, placement)
    return Engines(trainer, critic, generator)
