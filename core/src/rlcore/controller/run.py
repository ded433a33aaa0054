"""``rlcore.run``: build what the recipe names (or take the objects a user passes), place it, run.

Placement (:mod:`rlcore.controller.placement`) is computed once and handed to the backend and
generator factories. Ray trainer ranks use a local Ray instance when neither
``cluster.ray_address`` nor ``RAY_ADDRESS`` names a cluster; the generator stays with the driver
unless its plugin places its engines itself.
"""

from __future__ import annotations

import json
import os
import random
import signal
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml

from rlcore.config import ConfigError, RefitConfig, RunConfig, to_dict
from rlcore.controller.deadlines import TimedEnvironment
from rlcore.controller.faults import wrap_from_env
from rlcore.controller.given import check_given
from rlcore.controller.loop import Components, GRPOLoop
from rlcore.controller.mps_client import enter_mps_client
from rlcore.controller.offline import build_loggers
from rlcore.controller.preflight import check_model_name, check_prompt_lengths
from rlcore.controller.ray_local import start_local_ray
from rlcore.controller.report import Reporter, plot_curves, summary_table
from rlcore.controller.run_dir import RunDir
from rlcore.controller.run_end import print_outputs, save_final_model
from rlcore.controller.timing import summarize
from rlcore.controller.workers import LocalTrainer, RayTrainerGroup
from rlcore.controller.placement import plan_placement
from rlcore.interfaces import Generator, OldLogprobsChoice, Placement, TrainerHandle, WeightTransport
from rlcore.plugins import get_plugin_manager
from rlcore.checks import check_before_start
from rlcore.reward_fn import as_environment, build_environment
from rlcore.utils import resolve
from rlcore.verbosity import apply_verbosity
from rlcore.weights import stream_into


class StreamTransport:
    """Fallback refit: stream the trainer's HF-named chunks into ``generator.update_weights``."""

    name = "stream"

    def __init__(self, chunk_bytes: int | None = None, dtype: Any = None):
        self.chunk_bytes = chunk_bytes or RefitConfig().chunk_bytes  # the one default, policy.generation.refit's
        self.dtype = dtype

    def transfer(self, trainer: TrainerHandle, generator: Generator) -> dict[str, float]:
        return stream_into(generator, trainer.export_chunks(dtype=self.dtype, chunk_bytes=self.chunk_bytes))


def select_backend(config: RunConfig, manager):
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
    enter_mps_client(config.cluster.trainer_mps_priority, placement)  # before anything in the trainer uses CUDA
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


def pick_transport(manager, trainer: TrainerHandle, generator: Generator, config: RunConfig) -> WeightTransport:
    """A plugin's transport when one claims the pair, else :class:`StreamTransport`.

    The hook gets the trainer handle: a plugin that can send from inside the ranks uses its
    ``run_on_ranks``; one that cannot returns None and weights stream through this process."""
    found = manager.weight_transport(trainer=trainer, generator=generator)
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
    size, per_step = config.policy.train_global_batch_size, config.grpo.num_prompts_per_step * config.grpo.num_generations_per_prompt
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
    return dataset


def build_components(config: RunConfig, **given) -> Components:
    """Every part of the run: the objects in ``given`` as they are (checked against their
    protocols first, :mod:`rlcore.controller.given`), the others built from the recipe."""
    check_given(given)
    manager = get_plugin_manager()
    if not all(given.get(k) is not None for k in ("tokenizer", "backend", "generator")):
        check_model_name(config)
    tokenizer = given_or_loaded_tokenizer(config, given)
    algorithm, algorithm_reg = given.get("algorithm"), None
    if algorithm is None:  # a given algorithm replaces the lookup, as every given object does
        algorithm_reg = manager.get("algorithm", config.require_section("algorithm").name)
        algorithm = build_algorithm(config, manager, algorithm_reg)
    else:  # decided like a built one (use_old_logprobs: auto on a passed GRPO object)
        algorithm = resolve_old_logprobs(config, algorithm)
    teacher = given.get("teacher")
    if teacher is None and algorithm_reg is not None and "teacher" in algorithm_reg.capabilities:
        teacher = resolve(algorithm_reg.capabilities["teacher"])(config.section("algorithm"))  # distillation: "module:attr"
    environment, env_name, multi_turn_env = given.get("environment"), None, False
    if environment is None:  # a given environment replaces the lookup: no plugin of that name is needed
        environment, env_name, multi_turn_env = build_environment(config, manager)
    environment = TimedEnvironment(environment, env_name or type(environment).__name__, config.cluster.timeout_s,
                                   config.env.on_timeout)
    dataset = given_or_built_dataset(config, manager, given, tokenizer)
    check_prompt_lengths(dataset, config)
    placement = plan_placement(config)
    trainer = build_trainer(config, manager, placement, given.get("backend"))
    generator = given.get("generator")
    if generator is None:
        config.require_section("policy.generation")
        gen_cfg = config.generation
        generator = manager.get("generator", gen_cfg.backend).build(config, gen_cfg, placement)
    transport = pick_transport(manager, trainer, generator, config)
    print(f"refit transport: {transport.name} ({type(trainer).__name__} -> {type(generator).__name__})", flush=True)
    trainer = wrap_from_env(trainer)  # tests' RLCORE_FAULT: from here on every call may hit a rank
    multi_turn = None
    if multi_turn_env:
        from rlcore.rollout import make_multi_turn_runner

        multi_turn = make_multi_turn_runner(generator, environment, tokenizer, config)
    run_dir = Path(config.logger.log_dir)
    loggers = given.get("loggers")
    if loggers is None:
        loggers = build_loggers(config, run_dir)
    reporter = Reporter(config.grpo.max_num_steps, enabled=config.logger.print_table, label=algorithm.name)
    return Components(config, trainer, generator, environment, algorithm, dataset, transport, loggers, reporter, multi_turn,
                      teacher=teacher)


