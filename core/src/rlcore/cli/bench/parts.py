"""``rlcore bench generate|train|refit``: one part of the GRPO step, timed alone, through the run's
own collaborators (:class:`~rlcore.controller.loop.GRPOLoop`'s rollouts, learner and refitter), and
``rlcore bench component``: a plugin's component benchmark (the ``rlcore_benchmarks`` hook)."""

from __future__ import annotations

import statistics
import time

from rlcore.cli.bench.prepare import bench_config, bench_out_dir
from rlcore.cli.bench.report import append_row, device_name, gpu_count, peak_flops, train_flops
from rlcore.controller.grpo_run import build_components
from rlcore.controller.loop import GRPOLoop
from rlcore.controller.timing import StepTimer


def _repeat(args, once) -> tuple[list[float], list[dict]]:
    seconds, metrics = [], []
    for _ in range(args.steps):
        began = time.perf_counter()
        metrics.append(once())
        seconds.append(time.perf_counter() - began)
    return seconds[args.warmup:], metrics[args.warmup:]


def _measure(part: str, loop: GRPOLoop, args, info: dict, gpus: int) -> dict:
    """``part`` run ``--steps`` times; the means after ``--warmup``."""
    trajectories, _, _ = loop.rollouts.collect(loop.next_step(), StepTimer())
    if part == "generate":
        seconds, metrics = _repeat(args, lambda: loop.rollouts.collect(loop.next_step(), StepTimer())[1])
        tokens = statistics.mean(m["rollout/mean_response_tokens"] * m["rollout/num_trajectories"] for m in metrics)
        rate = tokens / statistics.mean(seconds)
        return {"seconds": statistics.mean(seconds), "gen_tokens_per_s": rate, "gen_tokens_per_gpu_s": rate / gpus if gpus else None}
    if part == "train":
        loop.c.generator.sleep()
        seconds, _ = _repeat(args, lambda: loop.train(trajectories, StepTimer())[0])
        seq = statistics.mean(len(t.result.prompt_ids) + len(t.result.response_ids) for t in trajectories)
        peak = peak_flops(device_name())
        flops = train_flops(info, len(trajectories), seq)
        mfu = flops / (statistics.mean(seconds) * gpus * peak) if peak and gpus else None
        return {"seconds": statistics.mean(seconds), "mfu": mfu}
    batch = loop.learner.batch(trajectories)
    seconds, metrics = _repeat(args, lambda: loop.refitter.refit(batch, StepTimer(), loop.step))
    gb = statistics.mean(m["refit/bytes"] for m in metrics) / 1e9
    return {"seconds": statistics.mean(seconds), "refit_gb_per_s": gb / statistics.mean(seconds)}


def time_part(args) -> int:
    from rlcore.loading.loader import to_dict

    config, info, out = bench_config(args)
    out.mkdir(parents=True, exist_ok=True)
    components = build_components(config, loggers=[])
    gpus = gpu_count(config, device_name())
    try:
        row = _measure(args.part, GRPOLoop(components), args, info, gpus)
    finally:
        if components.critic is not None:  # ppo: the critic lives on the trainer's ranks
            components.critic.shutdown()
        components.trainer.shutdown()
        components.generator.shutdown()
        if hasattr(components.environment, "close"):
            components.environment.close()
    _print(f"rlcore bench {args.part}: {args.recipe} ({info['shape']}) on {device_name()}, "
           f"means of repetitions {args.warmup + 1}-{args.steps}", row)
    path = append_row(out, args.part, {"shape": info["shape"], **row}, recipe=args.recipe, config_tree=to_dict(config),
                      device=device_name(), gpus=gpus)
    print(f"row appended to {path}")
    return 0


def run_component(args) -> int:
    from rlcore.loading.loader import to_dict
    from rlcore.plugins import get_plugin_manager
    from rlcore.utils import resolve

    benchmarks = get_plugin_manager().benchmarks()
    if args.name not in benchmarks:
        raise SystemExit(f"no component benchmark named {args.name!r} is installed (rlcore bench list: "
                         f"{', '.join(sorted(benchmarks)) or 'none'})")
    from rlcore.loading.loader import load_config

    config = load_config(args.recipe, list(args.overrides))  # as the recipe says: a component may need no model
    out = bench_out_dir(args)
    fn = benchmarks[args.name]
    row = (resolve(fn) if isinstance(fn, str) else fn)(config, args.steps, args.warmup)
    _print(f"rlcore bench component {args.name}: {args.recipe} on {device_name()}", row)
    path = append_row(out, f"component/{args.name}", row, recipe=args.recipe, config_tree=to_dict(config),
                      device=device_name(), gpus=gpu_count(config, device_name()))
    print(f"row appended to {path}")
    return 0


def _print(title: str, row: dict) -> None:
    print(f"\n{title}")
    print("| " + " | ".join(row) + " |")
    print("|" + "---|" * len(row))
    print("| " + " | ".join("-" if v is None else f"{v:.4g}" for v in row.values()) + " |", flush=True)
