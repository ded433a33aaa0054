"""``rlcore plan``: the ranked table (rich) or ``--json``, and ``--calibrate``."""

from __future__ import annotations

import json
import math

from rich import box
from rich.console import Console
from rich.table import Table

from rlcore.planning.search import Estimate

PHASES = ("generation", "refit", "logprobs", "values", "critic", "training", "offload")
SHORT = {"generation": "gen s", "logprobs": "logp", "training": "train", "offload": "offl", "values": "values"}
TABLE_WIDTH = 120


def add_parser(sub) -> None:
    p = sub.add_parser("plan", help="predict memory and step time of candidate layouts for a recipe, ranked")
    p.add_argument("recipe", nargs="?")
    p.add_argument("overrides", nargs="*", help="dotted.key=value")
    p.add_argument("--gpus", type=int, default=None, help="GPUs in all (default: the recipe's cluster)")
    p.add_argument("--nodes", type=int, default=None,
                   help="nodes (default: the recipe's cluster.num_nodes, or with --gpus as many nodes of cluster.gpus_per_node as they fill)")
    p.add_argument("--gpu", default="h200", help="h200, h100, a100, b200 or l40s")
    p.add_argument("--shape", default=None, help="model shape by name (e.g. llama-3.1-8b, qwen3moe) instead of policy.model_name")
    p.add_argument("--layers", type=int, default=None, help="override the model's layer count")
    p.add_argument("--prompt-tokens", type=int, default=None, help="prompt length (default: min(256, room left by max_new_tokens))")
    p.add_argument("--response-tokens", type=int, default=None,
                   help="mean response length (default: max_new_tokens, every response at the limit: the worst case)")
    p.add_argument("--response-max", type=int, default=None,
                   help="the longest response of a step, which bounds each engine's decoding (default: the limit)")
    p.add_argument("--lengths-from", default=None, metavar="METRICS_JSONL",
                   help="mean prompt and response lengths, each step's longest response and the lengths' percentiles from a previous run's metrics.jsonl")
    p.add_argument("--virtual-stages", action="store_true", help="also consider interleaved pipeline stages")
    p.add_argument("--top", type=int, default=10, help="fitting layouts shown")
    p.add_argument("--calibrate", action="store_true", help="measure this machine (GEMMs, attention, decode, a collective) "
                   "and write the calibration file the planner reads")
    p.add_argument("--wide", action="store_true", help="every column, at the table's natural width (default: fits 120 columns)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_plan)


def cmd_plan(args) -> int:
    from rlcore.config import ConfigError
    from rlcore.loading.loader import load_config, to_dict
    from rlcore.planning import plan as planning

    if args.calibrate:
        from rlcore.planning.measure import calibrate

        path, values = calibrate(args.gpu)
        print(json.dumps({"written": str(path), **values}, indent=2) if args.json else f"calibration for {args.gpu} written to {path}")
        if args.recipe is None:
            return 0
    if args.recipe is None:
        raise ConfigError("", "rlcore plan needs a recipe")
    if args.top < 1:
        raise ConfigError("--top", f"must be a positive number of layouts, got {args.top}")
    config = load_config(args.recipe, args.overrides)
    planning.refuse_unmodelled(to_dict(config))
    inp = planning.inputs(config, gpus=args.gpus, nodes=args.nodes, gpu_name=args.gpu, shape=args.shape, layers=args.layers,
                          prompt_tokens=args.prompt_tokens, response_tokens=args.response_tokens,
                          response_max=args.response_max, lengths_from=args.lengths_from)
    ranked = planning.plan(inp, virtual_stages=args.virtual_stages, keep=args.top)
    recipe = planning.evaluate_recipe(inp)
    world = inp.cluster.world
    if args.json:
        print(json.dumps({"model": inp.shape.name, "params": inp.shape.total_params, "gpus": world, "gpu": inp.cluster.gpu.name,
                          "calibration": inp.cal.source, "lengths": {"prompt_tokens": inp.work.prompt_tokens,
                          "response_tokens": inp.work.response_tokens, "response_max": inp.work.longest_response,
                          **({"sequence_sq_mean": round(inp.work.seq_sq_mean)} if inp.work.seq_sq_mean else {})},
                          "recipe": as_dict(recipe, world),
                          "layouts": [as_dict(e, world) for e in ranked]}, indent=2))
        return 0
    show(inp, ranked, recipe, args.top, wide=args.wide)
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
        "phases_s": {k: round(seconds(v), 3) for k, v in est.phases.items()}, "step_s": round(seconds(est.step_s), 3),
        "one_step_off_overlap": est.overlapped,
    }


