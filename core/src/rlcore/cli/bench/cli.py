"""``rlcore bench`` subcommands: argument parsing and the ``step`` benchmark (module docstring of
:mod:`rlcore.cli.bench`)."""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from rlcore.cli.bench.models import SHAPES
from rlcore.cli.bench.prepare import bench_config
from rlcore.cli.bench.report import append_row, device_name, gpu_count, print_table, step_row


def add_parser(sub) -> None:
    """``rlcore bench`` on the ``rlcore`` command's subparsers."""
    bench = sub.add_parser("bench", help="time a recipe's GRPO step (or one part of it) with a random-init model")
    kinds = bench.add_subparsers(dest="bench_command", required=True)
    for name, what in (("step", "whole steps through rlcore.run, in NeMo-RL's step-time table"),
                       ("generate", "the rollouts alone (generate and score)"),
                       ("train", "the learner's step alone (logprobs and the update) on one batch"),
                       ("refit", "the weight transfer and probe alone")):
        p = kinds.add_parser(name, help=what)
        _recipe_arguments(p)
        p.set_defaults(func=cmd_step if name == "step" else cmd_part, part=name)
    p = kinds.add_parser("component", help="a component benchmark a plugin registered (rlcore bench list)")
    p.add_argument("name")
    _recipe_arguments(p)
    p.set_defaults(func=cmd_component)
    p = kinds.add_parser("list", help="the component benchmarks the installed plugins provide")
    p.set_defaults(func=cmd_list)


def _at_least(minimum: int):
    """An argparse type: an integer of at least ``minimum`` (argparse names the option when it is not)."""
    def parse(text: str) -> int:
        value = int(text)
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        return value

    parse.__name__ = "count"  # argparse's message: "invalid count value" for a text that is no integer
    return parse


def _recipe_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("recipe")
    p.add_argument("overrides", nargs="*", help="dotted.key=value applied to the recipe")
    p.add_argument("--steps", type=_at_least(1), default=5, help="steps (or repetitions of the part) to run")
    p.add_argument("--warmup", type=_at_least(0), default=2, help="first steps left out of the means")
    p.add_argument("--shape", choices=sorted(SHAPES), default=None,
                   help="model shape to build (default: the recipe's policy.model_name: a local directory's config "
                        "or a known model name)")
    p.add_argument("--out", default=None, help="directory for the run and bench.jsonl (default: runs/bench/<recipe>-<time>)")
    p.add_argument("--workdir", default=str(Path(tempfile.gettempdir()) / "rlcore-bench"),
                   help="where the random-init models are built (and reused)")


def cmd_step(args) -> int:
    import rlcore
    from rlcore.loading.loader import to_dict

    config, info, out = bench_config(args)
    result = rlcore.run(config)
    device = device_name()
    gpus = gpu_count(config, device)
    samples = config.train.num_prompts_per_step * config.grpo.num_generations_per_prompt
    summary = result["summary"]
    window = [r for r in result["records"] if args.warmup < r.get("step", 0) and "rollout/mean_prompt_tokens" in r]
    prompt_tokens = sum(r["rollout/mean_prompt_tokens"] for r in window) / max(len(window), 1)
    row = step_row(summary, info, samples=samples, prompt_tokens=prompt_tokens, gpus=gpus, device=device)
    print_table(f"rlcore bench step: {args.recipe} ({info['shape']}, {info['params'] / 1e6:.1f}M parameters) on {device}, "
                f"means of steps {args.warmup + 1}-{args.steps}", gpus, row)
    path = append_row(out, "step", {"shape": info["shape"], "params": info["params"], **row}, recipe=args.recipe,
                      config_tree=to_dict(config), device=device, gpus=gpus)
    print(f"row appended to {path}")
    return 0


def cmd_part(args) -> int:
    from rlcore.cli.bench.parts import time_part

    return time_part(args)


def cmd_component(args) -> int:
    from rlcore.cli.bench.parts import run_component

    return run_component(args)


def cmd_list(args) -> int:
    from rlcore.plugins import get_plugin_manager

    found = get_plugin_manager().benchmarks()
    for name, fn in sorted(found.items()):
        print(f"{name}\t{fn if isinstance(fn, str) else f'{fn.__module__}:{fn.__qualname__}'}")
    if not found:
        print("no component benchmarks are installed")
    return 0


def main(argv: list[str] | None = None) -> int:
    from rlcore.cli.parser import Parser

    parser = Parser(prog="rlcore")
    add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["bench", *(argv or [])])
    return args.func(args)