def held_out_summary(records: list[dict]) -> dict:
    """``val/<name>_first`` and ``_last`` of every held-out metric (``val/accuracy``'s always present)."""
    out: dict = {"val/accuracy_first": None, "val/accuracy_last": None}
    for key in sorted({k for r in records for k in r if k.startswith("val/")}):
        seen = [r[key] for r in records if key in r]
        out[f"{key}_first"], out[f"{key}_last"] = seen[0], seen[-1]
    return out


def run(config: RunConfig, **given) -> dict:
    if config is None:
        raise ConfigError("", "rlcore.run needs a RunConfig (rlcore.load_config(path) or rlcore.build_config(dict))")
    given = as_environment(given)  # reward_fn=fn: a plain function scores the rollouts
    check_given(given)  # before the run directory is claimed: a wrong object fails at once
    apply_verbosity(config.logger.verbosity)  # before vLLM, transformers or Ray is imported
    check_before_start(config, given)  # names, env.reward_fn, the enabled loggers' packages
    seed_everything(config.grpo.seed, config.grpo.deterministic)
    run_dir = Path(config.logger.log_dir)
    owner = RunDir(config).open()
    try:
        from rlcore.controller.pairs import run_pairs, trains_on_pairs

        if trains_on_pairs(config):  # dpo, reward_model: preference pairs, no rollouts
            (run_dir / "config.yaml").write_text(yaml.safe_dump(to_dict(config), sort_keys=False))
            return run_pairs(config, owner, run_dir, given)
        from rlcore.controller.sft import run_sft, trains_on_answers

        if trains_on_answers(config):  # sft: the dataset's reference answers, no rollouts
            (run_dir / "config.yaml").write_text(yaml.safe_dump(to_dict(config), sort_keys=False))
            return run_sft(config, owner, run_dir, given)
        return _run_in(config, owner, run_dir, given)
    finally:
        owner.close()


def _run_in(config: RunConfig, owner: RunDir, run_dir: Path, given: dict) -> dict:
    (run_dir / "config.yaml").write_text(yaml.safe_dump(to_dict(config), sort_keys=False))
    print(f"run {owner.run_id} in {run_dir}", flush=True)
    components = build_components(config, **given)
    components.run_identity = owner.identity()
    loop = GRPOLoop(components)
    try:
        with components.reporter:
            records = loop.run()
        save_final_model(loop, components.trainer, config, run_dir, given.get("tokenizer"))
    finally:
        for logger in components.loggers:
            logger.close()
        components.trainer.shutdown()
        if "generator" not in given:
            components.generator.shutdown()
        if "environment" not in given and hasattr(components.environment, "close"):
            components.environment.close()
    summary = summarize([r for r in records if "timing/total" in r], config.grpo.summary_window)
    summary.update(held_out_summary(records))
    summary.update({"steps": loop.step, "run_id": owner.run_id,
                    "stopped_by_signal": None if loop.stop_signal is None else signal.Signals(loop.stop_signal).name})
    components.reporter.console.print(summary_table(summary, components.algorithm.name))
    plot = plot_curves(records, run_dir / "curves.png") if config.logger.plot else None
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    print_outputs(run_dir, config, components.reporter.console)
    return {"summary": summary, "records": records, "run_dir": str(run_dir), "plot": str(plot) if plot else None}