def seconds(value: float) -> float:
    """A time the planner shows: finite and not negative, or a bug in the model (inputs are checked before)."""
    assert math.isfinite(value) and value >= 0, f"the planner computed a time of {value} s"
    return value


def _cells(est: Estimate, world: int, packing: bool, wide: bool, phases: tuple) -> list[str]:
    lay, mem = est.layout, est.memory
    mb = f"{lay.train_mb_tokens // 1024}k/{lay.logprob_mb_tokens // 1024}k" if packing else "unpacked"
    times = [f"{seconds(est.phases.get(p, 0.0)):.1f}" if est.fits else "-" for p in phases]
    step = f"{seconds(est.step_s):.1f}" if est.fits else "-"
    share = f" ({lay.gen_memory_fraction:.2f})" if lay.colocated else ""
    if wide:
        extras = [lay.recompute] + (["offload"] if lay.offload else [])
        peak = f"{mem.peak_gib:.0f} ({mem.largest} {mem.parts[mem.largest]:.0f})"
        note = "fits" if est.fits else f"[red]{mem.problem}[/red]"
        return [lay.describe(world), lay.describe_generation(world) + share, mb, " ".join(extras), peak, *times, step, note]
    where = "" if lay.colocated else f"{lay.gen_gpus}g "
    generation = f"{where}TP{lay.gen_tp}x{lay.gen_replicas(world)}{share}"
    recompute = "+".join(filter(None, ({"none": "", "selective": "sel", "full": "full"}[lay.recompute], "off" if lay.offload else ""))) or "-"
    return [lay.describe(world), generation, mb, recompute, f"{mem.peak_gib:.0f}", *times, step]


COLUMNS = ("layout", "generation (mem share)", "mb tokens", "recompute", "peak GiB (largest)")
NARROW = ("layout", "engines (share)", "mb tok", "recomp", "GiB")
LEGEND = ("engines: colocated unless 'Ng' (N GPUs of their own), TP size x replicas (share of a GPU); "
          "recomp: activation recompute (sel: selective), off: trainer state offloaded; "
          "GiB: peak per GPU; (overlap): one step off, generation beside the trainer's phases. --wide shows every part.")


def show(inp, ranked: list[Estimate], recipe: Estimate, top: int, *, wide: bool = False) -> None:
    world = inp.cluster.world
    work = inp.work
    tail = f" (longest {work.longest_response})" if work.longest_response != work.response_tokens else ""
    title = (f"rlcore plan: {inp.shape.name} ({inp.shape.total_params / 1e9:.1f}B), {inp.backend}, {world} x {inp.cluster.gpu.name} "
             f"({inp.cluster.nodes} node{'s' if inp.cluster.nodes > 1 else ''}); {work.samples} samples x "
             f"{work.prompt_tokens}+{work.response_tokens}{tail} tokens; calibration: {inp.cal.source}")
    table = Table(title=title, title_justify="left", box=None if not wide else box.HEAVY_HEAD, pad_edge=False)
    packing = inp.work.packing
    rows = [("recipe", recipe, "bold")] + [(str(i), e, None) for i, e in enumerate([e for e in ranked if e.fits][:top], 1)]
    rows += [(f"x{i}", e, "dim") for i, e in enumerate([e for e in ranked if not e.fits][:3], 1)]
    phases = tuple(p for p in PHASES if any(p in e.phases for _, e, _ in rows))
    step = "step s" + (" (overlap)" if any(e.overlapped for _, e, _ in rows) else "")
    for column in ("#", *(COLUMNS if wide else NARROW)):
        table.add_column(column, overflow="fold", justify="right" if column in NARROW[4:] else "left")
    for column in (*(phases if wide else (SHORT.get(p, p) for p in phases)), step, *(("",) if wide else ())):
        table.add_column(column, overflow="fold", justify="right")
    for label, est, style in rows:
        table.add_row(label, *_cells(est, world, packing, wide, phases), style=style)
    console = Console(width=_width(wide))
    console.print(table)
    if not wide:
        for label, est, _ in rows:
            if not est.fits:
                console.print(f"{label}: [red]does not fit[/red]: {est.memory.problem}", highlight=False)
        console.print(LEGEND, style="dim", highlight=False)
    if not any(e.fits for e in ranked):
        console.print("[red]no candidate layout fits[/red]: more GPUs, a shorter max_total_sequence_length, or a larger GPU")


def _width(wide: bool) -> int:
    """--wide: the table's natural width (for a pager or a wide terminal); else 120 columns, or the terminal's if narrower."""
    if wide:
        return 100_000
    terminal = Console()
    return min(terminal.width, TABLE_WIDTH) if terminal.is_terminal else TABLE_WIDTH
