"""``rlcore plan``: the ranked table (rich) or ``--json``, and ``--calibrate``."""

from __future__ import annotations

import json

from rich.console import Console
from rich.table import Table

from rlcore.planning.search import Estimate

PHASES = ("generation", "refit", "logprobs", "training", "offload")


def add_parser(sub) -> None:
    p = sub.add_parser("plan", help="predict memory and step time of candidate layouts for a recipe, ranked")
    p.add_argument("recipe", nargs="?")
    p.add_argument("overrides", nargs="*", help="dotted.key=value")
    p.add_argument("--gpus", type=int, default=None, help="GPUs in all (default: the recipe's cluster)")
    p.add_argument("--nodes", type=int, default=None, help="nodes (default: the recipe's cluster.num_nodes)")
    p.add_argument("--gpu", default="h200", help="h200, h100, a100, b200 or l40s")
    p.add_argument("--shape", default=None, help="model shape by name (e.g. llama-3.1-8b, qwen3moe) instead of policy.model_name")
    p.add_argument("--layers", type=int, default=None, help="override the model's layer count")
    p.add_argument("--prompt-tokens", type=int, default=None, help="prompt length (default: min(256, room left by max_new_tokens))")
    p.add_argument("--response-tokens", type=int, default=None, help="response length (default: max_new_tokens, the worst case)")
    p.add_argument("--virtual-stages", action="store_true", help="also consider interleaved pipeline stages")
    p.add_argument("--top", type=int, default=10, help="fitting layouts shown")
    p.add_argument("--calibrate", action="store_true", help="measure this machine (GEMMs, attention, decode, a collective) "
                   "and write the calibration file the planner reads")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_plan)


def cmd_plan(args) -> int:
    from rlcore.config import ConfigError, load_config
    from rlcore.planning import plan as planning

    if args.calibrate:
        from rlcore.planning.measure import calibrate

        path, values = calibrate(args.gpu)
        print(json.dumps({"written": str(path), **values}, indent=2) if args.json else f"calibration for {args.gpu} written to {path}")
        if args.recipe is None:
            return 0
    if args.recipe is None:
        raise ConfigError("", "rlcore plan needs a recipe")
    config = load_config(args.recipe, args.overrides)
    inp = planning.inputs(config, gpus=args.gpus, nodes=args.nodes, gpu_name=args.gpu, shape=args.shape, layers=args.layers,
                          prompt_tokens=args.prompt_tokens, response_tokens=args.response_tokens)
    ranked = planning.plan(inp, virtual_stages=args.virtual_stages, keep=max(args.top, 1))
    recipe = planning.evaluate_recipe(inp)
    world = inp.cluster.world
    if args.json:
        print(json.dumps({"model": inp.shape.name, "params": inp.shape.total_params, "gpus": world, "gpu": inp.cluster.gpu.name,
                          "calibration": inp.cal.source, "recipe": as_dict(recipe, world),
                          "layouts": [as_dict(e, world) for e in ranked]}, indent=2))
        return 0
    show(inp, ranked, recipe, args.top)
    return 0


def as_dict(est: Estimate, world: int) -> dict:
    lay, mem = est.layout, est.memory
    return {
        "layout": lay.describe(world), "generation": lay.describe_generation(world), "fits": est.fits, "why_not": mem.problem,
        "backend": lay.backend, "tp": lay.tp, "pp": lay.pp, "vpp": lay.vpp, "cp": lay.cp, "ep": lay.ep, "etp": lay.etp,
        "dp": lay.dp(world), "sequence_parallel": lay.sp, "recompute": lay.recompute, "offload": lay.offload,
        "train_mb_tokens": lay.train_mb_tokens, "logprob_mb_tokens": lay.logprob_mb_tokens, "colocated": lay.colocated,
        "generation_gpus": lay.gen_gpus, "generation_tp": lay.gen_tp, "generation_replicas": lay.gen_replicas(world),
        "gpu_memory_utilization": lay.gen_memory_fraction,
        "memory_gib": {k: round(v, 2) for k, v in mem.parts.items()}, "peak_gib": round(mem.peak_gib, 2),
        "training_memory_gib": {k: round(v, 2) for k, v in mem.train_parts.items()},
        "peak_phase": mem.phase, "largest_part": mem.largest, "limit_gib": mem.limit_gib,
        "phases_s": {k: round(v, 3) for k, v in est.phases.items()}, "step_s": round(est.step_s, 3),
    }


def _row(table: Table, label: str, est: Estimate, world: int, packing: bool, style: str | None = None) -> None:
    lay, mem = est.layout, est.memory
    mb = f"{lay.train_mb_tokens // 1024}k/{lay.logprob_mb_tokens // 1024}k" if packing else "unpacked"
    extras = [lay.recompute] + (["offload"] if lay.offload else [])
    peak = f"{mem.peak_gib:.0f} ({mem.largest} {mem.parts[mem.largest]:.0f})"
    times = [f"{est.phases.get(p, 0.0):.1f}" if est.fits else "-" for p in PHASES]
    note = "fits" if est.fits else f"[red]{mem.problem}[/red]"
    table.add_row(label, lay.describe(world), lay.describe_generation(world) + (f" ({lay.gen_memory_fraction:.2f})" if lay.colocated else ""),
                  mb, " ".join(extras), peak, *times, f"{est.step_s:.1f}" if est.fits else "-", note, style=style)


def show(inp, ranked: list[Estimate], recipe: Estimate, top: int) -> None:
    world = inp.cluster.world
    title = (f"rlcore plan: {inp.shape.name} ({inp.shape.total_params / 1e9:.1f}B), {inp.backend}, {world} x {inp.cluster.gpu.name} "
             f"({inp.cluster.nodes} node{'s' if inp.cluster.nodes > 1 else ''}); {inp.work.samples} samples x "
             f"{inp.work.prompt_tokens}+{inp.work.response_tokens} tokens; calibration: {inp.cal.source}")
    table = Table(title=title, title_justify="left")
    for column in ("#", "layout", "generation (mem share)", "mb tokens", "recompute", "peak GiB (largest)", *PHASES, "step s", ""):
        table.add_column(column, overflow="fold")
    packing = inp.work.packing
    _row(table, "recipe", recipe, world, packing, style="bold")
    fitting = [e for e in ranked if e.fits][:top]
    for i, est in enumerate(fitting, 1):
        _row(table, str(i), est, world, packing)
    for est in [e for e in ranked if not e.fits][:3]:
        _row(table, "x", est, world, packing, style="dim")
    console = Console(width=max(Console().width, 200))
    console.print(table)
    if not fitting:
        console.print("[red]no candidate layout fits[/red]: more GPUs, a shorter max_total_sequence_length, or a larger GPU")
