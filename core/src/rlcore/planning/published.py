"""The reference system's published GRPO steps beside the planner's prediction for rlcore on the same
configuration and hardware, phase by phase: the table in ``docs/guides/planning.md``.

    python -m rlcore.planning.published                                # print the table (markdown)
    python -m rlcore.planning.published --write docs/guides/planning.md   # replace the guide's table

The rows are NeMo-RL v0.3's published breakdown (GRPO, mean of steps 22-29; 64 prompts x 32 samples,
4096-token sequences, global batch 512, sequence packing, colocated vLLM, H100 80 GB). They validate the
planner and are never fitted to (:mod:`rlcore.planning.fit` reads the project's own rows alone). Each row
plans one of the project's recipes set to that configuration; the layouts the published runs used are taken
from their recipes where they name them, and marked as assumed where not. The published mean tokens per
sample are taken as the mean response length; the longest response is planned at the limit (4096 tokens
less a 256-token prompt).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from attrs import frozen

BEGIN, END = "<!-- published-vs-planned:begin -->", "<!-- published-vs-planned:end -->"
COMMON = ("grpo.num_generations_per_prompt=32", "train.num_prompts_per_step=64", "policy.max_total_sequence_length=4096",
          "policy.train_global_batch_size=512", "policy.sequence_packing.enabled=true", "policy.generation.max_new_tokens=4096",
          # the reference system's colocated vLLM: 60% of each GPU, the trainer's state in host memory while it generates
          "policy.generation.gpu_memory_utilization=0.6", "policy.generation.colocated.offload_trainer_state=true")
MEGATRON = "policy.megatron_cfg."
DTENSOR = ("policy.megatron_cfg.enabled=false", "policy.dtensor_cfg.enabled=true")


@frozen
class Published:
    model: str
    backend: str
    nodes: int
    step: float
    train: float
    refit: float
    generation: float
    logprobs: float
    tokens: int  # mean tokens per sample
    recipe: str
    overrides: tuple = ()
    assumed: bool = False  # the layout is not named by the published run's recipe


ROWS = (
    Published("Llama 3.1-8B Instruct", "Megatron", 1, 112, 28, 5, 58, 18, 795, "grpo_math_8B_megatron.yaml"),
    Published("Llama 3.1-8B Instruct", "DTensor", 1, 122, 38, 4, 57, 19, 777, "grpo_math_8B_megatron.yaml", DTENSOR),
    Published("Llama 3.1-70B Base", "Megatron", 8, 147, 28, 14, 84, 18, 398, "grpo_math_8B_megatron.yaml",
              ("policy.model_name=meta-llama/Llama-3.1-70B", f"{MEGATRON}tensor_model_parallel_size=4",
               f"{MEGATRON}pipeline_model_parallel_size=4", "policy.generation.tensor_parallel_size=4")),
    Published("Llama 3.1-70B Base", "DTensor", 8, 230, 97, 15, 82, 28, 395, "grpo_math_8B_megatron.yaml",
              ("policy.model_name=meta-llama/Llama-3.1-70B", *DTENSOR, "policy.dtensor_cfg.tensor_parallel_size=4",
               "policy.dtensor_cfg.sequence_parallel=true", "policy.dtensor_cfg.activation_checkpointing=true",
               "policy.generation.tensor_parallel_size=4"), assumed=True),
    Published("Qwen3 32B", "Megatron", 8, 213, 68, 7, 96, 40, 3283, "grpo_math_8B_megatron.yaml",
              ("policy.model_name=Qwen/Qwen3-32B", f"{MEGATRON}tensor_model_parallel_size=4",
               f"{MEGATRON}pipeline_model_parallel_size=4", "policy.generation.tensor_parallel_size=4"), assumed=True),
    Published("Qwen3 30B-A3B", "Megatron", 8, 167, 50, 12, 78, 23, 3251, "grpo_qwen3_30BA3B_megatron.yaml"),
)
PHASES = (("step", None), ("train", "training"), ("refit", "refit"), ("generation", "generation"), ("logprobs", "logprobs"))


def predict(row: Published, recipes: Path):
    """The planner's estimate of the row's configuration with rlcore, on H100s, with the shipped calibration."""
    from rlcore.loading.loader import load_config
    from rlcore.planning import plan
    from rlcore.planning.calibration import load_calibration

    config = load_config(recipes / row.recipe, [*COMMON, *row.overrides])
    shipped = load_calibration("h100", user_file=Path(os.devnull))  # not a file: the user's calibration is left out
    inp = plan.inputs(config, gpus=8 * row.nodes, nodes=row.nodes, gpu_name="h100", response_tokens=row.tokens,
                      calibration=shipped)
    return plan.evaluate_recipe(inp)


def table(recipes: Path) -> str:
    head = ("| Model | Backend | Nodes x GPUs | rlcore layout (planned) | fits 80 GB | "
            + " | ".join(f"{name} (s) published / planned" for name, _ in PHASES) + " |")
    lines = [head, "|" + "---|" * (5 + len(PHASES))]
    for row in ROWS:
        est = predict(row, recipes)
        world = 8 * row.nodes
        layout = est.layout.describe(world) + f"; engines TP={est.layout.gen_tp}" + (" (assumed)" if row.assumed else "")
        cells = []
        for name, phase in PHASES:
            planned = est.step_s if phase is None else est.phases[phase]
            cells.append(f"{getattr(row, name):g} / {planned:.0f}")
        lines.append(f"| {row.model} | {row.backend} | {row.nodes}x8 | {layout} | {'yes' if est.fits else 'no'} | "
                     + " | ".join(cells) + " |")
    return "\n".join(lines)


def write(guide: Path, text: str) -> None:
    body = guide.read_text()
    if BEGIN not in body or END not in body:
        raise SystemExit(f"{guide} has no {BEGIN} ... {END} markers to replace")
    start, end = body.index(BEGIN) + len(BEGIN), body.index(END)
    guide.write_text(body[:start] + "\n" + text + "\n" + body[end:])


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m rlcore.planning.published", description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipes", default="recipes", help="the repository's recipes directory")
    parser.add_argument("--write", metavar="GUIDE", help="replace the table between the guide's markers")
    args = parser.parse_args(argv)
    text = table(Path(args.recipes))
    if args.write:
        write(Path(args.write), text)
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
