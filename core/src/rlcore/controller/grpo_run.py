"""The GRPO-family run: rollouts from the policy, trained on their rewards (``trains_on`` prompts).

:func:`build_components` builds every part (or takes the objects a user passed), :func:`run_grpo`
runs the loop with the sync or the async driver and writes the summary.
"""

from __future__ import annotations

import signal
from pathlib import Path

from rlcore.agents.runner import build_multi_turn_runner
from rlcore.config import RunConfig
from rlcore.controller import critic_step
from rlcore.controller.async_driver import run_async
from rlcore.controller.engines import build_engines
from rlcore.controller.environment import build_environment
from rlcore.controller.task import (
    build_algorithm, given_or_built_dataset, given_or_loaded_tokenizer, resolve_old_logprobs,
)
from rlcore.deadlines import bounded_teardown
from rlcore.controller.given import check_given
from rlcore.controller.memory_plan import apply_memory_plan
from rlcore.controller.loop import Components, GRPOLoop, run_sync
from rlcore.controller.placement import plan_placement
from rlcore.controller.model_files import check_model_name
from rlcore.controller.preflight import check_prompt_lengths, check_run_sizes
from rlcore.controller.report import Reporter
from rlcore.controller.run_dir import RunDir
from rlcore.controller.run_end import plot_curves, print_outputs, save_final_model, summary_table, write_summary
from rlcore.controller.run_skeleton import build_loggers
from rlcore.controller.timing import summarize
from rlcore.controller.transport import pick_transport
from rlcore.interfaces import RolloutTableLogger
from rlcore.plugins import get_plugin_manager
from rlcore.config.run_paths import inside
from rlcore.loggers.traces import RolloutTraces
from rlcore.utils import resolve


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
    dataset = given_or_built_dataset(config, manager, given, tokenizer)
    environment, multi_turn_env = build_environment(config, manager, given)
    check_prompt_lengths(dataset, config)
    check_run_sizes(config, dataset, algorithm)
    placement, memory_plan = apply_memory_plan(config, plan_placement(config), critic=critic_step.trains_critic(algorithm), given=given)
    engines = build_engines(config, manager, placement, given, algorithm)
    trainer, critic, generator = engines.trainer, engines.critic, engines.generator
    transport = pick_transport(manager, trainer, generator, config)
    print(f"refit transport: {transport.name} ({type(trainer).__name__} -> {type(generator).__name__})", flush=True)
    trainer = manager.wrap_trainer(trainer)  # a plugin's wrapper (a test's faults) sees every call from here on
    multi_turn = None
    if multi_turn_env:
        multi_turn = build_multi_turn_runner(generator, environment, tokenizer, config)
    run_dir = Path(config.logger.log_dir)
    loggers = given.get("loggers")
    if loggers is None:
        loggers = build_loggers(config, run_dir)
    reporter = Reporter(config.train.max_num_steps, enabled=config.logger.print_table, label=algorithm.name)
    traces = RolloutTraces(config.logger.rollouts, run_dir, tokenizer, [lg for lg in loggers if isinstance(lg, RolloutTableLogger)],
                           timeout_s=config.cluster.timeout_s)
    return Components(config, trainer, generator, environment, algorithm, dataset, transport, loggers, reporter, multi_turn,
                      teacher=teacher, critic=critic, placement=placement, memory_plan=memory_plan, traces=traces)


def held_out_summary(records: list[dict]) -> dict:
    """``val/<name>_first`` and ``_last`` of every held-out metric (``val/accuracy``'s always present)."""
    out: dict = {"val/accuracy_first": None, "val/accuracy_last": None}
    for key in sorted({k for r in records for k in r if k.startswith("val/")}):
        seen = [r[key] for r in records if key in r]
        out[f"{key}_first"], out[f"{key}_last"] = seen[0], seen[-1]
    return out


def run_grpo(config: RunConfig, owner: RunDir, run_dir: Path, given: dict) -> dict:
    """The GRPO-family run in ``run_dir`` (opened by ``rlcore.run``); returns summary, records, run dir, plot."""
    print(f"run {owner.run_id} in {run_dir}", flush=True)
    components = build_components(config, **given)
    components.run_identity = owner.identity()
    loop = GRPOLoop(components)
    try:
        with components.reporter:
            records = loop.run(run_async if config.grpo.async_grpo.enabled else run_sync)
        # The engines are done: their memory goes to the final exports (a LoRA merge's buffers, a critic's
        # state back from the host), which ran out of memory beside an awake 8B engine on an 80 GB GPU. Not
        # after a stop signal (the engine may have had it too; the checkpoint holds the model), nor for a
        # generator the caller gave (it stays as the run left it, for the caller's use), and bounded.
        if loop.skeleton.stop_signal is None and "generator" not in given:
            bounded_teardown(components.generator.sleep, "the generator (sleep before the final export)",
                             config.cluster.timeout_s)
        saved = save_final_model(loop.skeleton, components.trainer, config, run_dir, given.get("tokenizer"))
        if saved is not None and components.critic is not None:  # ppo: the critic in <run_dir>/critic (after a stop
            # signal the checkpoint holds it); with offload_trainer_state its state comes back for it (the engines sleep)
            critic_step.export_at_end(components.critic, run_dir, components.placement.offload_trainer_state)
    finally:  # each bounded: a component that hangs as the run ends is named and left behind
        limit = config.cluster.timeout_s
        loop.skeleton.close_loggers()
        if components.traces is not None:
            components.traces.close()
        if components.critic is not None:
            bounded_teardown(components.critic.shutdown, "the critic (shutdown)", limit)
        bounded_teardown(components.trainer.shutdown, "the trainer (shutdown)", limit)
        if "generator" not in given:
            bounded_teardown(components.generator.shutdown, "the generator (shutdown)", limit)
        if "environment" not in given:
            components.environment.close()  # a TimedEnvironment: bounded
    summary = summarize([r for r in records if "timing/total" in r], config.grpo.summary_window)
    summary.update(held_out_summary(records))
    summary.update({"steps": loop.step, "run_id": owner.run_id,
                    "stopped_by_signal": None if loop.stop_signal is None else signal.Signals(loop.stop_signal).name})
    components.reporter.console.print(summary_table(summary, components.algorithm.name))
    plot = plot_curves(records, inside(run_dir, "curves.png")) if config.logger.plot else None
    write_summary(run_dir, summary)
    print_outputs(run_dir, config, components.reporter.console)
    return {"summary": summary, "records": records, "run_dir": str(run_dir), "plot": str(plot) if plot else None}
