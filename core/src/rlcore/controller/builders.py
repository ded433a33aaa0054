"""Builders: the trainer, algorithm, generator, environment, transport and data of a run, from
the recipe (through the plugin registry) or from the objects a user passes to ``rlcore.run``.

Every loop (GRPO, SFT, pairs) builds its parts here and only here, so a part is built the same
way whatever the algorithm trains on.
"""

from __future__ import annotations

import os
import random
from typing import Any

import numpy as np
import torch

from rlcore.config import ConfigError, RefitConfig, RunConfig
from rlcore.controller import critic_step
from rlcore.deadlines import TimedEnvironment
from rlcore.controller.mps_client import enter_mps_client
from rlcore.controller.ray_local import start_local_ray
from rlcore.controller.workers import LocalTrainer, RayTrainerGroup
from rlcore.interfaces import CriticHandle, Generator, OldLogprobsChoice, Placement, TrainerHandle, WeightTransport
from rlcore.data.rows import is_rows, rows_dataset
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


def one_update_per_batch(config: RunConfig) -> bool:
    """Each generated batch trains exactly one optimizer step (``policy.train_global_batch_size``
    unset or at least P*G, the most a step keeps). The loop takes old logprobs right before the
    update, from the weights it starts at, so they are then the current policy's, detached, up to
    numerics. That holds in async runs too: a batch generated one version back is still scored by
    the trainer's weights of the moment (the generator's staleness is the rollout correction's part,
    p_train / p_gen)."""
    size, per_step = config.policy.train_global_batch_size, config.train.num_prompts_per_step * config.grpo.num_generations_per_prompt
    return size is None or size >= per_step


def resolve_old_logprobs(config: RunConfig, algorithm: Any) -> Any:
    """``algorithm`` with its old-logprob pass decided for this run, built from the recipe or
    passed to ``rlcore.run`` alike: one implementing :class:`rlcore.interfaces.OldLogprobsChoice`
    (``use_old_logprobs: auto``) skips the pass when :func:`one_update_per_batch`; any
    other keeps the ``uses_old_logprobs`` it declares."""
    if not isinstance(algorithm, OldLogprobsChoice):
        return algorithm
    one_update = one_update_per_batch(config)
    use = algorithm.choose_old_logprobs(one_update)
    why = "one optimizer step per batch" if one_update else "several optimizer steps per batch"
    print(f"algorithm {algorithm.name}: old-logprob pass {'runs' if use else 'skipped'} ({why}; "
          "algorithm.use_old_logprobs: auto|true|false)", flush=True)
    return algorithm


def build_algorithm(config: RunConfig, manager, registration=None):
    """The recipe's algorithm (``algorithm.name``, or ``registration``) built from its section, ``auto`` keys decided."""
    section = config.require_section("algorithm")
    return resolve_old_logprobs(config, (registration or manager.get("algorithm", section.name)).build(section))


def given_or_loaded_tokenizer(config: RunConfig, given: dict) -> Any:
    """The tokenizer passed to ``rlcore.run``, else ``policy.tokenizer_name`` (or the model's) through transformers."""
    tokenizer = given.get("tokenizer")
    if tokenizer is None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(config.policy.tokenizer_name or config.policy.model_name)
    return tokenizer


def given_or_built_dataset(config: RunConfig, manager, given: dict, tokenizer: Any) -> Any:
    """The dataset passed to ``rlcore.run``, else the ``data`` section's plugin built with ``tokenizer``."""
    dataset = given.get("dataset")
    if dataset is None:
        data_cfg = config.require_section("data")
        dataset = manager.get("dataset", data_cfg.name).build(data_cfg, tokenizer)
    elif is_rows(dataset):  # TRL's train_dataset: rows with a "prompt" column
        dataset = rows_dataset(dataset, tokenizer)
    return dataset


def build_generator(config: RunConfig, manager, placement: Placement, given: dict) -> Generator:
    """The generator passed to ``rlcore.run``, else ``policy.generation.backend``'s plugin."""
    generator = given.get("generator")
    if generator is None:
        config.require_section("policy.generation")
        generator = manager.get("generator", config.generation.backend).build(config, config.generation, placement)
    return generator


def build_environment(config: RunConfig, manager, given: dict) -> tuple[TimedEnvironment, bool]:
    """The environment (passed, else ``env.reward_fn``'s function, else ``env.name``'s plugin), every
    call bounded by ``cluster.timeout_s``; and whether the plugin registered it as multi-turn."""
    environment, name, multi_turn = given.get("environment"), None, False
    if environment is None and config.env.reward_fn:  # a plain function scores single-turn rollouts
        from rlcore.data.reward_fn import FunctionEnvironment, load_reward_fn

        environment = FunctionEnvironment(load_reward_fn(config.env.reward_fn), config.env.reward_fn)
        name = config.env.reward_fn
    if environment is None:  # a given environment replaces the lookup: no plugin of that name is needed
        reg = manager.get("environment", config.env.name)
        environment = reg.build(config.section(f"env.{config.env.name}"))
        name, multi_turn = config.env.name, bool(reg.capabilities.get("multi_turn"))
    timed = TimedEnvironment(environment, name or type(environment).__name__, config.cluster.timeout_s, config.env.on_timeout)
    return timed, multi_turn


def build_multi_turn_runner(generator, environment, tokenizer, config: RunConfig):
    """The rollouts of a multi-turn environment: the ``agent`` environment's agents through the
    endpoint (:mod:`rlcore.agents.runner`), any other turn by turn (:mod:`rlcore.generation.rollout`)."""
    from rlcore.config.agents import AgentEnvConfig

    section = config.section(f"env.{config.env.name}")
    if isinstance(section, AgentEnvConfig):
        from rlcore.agents.runner import make_agent_runner

        return make_agent_runner(generator, tokenizer, config, section)
    from rlcore.generation.rollout import make_multi_turn_runner

    return make_multi_turn_runner(generator, environment, tokenizer, config)
